"""Self-conditioning GEMM on Hopper in Gluon: TMA tiles, probabilities made in registers, wgmma.

Same math and contract as ``soft_embedding.py`` (read its docstring first): per logits row,
``p = exp(z - lse)`` with ``z = x * inv_t``, masked entries 0, and ``out = normalizer * p @ E``.

Why a second kernel. In the Triton kernel the compiler loads each logits tile from shared
memory in a blocked layout, computes ``p`` there, and after the cast to bf16 moves it
through shared memory again (store, barrier, load) into the register layout of the wgmma
A operand; with the pointer loads' address arithmetic that is ~380 instructions per warp
and K step for ~160 of arithmetic, and it holds the GEMM at ~60% of cuBLAS. Gluon lets the
kernel name its layouts and its shared-memory traffic: the logits and E tiles arrive by TMA,
``p`` is computed in registers, stored once to a shared tile and read by ``warpgroup_mma``
from there (asynchronously, one wgmma group in flight while the next ``p`` is computed).

Layouts (shared memory is this kernel's tightest resource after L2: Nsight Compute put the
L1/shared pipe at 79% with the logits read in the wgmma operand layout, a third of those
reads being bank conflicts). A warp reads the logits tile in rows of 8 threads x 16 bytes
(``tile_layout``: ``[1, VEC]`` elements per thread, ``[4, 8]`` threads), so the 8 threads
of a quarter warp read the 8 16-byte chunks of one 128-byte row of the TMA box, which the
128-byte swizzle only permutes: one wavefront per quarter warp, no conflict. Each thread
then stores its ``p`` (8 bytes from fp32 logits, 16 from 16-bit) into the p tile; with
fp32 logits a half warp writes two 64-byte row pieces, which land on disjoint banks under a
64-byte swizzle of the p tile (under 128 bytes they would collide 2-way), with 16-bit
logits a quarter warp writes one whole 128-byte row (128-byte swizzle).

Pipeline: ``STAGES`` shared-memory stages of (logits tile, E tile), each with an mbarrier
the TMA completes. At K step ``i`` the program waits for stage ``i``, computes ``p``, issues
the wgmma asynchronously and waits until only that one is in flight: then step ``i - 1``'s
wgmma (the last reader of its stage) is done; after a CTA barrier (both warpgroups past
it) the loads of step ``i + STAGES - 1`` go into that stage.

Scope (``supported``): Hopper, logits fp32/bf16/fp16 whose local slice TMA can address
(16-byte aligned rows), E bf16/fp16, no ``allowed`` mask, no softcap. ``keep`` masks rows
(``p = 0``, an all-dropped M-tile skips its K loop) instead of compacting them. Rows past the
end and the ragged last K block read as zeros from TMA (their ``p`` is 0, and E's padding
rows are 0). The schedule (whole tiles in waves, a split-K tail) and the split-K merge are
``soft_embedding.plan_split`` and ``soft_embedding.split_sum_kernel``. Gluon has no
interpreter: on the CPU the Triton kernel runs; this one is tested on the GPU against it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .soft_embedding import _tile_of_program

# Names that changed between Triton 3.6 and 3.9 (module-level aliases are callable in gluon.jit).
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

LOG2E = gl.constexpr(1.4426950408889634)
BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64
NUM_WARPS = 8


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
def _neg_lse2(lse):
    """``-lse * log2(e)`` rounded toward -inf (see ``soft_embedding._neg_lse2``)."""
    lse2 = lse * LOG2E
    residual = gl.fma(lse, LOG2E, -lse2)
    bits = lse2.to(gl.int32, bitcast=True)
    below = gl.where(lse2 > 0, bits - 1, bits + 1).to(gl.float32, bitcast=True)
    return -gl.where(residual < 0, below, lse2)


@gluon.jit
def _issue(x_desc, e_desc, x_bufs, e_bufs, bars, kb, stage, row0, col0, BK: gl.constexpr,
           pred=True):
    """TMA loads of K block ``kb`` (logits and E tiles) into ``stage`` (none where ``pred``
    is False)."""
    bar = bars.index(stage)
    mbarrier.expect(bar, x_desc.block_type.nbytes + e_desc.block_type.nbytes, pred)
    _tma_load(x_desc, [row0, kb * BK], bar, x_bufs.index(stage), pred)
    _tma_load(e_desc, [kb * BK, col0], bar, e_bufs.index(stage), pred)


@gluon.jit
def _k_loop(x_desc, e_desc, x_bufs, e_bufs, p_bufs, bars, acc, kb_begin, n_k, row0, col0,
            inv_t, neg_lse2, threshold, tile_layout: gl.constexpr, THRESHOLD: gl.constexpr,
            STAGES: gl.constexpr, BK: gl.constexpr):
    """``acc += p @ E`` over K blocks ``[kb_begin, kb_begin + n_k)``."""
    # The fill is predicated rather than branched (no branch before the loop). What keeps
    # ptxas from serializing the wgmmas (C7515) is the accumulator pinned by the caller; with
    # that pin the branched form compiles without C7515 too (checked for sm_90, Triton 3.6).
    for i in gl.static_range(STAGES - 1):
        _issue(x_desc, e_desc, x_bufs, e_bufs, bars, kb_begin + i, i, row0, col0, BK, i < n_k)
    for i in range(n_k):
        stage = i % STAGES
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        x = x_bufs.index(stage).load(tile_layout).to(gl.float32)
        # z = x * inv_t as the row-statistics pass computed it, then base 2 against lse.
        d2 = gl.fma(x * gl.expand_dims(inv_t, 1), LOG2E, gl.expand_dims(neg_lse2, 1))
        if THRESHOLD:
            d2 = gl.where(x >= gl.expand_dims(threshold, 1), d2, float("-inf"))
        p = _exp2_ftz(gl.minimum(d2, 0.0, propagate_nan=tl.PropagateNan.ALL))
        p = _nan_to_zero(p.to(e_desc.dtype))
        # p goes to the tensor cores from shared memory: a register operand would be rewritten
        # by the next step while its wgmma still reads it, which ptxas answers by waiting for
        # every wgmma right after issuing it (seen in the SASS: no overlap at all). So the
        # logits tile is read in the layout that suits shared memory (Layouts, above).
        p_buf = p_bufs.index(i % 2)
        p_buf.store(p)
        fence_async_shared()
        _cta_barrier()  # every warp's part of p is in shared memory
        acc = warpgroup_mma(p_buf, e_bufs.index(stage), acc, is_async=True)
        # Step i - 1's wgmma, the last reader of its stage and of the other p buffer, is done
        # in this warpgroup ...
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        # ... and after the barrier in both: its stage takes the loads STAGES - 1 steps ahead.
        _cta_barrier()
        ahead = i + STAGES - 1
        if ahead < n_k:
            _issue(x_desc, e_desc, x_bufs, e_bufs, bars, kb_begin + ahead, ahead % STAGES, row0,
                   col0, BK)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))


@gluon.jit
def soft_embedding_wgmma_kernel(
    x_desc, e_desc,                               # TMA: local logits [N, V_local], E [V_local, H]
    row_request_ptr, inv_t_ptr, lse_ptr, threshold_ptr, keep_ptr,
    norm_ptr, out_ptr, out_index_ptr, scratch_ptr,
    n_rows, v_local, hidden, stride_out, norm_value,
    n_tiles_n, dp_head, tail_tiles, split,        # schedule: soft_embedding.plan_split
    HAS_THRESHOLD: gl.constexpr, HAS_KEEP: gl.constexpr, HAS_OUT_INDEX: gl.constexpr,
    NORM_IS_TENSOR: gl.constexpr, STAGES: gl.constexpr, SCRATCH_N: gl.constexpr,
    VEC: gl.constexpr, P_SWIZZLE: gl.constexpr,
):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = e_desc.block_type.shape[1]
    NW: gl.constexpr = gl.num_warps()
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                         instr_shape=[16, BN, 16])
    tile_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [4, 8], [NW, 1], [1, 0])
    row_layout: gl.constexpr = gl.SliceLayout(1, tile_layout)

    # -- program -> tile and vocabulary range --
    m_tile, n_tile, tail_idx, piece, pieces = _tile_of_program(
        gl.program_id(0), n_tiles_n, dp_head, tail_tiles, split)
    k_blocks = gl.cdiv(v_local, BK)
    kb_begin = piece * k_blocks // pieces
    kb_end = (piece + 1) * k_blocks // pieces

    # -- per-row constants, in the row slice of the A-operand layout --
    row0 = m_tile * BM
    rows = row0 + gl.arange(0, BM, layout=row_layout)
    live = rows < n_rows
    if HAS_KEEP:
        live = live & (gl.load(keep_ptr + rows, mask=live, other=0) != 0)
    request = gl.load(row_request_ptr + rows, mask=live, other=0).to(gl.int64)
    inv_t = gl.load(inv_t_ptr + request, mask=live, other=0.0)
    lse = gl.load(lse_ptr + rows, mask=live, other=0.0)
    neg_lse2 = gl.where(live & (gl.abs(lse) < float("inf")), _neg_lse2(lse), float("-inf"))
    threshold = inv_t  # unused without HAS_THRESHOLD
    if HAS_THRESHOLD:
        # (one loop for both cases: a second loop behind a branch on whether any row has a
        # threshold makes ptxas serialize every wgmma, "non wgmma instructions defining
        # accumulator registers", so callers pass no threshold when no row has one)
        threshold = gl.load(threshold_ptr + rows, mask=live, other=float("-inf"))
    any_live = gl.max(live.to(gl.int32), 0) > 0
    n_k = gl.where(any_live, kb_end - kb_begin, 0)  # an all-dropped tile skips its K loop

    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    e_bufs = gl.allocate_shared_memory(e_desc.dtype, [STAGES, BK, BN], e_desc.layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout(P_SWIZZLE, 16)
    p_bufs = gl.allocate_shared_memory(e_desc.dtype, [2, BM, BK], p_layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()

    acc = gl.zeros([BM, BN], gl.float32, layout=mma_layout)
    # Pin the zeros before the loop's zero-trip branch: otherwise LLVM sinks a second zero
    # accumulator into the path that skips the loop, and ptxas, seeing non-wgmma definitions
    # of accumulator registers, serializes every wgmma (advisory C7515).
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    col0 = n_tile * BN
    acc = _k_loop(x_desc, e_desc, x_bufs, e_bufs, p_bufs, bars, acc, kb_begin, n_k, row0, col0, inv_t,
                  neg_lse2, threshold, tile_layout, HAS_THRESHOLD, STAGES, BK)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    # -- epilogue: a whole tile scaled into out, split pieces raw (piece 0 into out) --
    out_rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_layout))
    cols = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_layout))
    if piece > 0:
        slot = ((piece - 1) * tail_tiles + tail_idx).to(gl.int64)
        offs = (gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(1, mma_layout)), 1) * SCRATCH_N
                + gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(0, mma_layout)), 0))
        gl.store(scratch_ptr + slot * (BM * SCRATCH_N) + offs, acc)
    else:
        if NORM_IS_TENSOR:
            norm = gl.load(norm_ptr).to(gl.float32)
        else:
            norm = norm_value
        scale = gl.where(pieces > 1, 1.0, norm)
        in_range = out_rows < n_rows
        dest = out_rows.to(gl.int64)
        if HAS_OUT_INDEX:
            dest = gl.load(out_index_ptr + out_rows, mask=in_range, other=0).to(gl.int64)
        ptrs = out_ptr + gl.expand_dims(dest * stride_out, 1) + gl.expand_dims(cols, 0)
        mask = gl.expand_dims(in_range, 1) & gl.expand_dims(cols < hidden, 0)
        gl.store(ptrs, acc * scale, mask=mask)


def _p_swizzle(logits_bytes: int) -> int:
    """Swizzle of the p tile that keeps its stores conflict-free (Layouts, module docstring)."""
    return 64 if logits_bytes == 4 else 128


def supported(logits: torch.Tensor, embed_weight: torch.Tensor, vocab_start: int, allowed, softcap) -> bool:
    """Whether this kernel can run the call (else the Triton kernel does)."""
    if logits.device.type != "cuda" or torch.cuda.get_device_capability(logits.device)[0] != 9:
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


def stages_for(logits_dtype: torch.dtype, embed_dtype: torch.dtype, smem_bytes: int = 227 * 1024) -> int:
    """Pipeline stages that fit in shared memory beside the two p buffers (3 for fp32 logits,
    4 for 16-bit)."""
    per_stage = BLOCK_M * BLOCK_K * logits_dtype.itemsize + BLOCK_K * BLOCK_N * embed_dtype.itemsize
    p_bytes = 2 * BLOCK_M * BLOCK_K * embed_dtype.itemsize
    return max(2, min(4, (smem_bytes - p_bytes - 1024) // per_stage))


def launch(logits, row_request, inv_t, lse, embed_weight, norm_tensor, norm_value, out, *,
           keep, threshold, out_index, vocab_start, plan, scratch, placeholder):
    """Launch for one call of ``soft_embedding.soft_embedding_rows`` (inputs checked there)."""
    n_rows = logits.shape[0]
    v_local, hidden = embed_weight.shape
    x_dtype = getattr(gl, {torch.float32: "float32", torch.bfloat16: "bfloat16",
                           torch.float16: "float16"}[logits.dtype])
    e_dtype = gl.bfloat16 if embed_weight.dtype == torch.bfloat16 else gl.float16
    local = logits[:, vocab_start:vocab_start + v_local]
    x_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], x_dtype)
    e_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], e_dtype)
    x_desc = TensorDescriptor(local, [n_rows, v_local], [logits.stride(0), 1], [BLOCK_M, BLOCK_K], x_layout)
    e_desc = TensorDescriptor(embed_weight, [v_local, hidden], [embed_weight.stride(0), 1],
                              [BLOCK_K, BLOCK_N], e_layout)
    return soft_embedding_wgmma_kernel[(plan.programs,)](
        x_desc, e_desc, row_request, inv_t, lse,
        placeholder if threshold is None else threshold,
        placeholder if keep is None else keep,
        placeholder if norm_tensor is None else norm_tensor,
        out, placeholder if out_index is None else out_index, scratch,
        n_rows, v_local, hidden, out.stride(0), norm_value,
        plan.n_tiles_n, plan.dp_head, plan.tail_tiles, plan.split,
        HAS_THRESHOLD=threshold is not None, HAS_KEEP=keep is not None,
        HAS_OUT_INDEX=out_index is not None, NORM_IS_TENSOR=norm_tensor is not None,
        STAGES=stages_for(logits.dtype, embed_weight.dtype), SCRATCH_N=BLOCK_N,
        VEC=16 // logits.element_size(), P_SWIZZLE=_p_swizzle(logits.element_size()),
        num_warps=NUM_WARPS,
    )
