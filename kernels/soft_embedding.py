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

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import contract
from . import soft_embedding_probabilities as prologue
from .kept_rows import kept_first
from .logit_row import interpreting
from .tile_schedule import tile_of_program

MAX_SCRATCH_BYTES = 32 * 2**20  # split-K partials beyond the output: at most 32 MiB
MIN_K_BLOCKS_PER_PIECE = 8  # a split-K piece shorter than this is all prologue and epilogue
MAX_SPLIT = 16
PIECE_OVERHEAD = 0.02  # cost of one extra split-K wave (fill, drain, stage 2), in whole-tile units


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
# Tiles, schedule and tuning
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


# Hopper candidates, the first that fits taken per shape key; one whose kernel spills
# registers loses to any that does not (checked for sm_90 with Triton 3.6 and 3.9 over logits
# fp32/bf16/fp16, E bf16/fp16/fp32, keep, threshold, allowed, softcap). The prologue costs 4-5
# instructions and one MUFU op per probability and feeds 2 * block_n MMA flops; L2 traffic is
# 2 / block_n + 1 / block_m bytes per flop (fp32 logits, bf16 E). Hence tiles whose accumulator
# is 128 registers per thread, 128 x 256 (2 warpgroups of 64 x 256, the least L2 traffic).
# BLOCK_K 64 splits each dot into 4 wgmma (3 in flight while the next prologue runs), 32 into 2.
# In order of preference (the first that fits and does not spill is used, the same on every
# run): 128 x 256 x 64 in 3 stages, then 128 x 256 x 32 in 4 stages where the deeper tiles do
# not fit (fp32 E, an ``allowed`` mask).
GPU_CONFIGS = (
    TileConfig(128, 256, 64, 8, 3),
    TileConfig(128, 256, 32, 8, 4),
)
SHARED_MEMORY_BYTES = 227 * 1024  # Hopper's per-block limit
# The interpreter: small tiles so that tests cover several M/N tiles, split-K and masking, with
# a deep K block because the interpreter's cost is per operation, not per element.
INTERPRETER_CONFIG = TileConfig(32, 64, 128, 4, 1)
INTERPRETER_NUM_SMS = 4


def shared_memory_bytes(cfg: TileConfig, logits_dtype: torch.dtype, embed_dtype: torch.dtype,
                        has_allowed: bool) -> int:
    """Pipeline buffers: num_stages x (logits tile + allowed tile + E tile). Within a few KiB of
    what Triton 3.6/3.9 allocate for sm_90 near the limit (fp32 E); launches that still do not fit
    raise OutOfResources and the tuner skips them."""
    a_bytes = cfg.block_m * cfg.block_k * (logits_dtype.itemsize + int(has_allowed))
    return cfg.num_stages * (a_bytes + cfg.block_k * cfg.block_n * embed_dtype.itemsize)


def half_last_n(hidden: int, block_n: int) -> bool:
    """Whether the last N tile runs half as wide: H is not a multiple of BLOCK_N and the rest
    fits in half a tile (2816 = 5.5 x 512)."""
    rest = hidden % block_n
    return block_n >= 32 and 0 < rest <= block_n // 2


def gpu_candidates(logits_dtype, embed_dtype, has_allowed: bool,
                   configs: tuple[TileConfig, ...] = GPU_CONFIGS) -> list[TileConfig]:
    """The configs whose pipeline buffers fit in shared memory; with an ``allowed`` mask (one more
    load per entry) only BLOCK_K <= 32, the others spill registers."""
    return [cfg for cfg in configs
            if shared_memory_bytes(cfg, logits_dtype, embed_dtype, has_allowed) <= SHARED_MEMORY_BYTES
            and not (has_allowed and cfg.block_k > 32)]


@dataclass(frozen=True)
class SplitPlan:
    """Program layout: ``dp_head`` whole tiles, then ``tail_tiles`` tiles in ``split`` pieces each,
    then ``extra_tiles`` whole tiles of rows past ``num_kept`` (they only store zeros)."""

    n_tiles_n: int
    dp_head: int
    tail_tiles: int
    split: int
    extra_tiles: int
    block_m: int
    block_n: int

    @property
    def programs(self) -> int:
        return self.dp_head + self.tail_tiles * self.split + self.extra_tiles

    @property
    def scratch_elems(self) -> int:
        return self.tail_tiles * (self.split - 1) * self.block_m * self.block_n

    table = None  # the schedule is the launch's (``CountPlans``: read on the device)

    def flags(self) -> dict:
        return {}


def plan_split(rows: int, planned_rows: int, hidden: int, v_local: int, cfg: TileConfig,
               num_sms: int, max_scratch_bytes: int = MAX_SCRATCH_BYTES,
               min_k_blocks: int = MIN_K_BLOCKS_PER_PIECE) -> SplitPlan:
    """Whole tiles in full waves, the remainder split along the vocabulary to fill whole waves.

    Cost of a split S for the L tail tiles, in units of one whole tile's time:
    ceil(L * S / num_sms) / S (+ PIECE_OVERHEAD per extra wave); the smallest S among the cheapest
    wins. S is bounded by the scratch cap and by ``min_k_blocks`` per piece.
    """
    n_tiles_n = triton.cdiv(hidden, cfg.block_n)
    planned = triton.cdiv(planned_rows, cfg.block_m) * n_tiles_n
    total = triton.cdiv(rows, cfg.block_m) * n_tiles_n
    dp_head = planned // num_sms * num_sms
    tail = planned - dp_head
    k_blocks = triton.cdiv(v_local, cfg.block_k)
    tile_bytes = cfg.block_m * cfg.block_n * 4
    best_split, best_cost = 1, float(math.ceil(tail / num_sms))
    for split in range(2, MAX_SPLIT + 1):
        if k_blocks // split < min_k_blocks or (split - 1) * tail * tile_bytes > max_scratch_bytes:
            break
        waves = math.ceil(tail * split / num_sms)
        cost = waves / split + PIECE_OVERHEAD * waves
        if cost < best_cost - 1e-9:
            best_split, best_cost = split, cost
    if best_split == 1:
        dp_head, tail = planned, 0
    return SplitPlan(n_tiles_n, dp_head, tail, best_split, total - planned, cfg.block_m, cfg.block_n)


@dataclass(frozen=True)
class CountPlans:
    """``plan_split`` for every number of kept rows, for a launch whose count stays on the
    device: ``table`` ``[M-tiles + 1, 3]`` int32 holds ``(dp_head, tail_tiles, split)`` for
    ``ceil(count / block_m)`` tiles of rows; the launch takes the largest grid, scratch and merge
    of any count (the programs past a count's plan find no tile and do nothing)."""

    table: torch.Tensor
    n_tiles_n: int
    programs: int
    tail_tiles: int
    scratch_elems: int
    dp_head = 0  # (the launch's values, unused: the kernels read the table's)
    split = 1

    def flags(self) -> dict:
        """The kernels' arguments that make them read the table."""
        return dict(plan_ptr=self.table, PLAN_BY_COUNT=True)


_COUNT_PLANS: dict[tuple, CountPlans] = {}


def plans_by_count(rows: int, hidden: int, v_local: int, cfg: TileConfig, num_sms: int,
                   device: torch.device, min_k_blocks: int = MIN_K_BLOCKS_PER_PIECE) -> CountPlans:
    """``CountPlans`` of a shape, built once (its table is copied to the device then: a first
    call must not be inside a CUDA graph capture, as for the kernels' compilation)."""
    key = (rows, hidden, v_local, cfg, num_sms, str(device), min_k_blocks)
    if key not in _COUNT_PLANS:
        plans = [plan_split(rows, tiles * cfg.block_m, hidden, v_local, cfg, num_sms,
                            min_k_blocks=min_k_blocks)
                 for tiles in range(triton.cdiv(rows, cfg.block_m) + 1)]
        table = torch.tensor([(p.dp_head, p.tail_tiles, p.split) for p in plans],
                             dtype=torch.int32, device=device)
        _COUNT_PLANS[key] = CountPlans(table, plans[0].n_tiles_n, max(p.programs for p in plans),
                                       max(p.tail_tiles for p in plans),
                                       max(p.scratch_elems for p in plans))
    return _COUNT_PLANS[key]


_TUNED: dict[tuple, TileConfig] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_NUM_SMS
    return contract.sm_count(device)


def _pick_config(key: tuple, candidates: list[TileConfig], launch, tune: bool = True) -> TileConfig:
    """The first candidate (``GPU_CONFIGS`` order) that launches and does not spill registers,
    remembered per shape key. No timing: a choice made by a stopwatch could differ between two
    processes, and with it the summation order, i.e. the bits of the result. A launch only
    rewrites ``out`` (the kernel is a pure function of its inputs). Under CUDA-graph capture, or
    with ``tune`` False, the first candidate is used (and not remembered)."""
    if key in _TUNED:
        return _TUNED[key]
    if torch.cuda.is_current_stream_capturing() or not tune:
        return candidates[0]
    spilling = []
    for cfg in candidates:
        try:
            kernel = launch(cfg)  # compiles
        except OutOfResources:
            continue  # not this tile on this device
        if not getattr(kernel, "n_spills", 0):
            _TUNED[key] = cfg
            return cfg
        spilling.append(cfg)
    if not spilling:
        raise RuntimeError(f"no soft-embedding tile config fits this device for {key}")
    _TUNED[key] = spilling[0]
    return spilling[0]


def tuning_key(planned_rows: int, hidden: int, v_local: int, logits_dtype, embed_dtype,
               masks: tuple) -> tuple:
    """Rows bucketed to a power of two (at least 256, one canvas) so a new batch size rarely retunes."""
    rows_bucket = max(256, triton.next_power_of_2(max(planned_rows, 1)))
    v_bucket = triton.next_power_of_2(max(v_local, 1))
    return (rows_bucket, hidden, v_bucket, logits_dtype, embed_dtype) + masks


def _wgmma_module():
    """``soft_embedding_wgmma`` where this Triton has the Gluon API it uses, else None."""
    global _WGMMA
    if _WGMMA is False:
        try:
            from . import soft_embedding_wgmma
            _WGMMA = soft_embedding_wgmma
        except (ImportError, AttributeError):
            _WGMMA = None
    return _WGMMA


_WGMMA = False  # not looked up yet


def _launch_wgmma(module, logits, row_request, inv_t, lse, embed_weight, norm_tensor, norm_value,
                  out, keep, threshold, out_index, vocab_start, sms, planned_rows, *,
                  operand: dict | None = None):
    """The Gluon kernel on the same schedule as the Triton one (whole tiles in waves, a split-K
    tail), the same compaction of kept rows and the same split-K merge. ``operand``: the
    arguments of ``soft_embedding_operand.operand_in_place`` besides the rows (its masks and
    softcap): the operand is first written over the kept rows, then multiplied as it is."""
    n_rows = logits.shape[0]
    v_local, hidden = embed_weight.shape
    cfg = TileConfig(module.BLOCK_M, module.BLOCK_N, module.BLOCK_K, module.NUM_WARPS,
                     module.stages_for(logits.dtype, embed_weight.dtype))
    plan = _plan(n_rows, planned_rows, keep, hidden, v_local, cfg, sms, logits.device,
                 MIN_K_BLOCKS_PER_PIECE)
    placeholder = inv_t
    scratch = (torch.empty(plan.scratch_elems, dtype=torch.float32, device=logits.device)
               if plan.scratch_elems else placeholder)
    row_order, kept_count = _kept_first(keep)
    if operand is not None:
        from .soft_embedding_operand import operand_in_place

        operand_in_place(logits, row_request, inv_t, lse, row_order=row_order,
                         kept_count=kept_count, threshold=threshold, vocab_start=vocab_start,
                         v_local=v_local, **operand)
        threshold = None  # applied
    module.launch(logits, row_request, inv_t, lse, embed_weight, norm_tensor, norm_value, out,
                  row_order=row_order, kept_count=kept_count, threshold=threshold,
                  out_index=out_index, vocab_start=vocab_start, plan=plan, scratch=scratch,
                  placeholder=placeholder, p_given=operand is not None)
    _merge_split(plan, cfg, out, out_index, scratch, row_order, kept_count, norm_tensor,
                 norm_value, n_rows, hidden, placeholder)


def _plan(n_rows: int, planned_rows: int | None, keep, hidden: int, v_local: int, cfg: TileConfig,
          sms: int, device: torch.device, min_k_blocks: int):
    """The schedule of a launch: ``plan_split`` for ``planned_rows`` (every row without
    ``keep``, or the caller's count of kept rows), or with ``keep`` and no count
    ``plans_by_count``, the plan of every count, read on the device by the kept count there."""
    if keep is not None and planned_rows is None:
        return plans_by_count(n_rows, hidden, v_local, cfg, sms, device, min_k_blocks)
    return plan_split(n_rows, n_rows if planned_rows is None else planned_rows, hidden, v_local,
                      cfg, sms, min_k_blocks=min_k_blocks)


def _kept_first(keep: torch.Tensor | None):
    """(row order, kept count): the kept rows first, in row order (``kept_rows.kept_first``),
    and their number as a ``[1]`` int32 tensor that stays on the device (no sync); (None, None)
    without ``keep``."""
    if keep is None:
        return None, None
    return kept_first(keep)


def _merge_split(plan, cfg: TileConfig, out, out_index, scratch, row_order, kept_count,
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


# ---------------------------------------------------------------------------------------------
# Launch wrapper
# ---------------------------------------------------------------------------------------------


def _check_inputs(logits, row_request, temperature, lse, embed_weight, keep, threshold, allowed,
                  vocab_start, out, out_index, num_kept) -> None:
    """Cheap asserts at the kernel's boundary; the caller (``dgemma_sampler.ops``, the step)
    validates what a user passes, with clear errors."""
    assert logits.dim() == 2 and logits.dtype in contract.FLOAT_DTYPES, (logits.dtype, logits.shape)
    dev = logits.device
    assert dev.type == "cuda" or interpreting(), \
        f"the Triton soft embedding needs CUDA tensors (or TRITON_INTERPRET=1), got {dev}"
    n_rows, vocab = logits.shape
    assert not (n_rows and vocab) or logits.stride(1) == 1, "logits rows must be contiguous"
    v_local, hidden = embed_weight.shape
    assert embed_weight.dtype in contract.FLOAT_DTYPES, embed_weight.dtype
    assert not (v_local and hidden) or embed_weight.stride(1) == 1, "embed_weight rows must be contiguous"
    assert 0 <= vocab_start and vocab_start + v_local <= vocab, (vocab_start, v_local, vocab)
    for name, t, dtypes, shape in (
        ("row_request", row_request, (torch.int32, torch.int64), (n_rows,)),
        ("temperature", temperature, contract.FLOAT_DTYPES, (temperature.shape[0],)),
        ("lse", lse, (torch.float32,), (n_rows,)),
        ("keep", keep, (torch.bool,), (n_rows,)),
        ("threshold", threshold, (torch.float32,), (n_rows,)),
        ("allowed", allowed, (torch.bool,), (temperature.shape[0], vocab)),
        ("out_index", out_index, (torch.int64,), (n_rows,)),
    ):
        if t is None:
            continue
        assert t.dtype in dtypes, f"{name} must have dtype in {dtypes}, got {t.dtype}"
        assert tuple(t.shape) == shape, f"{name} must have shape {shape}, got {tuple(t.shape)}"
        assert t.device == dev, f"{name} must be on {dev}, got {t.device}"
    assert allowed is None or not allowed.numel() or allowed.stride(1) == 1, "allowed rows must be contiguous"
    if out is not None:
        assert out.dtype == torch.float32 and out.dim() == 2 and out.shape[1] == hidden, \
            f"out must be [M, {hidden}] fp32, got {out.dtype} {tuple(out.shape)}"
        assert out_index is not None or out.shape[0] == n_rows, "out must have a row per logits row"
        assert not out.numel() or out.stride(1) == 1, "out rows must be contiguous"
    assert out_index is None or out is not None, "out_index needs out, the buffer it indexes"
    assert num_kept is None or 0 <= num_kept <= n_rows, num_kept


def soft_embedding_rows(
    logits: torch.Tensor,
    row_request: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    embed_weight: torch.Tensor,
    normalizer: torch.Tensor | float,
    *,
    keep: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    vocab_start: int = 0,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    out_index: torch.Tensor | None = None,
    num_kept: int | None = None,
    config: TileConfig | None = None,
    num_sms: int | None = None,
    wgmma: bool | None = None,
    tune: bool = True,
    inv_t: torch.Tensor | None = None,
    logits_scratch: bool = False,
) -> torch.Tensor:
    """Triton twin of ``reference.soft_embedding_rows`` (same arguments, same result; inputs are
    validated by the caller, ``dgemma_sampler.ops``, and only asserted here). The kernel tiles
    rows itself, so unlike the oracle it takes no ``chunk_rows``.

    logits ``[N, V]`` fp32/bf16/fp16 (rows may be strided); row_request ``[N]`` int; temperature
    ``[R]``; lse ``[N]`` fp32; embed_weight ``[V_local, H]`` bf16/fp16/fp32 (fp32 multiplies in
    tf32 on the GPU); keep ``[N]`` bool; threshold ``[N]`` fp32; allowed ``[R, V]`` bool; out
    ``[N, H]`` fp32, rows may be strided (e.g. a view of a slot-indexed state buffer).

    With ``out_index`` ``[N]`` int64, row n is written to ``out[out_index[n]]`` (``out`` is then
    any ``[M, H]`` fp32 buffer, e.g. the flattened slot-indexed soft-embedding state).

    ``num_kept``: optional host-side count of True in ``keep``; it only sizes the schedule (a wrong
    count is still correct, just slower). ``config`` / ``num_sms`` override tuning (tests, bench).
    ``wgmma``: the Gluon kernel of ``soft_embedding_wgmma.py`` (Hopper, the common case); None:
    where it applies and no ``config`` is given, False: never, True: always (an error where it
    does not apply). ``tune`` False: the first tile config that fits, unchecked for register
    spills (``_pick_config``). ``dgemma_sampler.ops`` sets both from the environment (``envs``).
    ``inv_t``: ``contract.inverse_temperature(temperature)`` where the caller has it (a step
    computes it once for its soft-embedding kernels).
    ``logits_scratch``: the caller owns ``logits`` and reads no kept row's columns
    ``[vocab_start, vocab_start + V_local)`` afterwards. On Hopper, with logits in E's dtype,
    the operand is then written over them (``soft_embedding_operand``) and the Gluon kernel
    multiplies it without a prologue, masks and softcap included: the same result, faster.
    """
    _check_inputs(logits, row_request, temperature, lse, embed_weight, keep, threshold, allowed,
                  vocab_start, out, out_index, num_kept)
    assert not isinstance(normalizer, torch.Tensor) or normalizer.numel() == 1, normalizer.shape
    assert softcap is None or 0 < softcap < float("inf"), softcap
    n_rows = logits.shape[0]
    v_local, hidden = embed_weight.shape
    dev = logits.device
    if out is None:
        out = torch.empty(n_rows, hidden, dtype=torch.float32, device=dev)
    if n_rows == 0 or hidden == 0:
        return out

    if inv_t is None:
        inv_t = contract.inverse_temperature(temperature)
    contract.check_inverse_temperature(inv_t, temperature)
    norm_is_tensor = isinstance(normalizer, torch.Tensor)
    norm_tensor = normalizer.reshape(1).to(dev) if norm_is_tensor else None
    norm_value = 1.0 if norm_is_tensor else float(normalizer)
    sms = num_sms if num_sms is not None else _num_sms(dev)
    module = _wgmma_module() if wgmma or (wgmma is None and dev.type == "cuda") else None
    # A given operand where the caller allows it (it takes the masks and the softcap too).
    given = logits_scratch and module is not None and module.supported(
        logits, embed_weight, vocab_start, allowed, softcap, p_given=True)
    fits = given or (module is not None
                     and module.supported(logits, embed_weight, vocab_start, allowed, softcap))
    if wgmma is None:
        wgmma = fits and config is None
    elif wgmma and not fits:
        raise ValueError("the wgmma soft embedding does not support this call (see "
                         "soft_embedding_wgmma.supported)")
    planned_rows = None if keep is None else num_kept  # None: every row, or the device's count
    if wgmma:
        _launch_wgmma(module, logits, row_request, inv_t, lse, embed_weight, norm_tensor, norm_value,
                      out, keep, threshold, out_index, vocab_start, sms, planned_rows,
                      operand=dict(allowed=allowed, softcap=softcap) if given else None)
        return out

    row_order, kept_count = _kept_first(keep)
    interpret = interpreting()
    dot_precision = "tf32" if embed_weight.dtype == torch.float32 else "ieee"
    placeholder = inv_t  # any tensor on the device stands in for an absent optional pointer

    def launch(cfg: TileConfig):
        plan = _plan(n_rows, planned_rows, keep, hidden, v_local, cfg, sms, dev,
                     1 if interpret else MIN_K_BLOCKS_PER_PIECE)
        scratch = (torch.empty(plan.scratch_elems, dtype=torch.float32, device=dev)
                   if plan.scratch_elems else placeholder)
        flags = dict(HAS_KEEP=keep is not None, NORM_IS_TENSOR=norm_is_tensor, **plan.flags())
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
            DOT_PRECISION=dot_precision,
            EVEN_K=v_local % cfg.block_k == 0, EVEN_N=hidden % cfg.block_n == 0,
            HALF_LAST_N=half_last_n(hidden, cfg.block_n),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
        )
        _merge_split(plan, cfg, out, out_index, scratch, row_order, kept_count, norm_tensor,
                     norm_value, n_rows, hidden, placeholder)
        return kernel

    if config is None:
        if dev.type != "cuda":
            config = INTERPRETER_CONFIG
        else:
            masks = (keep is not None, threshold is not None, allowed is not None, softcap is not None)
            key = tuning_key(n_rows if planned_rows is None else planned_rows, hidden, v_local,
                             logits.dtype, embed_weight.dtype, masks)
            candidates = gpu_candidates(logits.dtype, embed_weight.dtype, allowed is not None)
            config = _pick_config(key, candidates, launch, tune)
    launch(config)
    return out
