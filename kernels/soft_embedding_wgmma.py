"""Self-conditioning GEMM on Hopper in Gluon: TMA tiles, probabilities made in registers, wgmma.

Same math and contract as ``soft_embedding.py`` (read its docstring first): per logits row,
``p = exp(z - lse)`` with ``z = x * inv_t``, masked entries 0, and ``out = normalizer * p @ E``.

Why a second kernel. In the Triton kernel the compiler loads each logits tile from shared
memory in a blocked layout, computes ``p`` there, and after the cast to bf16 moves it
through shared memory again (store, barrier, load) into the register layout of the wgmma
A operand; with the pointer loads' address arithmetic that is ~380 instructions per warp
and K step for ~160 of arithmetic, and it holds the GEMM at ~60% of cuBLAS. Gluon lets the
kernel name its layouts, its shared-memory traffic and which warps do what.

Warp specialization. A 128 x 256 output tile is computed by two consumer warpgroups of 4
warps, each owning 64 rows (its own accumulator, 128 fp32 registers per thread), and one
TMA warp. The TMA warp fills ``STAGES`` shared-memory stages of (logits tile, E tile); each
consumer waits for a stage, makes ``p`` for its rows, issues its wgmma asynchronously and
releases the stage (an mbarrier that counts both warpgroups) once that wgmma is done. The
warpgroups synchronise only within themselves (a named barrier of 128 threads), so one's
prologue runs while the other's wgmma holds the tensor cores; the CTA-wide kernel before
this one stopped all 8 warps at two CTA barriers per K step (72% vs 75% of cuBLAS from fp32
logits at 32 requests, ``bench/results/soft_embedding-diag-h200-v11-ws.log``). Nothing
keeps the two apart, though, so their wgmma may also finish together and leave the tensor
cores idle while both make ``p``; ``pingpong`` (off until timed) makes them issue in turns.

How ``p`` reaches the tensor cores depends on the logits dtype (``p_in_registers``):

* fp32 logits: ``p`` goes through shared memory. A warp reads the logits tile in rows of 8
  threads x 16 bytes (``tile_layout``: ``[1, VEC]`` elements per thread, ``[4, 8]``
  threads), so the 8 threads of a quarter warp read the 8 16-byte chunks of one 128-byte row
  of the TMA box, which the 128-byte swizzle only permutes: no bank conflict. Each thread
  stores its 8 bytes of ``p`` into the warpgroup's p buffer; a half warp writes two 64-byte
  row pieces, which land on disjoint banks under a 64-byte swizzle. One wgmma is in flight
  while the next ``p`` is made (two p buffers per warpgroup). The other K loop (``p`` in
  registers, not the default) reads the fp32 tile in ``FP32_A_LAYOUT``: the A-operand layout
  read plainly costs 2-way bank conflicts (``LDS.64``, a half warp reads 4 rows x 32 bytes,
  and rows 0 and 1 of the 128-byte swizzle share their bank pairs), so the lanes' rows are
  permuted (a half warp reads rows 0, 2, 4, 6: four disjoint bank pairs) and renamed back
  into the operand layout by a reshape and a permute that move no data; the accumulator rows
  then belong to permuted logits rows (``_operand_row``), which the row constants and the
  epilogue follow. Conflict-free and bit-identical, yet no faster: 24.6 / 23.4 ms against
  23.8 / 23.1 ms through shared memory at 32 requests (``soft_embedding-diag-h200-v17-*``).
* 16-bit logits: ``p`` is the wgmma's register operand. The tile is read in the A-operand
  layout by ``ldmatrix`` (conflict-free under the swizzle), ``p`` never returns to shared
  memory (no store, proxy fence or barrier before the wgmma), and the next ``p`` is made while
  the wgmma runs; the wgmma is waited for before its operand registers are rewritten. From
  bf16 logits: 76% of cuBLAS at 32 requests against 64% through shared memory
  (``soft_embedding-diag-h200-v14.log``).

What limits it: the prologue, not the GEMM around it. The same tiles, pipeline and warps with
the bf16 logits tile handed from its TMA stage straight to the wgmma (no prologue) reach 102% /
105% / 86% of cuBLAS at 32 / 4 / 1 requests (``bench/diag_soft_embedding.py``, variant
``plain``, ``soft_embedding-diag-h200-v20-skeleton.log``), so L2 traffic without cuBLAS's
2-CTA multicast is not the gap. In SM cycles the kernel is at 71% (fp32 logits) and 77%
(bf16) of cuBLAS at 32 requests with or without the exponentials
(``bench/results/ncu-h200-2026-12-03.md``, ``ncu-h200-gemm-noexp-cycles.txt``); they cost
clock frequency under the power limit. The rest of the prologue's cost is not in one stage:
without the proxy fence or the warpgroup barrier before the wgmma nothing changes
(``-v21-handover.log``), nor without the logits' trip through shared memory (pointer loads:
slower, ``-v22-x-pointer.log``); one FFMA instead of FMUL + FFMA per entry is faster from
bf16 logits only (``-v23-one-fma.log``; ``one_fma``, not yet the default). With one
operand's loads pinned to the program's first K block (so always in L2,
``soft_embedding-diag-h200-v17-operands.log``) pinning E gains 5% (fp32 logits) and 11%
(bf16), pinning the logits nothing. Hence the order of whole tiles (``_grouped_tile``): the
programs that share an E tile run side by side.

Scope (``supported``): Hopper, logits fp32/bf16/fp16 whose local slice TMA can address
(16-byte aligned rows), E bf16/fp16, no ``allowed`` mask, no softcap. ``keep`` masks rows
(``p = 0``, an all-dropped M-tile skips its K loop) instead of compacting them. Rows past the
end and the ragged last K block read as zeros from TMA (their ``p`` is 0, and E's padding
rows are 0). The schedule (whole tiles in waves, a split-K tail) and the split-K merge are
``soft_embedding.plan_split`` and ``soft_embedding.split_sum_kernel``. Gluon has no
interpreter: on the CPU the Triton kernel runs; this one is tested on the GPU against it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from dgemma_sampler.ops import cuda_capability

from .soft_embedding import _grouped_tile, _one_fma_accurate, _tile_of_program

# Names that changed between Triton 3.6 and 3.9 (module-level aliases are callable in gluon.jit).
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

LOG2E = gl.constexpr(1.4426950408889634)
BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64
NUM_WARPS = 8  # 2 consumer warpgroups (+ the TMA warp, in a warpgroup of its own)
# Registers per thread of the consumer warpgroups and of the TMA warp's warpgroup (setmaxnreg;
# 2 x 128 x 232 + 128 x 40 <= 64K).
CONSUMER_REGS, LOADER_REGS = 232, 40
# Whole tiles run in groups of GROUP_M M-tiles x all N-tiles, M-tile fastest
# (``soft_embedding._grouped_tile``).
GROUP_M = 6


@gluon.jit
def _exp2_ftz(d2):
    """``2^d2`` as one MUFU.EX2 (see ``logit_row.exp2_ftz``)."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [d2], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _nan_to_zero(p):
    """NaN -> 0 on the 16-bit MMA operand, one max per two entries (as ``soft_embedding``)."""
    if p.dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [p, gl.zeros_like(p)],
                                         dtype=gl.bfloat16, is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise("max.f16x2 $0, $1, $2;", "=r,r,r", [p, gl.zeros_like(p)],
                                         dtype=gl.float16, is_pure=True, pack=2)


# fp32 logits in the wgmma A-operand layout (module docstring, "fp32 logits"): the operand
# layout (Triton's linear layout for [64, 64], k_width 2: registers over k bit 0, row bit 3,
# k bits 3-5; lanes over k bits 1-2 then row bits 0-2; warps over row bits 4-5) with lanes'
# row bits permuted, so that a half warp's four rows fall on four distinct swizzle phases.
# ``_relabel_rows`` turns the loaded tile back into the operand layout itself (checked at
# compile time by ``assert_trivial``).
FP32_A_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [8, 0], [0, 8], [0, 16], [0, 32]],
    lane_bases=[[0, 2], [0, 4], [2, 0], [4, 0], [1, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64]))


@gluon.jit
def _operand_row(m):
    """Shared-memory row (within a warpgroup's 64) that operand row ``m`` is read from with
    ``FP32_A_LAYOUT``: low bits (m1, m0, m2), i.e. lane rows 0-3 on rows 0, 2, 4, 6."""
    return (m & ~7) | ((m & 3) << 1) | ((m >> 2) & 1)


@gluon.jit
def _relabel_rows(x):
    """A tile loaded in ``FP32_A_LAYOUT`` (rows in shared-memory order) with its rows renamed
    into operand order, element (m, k) = x[_operand_row(m), k]: a reshape and a permute of
    the row bits, which move no data."""
    R: gl.constexpr = x.shape[0]
    C: gl.constexpr = x.shape[1]
    y = gl.reshape(x, [R // 8, 2, 2, 2, C])  # shared-memory row bits (s2, s1, s0)
    y = gl.permute(y, [0, 3, 1, 2, 4])       # operand row bits (m2, m1, m0) = (s0, s2, s1)
    return gl.reshape(y, [R, C])


@gluon.jit
def _load_operand(buf, a_layout: gl.constexpr, ROW_PERM: gl.constexpr):
    """A logits tile from shared memory as fp32 in the wgmma A-operand layout; with
    ``ROW_PERM`` (fp32 logits) its rows in ``_operand_row`` order."""
    if ROW_PERM:
        x = gl.convert_layout(_relabel_rows(buf.load(FP32_A_LAYOUT)), a_layout, assert_trivial=True)
    else:
        x = buf.load(a_layout)
    return x.to(gl.float32)


@gluon.jit
def _neg_lse2(lse):
    """``-lse * log2(e)`` rounded toward -inf (see ``soft_embedding._neg_lse2``)."""
    lse2 = lse * LOG2E
    residual = gl.fma(lse, LOG2E, -lse2)
    bits = lse2.to(gl.int32, bitcast=True)
    below = gl.where(lse2 > 0, bits - 1, bits + 1).to(gl.float32, bitcast=True)
    return -gl.where(residual < 0, below, lse2)


@gluon.jit
def _probabilities(x, inv_t, neg_lse2, threshold, THRESHOLD: gl.constexpr, dtype: gl.constexpr,
                   ONE_FMA: gl.constexpr = False):
    """``p = exp(x * inv_t - lse)`` of an fp32 logits tile, as the MMA operand ``dtype``: 0 below
    the row's threshold, for NaN and on dead rows (``neg_lse2 = -inf``). With ``ONE_FMA`` the
    caller passes ``inv_t * log2(e)`` as ``inv_t``."""
    if ONE_FMA:
        # One FFMA, skipping z's rounding: only where that moves p by < 2e-4 relative
        # (``soft_embedding._probabilities``).
        d2 = gl.fma(x, gl.expand_dims(inv_t, 1), gl.expand_dims(neg_lse2, 1))
    else:
        # z = x * inv_t as the row-statistics pass computed it, then base 2 against lse.
        d2 = gl.fma(x * gl.expand_dims(inv_t, 1), LOG2E, gl.expand_dims(neg_lse2, 1))
    if THRESHOLD:
        d2 = gl.where(x >= gl.expand_dims(threshold, 1), d2, float("-inf"))
    p = _exp2_ftz(gl.minimum(d2, 0.0, propagate_nan=tl.PropagateNan.ALL))
    return _nan_to_zero(p.to(dtype))


@gluon.jit
def _row_constants(rows, n_rows, row_request_ptr, inv_t_ptr, lse_ptr, threshold_ptr, keep_ptr,
                   HAS_KEEP: gl.constexpr, HAS_THRESHOLD: gl.constexpr):
    """Per logits row: live (in range and kept), ``inv_t``, ``-lse * log2(e)`` (-inf on a dead
    row or a non-finite lse, so that its p is 0) and the threshold (``inv_t`` without one)."""
    live = rows < n_rows
    if HAS_KEEP:
        live = live & (gl.load(keep_ptr + rows, mask=live, other=0) != 0)
    request = gl.load(row_request_ptr + rows, mask=live, other=0).to(gl.int64)
    inv_t = gl.load(inv_t_ptr + request, mask=live, other=0.0)
    lse = gl.load(lse_ptr + rows, mask=live, other=0.0)
    neg_lse2 = gl.where(live & (gl.abs(lse) < float("inf")), _neg_lse2(lse), float("-inf"))
    threshold = inv_t  # unused without HAS_THRESHOLD
    if HAS_THRESHOLD:
        # (one K loop for both cases: a second loop behind a branch on whether any row has a
        # threshold makes ptxas serialize every wgmma, "non wgmma instructions defining
        # accumulator registers", so callers pass no threshold when no row has one)
        threshold = gl.load(threshold_ptr + rows, mask=live, other=float("-inf"))
    return live, inv_t, neg_lse2, threshold


@gluon.jit
def _store_acc(acc, row0, tile_row, col0, piece, pieces, tail_idx, tail_tiles, n_rows, hidden,
               stride_out, norm_ptr, norm_value, out_ptr, out_index_ptr, scratch_ptr,
               BM: gl.constexpr, HAS_OUT_INDEX: gl.constexpr, NORM_IS_TENSOR: gl.constexpr,
               SCRATCH_N: gl.constexpr, ROW_PERM: gl.constexpr):
    """Epilogue of the accumulator for rows ``[tile_row, tile_row + its rows)`` of the ``BM``-row
    tile at ``row0``: a whole tile scaled into ``out``; of a split tile, piece 0 raw into ``out``
    and the others into their scratch slot (``soft_embedding.split_sum_kernel`` adds them).
    With ``ROW_PERM`` accumulator row ``m`` belongs to row ``_operand_row(m)`` of the tile."""
    layout: gl.constexpr = acc.type.layout
    ROWS: gl.constexpr = acc.shape[0]
    BN: gl.constexpr = acc.shape[1]
    acc_rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    if ROW_PERM:
        acc_rows = _operand_row(acc_rows)
    tile_rows = tile_row + acc_rows
    tile_cols = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    if piece > 0:
        slot = ((piece - 1) * tail_tiles + tail_idx).to(gl.int64)
        offs = gl.expand_dims(tile_rows, 1) * SCRATCH_N + gl.expand_dims(tile_cols, 0)
        gl.store(scratch_ptr + slot * (BM * SCRATCH_N) + offs, acc)
    else:
        if NORM_IS_TENSOR:
            norm = gl.load(norm_ptr).to(gl.float32)
        else:
            norm = norm_value
        scale = gl.where(pieces > 1, 1.0, norm)
        out_rows = row0 + tile_rows
        cols = col0 + tile_cols
        in_range = out_rows < n_rows
        dest = out_rows.to(gl.int64)
        if HAS_OUT_INDEX:
            dest = gl.load(out_index_ptr + out_rows, mask=in_range, other=0).to(gl.int64)
        ptrs = out_ptr + gl.expand_dims(dest * stride_out, 1) + gl.expand_dims(cols, 0)
        mask = gl.expand_dims(in_range, 1) & gl.expand_dims(cols < hidden, 0)
        gl.store(ptrs, acc * scale, mask=mask)





@gluon.jit
def _loader(descs, smem, tile):
    """The TMA partition (one warp): K step ``i`` into stage ``i % STAGES`` once both consumer
    warpgroups have released that stage's previous use."""
    x_desc, e_desc = descs
    x_bufs, e_bufs, p_bufs, ready, empty = smem
    row0, col0, kb_begin, n_k, piece, pieces, tail_idx, tail_tiles = tile
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    for i in range(n_k):
        stage = i % STAGES
        # A fresh mbarrier counts as having completed the phase before its first: the first
        # round of waits (parity 1) passes at once.
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, x_desc.block_type.nbytes + e_desc.block_type.nbytes)
        kb = kb_begin + i
        _tma_load(x_desc, [row0, kb * BK], bar, x_bufs.index(stage))
        _tma_load(e_desc, [kb * BK, col0], bar, e_bufs.index(stage))


@gluon.jit
def _await_turn(empty, WG: gl.constexpr, i, PINGPONG: gl.constexpr):
    """Ping-pong (``pingpong``): warpgroup ``WG`` issues step ``i``'s wgmma only after the other
    warpgroup has issued its previous one. The two turn mbarriers sit after the stages' own in
    ``empty``; warpgroup 0's first wait passes on the fresh barrier (parity 1)."""
    if PINGPONG:
        STAGES: gl.constexpr = empty.type.shape[0] - 2
        mbarrier.wait(empty.index(STAGES + WG), (i & 1) ^ (1 - WG))


@gluon.jit
def _pass_turn(empty, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: this warpgroup's wgmma is issued, the other's turn."""
    if PINGPONG:
        STAGES: gl.constexpr = empty.type.shape[0] - 2
        mbarrier.arrive(empty.index(STAGES + 1 - WG))


@gluon.jit
def _k_loop_shared_p(WG: gl.constexpr, WM: gl.constexpr, e_dtype: gl.constexpr, smem, n_k, acc,
                     inv_t, neg_lse2, threshold, tile_layout: gl.constexpr,
                     HAS_THRESHOLD: gl.constexpr, PINGPONG: gl.constexpr):
    """``acc += p @ E`` over the K steps, ``p`` handed to the wgmma through shared memory: the
    logits tile read conflict-free in ``tile_layout`` (module docstring), ``p`` stored to this
    warpgroup's p buffers, one wgmma in flight while the next ``p`` is made."""
    x_bufs, e_bufs, p_bufs, ready, empty = smem
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    for i in range(n_k):
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        x = x_bufs.index(stage).slice(WG * WM, WM).load(tile_layout).to(gl.float32)
        p = _probabilities(x, inv_t, neg_lse2, threshold, HAS_THRESHOLD, e_dtype)
        p_buf = p_bufs.index(2 * WG + i % 2)
        p_buf.store(p)
        fence_async_shared()
        _cta_barrier()  # in a partition: this warpgroup's named barrier
        _await_turn(empty, WG, i, PINGPONG)
        acc = warpgroup_mma(p_buf, e_bufs.index(stage), acc, is_async=True)
        _pass_turn(empty, WG, PINGPONG)
        # Step i - 1's wgmma, the last reader of its stage and of the other p buffer, is done
        # in this warp ...
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        # ... and after the barrier in all four: the loader may refill its stage.
        _cta_barrier()
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))


@gluon.jit
def _k_loop_register_p(WG: gl.constexpr, WM: gl.constexpr, e_dtype: gl.constexpr, smem, i_begin,
                       i_end, acc, inv_t, neg_lse2, threshold, a_layout: gl.constexpr,
                       HAS_THRESHOLD: gl.constexpr, ROW_PERM: gl.constexpr,
                       ONE_FMA: gl.constexpr, PINGPONG: gl.constexpr):
    """``acc += p @ E`` over K steps ``[i_begin, i_end)``, ``p`` the wgmma's register operand: the
    logits tile is read straight in the A-operand layout (``ldmatrix`` for 16-bit logits), the
    next ``p`` is made while the wgmma runs, and the wgmma is waited for before its operand
    registers are rewritten (the other warpgroup's wgmma keeps the tensor cores busy
    meanwhile). ``ONE_FMA``: the one-FFMA prologue, ``inv_t`` being ``inv_t * log2(e)``."""
    x_bufs, e_bufs, p_bufs, ready, empty = smem
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    mbarrier.wait(ready.index(i_begin % STAGES), (i_begin // STAGES) & 1, pred=i_begin < i_end)
    x = _load_operand(x_bufs.index(i_begin % STAGES).slice(WG * WM, WM), a_layout, ROW_PERM)
    p = _probabilities(x, inv_t, neg_lse2, threshold, HAS_THRESHOLD, e_dtype, ONE_FMA)
    for i in range(i_begin, i_end):
        stage = i % STAGES
        _await_turn(empty, WG, i, PINGPONG)
        acc = warpgroup_mma(p, e_bufs.index(stage), acc, is_async=True)
        _pass_turn(empty, WG, PINGPONG)
        # The next step's p while this wgmma runs (after the last step a stale tile, unused).
        nxt = i + 1
        mbarrier.wait(ready.index(nxt % STAGES), (nxt // STAGES) & 1, pred=nxt < i_end)
        x = _load_operand(x_bufs.index(nxt % STAGES).slice(WG * WM, WM), a_layout, ROW_PERM)
        p = _probabilities(x, inv_t, neg_lse2, threshold, HAS_THRESHOLD, e_dtype, ONE_FMA)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        _cta_barrier()  # every warp's wgmma of this step is done: release its stage
        mbarrier.arrive(empty.index(stage))
    return acc


@gluon.jit
def _consumer(WG: gl.constexpr, descs, smem, tile, row_args, out_args,
              HAS_THRESHOLD: gl.constexpr, HAS_KEEP: gl.constexpr, HAS_OUT_INDEX: gl.constexpr,
              NORM_IS_TENSOR: gl.constexpr, SCRATCH_N: gl.constexpr, VEC: gl.constexpr,
              P_IN_REGISTERS: gl.constexpr, ROW_PERM: gl.constexpr, ONE_FMA: gl.constexpr,
              PINGPONG: gl.constexpr):
    """Consumer warpgroup ``WG`` (4 warps): rows ``[64 WG, 64 WG + 64)`` of the tile, its K
    loop, then its part of the epilogue."""
    x_desc, e_desc = descs
    row0, col0, kb_begin, n_k, piece, pieces, tail_idx, tail_tiles = tile
    hidden, stride_out, norm_ptr, norm_value, out_ptr, out_index_ptr, scratch_ptr = out_args
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BN: gl.constexpr = e_desc.block_type.shape[1]
    WM: gl.constexpr = BM // 2
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    # The layout the logits tile is read in: the A operand's, or rows of 8 threads x 16 bytes.
    if P_IN_REGISTERS:
        x_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    else:
        x_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [4, 8], [4, 1], [1, 0])
    n_rows, row_request_ptr, inv_t_ptr, lse_ptr, threshold_ptr, keep_ptr = row_args
    acc_rows = gl.arange(0, WM, layout=gl.SliceLayout(1, x_layout))
    if ROW_PERM:
        acc_rows = _operand_row(acc_rows)
    rows = row0 + WG * WM + acc_rows
    live, inv_t, neg_lse2, threshold = _row_constants(
        rows, n_rows, row_request_ptr, inv_t_ptr, lse_ptr, threshold_ptr, keep_ptr, HAS_KEEP,
        HAS_THRESHOLD)
    acc = gl.zeros([WM, BN], gl.float32, layout=mma_layout)
    # Pin the zeros before the loop's zero-trip branch: otherwise LLVM sinks a second zero
    # accumulator into the path that skips the loop, and ptxas, seeing non-wgmma definitions
    # of accumulator registers, serializes every wgmma (advisory C7515).
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    if P_IN_REGISTERS:
        n_one = 0
        if ONE_FMA:
            # Uniform per warpgroup: the one-FFMA loop where it is accurate, the exact one
            # otherwise (greedy rows, |lse| ~ 1e11); two loops in sequence, one of them empty.
            n_one = gl.where(_one_fma_accurate(neg_lse2), n_k, 0)
            acc = _k_loop_register_p(WG, WM, e_desc.dtype, smem, 0, n_one, acc, inv_t * LOG2E,
                                     neg_lse2, threshold, x_layout, HAS_THRESHOLD, ROW_PERM, True,
                                     PINGPONG)
        acc = _k_loop_register_p(WG, WM, e_desc.dtype, smem, n_one, n_k, acc, inv_t, neg_lse2,
                                 threshold, x_layout, HAS_THRESHOLD, ROW_PERM, False, PINGPONG)
    else:
        acc = _k_loop_shared_p(WG, WM, e_desc.dtype, smem, n_k, acc, inv_t, neg_lse2, threshold,
                               x_layout, HAS_THRESHOLD, PINGPONG)
    _store_acc(acc, row0, WG * WM, col0, piece, pieces, tail_idx, tail_tiles, n_rows, hidden,
               stride_out, norm_ptr, norm_value, out_ptr, out_index_ptr, scratch_ptr, BM,
               HAS_OUT_INDEX, NORM_IS_TENSOR, SCRATCH_N, ROW_PERM)


@gluon.jit
def _program_tile(n_rows, v_local, keep_ptr, n_tiles_n, dp_head, tail_tiles, split,
                  BM: gl.constexpr, BK: gl.constexpr, GROUP: gl.constexpr, HAS_KEEP: gl.constexpr):
    """This program's share of ``soft_embedding.plan_split``'s schedule: ``(row0, n_tile,
    kb_begin, n_k, piece, pieces, tail_idx)``, the tile's first row, its N-tile, and the
    ``n_k`` K blocks from ``kb_begin`` (0 when every row of the tile is dropped, so that the
    tile skips its K loop; every partition sees the same n_k)."""
    m_tile, n_tile, tail_idx, piece, pieces = _tile_of_program(
        gl.program_id(0), n_tiles_n, dp_head, tail_tiles, split)
    k_blocks = gl.cdiv(v_local, BK)
    kb_begin = piece * k_blocks // pieces
    kb_end = (piece + 1) * k_blocks // pieces
    # Which programs run side by side changes what the L2 serves them: from bf16 logits at 32
    # requests 72-75% -> 78-79% of cuBLAS with groups of 2 to 12, fp32 unchanged up to 6 and
    # slower at 12 (soft_embedding-diag-h200-v17-order.log, -v18-order-ab.log).
    m_tile, n_tile = _grouped_tile(m_tile, n_tile, dp_head, n_tiles_n, GROUP)
    row0 = m_tile * BM
    rows = row0 + gl.arange(0, BM, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    live = rows < n_rows
    if HAS_KEEP:
        live = live & (gl.load(keep_ptr + rows, mask=live, other=0) != 0)
    n_k = gl.where(gl.max(live.to(gl.int32), 0) > 0, kb_end - kb_begin, 0)
    return row0, n_tile, kb_begin, n_k, piece, pieces, tail_idx


@gluon.jit
def soft_embedding_wgmma_kernel(
    x_desc, e_desc,                               # TMA: local logits [N, V_local], E [V_local, H]
    row_request_ptr, inv_t_ptr, lse_ptr, threshold_ptr, keep_ptr,
    norm_ptr, out_ptr, out_index_ptr, scratch_ptr,
    n_rows, v_local, hidden, stride_out, norm_value,
    n_tiles_n, dp_head, tail_tiles, split,        # schedule: soft_embedding.plan_split
    HAS_THRESHOLD: gl.constexpr, HAS_KEEP: gl.constexpr, HAS_OUT_INDEX: gl.constexpr,
    NORM_IS_TENSOR: gl.constexpr, STAGES: gl.constexpr, SCRATCH_N: gl.constexpr,
    VEC: gl.constexpr, P_SWIZZLE: gl.constexpr, P_IN_REGISTERS: gl.constexpr,
    ROW_PERM: gl.constexpr, ONE_FMA: gl.constexpr, PINGPONG: gl.constexpr, GROUP: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = e_desc.block_type.shape[1]

    row0, n_tile, kb_begin, n_k, piece, pieces, tail_idx = _program_tile(
        n_rows, v_local, keep_ptr, n_tiles_n, dp_head, tail_tiles, split, BM, BK, GROUP, HAS_KEEP)
    col0 = n_tile * BN

    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    e_bufs = gl.allocate_shared_memory(e_desc.dtype, [STAGES, BK, BN], e_desc.layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout(P_SWIZZLE, 16)
    # two p buffers per consumer warpgroup (unused, and dropped by the compiler, with P_IN_REGISTERS)
    p_bufs = gl.allocate_shared_memory(e_desc.dtype, [4, BM // 2, BK], p_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # (with PINGPONG two more: the consumer warpgroups' turns to issue, one arrive each)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES + 2 * PINGPONG, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)  # the loader's expect + the TMA bytes
        mbarrier.init(empty.index(s), count=2)  # one arrive per consumer warpgroup
    for s in gl.static_range(STAGES, STAGES + 2 * PINGPONG):
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()

    descs = (x_desc, e_desc)
    smem = (x_bufs, e_bufs, p_bufs, ready, empty)
    tile = (row0, col0, kb_begin, n_k, piece, pieces, tail_idx, tail_tiles)
    row_args = (n_rows, row_request_ptr, inv_t_ptr, lse_ptr, threshold_ptr, keep_ptr)
    out_args = (hidden, stride_out, norm_ptr, norm_value, out_ptr, out_index_ptr, scratch_ptr)
    # (constexprs go to the partitions as arguments of their own: inside a tuple they would
    # arrive as tensors)
    gl.warp_specialize([
        (_consumer, (0, descs, smem, tile, row_args, out_args, HAS_THRESHOLD, HAS_KEEP,  # own warps
                     HAS_OUT_INDEX, NORM_IS_TENSOR, SCRATCH_N, VEC, P_IN_REGISTERS, ROW_PERM,
                     ONE_FMA, PINGPONG)),
        (_consumer, (1, descs, smem, tile, row_args, out_args, HAS_THRESHOLD, HAS_KEEP,
                     HAS_OUT_INDEX, NORM_IS_TENSOR, SCRATCH_N, VEC, P_IN_REGISTERS, ROW_PERM,
                     ONE_FMA, PINGPONG)),
        (_loader, (descs, smem, tile)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))
    for s in gl.static_range(STAGES, STAGES + 2 * PINGPONG):
        mbarrier.invalidate(empty.index(s))


def _p_swizzle(logits_bytes: int) -> int:
    """Swizzle of the p tile that keeps its stores conflict-free (Layouts, module docstring)."""
    return 64 if logits_bytes == 4 else 128


def supported(logits: torch.Tensor, embed_weight: torch.Tensor, vocab_start: int, allowed, softcap) -> bool:
    """Whether this kernel can run the call (else the Triton kernel does)."""
    if logits.device.type != "cuda" or cuda_capability(logits.device)[0] != 9:
        return False
    if allowed is not None or softcap is not None:
        return False
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if embed_weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    v_local, hidden = embed_weight.shape
    local = logits[:, vocab_start:vocab_start + v_local]
    for t in (local, embed_weight):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return hidden % 8 == 0 and v_local > 0 and logits.shape[0] > 0


def p_in_registers(logits_dtype: torch.dtype) -> bool:
    """Whether the wgmma takes ``p`` from registers (16-bit logits, read by ``ldmatrix``) or
    from shared memory (fp32 logits). fp32 logits in registers, read conflict-free in
    ``FP32_A_LAYOUT``, measured no faster (module docstring); that K loop stays for
    ``bench/diag_soft_embedding.py`` and its GPU test."""
    return logits_dtype != torch.float32


def one_fma(logits_dtype: torch.dtype) -> bool:
    """Whether the register K loop (16-bit logits) runs the one-FFMA prologue in warpgroups
    whose rows allow it. Not yet: the same arithmetic in every warpgroup (diagnostic variant
    ``one_fma``) took bf16 logits from 67-79% to 72-86% of cuBLAS, but this loop pair has not
    run on a GPU (``bench/results/soft_embedding-diag-h200-v23-one-fma.log``)."""
    return False


def pingpong(logits_dtype: torch.dtype) -> bool:
    """Whether the two consumer warpgroups issue their wgmma in turns (warpgroup 0's step i,
    then 1's, then 0's step i + 1, ...), one waiting on an mbarrier that the other arrives at
    after each issue, so that one's prologue runs while the other's wgmma holds the tensor
    cores and their wgmma never finish together (the ping-pong of FlashAttention-3). Only the
    order of issue changes, never a bit of the output. Off until timed on a GPU
    (``bench/diag_soft_embedding.py --variants base,pingpong``)."""
    return False


def stages_for(logits_dtype: torch.dtype, embed_dtype: torch.dtype, smem_bytes: int = 227 * 1024) -> int:
    """Pipeline stages that fit in shared memory beside the p buffers (3 for fp32 logits,
    4 for 16-bit)."""
    per_stage = BLOCK_M * BLOCK_K * logits_dtype.itemsize + BLOCK_K * BLOCK_N * embed_dtype.itemsize
    p_bytes = 2 * BLOCK_M * BLOCK_K * embed_dtype.itemsize
    return max(2, min(4, (smem_bytes - p_bytes - 1024) // per_stage))


@functools.lru_cache(maxsize=None)
def _tile_layouts(x_dtype: torch.dtype, e_dtype: torch.dtype, x_box: tuple, e_box: tuple):
    """Shared-memory layouts of the logits and E tiles the descriptors load (built once per
    dtypes and boxes: the two ``get_default_for`` calls take ~20 us of host time per launch on
    the H200 host)."""
    gl_dtype = lambda dtype: getattr(gl, str(dtype).removeprefix("torch."))
    return (gl.NVMMASharedLayout.get_default_for(list(x_box), gl_dtype(x_dtype)),
            gl.NVMMASharedLayout.get_default_for(list(e_box), gl_dtype(e_dtype)))


def tile_descriptors(logits, embed_weight, vocab_start: int, x_box: tuple, e_box: tuple):
    """TMA descriptors of the local logits slice ``[N, V_local]`` and of E ``[V_local, H]``,
    loading boxes of ``x_box`` and ``e_box``."""
    n_rows = logits.shape[0]
    v_local, hidden = embed_weight.shape
    local = logits[:, vocab_start:vocab_start + v_local]
    x_layout, e_layout = _tile_layouts(logits.dtype, embed_weight.dtype, x_box, e_box)
    return (TensorDescriptor(local, [n_rows, v_local], [logits.stride(0), 1], list(x_box), x_layout),
            TensorDescriptor(embed_weight, [v_local, hidden], [embed_weight.stride(0), 1],
                             list(e_box), e_layout))


def launch_arguments(logits, row_request, inv_t, lse, embed_weight, norm_tensor, norm_value, out,
                     *, keep, threshold, out_index, plan, scratch, placeholder):
    """The runtime arguments after the two descriptors, and the constexprs, that every Gluon
    soft-embedding kernel of this schedule takes (this file's and ``bench/proto_shared_p.py``'s)."""
    args = (row_request, inv_t, lse,
            placeholder if threshold is None else threshold,
            placeholder if keep is None else keep,
            placeholder if norm_tensor is None else norm_tensor,
            out, placeholder if out_index is None else out_index, scratch,
            logits.shape[0], embed_weight.shape[0], embed_weight.shape[1], out.stride(0), norm_value,
            plan.n_tiles_n, plan.dp_head, plan.tail_tiles, plan.split)
    constexprs = dict(HAS_THRESHOLD=threshold is not None, HAS_KEEP=keep is not None,
                      HAS_OUT_INDEX=out_index is not None, NORM_IS_TENSOR=norm_tensor is not None,
                      VEC=16 // logits.element_size(), GROUP=GROUP_M, CONSUMER_REGS=CONSUMER_REGS,
                      LOADER_REGS=LOADER_REGS, num_warps=4)
    return args, constexprs


def launch(logits, row_request, inv_t, lse, embed_weight, norm_tensor, norm_value, out, *,
           keep, threshold, out_index, vocab_start, plan, scratch, placeholder):
    """Launch for one call of ``soft_embedding.soft_embedding_rows`` (inputs checked there)."""
    descs = tile_descriptors(logits, embed_weight, vocab_start, (BLOCK_M, BLOCK_K), (BLOCK_K, BLOCK_N))
    args, constexprs = launch_arguments(
        logits, row_request, inv_t, lse, embed_weight, norm_tensor, norm_value, out, keep=keep,
        threshold=threshold, out_index=out_index, plan=plan, scratch=scratch, placeholder=placeholder)
    registers = p_in_registers(logits.dtype)
    return soft_embedding_wgmma_kernel[(plan.programs,)](
        *descs, *args, **constexprs,
        STAGES=stages_for(logits.dtype, embed_weight.dtype), SCRATCH_N=BLOCK_N,
        P_SWIZZLE=_p_swizzle(logits.element_size()),
        P_IN_REGISTERS=registers, ROW_PERM=registers and logits.dtype == torch.float32,
        ONE_FMA=registers and one_fma(logits.dtype), PINGPONG=pingpong(logits.dtype),
    )
