"""Self-conditioning GEMM: ``normalizer * softmax(z) @ E`` with the softmax recomputed in the prologue.

Math
----
For a logits row ``x`` (columns ``[vocab_start, vocab_start + V_local)`` of a row of ``V``), its
request's inverse temperature ``inv_t`` and the full-vocabulary ``lse`` from the row-statistics
pass, the probability of token ``v`` is

    p[v] = exp(z[v] - lse),   z[v] = min(softcap(x[v]) * inv_t, FLT_MAX),

exactly 0 where the entry is masked (NaN, ``-inf``, ``x < threshold``, not ``allowed``) and for rows
whose ``lse`` is not finite, and at most 1 (``lse`` covers every entry); and the soft embedding of
the row is

    out[n, :] = normalizer * sum_v p[n, v] * E[v - vocab_start, :]        (fp32).

Because ``lse`` is known, ``p`` is a plain elementwise function of the logits: no online rescaling,
every N-tile sees the same ``p`` and partial sums over vocabulary ranges simply add. So this is an
ordinary GEMM ``P @ E`` whose A operand is computed, not loaded: each K step loads a logits tile
``[BLOCK_M, BLOCK_K]`` (fp32 / bf16 / fp16), turns it into probabilities in registers, casts them to
E's dtype and feeds ``tl.dot`` with an E tile ``[BLOCK_K, BLOCK_N]``. ``P`` never touches memory.
(The same shape as flash attention's ``P @ V``.)

Cost model (one H200, rows R = 256 * requests, V = 2^18, H = 2816, fp32 logits)
---------------------------------------------------------------------------
* FLOPs ``2 R V H``: 12.1 TFLOP at 32 requests, ~18 ms at cuBLAS's 700 TFLOP/s -> compute-bound.
* The prologue runs on the same warps that issue the wgmma, so what counts is instructions per
  MMA flop. Each probability feeds ``2 * BLOCK_N`` flops and costs, per entry (SASS, sm_90):
  FMUL, FFMA, FMNMX, MUFU.EX2, half an F2FP pack and half an HMNMX2 (NaN -> 0 on the bf16
  pair), plus its share of the register -> shared -> register round trip that puts A in the
  wgmma register layout (Triton cannot hoist that conversion above the fp32 -> bf16 cast).
* Both operands come by pointer loads, pipelined ``num_stages`` deep by Triton; the address
  arithmetic adds integer instructions to every K step (the Gluon kernel loads by TMA).
  ``BLOCK_K / 16`` wgmma per step with ``BLOCK_K / 16 - 1`` in flight while the next prologue runs.
* Bytes from L2 per MMA flop: ``4/(2 BLOCK_N)`` (fp32 logits) + ``2/(2 BLOCK_M)`` (bf16 E): 128 x 256
  moves the least (64 KB per 1024 cycles), 64 x 512 halves the exps per flop for 25% more traffic.
* HBM: each logits tile is read by the ``H / BLOCK_N`` N-tiles of its M-tile and each E tile by
  every M-tile. Programs are ordered N-tile fastest, so the 132 programs of a wave are 12 M-tiles x 11
  N-tiles (22 x 6 for 64 x 512) walking K together: logits come from HBM once, E once per wave.
* H = 2816 = 5.5 x 512: with 64 x 512 tiles the last N tile runs as 64 x 256 (HALF_LAST_N).

Scheduling: data-parallel waves + split-K tail
----------------------------------------------
With ``T`` output tiles and ``S_m`` SMs, the first ``floor(T / S_m) * S_m`` tiles run whole (full
waves). The remaining ``L`` tiles (all of them when ``T < S_m``, e.g. 22 tiles at one request) are
split along the vocabulary into ``S`` contiguous ranges so that ``L * S`` programs fill whole waves.
Piece 0 of a split tile writes its fp32 partial into ``out``, pieces 1..S-1 into a scratch buffer of
``L * (S - 1)`` tiles; a second small kernel adds them in piece order (deterministic, no atomics),
multiplies by the normalizer and writes ``out``. At (1, 4, 16, 32) requests with 128 x 256 tiles on
132 SMs: S = (6, 3, 3, 3), scratch (14.4, 23.1, 23.1, 11.5) MB, capped at ``MAX_SCRATCH_BYTES``; with
64 x 512: S = (5, 1, 1, 1) (4 requests: 96 tiles in one wave of 132, the cap rules out S = 4).

Contract with the row-statistics pass: ``lse`` and ``threshold`` come from it, and ``p`` is only
consistent with them if both kernels compute the same fp32 ``z``. Without a softcap that holds by
construction (one fp32 multiply by the same ``inv_t``). With a softcap it needs the same tanh code:
at T = 0 (inv_t = 1e10) a 1-ulp difference in softcap(x) moves z by thousands of nats, and a token
sitting exactly at a top-k/top-p threshold can flip sides. Hence ``logit_row.softcapped``, the
helper every row kernel shares, and ``z`` rounded to fp32 before its exponent is formed (a greedy
row then gives exactly ``E[argmax]``).

On Hopper the common case (no ``allowed`` mask, no softcap, TMA-addressable logits, a 16-bit E)
runs ``soft_embedding_wgmma.py`` instead: the same math and schedule in Gluon, which keeps the
prologue off the layout round trip that Triton inserts here (see that file). Where the caller
owns 16-bit logits (``logits_scratch``: the hidden-state path), the operand is written over them
first (``soft_embedding_operand.py``, masks and softcap included) and the Gluon kernel multiplies
it with no prologue at all. This kernel is the one for everything else, and the only one the
interpreter can run.

Rows with ``keep`` False: the kept rows are compacted to the front of a row order on the device
(``kept_rows.kept_first``: a stable partition in one program, no host sync) and their count
stays on the device. M-tiles past the count skip the K loop and store zeros; within the last
live M-tile, dropped rows are masked. The schedule is then the one ``plan_split`` makes for
that count: ``plans_by_count`` tabulates it for every count (once per shape), the kernels read
their row of the table by the count on the device, and the launch takes the largest grid,
scratch and merge of any count (programs past their count's plan find no tile). Pass
``num_kept`` (a host int, e.g. known from the scheduler) to plan on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import soft_embedding_probabilities as prologue
from .logit_row import interpreting
from .tile_schedule import tile_of_program


@triton.jit
def _rows(first, n_rows, row_order_ptr, kept_count_ptr, HAS_KEEP: tl.constexpr, ROWS: tl.constexpr):
    """Rows at positions ``[first, first + ROWS)`` of the row order: ``row`` indices (int64),
    ``in_range`` (a row to write) and ``live`` (a kept row to compute). With ``keep`` the order
    is the compacted one (kept rows first) and only the first ``kept_count`` positions are live."""
    pos = first + tl.arange(0, ROWS)
    in_range = pos < n_rows
    if HAS_KEEP:
        count = tl.load(kept_count_ptr)
        row = tl.load(row_order_ptr + pos, mask=in_range, other=0).to(tl.int64)
    else:
        count = n_rows
        row = pos.to(tl.int64)
    return row, in_range, pos < count, first < count


@triton.jit
def _out_rows(row, in_range, out_index_ptr, HAS_OUT_INDEX: tl.constexpr):
    """Output row of each logits row: ``out_index[row]`` (a slot-indexed state buffer) or itself."""
    if HAS_OUT_INDEX:
        return tl.load(out_index_ptr + row, mask=in_range, other=0).to(tl.int64)
    return row


@triton.jit
def _schedule(plan_ptr, kept_count_ptr, dp_head, tail_tiles, split, BLOCK_M: tl.constexpr,
              PLAN_BY_COUNT: tl.constexpr):
    """``(dp_head, tail_tiles, split)``: the launch's, or with ``PLAN_BY_COUNT`` the row of
    ``plans_by_count``'s table for the kept count on the device (in tiles of ``BLOCK_M``)."""
    if PLAN_BY_COUNT:
        at = tl.cdiv(tl.load(kept_count_ptr), BLOCK_M) * 3
        return tl.load(plan_ptr + at), tl.load(plan_ptr + at + 1), tl.load(plan_ptr + at + 2)
    else:
        return dp_head, tail_tiles, split


@triton.jit
def _k_step(acc, x_ptrs, e_ptrs, a_ptrs, offs_k, live, col_ok, inv_t, neg_lse2, threshold,
            v_local, stride_embed,
            HAS_THRESHOLD: tl.constexpr, HAS_ALLOWED: tl.constexpr, SOFTCAP: tl.constexpr,
            INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
            EVEN_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K block: load the logits and E tiles, ``acc += p @ E``, advance the pointers.

    Fast path (EVEN_K, EVEN_N): the only mask is per row, constant along K, so loads stay
    16-byte vectors with no fill value to patch in afterwards. A ragged last K block reads E's
    missing rows as 0 (times a finite p <= 1) and the logits past the slice as NaN (p = NaN,
    zeroed by ``_nan_to_zero``).
    """
    allowed = None
    if EVEN_K:
        if EVEN_N:
            e = tl.load(e_ptrs)
        else:
            e = tl.load(e_ptrs, mask=col_ok[None, :], other=0.0)
    else:
        e = tl.load(e_ptrs, mask=(offs_k < v_local)[:, None] & col_ok[None, :], other=0.0)
    if EVEN_K:
        x = tl.load(x_ptrs, mask=live[:, None])
    else:
        x = tl.load(x_ptrs, mask=live[:, None] & (offs_k < v_local)[None, :], other=float("nan"))
    if HAS_ALLOWED:
        if EVEN_K:
            allowed = tl.load(a_ptrs, mask=live[:, None], other=0) != 0
        else:
            allowed = tl.load(a_ptrs, mask=live[:, None] & (offs_k < v_local)[None, :], other=0) != 0
    p = prologue.probabilities(x, inv_t, neg_lse2, threshold, allowed, SOFTCAP, HAS_THRESHOLD,
                       HAS_ALLOWED, INTERPRET)
    if INTERPRET:  # the interpreter's bf16/fp16 tl.dot is wrong: multiply the rounded values in fp32
        acc = tl.dot(prologue.rounded_as_fp32(p, e.dtype), e.to(tl.float32), acc)
    else:
        acc = tl.dot(prologue.nan_to_zero(p.to(e.dtype)), e, acc, input_precision=DOT_PRECISION)
    return acc, x_ptrs + BLOCK_K, e_ptrs + BLOCK_K * stride_embed, a_ptrs + BLOCK_K, offs_k + BLOCK_K


@triton.jit
def _k_loop(logits_ptr, embed_ptr, allowed_ptr, row, live, request, inv_t, neg_lse2, threshold,
            n_tile, kb_begin, kb_end, v_local, hidden, vocab_start,
            stride_logits, stride_allowed, stride_embed,
            HAS_THRESHOLD: tl.constexpr, HAS_ALLOWED: tl.constexpr, SOFTCAP: tl.constexpr,
            INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
            EVEN_N: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``sum_k p[rows, k] * E[k, cols]`` over K blocks ``[kb_begin, kb_end)`` of the N tile."""
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    offs_k = kb_begin * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = logits_ptr + row[:, None] * stride_logits + (vocab_start + offs_k)[None, :]
    e_ptrs = embed_ptr + offs_k.to(tl.int64)[:, None] * stride_embed + cols[None, :]
    a_ptrs = x_ptrs  # unused without HAS_ALLOWED
    if HAS_ALLOWED:
        a_ptrs = allowed_ptr + request[:, None] * stride_allowed + (vocab_start + offs_k)[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(kb_begin, kb_end):
        acc, x_ptrs, e_ptrs, a_ptrs, offs_k = _k_step(
            acc, x_ptrs, e_ptrs, a_ptrs, offs_k, live, col_ok, inv_t, neg_lse2, threshold,
            v_local, stride_embed, HAS_THRESHOLD, HAS_ALLOWED, SOFTCAP, INTERPRET, DOT_PRECISION,
            EVEN_K, EVEN_N, BLOCK_K)
    return acc


@triton.jit
def _store_tile(acc, out_ptr, out_index_ptr, scratch_ptr, row_order_ptr, kept_count_ptr, norm,
                m_tile, n_tile, tail_idx, piece, pieces, tail_tiles, n_rows, hidden, stride_out,
                HAS_KEEP: tl.constexpr, HAS_OUT_INDEX: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, SCRATCH_N: tl.constexpr):
    """A whole tile scaled into ``out``, piece 0 of a split tile raw into ``out``, pieces 1..S-1
    raw into their scratch tile (``BLOCK_M x SCRATCH_N``, row-major)."""
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if piece > 0:
        slot = ((piece - 1) * tail_tiles + tail_idx).to(tl.int64)
        offs = tl.arange(0, BLOCK_M)[:, None] * SCRATCH_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(scratch_ptr + slot * (BLOCK_M * SCRATCH_N) + offs, acc)
    else:
        # Row indices again rather than kept live in registers across the K loop.
        out_row, out_in_range, out_live, _ = _rows(
            m_tile * BLOCK_M, n_rows, row_order_ptr, kept_count_ptr, HAS_KEEP, BLOCK_M)
        scale = tl.where(pieces > 1, 1.0, norm)
        value = tl.where(out_live[:, None], acc * scale, 0.0)
        out_row = _out_rows(out_row, out_in_range, out_index_ptr, HAS_OUT_INDEX)
        out_ptrs = out_ptr + out_row[:, None] * stride_out + cols[None, :]
        tl.store(out_ptrs, value, mask=out_in_range[:, None] & (cols < hidden)[None, :])


@triton.jit
def _tile(logits_ptr, embed_ptr, allowed_ptr, out_ptr, out_index_ptr, scratch_ptr,
          row_order_ptr, kept_count_ptr, row, live, request, inv_t, neg_lse2, threshold, norm,
          m_tile, n_tile, tail_idx, piece, pieces, tail_tiles, kb_begin, kb_end, n_rows,
          v_local, hidden, vocab_start, stride_logits, stride_allowed, stride_embed, stride_out,
          HAS_KEEP: tl.constexpr, HAS_THRESHOLD: tl.constexpr, HAS_ALLOWED: tl.constexpr,
          HAS_OUT_INDEX: tl.constexpr, SOFTCAP: tl.constexpr, INTERPRET: tl.constexpr,
          DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          SCRATCH_N: tl.constexpr):
    """One output tile: the K loop and the store."""
    acc = _k_loop(logits_ptr, embed_ptr, allowed_ptr, row, live, request, inv_t, neg_lse2,
                  threshold, n_tile, kb_begin, kb_end, v_local, hidden, vocab_start,
                  stride_logits, stride_allowed, stride_embed,
                  HAS_THRESHOLD, HAS_ALLOWED, SOFTCAP, INTERPRET, DOT_PRECISION, EVEN_K, EVEN_N,
                  BLOCK_M, BLOCK_N, BLOCK_K)
    _store_tile(acc, out_ptr, out_index_ptr, scratch_ptr, row_order_ptr, kept_count_ptr, norm,
                m_tile, n_tile, tail_idx, piece, pieces, tail_tiles, n_rows, hidden, stride_out,
                HAS_KEEP, HAS_OUT_INDEX, BLOCK_M, BLOCK_N, SCRATCH_N)


@triton.jit
def soft_embedding_kernel(
    # pointers
    logits_ptr, row_request_ptr, inv_t_ptr, lse_ptr, threshold_ptr, allowed_ptr,
    row_order_ptr, kept_count_ptr, embed_ptr, norm_ptr, out_ptr, out_index_ptr,
    scratch_ptr,
    # sizes
    n_rows, v_local, hidden, vocab_start,
    # strides (elements between consecutive rows; the last dimension of every tensor is contiguous)
    stride_logits, stride_allowed, stride_embed, stride_out,
    # scalars
    norm_value,
    # schedule (see tile_schedule.tile_of_program)
    n_tiles_n, dp_head, tail_tiles, split,
    # meta-parameters
    HAS_KEEP: tl.constexpr, HAS_THRESHOLD: tl.constexpr, HAS_ALLOWED: tl.constexpr,
    HAS_OUT_INDEX: tl.constexpr,
    SOFTCAP: tl.constexpr, NORM_IS_TENSOR: tl.constexpr, INTERPRET: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    HALF_LAST_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    plan_ptr=None, PLAN_BY_COUNT: tl.constexpr = False,
):
    # -- program -> output tile and vocabulary range ------------------------------------------
    dp_head, tail_tiles, split = _schedule(plan_ptr, kept_count_ptr, dp_head, tail_tiles, split,
                                           BLOCK_M, PLAN_BY_COUNT)
    m_tile, n_tile, tail_idx, piece, pieces = tile_of_program(
        tl.program_id(0), n_tiles_n, dp_head, tail_tiles, split)
    row, in_range, live, tile_live = _rows(
        m_tile * BLOCK_M, n_rows, row_order_ptr, kept_count_ptr, HAS_KEEP, BLOCK_M)
    k_blocks = tl.cdiv(v_local, BLOCK_K)
    kb_begin = piece * k_blocks // pieces
    kb_end = tl.where(tile_live, (piece + 1) * k_blocks // pieces, kb_begin)  # dead tile: no K loop

    # -- per-row constants of the prologue ----------------------------------------------------
    request = tl.load(row_request_ptr + row, mask=live, other=0).to(tl.int64)
    inv_t = tl.load(inv_t_ptr + request, mask=live, other=0.0)
    lse = tl.load(lse_ptr + row, mask=live, other=0.0)
    # Rows not computed (dropped, past the kept count, or with a non-finite lse) get
    # neg_lse2 = -inf, hence p = 2^-inf = 0; their logits are not even loaded (read as 0).
    neg_lse2 = tl.where(live & (tl.abs(lse) < float("inf")), prologue.neg_lse2(lse), float("-inf"))
    threshold = None
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + row, mask=live, other=0.0)
    if NORM_IS_TENSOR:
        norm = tl.load(norm_ptr).to(tl.float32)
    else:
        norm = norm_value

    if HALF_LAST_N and n_tile == n_tiles_n - 1:
        # H is not a multiple of BLOCK_N and its last tile fits in half of one (H = 2816 =
        # 5.5 x 512): that tile runs half as wide instead of multiplying zeros.
        _tile(logits_ptr, embed_ptr, allowed_ptr, out_ptr, out_index_ptr,
              scratch_ptr, row_order_ptr, kept_count_ptr, row, live, request, inv_t, neg_lse2,
              threshold, norm, m_tile, n_tile * 2, tail_idx, piece, pieces, tail_tiles,
              kb_begin, kb_end, n_rows, v_local, hidden, vocab_start, stride_logits,
              stride_allowed, stride_embed, stride_out,
              HAS_KEEP, HAS_THRESHOLD, HAS_ALLOWED, HAS_OUT_INDEX, SOFTCAP, INTERPRET,
              DOT_PRECISION, EVEN_K, False,
              BLOCK_M, BLOCK_N // 2, BLOCK_K, BLOCK_N)
    else:
        _tile(logits_ptr, embed_ptr, allowed_ptr, out_ptr, out_index_ptr,
              scratch_ptr, row_order_ptr, kept_count_ptr, row, live, request, inv_t, neg_lse2,
              threshold, norm, m_tile, n_tile, tail_idx, piece, pieces, tail_tiles,
              kb_begin, kb_end, n_rows, v_local, hidden, vocab_start, stride_logits,
              stride_allowed, stride_embed, stride_out,
              HAS_KEEP, HAS_THRESHOLD, HAS_ALLOWED, HAS_OUT_INDEX, SOFTCAP, INTERPRET,
              DOT_PRECISION, EVEN_K, EVEN_N,
              BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_N)


@triton.jit
def split_sum_kernel(
    out_ptr, out_index_ptr, scratch_ptr, row_order_ptr, kept_count_ptr, norm_ptr,
    n_rows, hidden, stride_out, norm_value,
    n_tiles_n, dp_head, tail_tiles, split,
    HAS_KEEP: tl.constexpr, NORM_IS_TENSOR: tl.constexpr, HAS_OUT_INDEX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB_M: tl.constexpr,
    plan_ptr=None, PLAN_BY_COUNT: tl.constexpr = False,
):
    """Second stage of split-K: out = normalizer * (piece 0 + piece 1 + ... + piece S-1), in that
    order, for the rows ``[SUB_M * program_id(1), +SUB_M)`` of tail tile ``program_id(0)`` (with
    ``PLAN_BY_COUNT`` the grid covers the most tail tiles of any count: the others do nothing)."""
    dp_head, tail_tiles, split = _schedule(plan_ptr, kept_count_ptr, dp_head, tail_tiles, split,
                                           BLOCK_M, PLAN_BY_COUNT)
    tail_idx = tl.program_id(0)
    sub = tl.program_id(1)
    tile = dp_head + tail_idx
    m_tile = tile // n_tiles_n
    n_tile = tile % n_tiles_n
    # (a program past the count's tail tiles has no row in range)
    rows_limit = tl.where(tail_idx < tail_tiles, n_rows, 0)
    row, in_range, live, _ = _rows(
        m_tile * BLOCK_M + sub * SUB_M, rows_limit, row_order_ptr, kept_count_ptr, HAS_KEEP, SUB_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = in_range[:, None] & (cols < hidden)[None, :]
    out_row = _out_rows(row, in_range, out_index_ptr, HAS_OUT_INDEX)
    out_ptrs = out_ptr + out_row[:, None] * stride_out + cols[None, :]
    acc = tl.load(out_ptrs, mask=mask, other=0.0)
    offs = (sub * SUB_M + tl.arange(0, SUB_M))[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    for piece in range(1, split):
        slot = ((piece - 1) * tail_tiles + tail_idx).to(tl.int64)
        acc += tl.load(scratch_ptr + slot * (BLOCK_M * BLOCK_N) + offs, mask=mask, other=0.0)
    if NORM_IS_TENSOR:
        norm = tl.load(norm_ptr).to(tl.float32)
    else:
        norm = norm_value
    tl.store(out_ptrs, tl.where(live[:, None], acc * norm, 0.0), mask=mask)


# ---------------------------------------------------------------------------------------------
# Tile and launch
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileConfig:
    """Output tile ``block_m x block_n``, K step ``block_k``, and launch shape."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"


def launch_portable(logits, row_request, inv_t, lse, embed_weight, norm_tensor, norm_value, out, *,
                    cfg: TileConfig, plan, row_order, kept_count, threshold, allowed, out_index,
                    vocab_start: int, softcap, keep):
    """Launch ``soft_embedding_kernel`` (and the split-K merge) on ``plan``
    (``soft_embedding_dispatch``'s schedule) with tile ``cfg``; returns the compiled kernel
    (the dispatcher's tuning reads its spills). Inputs are checked by the dispatcher."""
    n_rows = logits.shape[0]
    v_local, hidden = embed_weight.shape
    interpret = interpreting()
    placeholder = inv_t  # any tensor on the device stands in for an absent optional pointer
    scratch = (torch.empty(plan.scratch_elems, dtype=torch.float32, device=logits.device)
               if plan.scratch_elems else placeholder)
    flags = dict(HAS_KEEP=keep is not None, NORM_IS_TENSOR=norm_tensor is not None, **plan.flags())
    schedule = (plan.n_tiles_n, plan.dp_head, plan.tail_tiles, plan.split)
    kernel = soft_embedding_kernel[(plan.programs,)](
        logits, row_request, inv_t, lse,
        placeholder if threshold is None else threshold,
        placeholder if allowed is None else allowed,
        placeholder if row_order is None else row_order,
        placeholder if kept_count is None else kept_count,
        embed_weight, placeholder if norm_tensor is None else norm_tensor,
        out, placeholder if out_index is None else out_index, scratch,
        n_rows, v_local, hidden, vocab_start,
        logits.stride(0), 0 if allowed is None else allowed.stride(0),
        embed_weight.stride(0), out.stride(0),
        norm_value, *schedule,
        HAS_THRESHOLD=threshold is not None, HAS_ALLOWED=allowed is not None,
        HAS_OUT_INDEX=out_index is not None,
        SOFTCAP=0.0 if softcap is None else float(softcap), INTERPRET=interpret,
        DOT_PRECISION="tf32" if embed_weight.dtype == torch.float32 else "ieee",
        EVEN_K=v_local % cfg.block_k == 0, EVEN_N=hidden % cfg.block_n == 0,
        HALF_LAST_N=half_last_n(hidden, cfg.block_n),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
    )
    merge_split(plan, cfg, out, out_index, scratch, row_order, kept_count, norm_tensor,
                norm_value, n_rows, hidden, placeholder)
    return kernel


def half_last_n(hidden: int, block_n: int) -> bool:
    """Whether the last N tile runs half as wide: H is not a multiple of BLOCK_N and the rest
    fits in half a tile (2816 = 5.5 x 512)."""
    rest = hidden % block_n
    return block_n >= 32 and 0 < rest <= block_n // 2




def merge_split(plan, cfg: TileConfig, out, out_index, scratch, row_order, kept_count,
                 norm_tensor, norm_value: float, n_rows: int, hidden: int, placeholder) -> None:
    """Second stage of split-K (``split_sum_kernel``) where the plan (``SplitPlan`` or
    ``CountPlans``) has a split tail (``plan_split`` folds S = 1 into the whole tiles).
    ``row_order`` / ``kept_count``: the compacted kept rows, or None for rows in order."""
    if not plan.tail_tiles:
        return
    sub_m = min(cfg.block_m, 8192 // cfg.block_n)  # 32 x 256 or 16 x 512: no spills
    split_sum_kernel[(plan.tail_tiles, cfg.block_m // sub_m)](
        out, placeholder if out_index is None else out_index, scratch,
        placeholder if row_order is None else row_order,
        placeholder if kept_count is None else kept_count,
        placeholder if norm_tensor is None else norm_tensor,
        n_rows, hidden, out.stride(0), norm_value,
        plan.n_tiles_n, plan.dp_head, plan.tail_tiles, plan.split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SUB_M=sub_m, num_warps=4,
        HAS_OUT_INDEX=out_index is not None, HAS_KEEP=row_order is not None,
        NORM_IS_TENSOR=norm_tensor is not None, **plan.flags(),
    )
