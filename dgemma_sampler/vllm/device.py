"""The device path of the vLLM adapters, importable without vLLM.

``common.FusedSampler._decode`` turns vLLM's input batch into host arrays and calls
``decode`` here; everything ``decode`` touches is duck-typed (vLLM's sampling states and
diffusion states, or stand-ins with the same attributes), so the GPU tests and the runner
benchmark drive exactly what vLLM runs on a machine without vLLM
(``tests/test_vllm_device_path.py``, ``bench/bench_runner.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..head import Projection
from ..runner import LogprobRequest, StepRunner
from ..state import to_device_int64
from ..step import StepOutput

# Bytes per projected logit besides the model dtype's, in vLLM 0.34's ``compute_logits``: the
# final softcap returns an fp32 copy of the LM head's output.
SOFTCAP_COPY_BYTES = 4


def projected_logit_bytes(embed_weight: torch.Tensor) -> int:
    """Bytes ``compute_logits`` holds per logit at its peak: the head's output in the model
    dtype and its fp32 softcapped copy (the tile budget of vLLM 0.34's hidden-state input when
    the step projects through ``compute_logits``)."""
    return embed_weight.element_size() + SOFTCAP_COPY_BYTES


def compute_logits_projection(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                              embed_weight: torch.Tensor) -> Projection:
    """A ``Projection`` through vLLM's own ``compute_logits`` (softcap applied, full vocabulary
    or a shared set's K columns, gathered across ranks)."""
    return Projection(project=lambda hidden, lengths: compute_logits(hidden),
                      itemsize=projected_logit_bytes(embed_weight))


class VllmRequestOptions:
    """``runner.RequestOptions`` read from vLLM's ``SamplingStates`` (``top_k`` / ``top_p``
    with ``.np`` host and ``.gpu`` device arrays; "no top-k" is the vocabulary size, "no
    top-p" is 1) and its diffusion request states (``constrained``, ``allowed_tensor``,
    ``seeded_slots``)."""

    def __init__(self, sampling_states: Any, diffusion_states: Any, vocab_size: int) -> None:
        self.sampling_states = sampling_states
        self.diffusion_states = diffusion_states
        self.vocab_size = vocab_size
        self.generation = 0  # moved whenever a slot gets a new request

    def top_k_top_p(self, slots: list[int], slots_t: torch.Tensor):
        ss = self.sampling_states
        k_on = bool((ss.top_k.np[slots] < self.vocab_size).any())
        p_on = bool((ss.top_p.np[slots] < 1.0).any())
        return (ss.top_k.gpu[slots_t].to(torch.int64) if k_on else None,
                ss.top_p.gpu[slots_t] if p_on else None)

    def allowed_rows(self, slots: list[int], vocab: int) -> torch.Tensor | None:
        states = self.diffusion_states
        if not any(s in states.constrained for s in slots):
            return None
        mask = torch.ones(len(slots), vocab, dtype=torch.bool, device=states.canvas.device)
        for i, s in enumerate(slots):
            ids = states.constrained.get(s)
            if ids is not None:
                mask[i] = False
                mask[i, states.allowed_tensor(ids)] = True
        return mask

    def any_masks(self, slots: list[int]) -> bool:
        """Whether a request of ``slots`` uses top-k, top-p or an allowed set (host arrays only)."""
        ss = self.sampling_states
        return (bool((ss.top_k.np[slots] < self.vocab_size).any())
                or bool((ss.top_p.np[slots] < 1.0).any())
                or any(s in self.diffusion_states.constrained for s in slots))

    def any_pins(self, slots: list[int]) -> bool:
        # Pins come with a seed canvas only, so the seeded slots cover the pinned ones.
        return not self.diffusion_states.seeded_slots.isdisjoint(slots)


def decode(
    runner: StepRunner,
    rows: torch.Tensor,
    *,
    decode_slots: np.ndarray,
    decode_idx: np.ndarray,
    valid: np.ndarray,
    vocab: int,
    column_tokens: torch.Tensor | None,
    sampled: torch.Tensor,
    num_sampled: torch.Tensor,
    draft_tokens: torch.Tensor,
    all_slots: torch.Tensor,
    projection: Projection | None = None,
    logprobs: LogprobRequest | None = None,
) -> StepOutput:
    """The decode requests of one vLLM step, on the device.

    ``rows`` are the logits of the decoding requests (vLLM 0.33) or their hidden states (0.34,
    with the ``projection`` of a tile: the model's LM head, or ``compute_logits``);
    ``decode_slots`` / ``decode_idx`` / ``valid``: each decoding request's slot, its index in
    the batch and its number of rows. Writes vLLM's outputs: ``sampled`` [num_reqs, CL] and
    ``num_sampled`` [num_reqs] at ``decode_idx``, and every batch slot's canvas into
    ``draft_tokens`` (the next step's input ids).
    """
    states = runner.state
    widths = states.canvas_width_np[decode_slots].astype(np.int64)
    hidden = projection is not None
    out = runner.step(
        decode_slots.tolist(), valid.astype(np.int64), widths, vocab=vocab,
        logits=None if hidden else rows, hidden_states=rows if hidden else None,
        projection=projection, column_tokens=column_tokens, logprobs=logprobs)
    W = out.sampled.shape[1]
    decode_idx_t = to_device_int64(rows.device, decode_idx)[0]
    sampled[decode_idx_t, :W] = out.sampled.to(sampled.dtype)
    num_sampled[decode_idx_t] = out.num_sampled.to(num_sampled.dtype)
    draft_tokens[all_slots, :W] = states.canvas[all_slots, :W]
    return out
