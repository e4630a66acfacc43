"""``FusedDiffusionSampler`` for vLLM 0.34: its ``DiffusionSampler`` with the fused kernels inside.

vLLM 0.34's model state hands the sampler the hidden states of the canvas positions
(``compute_sample_logits`` returns them unchanged) and the sampler projects logits itself,
through the ``compute_logits`` callable it is constructed with (LM head, softcap, the
tensor-parallel gather; K columns for a shared allowed set). The adapter takes 0.34's
constructor arguments (plus an optional ``backend``) and is called as 0.34's:
``__call__(hidden_states [rows, H], input_batch, draft_logits=None)``.

Where 0.34 pads every request to its tile's canvas width, projects the tile, and sizes tiles
for five fp32 ``[W, V]`` copies per request (projection, top-k/top-p copy, softmax, scaled
logits for logprobs), the adapter projects only the valid rows of a tile of requests (in
batch order; phantom positions count as uniform rows without being projected) and sizes tiles
for what ``compute_logits`` holds: its output in the model dtype and the fp32 softcapped copy
it returns (``device.projected_logit_bytes``). Everything after the projection reads those logits in
place (``runner.StepRunner``).

``profile_run`` is 0.34's own: one dummy full-canvas request through ``__call__``, so the
profiler sees the peak of this path (one request's projected logits and its O(1) row
statistics), the least a tile ever holds; tiles grow past one request only when free memory
allows at the step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.model_executor.models import diffusion_gemma as _dg

from .common import FusedSampler
from .device import projected_logit_bytes


class FusedDiffusionSampler(FusedSampler, _dg.DiffusionSampler):
    """Drop-in replacement for vLLM 0.34's ``diffusion_gemma.DiffusionSampler``."""

    def __call__(self, hidden_states: torch.Tensor, input_batch: Any,
                 draft_logits: torch.Tensor | None = None) -> Any:
        return self._sample(
            hidden_states, input_batch, project=self._project,
            logits_itemsize=projected_logit_bytes(self.embed_weight))

    def _project(self, hidden_rows: torch.Tensor, lengths: np.ndarray) -> torch.Tensor:
        """One tile's logits: vLLM's own ``compute_logits`` over the tile's valid rows."""
        return self.compute_logits(hidden_rows)
