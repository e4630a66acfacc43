"""Where the Gluon soft-embedding GEMM spends its time: variants that leave one stage out.

Each variant is the source of ``kernels/soft_embedding_wgmma.py`` with one text substitution,
written to a temporary module and timed at the real shape against cuBLAS on materialized bf16
probabilities (median of ``triton.testing.do_bench``; inputs from
``bench_soft_embedding.make_inputs``, the benchmark's own). The differences between variants place
the time (METHOD: "time variants that leave one stage out"); most variants compute wrong
results on purpose and are only timed.

    python bench/diag_soft_embedding.py [--requests 32] [--variants base,noexp,...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile

import torch
import triton.testing

from bench_soft_embedding import make_inputs  # this script's folder
from dgemma_sampler.kernels import soft_embedding as se

VOCAB, HIDDEN = 262144, 2816
SRC = os.path.join(os.path.dirname(se.__file__), "soft_embedding_wgmma.py")

EXP = "p = _exp2_ftz(gl.minimum(d2, 0.0, propagate_nan=tl.PropagateNan.ALL))"
NAN_TO_ZERO = "@gluon.jit\ndef _nan_to_zero(p):"
P_IN_REGISTERS = "    return logits_dtype != torch.float32\n"
LOAD_X = "_tma_load(x_desc, [row0, kb * BK], bar, x_bufs.index(stage))"
LOAD_X_CONST = "_tma_load(x_desc, [row0, kb_begin * BK], bar, x_bufs.index(stage))"
LOAD_E = "_tma_load(e_desc, [kb * BK, col0], bar, e_bufs.index(stage))"
LOAD_E_CONST = "_tma_load(e_desc, [kb_begin * BK, col0], bar, e_bufs.index(stage))"
BLOCK_SHAPE = "BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64"
SHARED_P_PROLOGUE = """        x = x_bufs.index(stage).slice(WG * WM, WM).load(tile_layout).to(gl.float32)
        p = _probabilities(x, inv_t, neg_lse2, threshold, HAS_THRESHOLD, e_dtype)
        p_buf = p_bufs.index(2 * WG + i % 2)
        p_buf.store(p)
        fence_async_shared()
        _cta_barrier()  # in a partition: this warpgroup's named barrier
        _await_turn(empty, WG, i, PINGPONG)
        acc = warpgroup_mma(p_buf, e_bufs.index(stage), acc, is_async=True)"""
PLAIN_MMA = "        _await_turn(empty, WG, i, PINGPONG)\n        acc = warpgroup_mma(x_bufs.index(stage).slice(WG * WM, WM), e_bufs.index(stage), acc, is_async=True)"
LEAN_EXP = 'p = _exp2_ftz(gl.maximum(d2, float("-inf")))'
NAN_TO_ZERO_BODY = """    if p.dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [p, gl.zeros_like(p)],
                                         dtype=gl.bfloat16, is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise("max.f16x2 $0, $1, $2;", "=r,r,r", [p, gl.zeros_like(p)],
                                         dtype=gl.float16, is_pure=True, pack=2)
"""
ONE_FMA = ("        d2 = gl.fma(x * gl.expand_dims(inv_t, 1), LOG2E, gl.expand_dims(neg_lse2, 1))",
           "        d2 = gl.fma(x, gl.expand_dims(inv_t * LOG2E, 1), gl.expand_dims(neg_lse2, 1))")
ONE_FMA_16 = "on a GPU (``bench/results/soft_embedding-diag-h200-v23-one-fma.log``).\"\"\"\n    return False\n"
ONE_FMA_16_ON = (ONE_FMA_16, ONE_FMA_16.replace("return False", "return logits_dtype.itemsize == 2"))
FENCE = "        fence_async_shared()\n"
BARRIER = "        _cta_barrier()  # in a partition: this warpgroup's named barrier\n"
FENCE_BARRIER = FENCE + BARRIER
PINGPONG = "(``bench/diag_soft_embedding.py --variants base,pingpong``).\"\"\"\n    return False\n"
PINGPONG_ON = (PINGPONG, PINGPONG.replace("return False", "return True"))
ACC_ROWS = "acc_rows = gl.arange(0, WM, layout=gl.SliceLayout(1, x_layout))"
SHARED_P_MAKE = SHARED_P_PROLOGUE.split("        fence_async_shared()")[0]
EXP_AND_CAST = "    " + EXP + "\n    return _nan_to_zero(p.to(dtype))\n"
MIXED_EXP = "p = _exp2_mixed(gl.minimum(d2, 0.0, propagate_nan=tl.PropagateNan.ALL))"
# 2^d for d <= 0 (or -inf / NaN -> 0) by polynomial: t = d + 1.5 * 2^23 rounds d to the
# integer j (in t's low mantissa bits), f = d - j in [-0.5, 0.5], 2^f by Taylor to degree 5,
# j added to the exponent field; d < -125 gives 0 (MUFU.EX2.FTZ gives 0 below -126).
_POLY = """
  {{ .reg .f32 t, j, f, q; .reg .b32 e, r; .reg .pred ok;
  add.rn.f32 t, {d}, 0f4B400000; sub.rn.f32 j, t, 0f4B400000; sub.rn.f32 f, {d}, j;
  fma.rn.f32 q, f, 0f3AAEC3FF, 0f3C1D955B; fma.rn.f32 q, q, f, 0f3D635847;
  fma.rn.f32 q, q, f, 0f3E75FDF0; fma.rn.f32 q, q, f, 0f3F317218; fma.rn.f32 q, q, f, 0f3F800000;
  mov.b32 e, t; shl.b32 e, e, 23; mov.b32 r, q; add.s32 r, r, e;
  setp.ge.f32 ok, {d}, 0fC2FA0000; selp.b32 {out}, r, 0, ok; }}"""


def _mixed_exp2(pack: int) -> str:
    """A gluon.jit ``_exp2_mixed``: of each ``pack`` entries, the last by _POLY, others MUFU."""
    lines = [f"ex2.approx.ftz.f32 ${i}, ${pack + i};" for i in range(pack - 1)]
    lines.append(_POLY.format(d=f"${2 * pack - 1}", out=f"${pack - 1}"))
    asm = " ".join(lines).replace("\n", " ")
    constraints = ",".join(["=r"] * pack + ["r"] * pack)
    return ("@gluon.jit\ndef _exp2_mixed(d2):\n"
            f"    return gl.inline_asm_elementwise({asm!r}, {constraints!r}, [d2], dtype=gl.float32,"
            f" is_pure=True, pack={pack})\n\n\n")


# Earlier designs, measured and replaced (32 requests, share of cuBLAS from fp32 / bf16 logits):
# - the CTA-wide pipeline kernel (8 warps, p through shared memory, CTA barriers): its barrier,
#   prologue and logits-load variants in soft_embedding-diag-h200-v7 to -v10 (early read of the
#   next tile 54%; logits by pointer loads 62% / 66%); 72% / 67% against 75% / 64% for the
#   first warp-specialized kernel in one run (-v11-ws);
# - a warpgroup of its own making p for the whole tile, two warpgroups only issuing wgmma:
#   70% / 72% against 73% / 73% for this kernel in one run (-v15-softmax-wg; the code is in
#   commit 73c1805).
# - the logits loaded by the consumer warps straight into the wgmma A-operand registers (pointer
#   loads one K step ahead, E alone by TMA; no shared-memory traffic for the logits): 50% / 59%
#   against 73% / 73% at 32 requests, 54% / 62% against 78% / 75% at 4 (-v16-pointer-r*.log,
#   fp32 outputs bit-identical; the code is in commit 2e35480).
# - two wgmma of a consumer warpgroup in flight with p in registers (step i + 1 issued before
#   step i is done, its operand registers kept live until then): ptxas serializes every wgmma
#   ("insufficient register resources", C7512, with 232 or 240 registers per consumer thread);
#   not timed. And ex2.approx.ftz.bf16x2 compiles to two MUFU.EX2.BF16 per pair: no MUFU issue
#   saved (SASS, Triton 3.6, bench/compile_sm90.py); not timed.
# - the register K loop issuing each K step as two half-width wgmma, one in flight while the
#   other half's p is made (both halves' operands named in the waits' deps): ptxas serializes
#   every wgmma (C7512) even with .maxnreg raised to 232 in the PTX; not timed.
# - the fp32 logits loaded by the consumer warpgroups (16-byte pointer loads one K step
#   ahead, p through shared memory, E alone by TMA in 6 stages): bit-identical, 61% against 75%
#   at 32 requests (soft_embedding-diag-h200-v22-x-pointer.log).

# name -> list of (old, new) substitutions
VARIANTS = {
    "base": [],
    # p through shared memory (the other K loop of the consumer warpgroups) for every logits
    # dtype, or through registers for every logits dtype (fp32 read in FP32_A_LAYOUT, or in the
    # plain operand layout with its 2-way bank conflicts). From fp32 logits at 32 requests
    # 23.4 ms in registers against 23.1 ms (soft_embedding-diag-h200-v17-operands.log); the
    # bank conflicts cost nothing measurable (-v17-fp32-registers.log, names of that day)
    "p_shared": [(P_IN_REGISTERS, "    return False\n")],
    "p_registers": [(P_IN_REGISTERS, "    return True\n")],
    "p_registers_no_row_perm": [(P_IN_REGISTERS, "    return True\n"),
                                ("ROW_PERM=registers and logits.dtype == torch.float32,",
                                 "ROW_PERM=False,")],
    # every K step loads the tiles of the program's first K block (wrong results, timing
    # only): the GEMM with its operands always in L2 (const_k), or one operand so (const_x:
    # the logits tile, const_e: the E tile). Is the memory pipeline what holds it back?
    # Partly: at 32 requests const_e 77% -> 81% (fp32 logits) and 76% -> 87% (bf16), const_x
    # nothing, const_k 82% / 88%; noexp 89% / 97% (soft_embedding-diag-h200-v17-operands.log)
    "const_k": [(LOAD_X, LOAD_X_CONST), (LOAD_E, LOAD_E_CONST)],
    "const_x": [(LOAD_X, LOAD_X_CONST)],
    "const_e": [(LOAD_E, LOAD_E_CONST)],
    # the whole-tile waves in another order (soft_embedding._grouped_tile): groups of g
    # M-tiles with the M-tile fastest (the default g = GROUP_M; g = 1 is the N-tile-fastest
    # order used before 2026-12-04, whose 11 consecutive programs share a logits tile). At 32 requests from
    # bf16 logits groups of 2-12 take 72-74% to 78-79%; fp32 logits unchanged with 2-6, 64%
    # with 12; at 16 requests within the noise (soft_embedding-diag-h200-v17-order.log,
    # alternating A/B in -v18-order-ab.log). The split-K tail's programs M-tile fastest as
    # well (within each piece) were slower from bf16 logits: 1 request 0.65 -> 0.81 ms, 4
    # requests 2.67 -> 2.76-2.87 ms; fp32 within the noise (-v19-tail-order.log; not kept)
    "group1": [("\nGROUP_M = 6\n", "\nGROUP_M = 1\n")],
    "group2": [("\nGROUP_M = 6\n", "\nGROUP_M = 2\n")],
    "group4": [("\nGROUP_M = 6\n", "\nGROUP_M = 4\n")],
    "group12": [("\nGROUP_M = 6\n", "\nGROUP_M = 12\n")],
    "const_k_noexp": [(LOAD_X, LOAD_X_CONST), (LOAD_E, LOAD_E_CONST),
                      (EXP, "p = gl.minimum(d2, 0.0, propagate_nan=tl.PropagateNan.ALL)")],
    # fewer pipeline stages (bf16 logits get 4 by default, fp32 3): with bf16 logits the L2
    # hit rate falls to 30% at 32 requests (Nsight Compute, 78% from fp32 logits), as if the
    # programs of a wave drifted apart in K; does a shorter lookahead keep them together?
    # (No: 3 stages time the same, 2 are slower, soft_embedding-diag-h200-v13-stages.log.)
    "stages3": [("return max(2, min(4,", "return max(2, min(3,")],
    "stages2": [("return max(2, min(4,", "return max(2, min(2,")],
    # another register split between the consumer warpgroups and the TMA warp
    "regs240": [("CONSUMER_REGS, LOADER_REGS = 232, 40", "CONSUMER_REGS, LOADER_REGS = 240, 24")],
    # z * log2(e) - lse2 as one FMA with inv_t * log2(e) folded (p moves by ~1 fp32 ulp, no
    # longer bit-identical to the Triton kernel; wrong on greedy rows): does the prologue's FMUL
    # per entry count? Not from fp32 logits (soft_embedding-diag-h200-v12-rs.log, -v23-one-fma.log);
    # from bf16 logits it does, 72-86% against 67-79% of cuBLAS at 1-32 requests (-v23)
    "one_fma": [ONE_FMA],
    # 16-bit logits: the one-FFMA loop in the warpgroups whose rows allow it, the exact one in
    # the others (greedy rows); not the default until it has run on a GPU (one_fma's docstring).
    # SASS per warp and K step (Triton 3.6, bf16): 253 instructions in the exact loop as it is,
    # 223 in the one-FFMA loop (no FMUL; the exact loop of the pair: 270), 191 without the clamp
    "one_fma16": [ONE_FMA_16_ON],
    # the same without the clamp of d2 at 0 in the one-FFMA loop: there |lse2| < 1024, so a
    # positive d2 is below 2^-9 and 2^d2 still casts to 1 (NaN p still zeroed after the cast)
    "one_fma16_noclamp": [ONE_FMA_16_ON, (EXP, "p = _exp2_ftz(d2) if ONE_FMA else " + EXP[4:])],
    # fp32 logits through the register K loop (p_registers) with that loop pair: less
    # shared-memory traffic than p through shared memory, and the one FFMA (not timed yet)
    "one_fma_registers": [(P_IN_REGISTERS, "    return True\n"),
                          (ONE_FMA_16, ONE_FMA_16.replace("return False", "return True"))],
    # no MUFU: p = min(d2, 0) cast. Faster in time but not in cycles: the exponentials cost
    # clock frequency under the power limit, not latency (ncu-h200-gemm-noexp-cycles.txt)
    "noexp": [(EXP, "p = gl.minimum(d2, 0.0, propagate_nan=tl.PropagateNan.ALL)")],
    # exp2 of one entry in 2 (poly2) or 4 (poly4) by a degree-5 polynomial on the FMA pipe
    # (Cody-Waite split, exponent by integer add; 3.3e-6 relative), the rest by MUFU.EX2:
    # does moving work off the MUFU pipe shorten the prologue? No (CTA-wide kernel): 72% ->
    # 62% (poly2) and 67% (poly4) of cuBLAS from fp32 logits (soft_embedding-diag-h200-v9.log)
    "poly2": [(NAN_TO_ZERO, _mixed_exp2(2) + NAN_TO_ZERO), (EXP, MIXED_EXP)],
    "poly4": [(NAN_TO_ZERO, _mixed_exp2(4) + NAN_TO_ZERO), (EXP, MIXED_EXP)],
    # K steps of 32 instead of 64 (twice the synchronisations per FLOP, a deeper pipeline in
    # steps: up to 6 stages): does the prologue's latency chain hide better in smaller pieces?
    # No: 63% / 72% against 73% / 81% at 32 requests (soft_embedding-diag-h200-v20-skeleton.log)
    "bk32": [(BLOCK_SHAPE, "BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 32"),
             ("return max(2, min(4,", "return max(2, min(6,")],
    # the GEMM skeleton alone (timing only, 16-bit logits; fp32 logits do not compile): the
    # logits tile goes from its TMA stage straight to the wgmma as the A operand, no prologue,
    # no p; what the same tiles, pipeline and warps reach on a plain bf16 GEMM: 102% / 105% /
    # 86% of cuBLAS at 32 / 4 / 1 requests (-v20-skeleton.log). So the tiles, the L2 traffic
    # without multicast and the pipeline are not the gap; the prologue is
    "plain": [(P_IN_REGISTERS, "    return False\n"), (SHARED_P_PROLOGUE, PLAIN_MMA)],
    # the prologue's data path without its arithmetic (timing only): p is the logits tile cast
    # to the operand dtype, so bf16 logits go by ldmatrix straight into the register operand
    # and fp32 logits through shared load, cast, p store, fence and barrier. Against plain
    # (same bytes through shared memory, no ldmatrix, no register operand) and base, this
    # splits what the register operand and the p handover cost from what the arithmetic costs
    "nomath": [(EXP_AND_CAST, "    return x.to(dtype)\n")],
    # fp32 logits (timing only, wrong results; 16-bit logits do not compile): each warpgroup
    # makes p for half its rows and stores it into both halves of its p buffer, so the
    # prologue's loads and arithmetic per MMA flop halve while the tiles, the L2 traffic and
    # the p stores stay. What a tile that shares one p between two N halves (64 x 512, p made
    # half by each warpgroup) could gain at most, before its extra E traffic
    "half_p": [(ACC_ROWS, ACC_ROWS.replace("gl.arange(0, WM,", "gl.arange(0, WM // 2,")),
               (SHARED_P_MAKE, SHARED_P_MAKE.replace(".slice(WG * WM, WM)", ".slice(WG * WM, WM // 2)")
                .replace("        p_buf.store(p)\n", "        p_buf.slice(0, WM // 2).store(p)\n"
                         "        p_buf.slice(WM // 2, WM // 2).store(p)\n"))],
    # the two consumer warpgroups issue their wgmma in turns (soft_embedding_wgmma.pingpong);
    # the output is unchanged (only the order of issue is), alone and with the one-FFMA loop pair
    "pingpong": [PINGPONG_ON],
    "pingpong_one_fma16": [PINGPONG_ON, ONE_FMA_16_ON],
    "pingpong_one_fma16_noclamp": [PINGPONG_ON, ONE_FMA_16_ON,
                                   (EXP, "p = _exp2_ftz(d2) if ONE_FMA else " + EXP[4:])],
    # the p-through-shared-memory K loop without its proxy fence, without the warpgroup
    # barrier before the wgmma, or without both (timing only: p may be read before it is
    # written): does the handover of p to the tensor cores hold the next wgmma back? No: fp32
    # logits 75% / 75% / 74% / 75% (base / nofence / nobarrier / both) at 32 requests
    # (soft_embedding-diag-h200-v21-handover.log)
    "nofence": [(FENCE_BARRIER, BARRIER)],
    "nobarrier": [(FENCE_BARRIER, FENCE)],
    "nofence_nobarrier": [(FENCE_BARRIER, "")],
    # fewer prologue instructions per entry: NaN -> -inf before the exponential by one
    # non-propagating max, no clamp of d2 at 0 and no NaN pass on p (lean: 1 FMNMX instead of
    # FMNMX + HMNMX2 per two entries; lean_fma: also one_fma's single FMA)
    "lean": [(EXP, LEAN_EXP), (NAN_TO_ZERO_BODY, "    return p\n")],
    "lean_fma": [(EXP, LEAN_EXP), (NAN_TO_ZERO_BODY, "    return p\n"), ONE_FMA],
}


def load_variant(name: str):
    text = open(SRC).read()
    for old, new in VARIANTS[name]:
        assert old in text, (name, old)
        text = text.replace(old, new)
    text = text.replace("from .soft_embedding import", "from dgemma_sampler.kernels.soft_embedding import")
    path = os.path.join(tempfile.mkdtemp(), f"se_wgmma_{name}.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(f"se_wgmma_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def time_kernel_module(module, logits: torch.Tensor, x: dict, out: torch.Tensor) -> float:
    """Milliseconds of ``soft_embedding_rows`` on the benchmark's inputs ``x`` with ``module`` as
    its Gluon kernel (``soft_embedding._WGMMA``), after one run to compile; raises what the
    launch raises (a variant that does not compile, say)."""
    se._WGMMA = module
    fn = lambda: se.soft_embedding_rows(logits, x["row_request"], x["temperature"], x["lse"],
                                        x["embed"], x["normalizer"], out=out, wgmma=True)
    fn()
    torch.cuda.synchronize()
    return bench_ms(fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out")
    args = ap.parse_args()
    x = make_inputs(args.requests, VOCAB, HIDDEN)
    out = x["out"]
    gemm_out = torch.empty(out.shape, device="cuda", dtype=torch.bfloat16)
    cublas = bench_ms(lambda: torch.mm(x["probs"], x["embed"], out=gemm_out))
    print(f"cuBLAS {cublas:.3f} ms", flush=True)
    results = dict(requests=args.requests, cublas_ms=cublas, variants={})
    reference_out = None
    for name in args.variants.split(","):
        module = load_variant(name)
        for dname, logits in (("fp32", x["logits"]), ("bf16", x["logits_bf16"])):
            try:
                ms = time_kernel_module(module, logits, x, out)
            except Exception as exc:  # a variant that does not compile is reported, not fatal
                print(f"{name:22s} {dname}: failed {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            if name == "base" and dname == "fp32":
                reference_out = out.clone()
            diff = (out - reference_out).abs().max().item() if reference_out is not None else float("nan")
            regs = getattr(se._last_kernel, "n_regs", None)
            results["variants"][f"{name} {dname}"] = dict(ms=ms, vs_cublas=cublas / ms, max_diff=diff,
                                                         regs=regs)
            print(f"{name:22s} {dname}: {ms:7.3f} ms ({cublas / ms:4.0%} of cuBLAS) regs {regs} "
                  f"max|out - base fp32| {diff:.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
