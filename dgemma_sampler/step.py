"""One decode step over a group of decoding requests: statistics -> accept/renoise ->
convergence -> commit bookkeeping -> self-conditioning soft embedding.

The step follows vLLM 0.33's ``_compiled_sample_step`` position for position (README lists
the deliberate differences). Every request is processed independently of the others, so a
step over a tile of requests gives the same result as a step over all of them: the
dispatcher (``sampler.py``) may cut requests into tiles freely.

Layout: ``logits`` is ``[N, V]``; decoding request j owns rows
``row_starts[j] .. row_starts[j] + valid_len[j]`` (canvas positions 0 .. valid_len[j]-1).
Its canvas is ``width[j] >= valid_len[j]`` wide; positions in ``[valid_len, width)`` are
*phantom* (a canvas truncated near the end of the context): as in vLLM they count as a
uniform row (entropy ``log V``, argmax 0) for confidence and acceptance and are never
emitted. Everything below runs on the device without a host synchronisation, except the
optional logprobs, which (as in vLLM) need to know on the host which requests converged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import reference
from .keyed_noise import Stream, random_tokens
from .reference import RowStats


@dataclass
class StepOutput:
    """What one decode step produced for its decoding requests (``n`` of them)."""

    sampled: torch.Tensor  # [n, W] int64: the emitted canvas (0 where nothing is emitted)
    num_sampled: torch.Tensor  # [n] int32: tokens emitted (valid length on commit, else 0)
    just_converged: torch.Tensor  # [n] bool: denoise steps that converged
    stats: RowStats  # [n, W] per-position statistics (phantom positions filled in)
    logprobs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def row_layout(row_starts: torch.Tensor, valid_len: torch.Tensor, num_rows: int):
    """Map every logits row to (request, position) on the device, without a sync."""
    dev = row_starts.device
    rows = torch.arange(num_rows, device=dev, dtype=torch.int64)
    ends = row_starts + valid_len
    request = torch.searchsorted(ends, rows, right=True)
    request = request.clamp(max=max(row_starts.numel() - 1, 0))
    position = rows - row_starts[request]
    return request, position


def acceptance_mask(entropy: torch.Tensor, entropy_bound: float) -> torch.Tensor:
    """Entropy-bound acceptance over the last dimension.

    Sort ascending (stable: ties go by position); the position of rank j is accepted iff
    the sum of the entropies ranked before it is ``<= entropy_bound``, so the lowest-entropy
    position is always accepted. ``+inf`` entries (positions outside a canvas) sort last.
    """
    sorted_ent, order = torch.sort(entropy, dim=-1, stable=True)
    before = torch.cumsum(sorted_ent, dim=-1) - sorted_ent
    # The first rank has nothing before it, even when its own entropy is +inf.
    before[..., 0] = 0.0
    accepted_sorted = before <= entropy_bound
    return torch.zeros_like(accepted_sorted).scatter_(-1, order, accepted_sorted)


def _stats_padded(
    stats: RowStats, request: torch.Tensor, position: torch.Tensor, n: int, width: int,
    phantom_entropy: float, phantom_argmax: int,
) -> RowStats:
    """Scatter flat-row statistics into ``[n, width]``, phantom positions filled in."""
    dev = request.device

    def full(value, dtype):
        return torch.full((n, width), value, dtype=dtype, device=dev)

    out = RowStats(
        argmax=full(phantom_argmax, torch.int64),
        sample=full(phantom_argmax, torch.int64),
        entropy=full(phantom_entropy, torch.float32),
        lse=full(float("nan"), torch.float32),
        threshold=full(float("-inf"), torch.float32),
        has_nan=full(False, torch.bool),
    )
    for dst, src in zip(out.as_tuple(), stats.as_tuple()):
        dst[request, position] = src.to(dst.dtype)
    return out


def denoise_update(
    state,
    slots: torch.Tensor,
    stats: RowStats,
    valid_len: torch.Tensor,
    width: torch.Tensor,
    W: int,
    *,
    confidence_threshold: float,
    entropy_bound: float,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The accept/renoise/convergence/commit update of DESIGN section 2, steps 3-6.

    ``stats`` are ``[n, W]`` (phantom positions filled in). Writes the state in place and
    returns ``(sampled [n, W], num_sampled [n], sc_keep [n], just_converged [n], pinned)``.
    """
    n = slots.numel()
    dev = slots.device
    pos = torch.arange(W, device=dev)
    inside = pos.unsqueeze(0) < width.unsqueeze(1)  # positions of each request's canvas
    entropy = torch.where(inside, stats.entropy, float("inf"))

    # 3. Confidence: mean entropy over the canvas (phantom positions included, as vLLM).
    mean_entropy = torch.where(inside, stats.entropy, 0.0).sum(-1) / width.to(torch.float32)
    confident = mean_entropy < confidence_threshold
    state.confident[slots] = confident

    # 4. Entropy-bound acceptance.
    accepted = acceptance_mask(entropy, entropy_bound)

    # 5. Canvas update. Commit: a fresh canvas; denoise: accepted positions take the
    # sample, the others a fresh uniform token; pinned positions keep their seed token.
    is_commit = state.is_encoder_phase[slots]
    is_denoise = ~is_commit
    step_after = torch.where(is_denoise, state.step[slots] + 1, 0).to(state.step.dtype)
    state.step[slots] = step_after
    seeds = state.seeds[slots].unsqueeze(1)
    draws = state.draws[slots].unsqueeze(1)
    renoise = random_tokens(seeds, draws, pos.unsqueeze(0), Stream.RENOISE, vocab_size)
    fresh = random_tokens(seeds, draws, pos.unsqueeze(0), Stream.CANVAS, vocab_size)
    pinned = state.pin_mask[slots, :W]
    denoised = torch.where(accepted, stats.sample, renoise)
    denoised = torch.where(pinned, state.seed_canvas[slots, :W], denoised)
    old_canvas = state.canvas[slots, :W]
    new_canvas = torch.where(is_commit.unsqueeze(1), fresh, denoised)
    new_canvas = torch.where(inside, new_canvas, old_canvas)

    # 6. Stability ring of argmax canvases (denoise steps write, commits reset).
    ring = state.accepted_canvas_history.shape[1]
    hist_len = state.accepted_canvas_history_len[slots]
    history = state.accepted_canvas_history[slots, :, :W]
    write = (torch.arange(ring, device=dev).unsqueeze(0) == (hist_len % ring).unsqueeze(1))
    write = (write & is_denoise.unsqueeze(1)).unsqueeze(2) & inside.unsqueeze(1)
    history = torch.where(write, stats.argmax.unsqueeze(1), history)
    state.accepted_canvas_history[slots, :, :W] = history
    argmax_canvas = state.argmax_canvas[slots, :W]
    argmax_canvas = torch.where(is_denoise.unsqueeze(1) & inside, stats.argmax, argmax_canvas)
    state.argmax_canvas[slots, :W] = argmax_canvas
    new_hist_len = torch.where(is_denoise, hist_len + 1, 0).to(hist_len.dtype)
    state.accepted_canvas_history_len[slots] = new_hist_len
    mismatch = ((history != history[:, :1]) & inside.unsqueeze(1)).any(dim=2).any(dim=1)
    stable = ~mismatch
    converged = (stable & confident & (new_hist_len >= ring)) | (
        step_after >= state.max_steps[slots]
    )
    commit_next = torch.where(is_commit, False, converged)
    read_only = state.read_only[slots]
    emit = is_commit | (is_denoise & converged & read_only)
    sampled = argmax_canvas * emit.unsqueeze(1) * inside
    num_sampled = (emit * valid_len).to(torch.int32)
    # Soft embeddings are stored only for requests that denoise again next step.
    sc_keep = is_denoise & ~commit_next
    just_converged = converged & is_denoise
    new_canvas = torch.where(just_converged.unsqueeze(1) & inside, argmax_canvas, new_canvas)
    state.canvas[slots, :W] = new_canvas
    state.is_encoder_phase[slots] = commit_next & ~read_only
    state.draws[slots] += 1
    return sampled, num_sampled, sc_keep, just_converged, pinned


def decode_step(
    state,
    logits: torch.Tensor,
    slots: torch.Tensor,
    row_starts: torch.Tensor,
    valid_len: torch.Tensor,
    width: torch.Tensor,
    W: int,
    *,
    confidence_threshold: float,
    entropy_bound: float,
    temperature_of: Callable[[torch.Tensor], torch.Tensor],
    stats_fn: Callable[..., RowStats],
    soft_fn: Callable[..., torch.Tensor] | None,
    embed_weight: torch.Tensor | None,
    normalizer: torch.Tensor | float = 1.0,
    vocab_size: int,
    softcap: float | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    column_tokens: torch.Tensor | None = None,
    vocab_start: int = 0,
    sc_reduce: Callable[[torch.Tensor], None] | None = None,
) -> StepOutput:
    """Run one decode step for the requests in ``slots`` (device tensors, no host sync).

    ``stats_fn`` / ``soft_fn`` are the flat-row functions of a backend
    (``reference.row_stats_rows`` / ``soft_embedding_rows`` or their Triton twins).
    ``top_k`` / ``top_p`` are per-request ([n]) or None; ``allowed`` is ``[n, V]`` bool or
    None; ``column_tokens`` names the token of each logits column when the logits hold an
    allowed subset only. ``sc_reduce`` all-reduces the soft embedding across
    tensor-parallel ranks (in place) when the embedding is a vocabulary slice.
    """
    n = slots.numel()
    n_rows, cols = logits.shape
    request, position = row_layout(row_starts, valid_len, n_rows)
    temperature = temperature_of(slots)
    seeds = state.seeds[slots]
    draws = state.draws[slots]
    kwargs = dict(softcap=softcap, top_k=top_k, top_p=top_p, allowed=allowed)
    if column_tokens is not None:
        kwargs["column_tokens"] = column_tokens
    flat = stats_fn(logits, request, position, temperature, seeds, draws, **kwargs)
    phantom_argmax = 0 if column_tokens is None else int(column_tokens[0])
    stats = _stats_padded(flat, request, position, n, W, math.log(cols), phantom_argmax)

    sampled, num_sampled, sc_keep, just_converged, pinned = denoise_update(
        state, slots, stats, valid_len, width, W,
        confidence_threshold=confidence_threshold, entropy_bound=entropy_bound,
        vocab_size=vocab_size,
    )

    # 7. Self-conditioning: written straight into the slot-indexed state rows.
    sc = state.self_conditioning_embeds
    # index_fill_ takes the 0 as a kernel argument: no host-to-device copy, so the step can be
    # captured in a CUDA graph (the whole canvas rows are cleared; positions past a request's
    # width are never read).
    sc.index_fill_(0, slots, 0.0)
    if soft_fn is not None and embed_weight is not None:
        keep = sc_keep[request] & ~pinned[request, position]
        sc_rows = sc.view(-1, sc.shape[-1])
        out_index = slots[request] * sc.shape[1] + position
        soft_fn(logits, request, temperature, flat.lse, embed_weight, normalizer, keep=keep,
                threshold=flat.threshold, allowed=allowed, vocab_start=vocab_start,
                softcap=softcap, out=sc_rows, out_index=out_index)
        if sc_reduce is not None:
            # Partial sums of a vocabulary slice: add the other ranks' (in fp32).
            part = sc[slots, :W]
            sc_reduce(part)
            sc[slots, :W] = part
    return StepOutput(sampled=sampled, num_sampled=num_sampled, just_converged=just_converged,
                      stats=stats)
