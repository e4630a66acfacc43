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

Host cost. An eager step is bound by how many operators the host dispatches (each costs
15-25 us of dispatch and launch on a GPU, against ~1 us of kernel time), so the step keeps
that number small: what depends only on the batch's shape lives in a ``StepLayout`` that the
dispatcher builds once per batch shape; a step whose rows fill every canvas (the common
case) takes the flat statistics as ``[n, W]`` views; the two keyed random canvases come from
one Triton launch; and masks that are all True are not applied. What remains is replayed from
CUDA graphs once a batch shape repeats (``update_runner``, ``update_graph.py``): the state
update is ``update_after_stats``, which reads no logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from . import envs, support
from .kernels.contract import PHANTOM_ENTROPY, PHANTOM_TOKEN, ROW_STATS
from .keyed_noise import Stream, random_tokens
from .reference import RowStats

if TYPE_CHECKING:
    from .backend import Kernels
    from .config import SamplerConfig

NOISE_STREAMS = (Stream.RENOISE, Stream.CANVAS)


@dataclass
class StepOutput:
    """What one decode step produced for its decoding requests (``n`` of them)."""

    sampled: torch.Tensor  # [n, W] int64: the emitted canvas (0 where nothing is emitted)
    num_sampled: torch.Tensor  # [n] int32: tokens emitted (valid length on commit, else 0)
    just_converged: torch.Tensor  # [n] bool: denoise steps that converged
    stats: RowStats  # [n, W] per-position statistics (phantom positions filled in)
    logprobs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # [support.NUM_PATHS] int64 on the device: rows per soft-embedding path (support.PATH_*),
    # None when the step ran the dense soft embedding only (tail_eps 0).
    sc_path_rows: torch.Tensor | None = None


class UpdateRunner(Protocol):
    """How ``decode_step`` runs its logits-free parts for a caller (``update_graph.UpdateGraph``
    replays them from CUDA graphs); by default they are called directly."""

    def prologue(self, fn: Callable[[], tuple], device: torch.device) -> tuple:
        """``fn()``: the per-request gathers."""

    def __call__(self, update: Callable[..., tuple[StepOutput, torch.Tensor | None]],
                 flat: RowStats) -> tuple[StepOutput, torch.Tensor | None]:
        """``update(flat)``: the state update."""

    def detach(self, out: StepOutput) -> StepOutput:
        """The step's output in memory of its own."""


def row_layout(row_starts: torch.Tensor, valid_len: torch.Tensor, num_rows: int):
    """Map every logits row to (request, position) on the device, without a sync."""
    dev = row_starts.device
    rows = torch.arange(num_rows, device=dev, dtype=torch.int64)
    ends = row_starts + valid_len
    request = torch.searchsorted(ends, rows, right=True)
    request = request.clamp(max=max(row_starts.numel() - 1, 0))
    position = rows - row_starts[request]
    return request, position


@dataclass
class StepLayout:
    """The device tensors of a step that depend only on the batch's shape.

    A batch keeps its shape (slots, valid lengths, canvas widths) for many steps, so the
    dispatcher builds this once per shape and reuses it; nothing here is written by a step.
    """

    request: torch.Tensor  # [N] int64: request of each logits row
    position: torch.Tensor  # [N] int64: canvas position of each logits row
    positions: torch.Tensor  # [W] int64: 0 .. W-1
    inside: torch.Tensor | None  # [n, W] bool: position < the request's width; None: all are
    width_f: torch.Tensor  # [n] fp32 canvas widths (the mean entropy's divisor)
    valid_i32: torch.Tensor  # [n] int32 valid lengths (tokens emitted on a commit)
    sc_index: torch.Tensor  # [N] int64: row of each logits row in the flat self-conditioning view
    ring_ids: torch.Tensor  # [ring] int64: 0 .. ring-1
    dense: bool  # the rows are exactly the n x W canvas positions, in order
    any_pins: bool  # some request of the batch has pinned positions


def step_layout(
    state, slots: torch.Tensor, row_starts: torch.Tensor, valid_len: torch.Tensor,
    width: torch.Tensor, W: int, num_rows: int, *, full_width: bool = False, any_pins: bool = True,
) -> StepLayout:
    """Build the ``StepLayout`` of a batch (device ops only, no host sync).

    ``full_width``: the caller knows every canvas is ``W`` wide. ``any_pins=False``: the caller
    knows no request of the batch pins positions (the pin masks are then not read).
    Rows that fill every canvas (``num_rows == n * W``; valid <= width <= W) imply both a
    dense layout and full widths.
    """
    n = slots.numel()
    dev = slots.device
    dense = num_rows == n * W
    request, position = row_layout(row_starts, valid_len, num_rows)
    positions = torch.arange(W, device=dev)
    inside = None
    if not (dense or full_width):
        inside = positions.unsqueeze(0) < width.unsqueeze(1)
    sc_index = slots[request] * state.self_conditioning_embeds.shape[1] + position
    ring = state.accepted_canvas_history.shape[1]
    return StepLayout(
        request=request, position=position, positions=positions, inside=inside,
        width_f=width.to(torch.float32), valid_i32=valid_len.to(torch.int32), sc_index=sc_index,
        ring_ids=torch.arange(ring, device=dev), dense=dense, any_pins=any_pins,
    )


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
    phantom_entropy: float, phantom_argmax: int | torch.Tensor,
) -> RowStats:
    """Scatter flat-row statistics into ``[n, width]``, phantom positions filled in as
    ``contract.ROW_STATS`` says.

    ``phantom_argmax`` may be a 0-d device tensor (the first allowed id of a constrained
    read), so that filling it in needs no host read.
    """
    dev = request.device
    padded = []
    for stat, src in zip(ROW_STATS, stats.as_tuple()):
        fill = stat.phantom
        value = phantom_argmax if fill == PHANTOM_TOKEN else (
            phantom_entropy if fill == PHANTOM_ENTROPY else fill)
        if isinstance(value, torch.Tensor):
            dst = value.to(stat.dtype).expand(n, width).clone()
        else:
            dst = torch.full((n, width), value, dtype=stat.dtype, device=dev)
        dst[request, position] = src.to(dst.dtype)
        padded.append(dst)
    return RowStats(*padded)


def use_triton_update(device: torch.device, backend: str = "auto") -> bool:
    """Whether the step's update runs its Triton kernels (``kernels/canvas_update.py``, and the
    keyed random canvases of ``kernels/random_tokens.py``): always on CUDA (one launch instead
    of ~60 small operators and a sort, or ~120 int64 tensor ops for the canvases), and under the
    interpreter when the step's backend is Triton (so the CPU tests run the kernels); the
    PyTorch twins elsewhere."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if device.type == "cuda":
        return True
    return backend == "triton" and envs.triton_interpret()


def noise_canvases(seeds: torch.Tensor, draws: torch.Tensor, width: int, vocab_size: int,
                   streams=NOISE_STREAMS, *, triton: bool):
    """Keyed uniform tokens of positions ``0 .. width-1``: one ``[n, width]`` int64 tensor
    per stream (the planes of one ``[len(streams), n, width]`` tensor from the kernel)."""
    if triton:
        from .kernels.random_tokens import random_tokens_canvas

        return random_tokens_canvas(seeds, draws, width, streams, vocab_size)
    pos = torch.arange(width, device=seeds.device).unsqueeze(0)
    return [random_tokens(seeds.unsqueeze(1), draws.unsqueeze(1), pos, s, vocab_size)
            for s in streams]


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
    layout: StepLayout | None = None,
    seeds: torch.Tensor | None = None,
    draws: torch.Tensor | None = None,
    noise_backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The accept/renoise/convergence/commit update of DESIGN section 2, steps 3-6.

    ``stats`` are ``[n, W]`` (phantom positions filled in). ``layout`` (optional) carries
    the shape-only tensors (only its ``inside``/``positions``/``width_f``/``valid_i32``/
    ``ring_ids``/``any_pins`` are read here); ``seeds`` / ``draws`` the already gathered
    ``state.seeds[slots]`` / ``state.draws[slots]``. Writes the state in place and returns
    ``(sampled [n, W], num_sampled [n], sc_keep [n], just_converged [n], pinned)`` with
    ``pinned`` None when no request pins positions.
    """
    dev = slots.device
    inside: torch.Tensor | None  # None: every position is inside its canvas
    if layout is None:
        positions = torch.arange(W, device=dev)
        inside = positions.unsqueeze(0) < width.unsqueeze(1)
        width_f, valid_i32 = width.to(torch.float32), valid_len.to(torch.int32)
        ring_ids = torch.arange(state.accepted_canvas_history.shape[1], device=dev)
        any_pins = True
    else:
        inside, width_f, valid_i32 = layout.inside, layout.width_f, layout.valid_i32
        ring_ids, any_pins = layout.ring_ids, layout.any_pins
    if seeds is None:
        seeds = state.seeds[slots]
    if draws is None:
        draws = state.draws[slots]

    def within(mask):  # ``mask & inside``; ``inside`` None means every position is inside
        return mask if inside is None else mask & inside

    # 3. Confidence: mean entropy over the canvas (phantom positions included, as vLLM).
    if inside is None:
        entropy = stats.entropy
        mean_entropy = entropy.sum(-1) / width_f
    else:
        entropy = torch.where(inside, stats.entropy, float("inf"))
        mean_entropy = torch.where(inside, stats.entropy, 0.0).sum(-1) / width_f
    confident = mean_entropy < confidence_threshold
    state.confident[slots] = confident

    # 4. Entropy-bound acceptance.
    accepted = acceptance_mask(entropy, entropy_bound)

    # 5. Canvas update. Commit: a fresh canvas; denoise: accepted positions take the
    # sample, the others a fresh uniform token; pinned positions keep their seed token.
    is_commit = state.is_encoder_phase[slots]
    is_denoise = ~is_commit
    step_after = (state.step[slots] + 1) * is_denoise  # +1 on denoise, 0 on commit
    state.step[slots] = step_after
    renoise, fresh = noise_canvases(seeds, draws, W, vocab_size,
                                    triton=use_triton_update(dev, noise_backend))
    denoised = torch.where(accepted, stats.sample, renoise)
    pinned = None
    if any_pins:
        pinned = state.pin_mask[slots, :W]
        denoised = torch.where(pinned, state.seed_canvas[slots, :W], denoised)
    new_canvas = torch.where(is_commit.unsqueeze(1), fresh, denoised)

    # 6. Stability ring of argmax canvases (denoise steps write, commits reset).
    ring = ring_ids.numel()
    hist_len = state.accepted_canvas_history_len[slots]
    history = state.accepted_canvas_history[slots, :, :W]
    write = (ring_ids.unsqueeze(0) == (hist_len % ring).unsqueeze(1)) & is_denoise.unsqueeze(1)
    write = write.unsqueeze(2)
    if inside is not None:
        write = write & inside.unsqueeze(1)
    history = torch.where(write, stats.argmax.unsqueeze(1), history)
    state.accepted_canvas_history[slots, :, :W] = history
    argmax_canvas = state.argmax_canvas[slots, :W]
    argmax_canvas = torch.where(within(is_denoise.unsqueeze(1)), stats.argmax, argmax_canvas)
    state.argmax_canvas[slots, :W] = argmax_canvas
    new_hist_len = (hist_len + 1) * is_denoise
    state.accepted_canvas_history_len[slots] = new_hist_len
    mismatch = history != history[:, :1]
    if inside is not None:
        mismatch = mismatch & inside.unsqueeze(1)
    stable = ~mismatch.any(dim=2).any(dim=1)
    converged = (stable & confident & (new_hist_len >= ring)) | (
        step_after >= state.max_steps[slots]
    )
    # A converging denoise step commits next (a commit step never converges again).
    just_converged = converged & is_denoise
    read_only = state.read_only[slots]
    emit = is_commit | (just_converged & read_only)
    sampled = argmax_canvas * within(emit.unsqueeze(1))
    num_sampled = emit * valid_i32
    # Soft embeddings are stored only for requests that denoise again next step.
    sc_keep = is_denoise & ~just_converged
    # Converging requests show their argmax canvas (= stats.argmax inside the canvas).
    new_canvas = torch.where(just_converged.unsqueeze(1), stats.argmax, new_canvas)
    if inside is None:
        state.canvas[slots, :W] = new_canvas
    else:
        state.canvas[slots, :W] = torch.where(inside, new_canvas, state.canvas[slots, :W])
    state.is_encoder_phase[slots] = just_converged & ~read_only
    state.draws[slots] = draws + 1
    return sampled, num_sampled, sc_keep, just_converged, pinned


@dataclass(frozen=True)
class StepBatch:
    """The decoding requests of a step and where their rows are (device tensors; module
    docstring, "Layout"): ``slots`` [n], ``row_starts`` / ``valid_len`` / ``width`` [n] int64, the
    output width ``W``, and the batch's ``StepLayout`` where the caller keeps one (None: built)."""

    slots: torch.Tensor
    row_starts: torch.Tensor
    valid_len: torch.Tensor
    width: torch.Tensor
    W: int
    layout: StepLayout | None = None


@dataclass(frozen=True)
class RowMasks:
    """What the statistics and the soft embedding apply to every logit: the final ``softcap``
    (None: the logits carry it), per-request ``top_k`` / ``top_p`` ([n] or None), per-request
    ``allowed`` masks ([n, V] bool or None), and ``column_tokens`` (the token of each column
    when the logits hold one shared allowed set's K columns only)."""

    softcap: float | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    allowed: torch.Tensor | None = None
    column_tokens: torch.Tensor | None = None


NO_MASKS = RowMasks()


@dataclass(frozen=True)
class SelfConditioning:
    """Where a step's soft embedding comes from: ``embed_weight`` ``[V_local, H]`` (this rank's
    vocabulary slice, logits columns ``[vocab_start, vocab_start + V_local)``), the
    ``normalizer``, ``reduce`` (in-place all-reduce of the partial sums across tensor-parallel
    ranks), ``row_vocab`` (the vocabulary a row stands for when the logits hold this rank's
    slice only: its phantom rows' entropy and the slice's share of ``tail_eps``; None: the
    logits' columns) and ``logits_scratch`` (the step owns the logits: the soft embedding may
    overwrite the rows it multiplies, ``kernels/soft_embedding_operand.py``)."""

    embed_weight: torch.Tensor
    normalizer: torch.Tensor | float = 1.0
    vocab_start: int = 0
    reduce: Callable[[torch.Tensor], None] | None = None
    row_vocab: int | None = None
    logits_scratch: bool = False


def decode_step(
    state,
    logits: torch.Tensor,
    batch: StepBatch,
    *,
    cfg: SamplerConfig,
    vocab_size: int,
    kernels: Kernels,
    request_inputs: Callable[[torch.Tensor], tuple[torch.Tensor, ...]],
    masks: RowMasks = NO_MASKS,
    soft: SelfConditioning | None = None,
    update_runner: UpdateRunner | None = None,
) -> StepOutput:
    """Run one decode step for the requests of ``batch`` (device tensors, no host sync).

    ``cfg`` gives the acceptance bound, the confidence threshold and the soft embedding's tail
    tolerance (``tail_eps``, ``support.py``; a vocabulary slice of the embedding gets the share
    ``tail_eps * V_local / V``, so the all-reduced sum keeps it); ``vocab_size`` the vocabulary
    random tokens come from. ``request_inputs(slots)`` gives the requests' ``(temperature,
    inv_t, seeds, draws)`` (``StepRunner.request_inputs``; the inverse temperature once, shared
    by the statistics and the soft embedding's kernels). ``kernels`` are the backend's flat-row
    operations (``backend.Kernels``). ``soft`` None: no soft embedding. ``update_runner`` (an
    ``UpdateRunner``: ``update_graph.UpdateGraph``) runs the step's logits-free parts for the
    caller, from CUDA graphs: ``prologue(fn, device)`` the per-request gathers,
    ``update_runner(update, flat)`` the state update (``update_after_stats``) and
    ``detach(out)`` hands the output over; by default they are called directly.
    """
    slots, W = batch.slots, batch.W
    n_rows, cols = logits.shape
    if soft is not None and soft.row_vocab is not None:
        cols = soft.row_vocab
    layout = batch.layout
    if layout is None:
        layout = step_layout(state, slots, batch.row_starts, batch.valid_len, batch.width, W,
                             n_rows)
    request = layout.request
    column_tokens = masks.column_tokens

    def prologue():
        return request_inputs(slots)

    if update_runner is None:
        temperature, inv_t, seeds, draws = prologue()
    else:
        temperature, inv_t, seeds, draws = update_runner.prologue(prologue, slots.device)
    kwargs = dict(softcap=masks.softcap, top_k=masks.top_k, top_p=masks.top_p,
                  allowed=masks.allowed, inv_t=inv_t)
    if column_tokens is not None:
        kwargs["column_tokens"] = column_tokens
    flat = kernels.row_stats_rows(logits, request, layout.position, temperature, seeds, draws,
                                  **kwargs)
    phantom_argmax = 0 if column_tokens is None else column_tokens[0]

    def update(flat_stats: RowStats, gather: bool = False) -> tuple[StepOutput, torch.Tensor | None]:
        # ``gather``: read seeds and draws from the state here (a captured update must not
        # hold on to this step's gathered copies).
        return update_after_stats(
            state, flat_stats, batch, layout, cfg=cfg, vocab_size=vocab_size,
            phantom_entropy=math.log(cols), phantom_argmax=phantom_argmax,
            seeds=None if gather else seeds, draws=None if gather else draws,
            backend=kernels.name, soft=soft is not None)

    out, keep = update(flat) if update_runner is None else update_runner(update, flat)

    # 7. Self-conditioning: written straight into the slot-indexed state rows (cleared by
    # the update).
    sc_path_rows = None
    if soft is not None:
        sc = state.self_conditioning_embeds
        sc_rows = sc.view(-1, sc.shape[-1])
        # Without top-k / top-p every threshold is -inf: pass none (the Hopper kernel then
        # skips a compare and a select per probability).
        threshold = flat.threshold if (masks.top_k is not None or masks.top_p is not None) else None
        soft_args = (logits, request, temperature, flat.lse, soft.embed_weight, soft.normalizer)
        soft_kwargs = dict(keep=keep, threshold=threshold, allowed=masks.allowed,
                           vocab_start=soft.vocab_start, softcap=masks.softcap, out=sc_rows,
                           out_index=layout.sc_index, inv_t=inv_t,
                           logits_scratch=soft.logits_scratch)
        slice_eps = support.slice_tail_eps(cfg.tail_eps, soft.embed_weight.shape[0] / cols)
        if slice_eps > 0:
            _, rows_support = support.soft_embedding_tail(
                kernels, *soft_args, **soft_kwargs, tail_eps=slice_eps,
                argmax=flat.argmax if column_tokens is None else None, entropy=flat.entropy)
            sc_path_rows = rows_support.path_rows()
        else:
            kernels.soft_embedding_rows(*soft_args, **soft_kwargs)
        if soft.reduce is not None:
            # Partial sums of a vocabulary slice: add the other ranks' (in fp32).
            part = sc[slots, :W]
            soft.reduce(part)
            sc[slots, :W] = part
    # (After the GEMM's launch: what the caller keeps leaves the runner's memory last.)
    out = out if update_runner is None else update_runner.detach(out)
    out.sc_path_rows = sc_path_rows
    return out


def update_after_stats(
    state,
    flat: RowStats,
    batch: StepBatch,
    layout: StepLayout,
    *,
    cfg: SamplerConfig,
    vocab_size: int,
    phantom_entropy: float,
    phantom_argmax: int | torch.Tensor,
    seeds: torch.Tensor | None = None,
    draws: torch.Tensor | None = None,
    backend: str = "auto",
    soft: bool = True,
) -> tuple[StepOutput, torch.Tensor | None]:
    """Everything of a step between the row statistics and the soft embedding.

    Reads the flat-row statistics, the state and the layout and nothing else (no logits, no
    host values that change between steps of one batch shape), so a batch that keeps its
    shape can replay it from a CUDA graph (``update_graph.py``). Returns the step's output
    and ``keep`` (which rows get a soft embedding; None when ``soft`` is False), and clears
    the self-conditioning rows of ``batch.slots``.
    """
    slots, valid_len, width, W = batch.slots, batch.valid_len, batch.width, batch.W
    n = slots.numel()
    request, position = layout.request, layout.position
    if layout.dense:
        # Every canvas is full: rows are the [n, W] positions in order, nothing to pad.
        stats = RowStats(*(t.reshape(n, W) for t in flat.as_tuple()))
    else:
        stats = _stats_padded(flat, request, position, n, W, phantom_entropy, phantom_argmax)

    sc = state.self_conditioning_embeds
    # index_fill_ takes the 0 as a kernel argument: no host-to-device copy, so the step can be
    # captured in a CUDA graph (the whole canvas rows are cleared; positions past a request's
    # width are never read).
    sc.index_fill_(0, slots, 0.0)
    keep = None
    if use_triton_update(slots.device, backend):
        from .kernels.canvas_update import canvas_update

        sampled, num_sampled, just_converged, keep_canvas = canvas_update(
            state, slots, stats.entropy, stats.argmax, stats.sample, width, valid_len,
            confidence_threshold=cfg.confidence_threshold, entropy_bound=cfg.entropy_bound,
            vocab_size=vocab_size, streams=NOISE_STREAMS, pins=layout.any_pins)
        if soft:
            keep = keep_canvas.view(-1) if layout.dense else keep_canvas[request, position]
    else:
        sampled, num_sampled, sc_keep, just_converged, pinned = denoise_update(
            state, slots, stats, valid_len, width, W,
            confidence_threshold=cfg.confidence_threshold, entropy_bound=cfg.entropy_bound,
            vocab_size=vocab_size, layout=layout, seeds=seeds, draws=draws, noise_backend=backend,
        )
        if soft:
            if pinned is None:
                keep = sc_keep[request]
            elif layout.dense:
                keep = (sc_keep.unsqueeze(1) & ~pinned).view(-1)
            else:
                keep = (sc_keep.unsqueeze(1) & ~pinned)[request, position]
    out = StepOutput(sampled=sampled, num_sampled=num_sampled, just_converged=just_converged,
                     stats=stats)
    return out, keep
