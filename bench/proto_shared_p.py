"""Prototype: the soft-embedding GEMM with one ``p`` shared by the two consumer warpgroups.

The shipped Gluon kernel (``kernels/soft_embedding_wgmma.py``) computes a 128 x 256 output
tile, each consumer warpgroup owning 64 rows: every probability is made once per N-tile, so
once per 256 output columns, and that prologue is what holds the kernel at 70-85% of cuBLAS
(its docstring). Here the tile is 64 x 512: both warpgroups read the same 64 rows of ``p``
and own one 256-column half of the output each. Per K step each warpgroup makes ``p`` for 32
of the rows (16 entries per thread instead of 32) and stores it into a shared p buffer; once
both halves are in (mbarrier ``p_ready``, one arrive per warpgroup) each issues its wgmma
over the whole 64-row buffer and its E half. The exponentials and the rest of the prologue
per MMA flop halve; what grows is the E tile (64 KB of bf16 per 64-step stage, two 256-wide
TMA boxes), so L2 -> shared traffic per flop rises by a quarter with fp32 logits (80 KB
against 64 KB per 2 M MACs) and by half with bf16 logits (72 against 48 KB), and only 2
stages of 64 fit beside the p buffers (``--block-k 32``: 5 stages of 32).

Buffers and barriers, per stage ``s``: ``ready[s]`` (the loader's expect + TMA bytes),
``empty[s]`` (count 2: both warpgroups' wgmma of that step are done). Per p buffer ``b``
(two, step ``i`` uses ``i % 2``): ``p_ready[b]`` (count 2: both halves stored) and
``p_free[b]`` (count 2: both warpgroups' wgmma that read it are done). H = 2816 = 5.5 x 512:
in the last N-tile the second half lies outside: that warpgroup makes its half of ``p``
without issuing a wgmma (the loop without MMA).

The module is a drop-in for ``soft_embedding._WGMMA`` (``BLOCK_*``, ``NUM_WARPS``,
``stages_for``, ``supported``, ``launch``): the same schedule (``plan_split`` with these
tiles), split-K merge and epilogue. Same scope as the shipped kernel, always p through
shared memory. Gluon has no interpreter; this runs on a Hopper GPU only:

    cd bench && python proto_shared_p.py [--requests 32] [--block-k 64]

prints, per logits dtype, the time against cuBLAS on materialized bf16 probabilities and the
shipped kernel in the same run, and the largest difference from the shipped kernel's output.
Not run yet: written without a device (2026-12-04). It compiles for sm_90 with Triton 3.6 and
3.9 without spills or wgmma serialization (``bench/compile_sm90.py --module
bench/proto_shared_p.py``): 168 registers, 2 stages of 64 (fp32 and bf16 logits), and per warp
and K step 153 instructions from fp32 logits (the shipped kernel: 239) and 175 from bf16 (253,
p in registers there); with ``BLOCK_K = 32``, 5 stages (fp32) or 6 (bf16), 120 instructions per
K step of 32 from fp32. ``test_gpu_shared_p_prototype_matches_the_gluon_kernel`` checks it
against the shipped kernel on the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from dgemma_sampler.kernels import soft_embedding_wgmma as shipped
from dgemma_sampler.kernels.soft_embedding_wgmma import (_cta_barrier, _probabilities,
                                                         _program_tile, _row_constants, _store_acc,
                                                         _tma_load)

BLOCK_M, BLOCK_N, BLOCK_K = 64, 512, 64
HALF_N = BLOCK_N // 2  # one consumer warpgroup's columns, one E box (TMA boxes are <= 256 wide)
NUM_WARPS = 8
supported = shipped.supported


@gluon.jit
def _loader(descs, smem, tile):
    """The TMA warp: step ``i``'s logits tile and both E halves into stage ``i % STAGES`` once
    both warpgroups are done with its previous use. A second half wholly past H (the last
    N-tile, whose warpgroup issues no wgmma) loads the first half's box again, from L2: the
    stage's expected bytes stay fixed without counting on a box that lies entirely out of
    bounds to complete its transaction."""
    x_desc, e_desc = descs
    x_bufs, e_bufs, p_bufs, ready, empty, p_ready, p_free = smem
    row0, col0, kb_begin, n_k, piece, pieces, tail_idx, tail_tiles = tile
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    HN: gl.constexpr = e_desc.block_type.shape[1]
    hidden = e_desc.shape[1]
    col1 = gl.where(col0 + HN < hidden, col0 + HN, col0)
    for i in range(n_k):
        stage = i % STAGES
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, x_desc.block_type.nbytes + 2 * e_desc.block_type.nbytes)
        kb = kb_begin + i
        _tma_load(x_desc, [row0, kb * BK], bar, x_bufs.index(stage))
        _tma_load(e_desc, [kb * BK, col0], bar, e_bufs.index(2 * stage))
        _tma_load(e_desc, [kb * BK, col1], bar, e_bufs.index(2 * stage + 1))


@gluon.jit
def _k_loop(WG: gl.constexpr, smem, i_begin, i_end, acc, inv_t, neg_lse2, threshold,
            tile_layout: gl.constexpr, HAS_THRESHOLD: gl.constexpr, MMA: gl.constexpr):
    """Steps ``[i_begin, i_end)`` of warpgroup ``WG``: its 32 rows of ``p`` into the step's p
    buffer, then (``MMA``) the wgmma of the whole buffer with its E half, one in flight."""
    x_bufs, e_bufs, p_bufs, ready, empty, p_ready, p_free = smem
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    HM: gl.constexpr = x_bufs.type.shape[1] // 2
    for i in range(i_begin, i_end):
        stage = i % STAGES
        b = i % 2
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        x = x_bufs.index(stage).slice(WG * HM, HM).load(tile_layout).to(gl.float32)
        p = _probabilities(x, inv_t, neg_lse2, threshold, HAS_THRESHOLD, p_bufs.dtype)
        # buffer b was last read by both warpgroups' wgmma of step i - 2
        mbarrier.wait(p_free.index(b), ((i // 2) & 1) ^ 1)
        p_bufs.index(b).slice(WG * HM, HM).store(p)
        fence_async_shared()
        _cta_barrier()  # this warpgroup's stores are all fenced before its one arrive
        mbarrier.arrive(p_ready.index(b))
        mbarrier.wait(p_ready.index(b), (i // 2) & 1)
        if MMA:
            acc = warpgroup_mma(p_bufs.index(b), e_bufs.index(2 * stage + WG), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        # step i - 1's wgmma is done in every warp: its p buffer and its stage are free
        _cta_barrier()
        mbarrier.arrive(p_free.index(1 - b), pred=i > 0)
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
    return acc


@gluon.jit
def _consumer(WG: gl.constexpr, descs, smem, tile, row_args, out_args,
              HAS_THRESHOLD: gl.constexpr, HAS_KEEP: gl.constexpr, HAS_OUT_INDEX: gl.constexpr,
              NORM_IS_TENSOR: gl.constexpr, VEC: gl.constexpr):
    """Consumer warpgroup ``WG``: p rows ``[32 WG, 32 WG + 32)``, output columns
    ``[col0 + 256 WG, +256)`` of all 64 rows."""
    x_desc, e_desc = descs
    row0, col0, kb_begin, n_k, piece, pieces, tail_idx, tail_tiles = tile
    hidden, stride_out, norm_ptr, norm_value, out_ptr, out_index_ptr, scratch_ptr = out_args
    n_rows, row_request_ptr, inv_t_ptr, lse_ptr, threshold_ptr, keep_ptr = row_args
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    HN: gl.constexpr = e_desc.block_type.shape[1]
    HM: gl.constexpr = BM // 2
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HN, 16])
    # rows of BK // VEC threads x 16 bytes (a K step of 32 or 64 entries)
    TPR: gl.constexpr = BK // VEC
    tile_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // TPR, TPR], [4, 1], [1, 0])
    rows = row0 + WG * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, tile_layout))
    live, inv_t, neg_lse2, threshold = _row_constants(
        rows, n_rows, row_request_ptr, inv_t_ptr, lse_ptr, threshold_ptr, keep_ptr, HAS_KEEP,
        HAS_THRESHOLD)
    acc = gl.zeros([BM, HN], gl.float32, layout=mma_layout)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))  # (see the shipped kernel)
    # Uniform per warpgroup: the second half of the last N-tile is past H, no wgmma there.
    n_mma = gl.where(col0 + WG * HN < hidden, n_k, 0)
    acc = _k_loop(WG, smem, 0, n_mma, acc, inv_t, neg_lse2, threshold, tile_layout,
                  HAS_THRESHOLD, True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    acc = _k_loop(WG, smem, n_mma, n_k, acc, inv_t, neg_lse2, threshold, tile_layout,
                  HAS_THRESHOLD, False)
    _store_acc(acc, row0, 0, col0 + WG * HN, piece, pieces, tail_idx, tail_tiles, n_rows, hidden,
               stride_out, norm_ptr, norm_value, out_ptr, out_index_ptr, scratch_ptr + WG * HN, BM,
               HAS_OUT_INDEX, NORM_IS_TENSOR, 2 * HN, False)


@gluon.jit
def shared_p_kernel(
    x_desc, e_desc, row_request_ptr, inv_t_ptr, lse_ptr, threshold_ptr, keep_ptr,
    norm_ptr, out_ptr, out_index_ptr, scratch_ptr,
    n_rows, v_local, hidden, stride_out, norm_value,
    n_tiles_n, dp_head, tail_tiles, split,
    HAS_THRESHOLD: gl.constexpr, HAS_KEEP: gl.constexpr, HAS_OUT_INDEX: gl.constexpr,
    NORM_IS_TENSOR: gl.constexpr, STAGES: gl.constexpr, VEC: gl.constexpr, GROUP: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    HN: gl.constexpr = e_desc.block_type.shape[1]

    row0, n_tile, kb_begin, n_k, piece, pieces, tail_idx = _program_tile(
        n_rows, v_local, keep_ptr, n_tiles_n, dp_head, tail_tiles, split, BM, BK, GROUP, HAS_KEEP)
    col0 = n_tile * (2 * HN)

    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    e_bufs = gl.allocate_shared_memory(e_desc.dtype, [2 * STAGES, BK, HN], e_desc.layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], e_desc.dtype)
    p_bufs = gl.allocate_shared_memory(e_desc.dtype, [2, BM, BK], p_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    for b in gl.static_range(2):
        mbarrier.init(p_ready.index(b), count=2)
        mbarrier.init(p_free.index(b), count=2)
    fence_async_shared()

    descs = (x_desc, e_desc)
    smem = (x_bufs, e_bufs, p_bufs, ready, empty, p_ready, p_free)
    tile = (row0, col0, kb_begin, n_k, piece, pieces, tail_idx, tail_tiles)
    row_args = (n_rows, row_request_ptr, inv_t_ptr, lse_ptr, threshold_ptr, keep_ptr)
    out_args = (hidden, stride_out, norm_ptr, norm_value, out_ptr, out_index_ptr, scratch_ptr)
    gl.warp_specialize([
        (_consumer, (0, descs, smem, tile, row_args, out_args, HAS_THRESHOLD, HAS_KEEP,
                     HAS_OUT_INDEX, NORM_IS_TENSOR, VEC)),
        (_consumer, (1, descs, smem, tile, row_args, out_args, HAS_THRESHOLD, HAS_KEEP,
                     HAS_OUT_INDEX, NORM_IS_TENSOR, VEC)),
        (_loader, (descs, smem, tile)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))
    for b in gl.static_range(2):
        mbarrier.invalidate(p_ready.index(b))
        mbarrier.invalidate(p_free.index(b))


def stages_for(logits_dtype: torch.dtype, embed_dtype: torch.dtype, smem_bytes: int = 227 * 1024) -> int:
    """Stages of (logits tile, two E halves) that fit beside the two p buffers (at most 6)."""
    per_stage = BLOCK_M * BLOCK_K * logits_dtype.itemsize + BLOCK_K * BLOCK_N * embed_dtype.itemsize
    p_bytes = 2 * BLOCK_M * BLOCK_K * embed_dtype.itemsize
    return max(2, min(6, (smem_bytes - p_bytes - 1024) // per_stage))


def launch(logits, row_request, inv_t, lse, embed_weight, norm_tensor, norm_value, out, *,
           keep, threshold, out_index, vocab_start, plan, scratch, placeholder):
    """``soft_embedding_wgmma.launch``'s contract, with 64 x 512 tiles."""
    assert plan.block_m == BLOCK_M and plan.block_n == BLOCK_N, plan
    descs = shipped.tile_descriptors(logits, embed_weight, vocab_start, (BLOCK_M, BLOCK_K),
                                     (BLOCK_K, HALF_N))
    args, constexprs = shipped.launch_arguments(
        logits, row_request, inv_t, lse, embed_weight, norm_tensor, norm_value, out, keep=keep,
        threshold=threshold, out_index=out_index, plan=plan, scratch=scratch, placeholder=placeholder)
    return shared_p_kernel[(plan.programs,)](
        *descs, *args, **constexprs, STAGES=stages_for(logits.dtype, embed_weight.dtype))


def main() -> None:
    from bench_soft_embedding import make_inputs  # this script's folder
    from diag_soft_embedding import bench_ms, time_kernel_module
    from dgemma_sampler.kernels import soft_embedding as se

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--block-k", type=int, default=64, choices=(32, 64))
    ap.add_argument("--out")
    args = ap.parse_args()
    global BLOCK_K
    BLOCK_K = args.block_k
    x = make_inputs(args.requests, 262144, 2816)
    out = x["out"]
    gemm_out = torch.empty(out.shape, device="cuda", dtype=torch.bfloat16)
    cublas = bench_ms(lambda: torch.mm(x["probs"], x["embed"], out=gemm_out))
    print(f"requests {args.requests}, BLOCK_K {BLOCK_K}: cuBLAS {cublas:.3f} ms", flush=True)
    results = dict(requests=args.requests, block_k=BLOCK_K, cublas_ms=cublas, runs={})
    this = sys.modules[__name__]
    for dname, logits in (("fp32", x["logits"]), ("bf16", x["logits_bf16"])):
        reference_out = None
        for name, module in (("shipped", shipped), ("shared_p", this)):
            try:
                ms = time_kernel_module(module, logits, x, out)
            except Exception as exc:  # reported, not fatal: the next one still runs
                print(f"{name:9s} {dname}: failed {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            if name == "shipped":
                reference_out = out.clone()
            diff = (((out - reference_out).abs().max() / reference_out.abs().max()).item()
                    if reference_out is not None else float("nan"))
            regs = getattr(se._last_kernel, "n_regs", None)
            results["runs"][f"{name} {dname}"] = dict(ms=ms, vs_cublas=cublas / ms, rel_diff=diff, regs=regs)
            print(f"{name:9s} {dname}: {ms:7.3f} ms ({cublas / ms:4.0%} of cuBLAS) regs {regs} "
                  f"max|out - shipped| / max|shipped| {diff:.1e}", flush=True)
    se._WGMMA = shipped
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
