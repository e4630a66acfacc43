"""``FusedDiffusionSampler`` for vLLM 0.33: its ``DiffusionSampler`` with the fused kernels inside.

vLLM 0.33's model state projects the logits of every canvas position (``compute_logits``,
softcap included) before the sampler runs, and calls the sampler with them:
``__call__(logits [rows, V or K], input_batch, draft_logits=None)``. The adapter is
constructed with exactly the arguments of 0.33's ``DiffusionSampler`` (plus an optional
``backend``), keeps its host bookkeeping and hands the device work to ``runner.StepRunner``
in one tile (``common.FusedSampler``).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.models import diffusion_gemma as _dg

from .common import FusedSampler


class FusedDiffusionSampler(FusedSampler, _dg.DiffusionSampler):
    """Drop-in replacement for vLLM 0.33's ``diffusion_gemma.DiffusionSampler``."""

    def __call__(self, logits: torch.Tensor, input_batch: Any,
                 draft_logits: torch.Tensor | None = None) -> Any:
        return self._sample(logits, input_batch)
