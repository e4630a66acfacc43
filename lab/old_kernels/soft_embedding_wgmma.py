"""Self-conditioning GEMM on Hopper in Gluon: TMA tiles, probabilities made in registers, wgmma.

Same math and contract as ``soft_embedding.py`` (read its docstring first): per logits row,
``p = exp(z - lse)`` with ``z = x * inv_t``, masked entries 0, and ``out = normalizer * p @ E``.

Why a second kernel. In the Triton kernel the compiler loads each logits tile from shared
memory in a blocked layout, computes ``p`` there, and after the cast to bf16 moves it
through shared memory again (store, barrier, load) into the register layout of the wgmma
A operand; with the pointer loads' address arithmetic that is ~380 instructions per warp
and K step for ~160 of arithmetic. Gluon lets the kernel name its layouts, its
shared-memory traffic and which warps do what.

Warp specialization. An output tile (128 x 256, or 256 x 128 for a given operand of one
canvas: ``tile_shape``) is computed by two consumer warpgroups of 4 warps, each owning half
its rows (its own accumulator, 128 fp32 registers per thread), and a loader:
one TMA warp, or with a row order (below) a warpgroup. The loader fills ``STAGES``
shared-memory stages of (logits tile, E tile); each
consumer waits for a stage, makes ``p`` for its rows, issues its wgmma asynchronously and
releases the stage (an mbarrier that counts both warpgroups) once that wgmma is done. The
warpgroups synchronise only within themselves (a named barrier of 128 threads), so one's
prologue runs while the other's wgmma holds the tensor cores, instead of all 8 warps
stopping at CTA barriers every K step.

How ``p`` reaches the tensor cores depends on the logits dtype (``p_in_registers``):

* fp32 logits: ``p`` goes through shared memory. A warp reads the logits tile in rows of 8
  threads x 16 bytes (``tile_layout``: ``[1, VEC]`` elements per thread, ``[4, 8]``
  threads), so the 8 threads of a quarter warp read the 8 16-byte chunks of one 128-byte row
  of the TMA box, which the 128-byte swizzle only permutes: no bank conflict. Each thread
  stores its 8 bytes of ``p`` into the warpgroup's p buffer; a half warp writes two 64-byte
  row pieces, which land on disjoint banks under a 64-byte swizzle. One wgmma is in flight
  while the next ``p`` is made (two p buffers per warpgroup).
* 16-bit logits: ``p`` is the wgmma's register operand. The tile is read in the A-operand
  layout by ``ldmatrix`` (conflict-free under the swizzle), ``p`` never returns to shared
  memory (no store, proxy fence or barrier before the wgmma), and the next ``p`` is made while
  the wgmma runs; the wgmma is waited for before its operand registers are rewritten.

What limits it: the prologue (the exponentials, issued by the warps that also issue the
wgmma), not the GEMM around it nor its L2 traffic. Of the operands, E is the one whose reuse
in L2 matters: hence the order of whole tiles (``tile_schedule.grouped_tile``), so that the
programs that share an E tile run side by side.

Rows not kept. With ``keep`` the caller passes a row order, kept rows first, and their count
(on the device): tiles run over the positions of that order, so the cost follows the kept rows,
not the tiles they are scattered over, and tiles past the count skip their K loop. TMA loads
boxes of consecutive rows and cannot gather: a tile whose kept rows are consecutive (every row
kept, or whole requests dropped) still loads by TMA, the others' logits rows come by
``cp.async`` from a loader warpgroup (16-byte vectors into the same swizzled stage; each
thread's copies arrive on the stage's barrier), E still by TMA. Rows not kept are written as
zeros.

Given operand (``P_GIVEN``). Where the step owns its logits, ``soft_embedding_operand`` writes
``p`` (E's dtype, masks and softcap applied) over the rows this kernel multiplies; the consumers
then load the tile straight into the wgmma's register operand, with no prologue: a plain GEMM,
bit-identical to the fused one.

Scope (``supported``): Hopper, logits fp32/bf16/fp16 whose local slice TMA can address
(16-byte aligned rows), E bf16/fp16, no ``allowed`` mask, no softcap (a given operand: any
mask and softcap, logits in E's dtype). Rows past the end and the
ragged last K block read as zeros (TMA's bounds, the copies' masks; their ``p`` is 0, and E's
padding rows are 0). The schedule (whole tiles in waves, a split-K tail) and the split-K merge
are ``soft_embedding.plan_split`` and ``soft_embedding.split_sum_kernel``. Gluon has no
interpreter: on the CPU the Triton kernel runs; this one is tested on the GPU against it.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .contract import cuda_capability
from .tile_schedule import grouped_tile, tile_of_program

# Names that changed between Triton 3.6 and 3.9 (module-level aliases are callable in gluon.jit).
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
_copy_rows = (async_copy.async_load if hasattr(async_copy, "async_load")
              else async_copy.async_copy_global_to_shared)

LOG2E = gl.constexpr(1.4426950408889634)
BLOCK_K = 64
# Output tiles (rows x hidden columns). Each consumer warpgroup owns half the rows, an
# accumulator of 128 fp32 registers per thread either way. WIDE reads each E tile once per
# 128 rows and each logits tile once per 256 columns; TALL reads E once per 256 rows, which is
# what matters where the rows are few: at one canvas (256 rows) the GEMM streams all of E
# (1.5 GB) against 0.13 GB of operand, in one wave, and with WIDE tiles the E tile of each
# (N-tile, vocabulary piece) is wanted by two programs that must meet in the L2 to read it
# from HBM once. TALL only multiplies a given operand: a prologue would make twice as many
# probabilities per wgmma flop.
WIDE, TALL = (128, 256), (256, 128)
TALL_MAX_ROWS = 256
NUM_WARPS = 8  # 2 consumer warpgroups (+ the loader, in a warpgroup of its own)
# Registers per thread of the consumer warpgroups and of the loader's warpgroup (setmaxnreg;
# 2 x 128 x 232 + 128 x 40 <= 64K).
CONSUMER_REGS, LOADER_REGS = 232, 40
# With a row order the loader warpgroup holds its rows' offsets across the K loop: more
# registers there (a TALL tile's 256 rows need 80), fewer for the consumers (neither spills).
GATHER_CONSUMER_REGS, GATHER_LOADER_REGS = 216, 80
# The loader of a tile whose rows a row order lists: a warpgroup (the TMA warp's warpgroup holds
# its registers anyway).
GATHER_WARPS = 4
# Whole tiles run in groups of GROUP_M M-tiles x all N-tiles, M-tile fastest
# (``tile_schedule.grouped_tile``).
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


@gluon.jit
def _load_operand(buf, a_layout: gl.constexpr):
    """A logits tile from shared memory as fp32 in the wgmma A-operand layout."""
    return buf.load(a_layout).to(gl.float32)


@gluon.jit
def _neg_lse2(lse):
    """``-lse * log2(e)`` rounded toward -inf (see ``soft_embedding_probabilities.neg_lse2``)."""
    lse2 = lse * LOG2E
    residual = gl.fma(lse, LOG2E, -lse2)
    bits = lse2.to(gl.int32, bitcast=True)
    below = gl.where(lse2 > 0, bits - 1, bits + 1).to(gl.float32, bitcast=True)
    return -gl.where(residual < 0, below, lse2)


@gluon.jit
def _probabilities(x, inv_t, neg_lse2, threshold, THRESHOLD: gl.constexpr, dtype: gl.constexpr):
    """``p = exp(x * inv_t - lse)`` of an fp32 logits tile, as the MMA operand ``dtype``: 0 below
    the row's threshold, for NaN and on dead rows (``neg_lse2 = -inf``)."""
    # z = x * inv_t as the row-statistics pass computed it, then base 2 against lse.
    d2 = gl.fma(x * gl.expand_dims(inv_t, 1), LOG2E, gl.expand_dims(neg_lse2, 1))
    if THRESHOLD:
        d2 = gl.where(x >= gl.expand_dims(threshold, 1), d2, float("-inf"))
    p = _exp2_ftz(gl.minimum(d2, 0.0, propagate_nan=tl.PropagateNan.ALL))
    return _nan_to_zero(p.to(dtype))


@gluon.jit
def _tile_rows(pos, n_rows, row_order_ptr, kept_count_ptr, HAS_ROW_ORDER: gl.constexpr):
    """Logits rows at tile positions ``pos`` (int64) and whether each is live: with a row order
    (kept rows first) the rows it lists, live up to the kept count; else the positions."""
    if HAS_ROW_ORDER:
        live = (pos < n_rows) & (pos < gl.load(kept_count_ptr))
        rows = gl.load(row_order_ptr + pos, mask=pos < n_rows, other=0).to(gl.int64)
    else:
        live = pos < n_rows
        rows = pos.to(gl.int64)
    return rows, live


@gluon.jit
def _row_constants(pos, n_rows, row_request_ptr, inv_t_ptr, lse_ptr, threshold_ptr,
                   row_order_ptr, kept_count_ptr, HAS_ROW_ORDER: gl.constexpr,
                   HAS_THRESHOLD: gl.constexpr):
    """Per tile position: live (a row to compute), ``inv_t``, ``-lse * log2(e)`` (-inf on a
    dead row or a non-finite lse, so that its p is 0) and the threshold (``inv_t`` without one)."""
    rows, live = _tile_rows(pos, n_rows, row_order_ptr, kept_count_ptr, HAS_ROW_ORDER)
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
               row_order_ptr, kept_count_ptr, BM: gl.constexpr, HAS_ROW_ORDER: gl.constexpr,
               HAS_OUT_INDEX: gl.constexpr, NORM_IS_TENSOR: gl.constexpr,
               SCRATCH_N: gl.constexpr):
    """Epilogue of the accumulator for positions ``[tile_row, tile_row + its rows)`` of the
    ``BM``-row tile at ``row0``: a whole tile scaled into ``out`` (zero for a row not kept); of a
    split tile, piece 0 raw into ``out`` and the others into their scratch slot
    (``soft_embedding.split_sum_kernel`` adds them)."""
    layout: gl.constexpr = acc.type.layout
    ROWS: gl.constexpr = acc.shape[0]
    BN: gl.constexpr = acc.shape[1]
    acc_rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
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
        pos = row0 + tile_rows
        in_range = pos < n_rows
        dest, live = _tile_rows(pos.to(gl.int64), n_rows, row_order_ptr, kept_count_ptr,
                                HAS_ROW_ORDER)
        if HAS_OUT_INDEX:
            dest = gl.load(out_index_ptr + dest, mask=in_range, other=0).to(gl.int64)
        cols = col0 + tile_cols
        ptrs = out_ptr + gl.expand_dims(dest * stride_out, 1) + gl.expand_dims(cols, 0)
        mask = gl.expand_dims(in_range, 1) & gl.expand_dims(cols < hidden, 0)
        # (a row not kept has p = 0, but 0 * a non-finite E entry would not be 0)
        gl.store(ptrs, gl.where(gl.expand_dims(live, 1), acc * scale, 0.0), mask=mask)


@gluon.jit
def _tma_stages(descs, smem, tile, x_row, ARRIVE: gl.constexpr):
    """K step ``i`` of the logits rows from ``x_row`` and of E by TMA into stage
    ``i % STAGES``, once both consumer warpgroups have released that stage's previous use;
    ``ARRIVE``: each thread also arrives on the stage (the row-order kernel's barrier count)."""
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
        _tma_load(x_desc, [x_row, kb * BK], bar, x_bufs.index(stage))
        _tma_load(e_desc, [kb * BK, col0], bar, e_bufs.index(stage))
        if ARRIVE:
            async_copy.mbarrier_arrive(bar, increment_count=False)  # no copies: at once


@gluon.jit
def _loader(descs, smem, tile):
    """The TMA partition (one warp) of a tile of consecutive rows."""
    _tma_stages(descs, smem, tile, tile[0], False)


@gluon.jit
def _gather_loader(descs, smem, tile, gather, VEC: gl.constexpr):
    """The loader partition (a warpgroup) of a tile whose rows a row order lists. E comes by
    TMA as in ``_loader``. If the tile's positions hold consecutive kept rows (every row kept,
    or whole requests dropped), its logits come by TMA too; otherwise (TMA cannot gather rows)
    by ``cp.async`` of 16-byte vectors, from row offsets read once before the K loop. Either
    way each thread arrives once per stage on its ``ready`` barrier (after its copies land).
    Rows past the kept count read as zeros, and so do vectors past the slice's end. A vector
    that straddles the end is read whole (a copy's mask must be uniform over its 16 bytes): it
    stays inside the row's 16-byte aligned span, and its columns past the end meet E's zero
    padding rows."""
    x_desc, e_desc = descs
    x_bufs, e_bufs, p_bufs, ready, empty = smem
    row0, col0, kb_begin, n_k, piece, pieces, tail_idx, tail_tiles = tile
    x_ptr, stride_x, v_local, n_rows, row_order_ptr, kept_count_ptr = gather
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    BM: gl.constexpr = x_bufs.type.shape[1]
    BK: gl.constexpr = x_bufs.type.shape[2]
    # The kept rows stand in increasing order, so the tile's are consecutive when all its
    # positions are kept and its last row is as far from its first as its last position.
    # (a program past its count's plan has row0 >= n_rows and nothing to load)
    last = gl.minimum(row0 + BM, n_rows) - 1
    first_row = gl.load(row_order_ptr + row0, mask=row0 < n_rows, other=0)
    consecutive = (last < gl.load(kept_count_ptr)) & (
        gl.load(row_order_ptr + last) - first_row == last - row0)
    if consecutive:
        _tma_stages(descs, smem, tile, first_row.to(gl.int32), True)
    else:
        LANES: gl.constexpr = BK // VEC  # threads per row of the tile
        layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // LANES, LANES],
                                                [gl.num_warps(), 1], [1, 0])
        pos = (row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))).to(gl.int64)
        rows, live = _tile_rows(pos, n_rows, row_order_ptr, kept_count_ptr, True)
        row_ptrs = gl.expand_dims(x_ptr + rows * stride_x, 1)
        live = gl.expand_dims(live, 1)
        # each vector's first column: the mask is uniform over a vector (16-byte copies)
        vec_cols = gl.arange(0, BK, layout=gl.SliceLayout(0, layout)) // VEC * VEC
        cols = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
        for i in range(n_k):
            stage = i % STAGES
            mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, e_desc.block_type.nbytes)
            kb = kb_begin + i
            _tma_load(e_desc, [kb * BK, col0], bar, e_bufs.index(stage))
            mask = live & gl.expand_dims(kb * BK + vec_cols < v_local, 0)
            _copy_rows(x_bufs.index(stage), row_ptrs + gl.expand_dims(kb * BK + cols, 0),
                       mask=mask)
            async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _k_loop_shared_p(WG: gl.constexpr, WM: gl.constexpr, e_dtype: gl.constexpr, smem, n_k, acc,
                     inv_t, neg_lse2, threshold, tile_layout: gl.constexpr,
                     HAS_THRESHOLD: gl.constexpr):
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
        acc = warpgroup_mma(p_buf, e_bufs.index(stage), acc, is_async=True)
        # Step i - 1's wgmma, the last reader of its stage and of the other p buffer, is done
        # in this warp ...
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        # ... and after the barrier in all four: the loader may refill its stage.
        _cta_barrier()
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))


@gluon.jit
def _register_operand(buf, a_layout: gl.constexpr, inv_t, neg_lse2, threshold,
                      HAS_THRESHOLD: gl.constexpr, e_dtype: gl.constexpr, P_GIVEN: gl.constexpr):
    """The wgmma's register operand from a 16-bit tile: ``p`` made from logits, or with ``P_GIVEN``
    the tile itself (``soft_embedding_operand`` wrote ``p`` over the logits)."""
    if P_GIVEN:
        return buf.load(a_layout)
    x = _load_operand(buf, a_layout)
    return _probabilities(x, inv_t, neg_lse2, threshold, HAS_THRESHOLD, e_dtype)


@gluon.jit
def _k_loop_register_p(WG: gl.constexpr, WM: gl.constexpr, e_dtype: gl.constexpr, smem, n_k,
                       acc, inv_t, neg_lse2, threshold, a_layout: gl.constexpr,
                       HAS_THRESHOLD: gl.constexpr, P_GIVEN: gl.constexpr):
    """``acc += p @ E`` over the K steps, ``p`` the wgmma's register operand: the logits tile is
    read straight in the A-operand layout (``ldmatrix`` for 16-bit logits), the next ``p`` is
    made while the wgmma runs, and the wgmma is waited for before its operand registers are
    rewritten (the other warpgroup's wgmma keeps the tensor cores busy meanwhile)."""
    x_bufs, e_bufs, p_bufs, ready, empty = smem
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    mbarrier.wait(ready.index(0), 0, pred=0 < n_k)
    p = _register_operand(x_bufs.index(0).slice(WG * WM, WM), a_layout, inv_t, neg_lse2,
                          threshold, HAS_THRESHOLD, e_dtype, P_GIVEN)
    for i in range(0, n_k):
        stage = i % STAGES
        acc = warpgroup_mma(p, e_bufs.index(stage), acc, is_async=True)
        # The next step's p while this wgmma runs (after the last step a stale tile, unused).
        nxt = i + 1
        mbarrier.wait(ready.index(nxt % STAGES), (nxt // STAGES) & 1, pred=nxt < n_k)
        p = _register_operand(x_bufs.index(nxt % STAGES).slice(WG * WM, WM), a_layout, inv_t,
                              neg_lse2, threshold, HAS_THRESHOLD, e_dtype, P_GIVEN)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        _cta_barrier()  # every warp's wgmma of this step is done: release its stage
        mbarrier.arrive(empty.index(stage))
    return acc


@gluon.jit
def _consumer(WG: gl.constexpr, descs, smem, tile, row_args, out_args,
              HAS_THRESHOLD: gl.constexpr, HAS_ROW_ORDER: gl.constexpr, HAS_OUT_INDEX: gl.constexpr,
              NORM_IS_TENSOR: gl.constexpr, SCRATCH_N: gl.constexpr, VEC: gl.constexpr,
              P_IN_REGISTERS: gl.constexpr, P_GIVEN: gl.constexpr):
    """Consumer warpgroup ``WG`` (4 warps): rows ``[WM WG, WM WG + WM)`` of the tile (``WM``,
    half its rows), its K loop, then its part of the epilogue."""
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
    n_rows, row_request_ptr, inv_t_ptr, lse_ptr, threshold_ptr, row_order_ptr, kept_count_ptr = \
        row_args
    pos = (row0 + WG * WM + gl.arange(0, WM, layout=gl.SliceLayout(1, x_layout))).to(gl.int64)
    live, inv_t, neg_lse2, threshold = _row_constants(
        pos, n_rows, row_request_ptr, inv_t_ptr, lse_ptr, threshold_ptr, row_order_ptr,
        kept_count_ptr, HAS_ROW_ORDER, HAS_THRESHOLD)
    acc = gl.zeros([WM, BN], gl.float32, layout=mma_layout)
    # Pin the zeros before the loop's zero-trip branch: otherwise LLVM sinks a second zero
    # accumulator into the path that skips the loop, and ptxas, seeing non-wgmma definitions
    # of accumulator registers, serializes every wgmma (advisory C7515).
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    if P_IN_REGISTERS:
        acc = _k_loop_register_p(WG, WM, e_desc.dtype, smem, n_k, acc, inv_t, neg_lse2,
                                 threshold, x_layout, HAS_THRESHOLD, P_GIVEN)
    else:
        acc = _k_loop_shared_p(WG, WM, e_desc.dtype, smem, n_k, acc, inv_t, neg_lse2, threshold,
                               x_layout, HAS_THRESHOLD)
    _store_acc(acc, row0, WG * WM, col0, piece, pieces, tail_idx, tail_tiles, n_rows, hidden,
               stride_out, norm_ptr, norm_value, out_ptr, out_index_ptr, scratch_ptr,
               row_order_ptr, kept_count_ptr, BM, HAS_ROW_ORDER, HAS_OUT_INDEX, NORM_IS_TENSOR,
               SCRATCH_N)


@gluon.jit
def _program_tile(n_rows, v_local, kept_count_ptr, plan_ptr, n_tiles_n, dp_head, tail_tiles,
                  split, BM: gl.constexpr, BK: gl.constexpr, GROUP: gl.constexpr,
                  HAS_ROW_ORDER: gl.constexpr, PLAN_BY_COUNT: gl.constexpr):
    """This program's share of ``soft_embedding.plan_split``'s schedule (with
    ``PLAN_BY_COUNT`` the one ``soft_embedding.plans_by_count`` holds for the kept count):
    ``(row0, n_tile, kb_begin, n_k, piece, pieces, tail_idx, tail_tiles)``, the tile's first
    position, its N-tile, and the ``n_k`` K blocks from ``kb_begin`` (0 for a tile past the kept
    count, so that it skips its K loop; every partition sees the same n_k)."""
    if PLAN_BY_COUNT:
        at = gl.cdiv(gl.load(kept_count_ptr), BM) * 3
        dp_head = gl.load(plan_ptr + at)
        tail_tiles = gl.load(plan_ptr + at + 1)
        split = gl.load(plan_ptr + at + 2)
    m_tile, n_tile, tail_idx, piece, pieces = tile_of_program(
        gl.program_id(0), n_tiles_n, dp_head, tail_tiles, split)
    k_blocks = gl.cdiv(v_local, BK)
    kb_begin = piece * k_blocks // pieces
    kb_end = (piece + 1) * k_blocks // pieces
    # Which programs run side by side changes what the L2 serves them (GROUP_M).
    m_tile, n_tile = grouped_tile(m_tile, n_tile, dp_head, n_tiles_n, GROUP)
    row0 = m_tile * BM
    n_k = kb_end - kb_begin
    if HAS_ROW_ORDER:
        n_k = gl.where(row0 < gl.load(kept_count_ptr), n_k, 0)
    return row0, n_tile, kb_begin, n_k, piece, pieces, tail_idx, tail_tiles


@gluon.jit
def soft_embedding_wgmma_kernel(
    x_desc, e_desc,                               # TMA: local logits [N, V_local], E [V_local, H]
    x_ptr, stride_x,                              # the local logits again, for the row gather
    row_request_ptr, inv_t_ptr, lse_ptr, threshold_ptr, row_order_ptr, kept_count_ptr, plan_ptr,
    norm_ptr, out_ptr, out_index_ptr, scratch_ptr,
    n_rows, v_local, hidden, stride_out, norm_value,
    n_tiles_n, dp_head, tail_tiles, split,        # schedule: soft_embedding.plan_split
    HAS_THRESHOLD: gl.constexpr, HAS_ROW_ORDER: gl.constexpr, HAS_OUT_INDEX: gl.constexpr,
    NORM_IS_TENSOR: gl.constexpr, STAGES: gl.constexpr, SCRATCH_N: gl.constexpr,
    VEC: gl.constexpr, P_SWIZZLE: gl.constexpr, P_IN_REGISTERS: gl.constexpr, P_GIVEN: gl.constexpr,
    GROUP: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, GATHER_WARPS: gl.constexpr,
    PLAN_BY_COUNT: gl.constexpr,
):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = e_desc.block_type.shape[1]

    row0, n_tile, kb_begin, n_k, piece, pieces, tail_idx, tail_tiles = _program_tile(
        n_rows, v_local, kept_count_ptr, plan_ptr, n_tiles_n, dp_head, tail_tiles, split, BM, BK,
        GROUP, HAS_ROW_ORDER, PLAN_BY_COUNT)
    col0 = n_tile * BN

    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    e_bufs = gl.allocate_shared_memory(e_desc.dtype, [STAGES, BK, BN], e_desc.layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout(P_SWIZZLE, 16)
    # two p buffers per consumer warpgroup (unused, and dropped by the compiler, with P_IN_REGISTERS)
    p_bufs = gl.allocate_shared_memory(e_desc.dtype, [4, BM // 2, BK], p_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # A stage is ready after the loader's expect and the TMA bytes, and with a row order once
    # each loader thread's row copies have landed (one arrive per thread).
    READY_ARRIVALS: gl.constexpr = 1 + (32 * GATHER_WARPS if HAS_ROW_ORDER else 0)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=READY_ARRIVALS)
        mbarrier.init(empty.index(s), count=2)  # one arrive per consumer warpgroup
    fence_async_shared()

    descs = (x_desc, e_desc)
    smem = (x_bufs, e_bufs, p_bufs, ready, empty)
    tile = (row0, col0, kb_begin, n_k, piece, pieces, tail_idx, tail_tiles)
    row_args = (n_rows, row_request_ptr, inv_t_ptr, lse_ptr, threshold_ptr, row_order_ptr,
                kept_count_ptr)
    out_args = (hidden, stride_out, norm_ptr, norm_value, out_ptr, out_index_ptr, scratch_ptr)
    # (constexprs go to the partitions as arguments of their own: inside a tuple they would
    # arrive as tensors)
    if HAS_ROW_ORDER:
        gather = (x_ptr, stride_x, v_local, n_rows, row_order_ptr, kept_count_ptr)
        gl.warp_specialize([
            (_consumer, (0, descs, smem, tile, row_args, out_args, HAS_THRESHOLD, True,  # own warps
                         HAS_OUT_INDEX, NORM_IS_TENSOR, SCRATCH_N, VEC, P_IN_REGISTERS, P_GIVEN)),
            (_consumer, (1, descs, smem, tile, row_args, out_args, HAS_THRESHOLD, True,
                         HAS_OUT_INDEX, NORM_IS_TENSOR, SCRATCH_N, VEC, P_IN_REGISTERS, P_GIVEN)),
            (_gather_loader, (descs, smem, tile, gather, VEC)),
        ], [4, GATHER_WARPS], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (0, descs, smem, tile, row_args, out_args, HAS_THRESHOLD, False,
                         HAS_OUT_INDEX, NORM_IS_TENSOR, SCRATCH_N, VEC, P_IN_REGISTERS, P_GIVEN)),
            (_consumer, (1, descs, smem, tile, row_args, out_args, HAS_THRESHOLD, False,
                         HAS_OUT_INDEX, NORM_IS_TENSOR, SCRATCH_N, VEC, P_IN_REGISTERS, P_GIVEN)),
            (_loader, (descs, smem, tile)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


def _p_swizzle(logits_bytes: int) -> int:
    """Swizzle of the p tile that keeps its stores conflict-free (Layouts, module docstring)."""
    return 64 if logits_bytes == 4 else 128


def local_columns(logits: torch.Tensor, vocab_start: int, v_local: int) -> torch.Tensor:
    """The columns ``[vocab_start, vocab_start + v_local)`` of ``logits``: the tensor itself
    where that is all of them (a slice is an operator the host dispatches, three per call)."""
    if vocab_start == 0 and v_local == logits.shape[1]:
        return logits
    return logits[:, vocab_start:vocab_start + v_local]


def supported(logits: torch.Tensor, embed_weight: torch.Tensor, vocab_start: int, allowed, softcap,
              p_given: bool = False) -> bool:
    """Whether this kernel can run the call (else the Triton kernel does). ``p_given``: the
    operand was written over the logits (``soft_embedding_operand``, which applied the softcap
    and the masks): the logits then hold E's dtype."""
    if logits.device.type != "cuda" or cuda_capability(logits.device)[0] != 9:
        return False
    if p_given:
        if logits.dtype != embed_weight.dtype:
            return False
    elif allowed is not None or softcap is not None:
        return False
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if embed_weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    v_local, hidden = embed_weight.shape
    local = local_columns(logits, vocab_start, v_local)
    for t in (local, embed_weight):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    # The row gather copies 16-byte vectors by cp.async: Triton must see the row stride as a
    # multiple of 16 elements (it specializes integer arguments by that divisibility).
    if logits.stride(0) % 16:
        return False
    return hidden % 8 == 0 and v_local > 0 and logits.shape[0] > 0


def p_in_registers(logits_dtype: torch.dtype) -> bool:
    """Whether the wgmma takes ``p`` from registers (16-bit logits, read by ``ldmatrix``) or
    from shared memory (fp32 logits: read in the A-operand layout, an fp32 tile costs bank
    conflicts or a row permutation, and was no faster)."""
    return logits_dtype != torch.float32


def tile_shape(p_given: bool, n_rows: int) -> tuple[int, int]:
    """The output tile of a call: TALL for a given operand of at most ``TALL_MAX_ROWS`` rows
    (one canvas: every program then reads its E slice alone), else WIDE."""
    return TALL if p_given and n_rows <= TALL_MAX_ROWS else WIDE


def stages_for(logits_dtype: torch.dtype, embed_dtype: torch.dtype, smem_bytes: int = 227 * 1024,
               tile: tuple[int, int] = WIDE) -> int:
    """Pipeline stages that fit in shared memory beside the p buffers (3 for fp32 logits,
    4 for 16-bit; the two tiles' stages hold as many bytes)."""
    block_m, block_n = tile
    per_stage = block_m * BLOCK_K * logits_dtype.itemsize + BLOCK_K * block_n * embed_dtype.itemsize
    # (the compiler drops the p buffers of a kernel whose operand goes through registers)
    p_bytes = 0 if p_in_registers(logits_dtype) else 2 * block_m * BLOCK_K * embed_dtype.itemsize
    return max(2, min(4, (smem_bytes - p_bytes - 1024) // per_stage))


@functools.cache
def _tile_layouts(x_dtype: torch.dtype, e_dtype: torch.dtype, x_box: tuple, e_box: tuple):
    """Shared-memory layouts of the logits and E tiles the descriptors load (built once per
    dtypes and boxes: the two ``get_default_for`` calls cost tens of microseconds of host time
    per launch)."""
    gl_dtype = lambda dtype: getattr(gl, str(dtype).removeprefix("torch."))
    return (gl.NVMMASharedLayout.get_default_for(list(x_box), gl_dtype(x_dtype)),
            gl.NVMMASharedLayout.get_default_for(list(e_box), gl_dtype(e_dtype)))


def tile_descriptors(logits, embed_weight, vocab_start: int, x_box: tuple, e_box: tuple):
    """TMA descriptors of the local logits slice ``[N, V_local]`` and of E ``[V_local, H]``,
    loading boxes of ``x_box`` and ``e_box``."""
    n_rows = logits.shape[0]
    v_local, hidden = embed_weight.shape
    local = local_columns(logits, vocab_start, v_local)
    x_layout, e_layout = _tile_layouts(logits.dtype, embed_weight.dtype, x_box, e_box)
    return (TensorDescriptor(local, [n_rows, v_local], [logits.stride(0), 1], list(x_box), x_layout),
            TensorDescriptor(embed_weight, [v_local, hidden], [embed_weight.stride(0), 1],
                             list(e_box), e_layout))


def launch(logits, row_request, inv_t, lse, embed_weight, norm_tensor, norm_value, out, *,
           row_order, kept_count, threshold, out_index, vocab_start, plan, scratch, placeholder,
           tile: tuple[int, int], p_given: bool = False):
    """Launch for one call of ``soft_embedding.soft_embedding_rows`` (inputs checked there) on
    ``plan`` (``soft_embedding.plan_split``, or ``plans_by_count`` where the kept count stays on
    the device); ``row_order`` (int64, the kept rows first and in increasing order, as
    ``soft_embedding._kept_first`` makes it: the loader's test for consecutive rows relies on
    it) with ``kept_count`` ([1] int32 on the device), or both None for every row in order;
    ``placeholder`` stands in for absent tensors. ``tile``: the output tile ``plan`` was made
    for (``tile_shape``). ``p_given``: the kept rows of ``logits`` hold the operand already
    (``soft_embedding_operand``): no prologue, no threshold."""
    assert (row_order is None) == (kept_count is None), "row_order and kept_count go together"
    assert not p_given or (logits.dtype == embed_weight.dtype and threshold is None), \
        "a given operand has E's dtype and its masks applied"
    block_m, block_n = tile
    assert (block_m, block_n) == WIDE or p_given, "TALL multiplies a given operand"
    descs = tile_descriptors(logits, embed_weight, vocab_start, (block_m, BLOCK_K), (BLOCK_K, block_n))
    v_local = embed_weight.shape[0]
    return soft_embedding_wgmma_kernel[(plan.programs,)](
        *descs, local_columns(logits, vocab_start, v_local), logits.stride(0),
        row_request, inv_t, lse,
        placeholder if threshold is None else threshold,
        placeholder if row_order is None else row_order,
        placeholder if kept_count is None else kept_count,
        placeholder if plan.table is None else plan.table,
        placeholder if norm_tensor is None else norm_tensor,
        out, placeholder if out_index is None else out_index, scratch,
        logits.shape[0], v_local, embed_weight.shape[1], out.stride(0), norm_value,
        plan.n_tiles_n, plan.dp_head, plan.tail_tiles, plan.split,
        HAS_THRESHOLD=threshold is not None, HAS_ROW_ORDER=row_order is not None,
        HAS_OUT_INDEX=out_index is not None, NORM_IS_TENSOR=norm_tensor is not None,
        STAGES=stages_for(logits.dtype, embed_weight.dtype, tile=(block_m, block_n)),
        SCRATCH_N=block_n,
        VEC=16 // logits.element_size(), P_SWIZZLE=_p_swizzle(logits.element_size()),
        P_IN_REGISTERS=p_in_registers(logits.dtype), P_GIVEN=p_given, GROUP=GROUP_M,
        CONSUMER_REGS=GATHER_CONSUMER_REGS if row_order is not None else CONSUMER_REGS,
        LOADER_REGS=GATHER_LOADER_REGS if row_order is not None else LOADER_REGS,
        GATHER_WARPS=GATHER_WARPS, PLAN_BY_COUNT=plan.table is not None, num_warps=4,
    )
