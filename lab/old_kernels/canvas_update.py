"""The canvas update of one decode step in one launch: confidence, entropy-bound acceptance,
renoise, the stability ring, convergence and the commit bookkeeping (DESIGN section 2, steps 3-6).

Math (request j in slot s, canvas positions p < W, ``inside`` = p < width_j; the statistics
``e`` (entropy), ``a`` (arg-max), ``x`` (sample) are the step's ``[n, W]`` rows, phantom
positions filled in)::

    confident   = sum_inside(e) / width < confidence_threshold
    accepted    : rank the positions by e (ascending, +inf outside the canvas, NaN last,
                  ties by position); before_r = float(S_r) - e_r with S_r the prefix sum of
                  the ranked entropies accumulated in fp64, before_0 = 0; rank r is accepted
                  iff before_r <= entropy_bound
    denoise     : canvas = accepted ? x : renoise token; pinned positions keep their seed token
    commit      : canvas = a fresh random canvas; the step counter restarts
    ring        : a denoise step writes a into ring row (len mod RING) and the arg-max canvas
    converged   = (every ring row equal inside the canvas and confident and len >= RING)
                  or step >= max_steps

and the rest as ``dgemma_sampler.step.denoise_update``, its PyTorch twin, spells it.

The prefix sums are those of PyTorch on the CPU (``torch.cumsum`` of fp32 accumulates in a
double, in order, and rounds each prefix to fp32), so the accepted set is the oracle's bit for
bit; PyTorch on a GPU scans in fp32 in a tree order, whose prefixes can differ in the last bit.
The mean entropy of the confidence test is a sum in the kernel's own (tree) order, rounded
division included; where it lies within an ulp of ``confidence_threshold`` the verdict can
differ from the twin's (whose CPU sum runs in yet another order).

Why one kernel: the twin is ~60 small operators, a segmented sort among them. Each costs a GPU
~2-3 us even replayed from a CUDA graph, ~0.15 ms per step whatever the batch, about a tenth of a
one-request step. Here one program per request does it all in one launch:

* ranks by comparison (``W x W`` compares in chunks, ~65k at W = 256), no sort;
* the ranked entropies are scattered to a scratch row, read back in rank order by a scalar
  loop (the only sequential part: W dependent fp64 adds; its loads run ahead, unrolled, and
  its verdicts stay in registers until it ends), and the verdicts gathered back by rank
  through a second scratch row; the program's threads meet at a barrier after each scatter
  (global writes of one CTA are visible to its threads after ``bar.sync``);
* the ring is read and written as a ``[RING, W]`` tile.

Traffic: per request ~W x (3 statistics + canvas + arg-max canvas + RING ring rows + outputs)
x 8 bytes, ~10 KB at W = 256, RING = 3: nothing next to the logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .random_tokens import _canvas_tokens

# Elements of one rank-comparison tile ([BLOCK_W, CHUNK]), 16 per thread at 8 warps.
RANK_TILE = 4096
NUM_WARPS = 8
SCAN_UNROLL = 8  # ranked entropies loaded ahead of the scan's sequential adds


@triton.jit
def _before(e_a, p_a, e_b, p_b):
    """Whether (e_a, p_a) ranks before (e_b, p_b): ascending entropy, NaN last (as
    ``torch.sort``), equal entropies by position."""
    nan_a = e_a != e_a
    nan_b = e_b != e_b
    less = (e_a < e_b) | (nan_b & (e_a == e_a))
    same = (e_a == e_b) | (nan_a & nan_b)
    return less | (same & (p_a < p_b))


@triton.jit
def _canvas_update_kernel(
    entropy_ptr, argmax_ptr, sample_ptr,          # [n, W] statistics (fp32, int64, int64)
    slots_ptr, width_ptr, valid_ptr,              # [n] int64 slot, canvas width, valid length
    phase_ptr, step_ptr, confident_ptr,           # [S] slot-indexed state: bool, int32, bool
    hist_len_ptr, max_steps_ptr, read_only_ptr,   # [S] int32, int32, bool
    seeds_ptr, draws_ptr,                         # [S] int64
    canvas_ptr, argmax_canvas_ptr,                # [S, CL] int64
    pin_ptr, seed_canvas_ptr,                     # [S, CL] bool, int64
    history_ptr,                                  # [S, RING, CL] int64
    sampled_ptr, num_sampled_ptr, converged_ptr,  # [n, W] int64, [n] int32, [n] bool
    keep_ptr,                                     # [n, W] bool
    ranked_ptr, verdict_ptr,                      # [n, BLOCK_W] fp32, int8 scratch
    W, CL, confidence_threshold, entropy_bound,
    RING: tl.constexpr, RING_P2: tl.constexpr, PINS: tl.constexpr,
    RENOISE_STREAM: tl.constexpr, CANVAS_STREAM: tl.constexpr, VOCAB: tl.constexpr,
    BLOCK_W: tl.constexpr, CHUNK: tl.constexpr, SCAN_UNROLL: tl.constexpr,
):
    j = tl.program_id(0)
    slot = tl.load(slots_ptr + j).to(tl.int64)
    width = tl.load(width_ptr + j).to(tl.int32)
    valid = tl.load(valid_ptr + j).to(tl.int32)
    pos = tl.arange(0, BLOCK_W)
    live = pos < W
    inside = live & (pos < width)
    stat_row = j.to(tl.int64) * W
    ent = tl.load(entropy_ptr + stat_row + pos, mask=live, other=0.0)
    arg = tl.load(argmax_ptr + stat_row + pos, mask=live, other=0)
    smp = tl.load(sample_ptr + stat_row + pos, mask=live, other=0)

    # 3. Confidence: the mean entropy over the canvas, phantom positions included (a rounded
    # division, as torch's; Triton's ``/`` is an approximate one).
    confident = tl.div_rn(tl.sum(tl.where(inside, ent, 0.0), axis=0), width.to(tl.float32)) \
        < confidence_threshold

    # 4. Acceptance. Ranks by comparison: rank_i = #{j live: j ranks before i}.
    key = tl.where(inside, ent, float("inf"))
    rank = tl.zeros([BLOCK_W], tl.int32)
    for c in range(0, BLOCK_W, CHUNK):  # (not unrolled: compile time would grow as W^2)
        pc = c + tl.arange(0, CHUNK)
        ec = tl.load(entropy_ptr + stat_row + pc, mask=pc < W, other=0.0)
        kc = tl.where(pc < width, ec, float("inf"))
        earlier = _before(kc[None, :], pc[None, :], key[:, None], pos[:, None]) \
            & (pc < W)[None, :]
        rank += tl.sum(earlier.to(tl.int32), axis=1)
    scratch = j.to(tl.int64) * BLOCK_W
    tl.store(ranked_ptr + scratch + rank, key, mask=live)
    tl.debug_barrier()
    # The scan stores nothing (its verdicts collect in registers, by rank), so the unrolled
    # loop's loads do not wait behind stores that might alias them: only the fp64 adds are
    # sequential.
    total = tl.zeros((), tl.float64)
    by_rank = tl.zeros([BLOCK_W], tl.int1)
    for r in tl.range(0, W, loop_unroll_factor=SCAN_UNROLL):
        e_r = tl.load(ranked_ptr + scratch + r)
        total += e_r.to(tl.float64)
        before = tl.where(r == 0, 0.0, total.to(tl.float32) - e_r)
        by_rank = tl.where(pos == r, before <= entropy_bound, by_rank)
    tl.store(verdict_ptr + scratch + pos, by_rank.to(tl.int8), mask=live)
    tl.debug_barrier()
    accepted = tl.load(verdict_ptr + scratch + rank, mask=live, other=0) != 0

    # 5. Canvas update: commit -> a fresh canvas; denoise -> the sample where accepted, else
    # a renoise token; pinned positions keep their seed token.
    # (Scalar booleans are negated as ``x == 0`` and join tensor masks through ``tl.where``:
    # in the interpreter ``~`` of a scalar and ``&`` of a scalar and a tensor give no booleans.)
    is_commit = tl.load(phase_ptr + slot) != 0
    is_denoise = is_commit == 0
    step_after = tl.where(is_denoise, tl.load(step_ptr + slot) + 1, 0)
    seed = tl.load(seeds_ptr + slot)
    draw = tl.load(draws_ptr + slot)
    renoise = _canvas_tokens(seed, draw, pos, RENOISE_STREAM, VOCAB)
    fresh = _canvas_tokens(seed, draw, pos, CANVAS_STREAM, VOCAB)
    denoised = tl.where(accepted, smp, renoise)
    slot_row = slot * CL
    pinned = tl.zeros([BLOCK_W], tl.int1)
    if PINS:
        pinned = tl.load(pin_ptr + slot_row + pos, mask=live, other=0) != 0
        seed_tokens = tl.load(seed_canvas_ptr + slot_row + pos, mask=live, other=0)
        denoised = tl.where(pinned, seed_tokens, denoised)
    new_canvas = tl.where(is_commit, fresh, denoised)

    # 6. Stability ring (denoise steps write row len mod RING; commits reset the length).
    hist_len = tl.load(hist_len_ptr + slot)
    ring = tl.arange(0, RING_P2)
    ring_ptrs = history_ptr + slot * (RING * CL) + ring[:, None] * CL + pos[None, :]
    ring_live = (ring < RING)[:, None] & live[None, :]
    history = tl.load(ring_ptrs, mask=ring_live, other=0)
    write = tl.where(is_denoise, (ring == hist_len % RING)[:, None] & inside[None, :], False)
    history = tl.where(write, arg[None, :], history)
    tl.store(ring_ptrs, history, mask=write & ring_live)
    first = tl.sum(tl.where((ring == 0)[:, None], history, 0), axis=0)
    mismatch = (history != first[None, :]) & ring_live & inside[None, :]
    stable = tl.max(tl.max(mismatch.to(tl.int32), axis=1), axis=0) == 0
    old_argmax = tl.load(argmax_canvas_ptr + slot_row + pos, mask=live, other=0)
    argmax_canvas = tl.where(tl.where(is_denoise, inside, False), arg, old_argmax)
    tl.store(argmax_canvas_ptr + slot_row + pos, argmax_canvas, mask=live)
    new_hist_len = tl.where(is_denoise, hist_len + 1, 0)

    converged = (stable & confident & (new_hist_len >= RING)) | (
        step_after >= tl.load(max_steps_ptr + slot))
    # A converging denoise step commits next (a commit step never converges again).
    just_converged = converged & is_denoise
    read_only = tl.load(read_only_ptr + slot) != 0
    writable = read_only == 0
    emit = is_commit | (just_converged & read_only)
    tl.store(sampled_ptr + stat_row + pos, tl.where(tl.where(emit, inside, False), argmax_canvas, 0),
             mask=live)
    tl.store(num_sampled_ptr + j, tl.where(emit, valid, 0))
    tl.store(converged_ptr + j, just_converged)
    # Soft embeddings only for requests that denoise again, never at pinned positions.
    sc_keep = is_denoise & (just_converged == 0)
    tl.store(keep_ptr + stat_row + pos, tl.where(sc_keep, pinned == 0, False), mask=live)
    # Converging requests show their arg-max canvas.
    new_canvas = tl.where(just_converged, arg, new_canvas)
    tl.store(canvas_ptr + slot_row + pos, new_canvas, mask=inside)

    # Every warp has read the slot's scalars above before any of them is written.
    tl.debug_barrier()
    tl.store(step_ptr + slot, step_after)
    tl.store(confident_ptr + slot, confident)
    tl.store(hist_len_ptr + slot, new_hist_len)
    tl.store(phase_ptr + slot, just_converged & writable)
    tl.store(draws_ptr + slot, draw + 1)


_STATE_DTYPES = {
    "is_encoder_phase": torch.bool, "step": torch.int32, "confident": torch.bool,
    "accepted_canvas_history_len": torch.int32, "max_steps": torch.int32,
    "read_only": torch.bool, "seeds": torch.int64, "draws": torch.int64,
    "canvas": torch.int64, "argmax_canvas": torch.int64, "pin_mask": torch.bool,
    "seed_canvas": torch.int64, "accepted_canvas_history": torch.int64,
}


def canvas_update(
    state, slots: torch.Tensor, entropy: torch.Tensor, argmax: torch.Tensor,
    sample: torch.Tensor, width: torch.Tensor, valid_len: torch.Tensor, *,
    confidence_threshold: float, entropy_bound: float, vocab_size: int,
    streams: tuple[int, int], pins: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the update for the ``n`` requests in ``slots`` and write ``state`` in place.

    ``state`` holds the slot-indexed tensors named in ``_STATE_DTYPES`` (the attributes of
    ``dgemma_sampler.state.DiffusionState``), contiguous; ``entropy`` / ``argmax`` / ``sample``
    are the step's contiguous ``[n, W]`` statistics; ``width`` / ``valid_len`` the requests'
    ``[n]`` canvas widths and valid lengths; ``streams`` the renoise and fresh-canvas
    stream ids of the keyed tokens. ``pins=False`` promises that no request pins a position
    (the pin masks are not read). Returns ``(sampled [n, W] int64, num_sampled [n] int32,
    just_converged [n] bool, keep [n, W] bool)``: ``keep`` marks the positions that get a
    soft embedding (the request denoises again and the position is not pinned).
    """
    for name, dtype in _STATE_DTYPES.items():
        t = getattr(state, name)
        assert t.dtype == dtype and t.is_contiguous() and t.device == slots.device, \
            f"state.{name} must be a contiguous {dtype} tensor on {slots.device}"
    n = slots.numel()
    assert entropy.dim() == 2 and entropy.shape[0] == n, \
        f"entropy must be [n, W] with n = {n}, got {tuple(entropy.shape)}"
    W = entropy.shape[1]
    for name, t, dtype in (("entropy", entropy, torch.float32), ("argmax", argmax, torch.int64),
                           ("sample", sample, torch.int64)):
        assert t.shape == (n, W) and t.dtype == dtype and t.is_contiguous(), \
            f"{name} must be a contiguous {dtype} tensor of shape {(n, W)}"
    for name, t in (("slots", slots), ("width", width), ("valid_len", valid_len)):
        assert t.shape == (n,) and not t.dtype.is_floating_point and t.is_contiguous(), \
            f"{name} must be a contiguous [n] integer tensor"
    canvas = state.canvas
    S, CL = canvas.shape
    history = state.accepted_canvas_history
    assert history.dim() == 3 and history.shape[0] == S and history.shape[2] == CL, \
        f"accepted_canvas_history must be [{S}, RING, {CL}], got {tuple(history.shape)}"
    assert 1 <= W <= CL, f"canvas width W = {W} must be in [1, {CL}]"
    assert 1 <= int(vocab_size) < 2**32, f"vocab_size must be in [1, 2^32), got {vocab_size!r}"
    dev = slots.device
    sampled = torch.empty((n, W), dtype=torch.int64, device=dev)
    num_sampled = torch.empty((n,), dtype=torch.int32, device=dev)
    converged = torch.empty((n,), dtype=torch.bool, device=dev)
    keep = torch.empty((n, W), dtype=torch.bool, device=dev)
    if n == 0:
        return sampled, num_sampled, converged, keep
    block_w = triton.next_power_of_2(W)
    ranked = torch.empty((n, block_w), dtype=torch.float32, device=dev)
    verdict = torch.empty((n, block_w), dtype=torch.int8, device=dev)
    ring = history.shape[1]
    _canvas_update_kernel[(n,)](
        entropy, argmax, sample, slots, width, valid_len,
        state.is_encoder_phase, state.step, state.confident, state.accepted_canvas_history_len,
        state.max_steps, state.read_only, state.seeds, state.draws,
        canvas, state.argmax_canvas, state.pin_mask, state.seed_canvas, history,
        sampled, num_sampled, converged, keep, ranked, verdict,
        W, CL, float(confidence_threshold), float(entropy_bound),
        RING=ring, RING_P2=triton.next_power_of_2(ring), PINS=bool(pins),
        RENOISE_STREAM=int(streams[0]), CANVAS_STREAM=int(streams[1]), VOCAB=int(vocab_size),
        BLOCK_W=block_w, CHUNK=max(1, min(block_w, RANK_TILE // block_w)),
        SCAN_UNROLL=SCAN_UNROLL, num_warps=NUM_WARPS,
    )
    return sampled, num_sampled, converged, keep
