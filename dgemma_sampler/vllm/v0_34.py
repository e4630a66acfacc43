"""``FusedDiffusionSampler`` for vLLM 0.34: its ``DiffusionSampler`` with the fused kernels inside.

vLLM 0.34's model state hands the sampler the hidden states of the canvas positions
(``compute_sample_logits`` returns them unchanged) and the sampler projects logits itself,
through the ``compute_logits`` callable it is constructed with: DiffusionGemma's
``compute_logits`` (the LM head GEMM in the model dtype, the tensor-parallel gather of the
vocabulary slices, then the final softcap as an fp32 copy; K columns for a shared allowed set).
The adapter takes 0.34's constructor arguments (plus an optional ``backend``) and is called as
0.34's: ``__call__(hidden_states [rows, H], input_batch, draft_logits=None)``.

Where ``compute_logits`` is DiffusionGemma's own (``model_lm_head``: the model's method, an
unquantized head, no logit scale), the adapter does not call it: it projects through the model's
``lm_head.weight`` itself (``head.LmHead``), in the model dtype, batch-invariantly, and applies
the model's ``final_logit_softcapping`` in the kernels that read the logits. A tile then holds 2
bytes per logit instead of 6 (the head's bf16 output and the fp32 softcapped copy), so tiles are
larger and the head is read fewer times. Under tensor parallelism each rank projects its own
vocabulary slice of the head and never gathers the logits: the statistics merge O(1) partials
per row across the ranks and the soft embedding all-reduces ``[rows, H]``. ``compute_logits``
stays for what only it knows: a shared allowed set's K columns, any other head, and, under tensor
parallelism, batches with top-k / top-p or per-request allowed sets (their thresholds need the
whole row) or a head slice that does not start on a sampling block.

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

from ..head import LmHead, Projection
from ..reference import SAMPLE_BLOCK
from .common import FusedSampler, logger
from .device import compute_logits_projection


def model_lm_head(compute_logits: Any) -> tuple[Any, Any] | None:
    """``(model, lm_head)`` when ``compute_logits`` is DiffusionGemma's own over a plain head
    (the adapter may then project through ``lm_head.weight`` itself), else None."""
    model = getattr(compute_logits, "__self__", None)
    own = _dg.DiffusionGemmaForConditionalGeneration.compute_logits
    if model is None or getattr(compute_logits, "__func__", None) is not own:
        return None
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    lm_head = getattr(model, "lm_head", None)
    processor = getattr(model, "logits_processor", None)
    if lm_head is None or processor is None:
        return None
    if not isinstance(getattr(lm_head, "quant_method", None),
                      (UnquantizedEmbeddingMethod, UnquantizedLinearMethod)):
        return None
    weight = getattr(lm_head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    if (getattr(processor, "scale", 1.0) != 1.0 or getattr(processor, "soft_cap", None) is not None
            or getattr(processor, "logits_as_input", False)
            or getattr(processor, "head_dtype", None) not in (None, weight.dtype)
            or getattr(lm_head, "bias", None) is not None):
        return None
    return model, lm_head


class FusedDiffusionSampler(FusedSampler, _dg.DiffusionSampler):
    """Drop-in replacement for vLLM 0.34's ``diffusion_gemma.DiffusionSampler``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._model_head = model_lm_head(self.compute_logits)
        self._head: LmHead | None = None
        if self._model_head is None:
            logger.info_once("dgemma-sampler: compute_logits is not DiffusionGemma's own; the "
                             "sampler projects through it (fp32 softcapped logits)")

    def __call__(self, hidden_states: torch.Tensor, input_batch: Any,
                 draft_logits: torch.Tensor | None = None) -> Any:
        return self._sample(hidden_states, input_batch, projection=self._projection)

    def _projection(self, decode_slots: np.ndarray) -> tuple[Projection, int]:
        """This step's projection and its number of columns: the model's LM head where it can
        serve (``_lm_head``), else ``compute_logits``."""
        head = self._lm_head(decode_slots)
        if head is not None:
            return head.projection(), head.weight.shape[0]
        allowed = self.diffusion_states.step_allowed
        columns = self.vocab_size if allowed is None else allowed.numel()
        return compute_logits_projection(self.compute_logits, self.embed_weight), columns

    def _lm_head(self, decode_slots: np.ndarray) -> LmHead | None:
        """The model's LM head for this step's requests, or None where ``compute_logits`` must
        project: a shared allowed set; under tensor parallelism, masks (top-k / top-p, allowed
        sets) or a head slice other than the embedding's or not on a sampling block."""
        if self._model_head is None or self.diffusion_states.step_allowed is not None:
            return None
        model, lm_head = self._model_head
        shard = lm_head.shard_indices
        start, end = shard.org_vocab_start_index, shard.org_vocab_end_index
        if self.tp_size == 1 and (start, end) != (0, self.vocab_size):
            return None
        if self.tp_size > 1 and ((start, end) != (self.sc_vocab_start, self.sc_vocab_end)
                                 or start % SAMPLE_BLOCK
                                 or self.options.any_masks(decode_slots.tolist())):
            return None
        weight = lm_head.weight
        head = self._head
        if head is None or head.weight.data_ptr() != weight.data_ptr():
            self._head = head = LmHead(weight[: end - start], softcap=model.final_logit_softcapping,
                                       vocab_start=start, vocab_size=self.vocab_size,
                                       backend=self.backend)
        return head
