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

LOAD = "x = x_bufs.index(stage).load(tile_layout).to(gl.float32)"
EXP = "p = _exp2_ftz(gl.minimum(d2, 0.0, propagate_nan=tl.PropagateNan.ALL))"
BAR2 = "        _cta_barrier()\n        ahead = i + STAGES - 1"
EXPECT = "mbarrier.expect(bar, x_desc.block_type.nbytes + e_desc.block_type.nbytes, pred)"
X_TMA = "    _tma_load(x_desc, [row0, kb * BK], bar, x_bufs.index(stage), pred)\n"
STORE = "        p_buf.store(p)\n        fence_async_shared()\n        _cta_barrier()  # every warp's part of p is in shared memory\n"

NAN_TO_ZERO = "@gluon.jit\ndef _nan_to_zero(p):"
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


# The logits by pointer loads straight into registers, one K step ahead, instead of TMA into
# shared memory and a read back: each logits tile is used once, by the prologue, and staging
# it costs shared-memory bandwidth (TMA write + LDS: with fp32 logits 64 of the ~190 KB a K
# step moves through shared memory, where wgmma reads the E tile once per warpgroup). E keeps
# its TMA pipeline, which gains the stages the logits tiles freed. Measured slower, with the
# same output: 72% -> 62% of cuBLAS from fp32 logits, 68% -> 66% from bf16, 230 / 212
# registers (bench/results/soft_embedding-diag-h200-v10.log): shared-memory bandwidth is not
# what holds the kernel back.
_X_TILE = """@gluon.jit
def _x_tile(x_rows, row_ok, kb, v_local, BK: gl.constexpr, tile_layout: gl.constexpr):
    \"\"\"Logits tile of K block ``kb`` in ``tile_layout`` (0 past the rows and the slice).\"\"\"
    cols = kb * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, tile_layout))
    ptrs = x_rows + gl.expand_dims(cols, 0)
    mask = row_ok & gl.expand_dims(cols < v_local, 0)
    return gl.load(ptrs, mask=mask, other=0.0)


"""
LDG_LOGITS = [
    (NAN_TO_ZERO, _X_TILE + NAN_TO_ZERO),
    (EXPECT, "mbarrier.expect(bar, e_desc.block_type.nbytes, pred)"),
    (X_TMA, ""),
    ("            STAGES: gl.constexpr, BK: gl.constexpr):",
     "            STAGES: gl.constexpr, BK: gl.constexpr, x_rows, row_ok, v_local):"),
    ("    for i in range(n_k):\n        stage = i % STAGES\n        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)\n"
     "        " + LOAD + "\n",
     "    x_next = _x_tile(x_rows, row_ok & (n_k > 0), kb_begin, v_local, BK, tile_layout)\n"
     "    for i in range(n_k):\n        stage = i % STAGES\n        x = x_next.to(gl.float32)\n"
     "        x_next = _x_tile(x_rows, row_ok & (i + 1 < n_k), kb_begin + i + 1, v_local, BK, tile_layout)\n"
     "        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)\n"),
    ("    x_desc, e_desc,                               # TMA: local logits [N, V_local], E [V_local, H]\n",
     "    x_desc, e_desc, x_ptr, stride_x,\n"),
    ("    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)\n",
     "    x_bufs = 0  # unused: the logits come by pointer loads\n"
     "    x_rows = x_ptr + gl.expand_dims(rows.to(gl.int64) * stride_x, 1)\n"
     "    row_ok = gl.expand_dims(rows < n_rows, 1)\n"),
    ("                  neg_lse2, threshold, tile_layout, HAS_THRESHOLD, STAGES, BK)",
     "                  neg_lse2, threshold, tile_layout, HAS_THRESHOLD, STAGES, BK, x_rows, row_ok, v_local)"),
    ("        x_desc, e_desc, row_request, inv_t, lse,", "        x_desc, e_desc, local, logits.stride(0), row_request, inv_t, lse,"),
    ("    per_stage = BLOCK_M * BLOCK_K * logits_dtype.itemsize + BLOCK_K * BLOCK_N * embed_dtype.itemsize",
     "    per_stage = BLOCK_K * BLOCK_N * embed_dtype.itemsize"),
]

# name -> list of (old, new) substitutions
VARIANTS = {
    "base": [],
    # no MUFU: p = min(d2, 0) cast (measures the exponentials)
    "noexp": [(EXP, "p = gl.minimum(d2, 0.0, propagate_nan=tl.PropagateNan.ALL)")],
    # no barrier before the TMA refill (a race: measures that barrier)
    "nobar2": [(BAR2, "        ahead = i + STAGES - 1")],
    # no logits read from shared memory and no prologue math (p a splat)
    "noprologue": [(LOAD, "x = gl.full([128, 64], 0.5, gl.float32, tile_layout) + i")],
    # ... and no logits TMA either (only E streams)
    "noprologue_nologits": [(LOAD, "x = gl.full([128, 64], 0.5, gl.float32, tile_layout) + i"),
                            (EXPECT, "mbarrier.expect(bar, e_desc.block_type.nbytes, pred)"), (X_TMA, "")],
    # ... and p written once (no per-step store, fence, barrier): a plain pipelined SS GEMM
    "gemm_only": [(LOAD, "x = gl.full([128, 64], 0.5, gl.float32, tile_layout) + i"),
                  (EXPECT, "mbarrier.expect(bar, e_desc.block_type.nbytes, pred)"), (X_TMA, ""),
                  (STORE, "        p_buf = p_bufs.index(0)\n")],
    # the next step's logits tile read right after this step's wgmma issue, not at the top of
    # the next step (bench/results/soft_embedding-h200-v9-early-read.log: 72% -> 54% of cuBLAS
    # at 32 requests from fp32 logits, 186-190 registers instead of 172)
    "early_read": [
        ("""    for i in range(n_k):
        stage = i % STAGES
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        x = x_bufs.index(stage).load(tile_layout).to(gl.float32)
""", """    mbarrier.wait(bars.index(0), 0, pred=n_k > 0)
    x_next = x_bufs.index(0).load(tile_layout)
    for i in range(n_k):
        stage = i % STAGES
        x = x_next.to(gl.float32)
"""),
        ("""        acc = warpgroup_mma(p_buf, e_bufs.index(stage), acc, is_async=True)
""", """        acc = warpgroup_mma(p_buf, e_bufs.index(stage), acc, is_async=True)
        nxt = i + 1
        mbarrier.wait(bars.index(nxt % STAGES), (nxt // STAGES) & 1, pred=nxt < n_k)
        x_next = x_bufs.index(nxt % STAGES).load(tile_layout)
""")],
    # exp2 of one entry in 2 (poly2) or 4 (poly4) by a degree-5 polynomial on the FMA pipe
    # (Cody-Waite split, exponent by integer add; 3.3e-6 relative), the rest by MUFU.EX2:
    # does moving work off the MUFU pipe shorten the prologue? No: 72% -> 62% (poly2) and 67%
    # (poly4) of cuBLAS from fp32 logits (bench/results/soft_embedding-diag-h200-v9.log)
    "poly2": [(NAN_TO_ZERO, _mixed_exp2(2) + NAN_TO_ZERO), (EXP, MIXED_EXP)],
    "poly4": [(NAN_TO_ZERO, _mixed_exp2(4) + NAN_TO_ZERO), (EXP, MIXED_EXP)],
    # the logits by pointer loads into registers, one K step ahead (LDG_LOGITS above)
    "ldg_logits": LDG_LOGITS,
    # BLOCK_K 32 with up to 8 stages (a deeper TMA lookahead in bytes-ahead terms)
    "bk32": [("BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64", "BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 32"),
             ("return max(2, min(4,", "return max(2, min(8,")],
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out")
    args = ap.parse_args()
    x = make_inputs(args.requests, VOCAB, HIDDEN)
    out = x["out"]
    gemm_out = torch.empty(out.shape, device="cuda", dtype=torch.bfloat16)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    cublas = bench(lambda: torch.mm(x["probs"], x["embed"], out=gemm_out))
    print(f"cuBLAS {cublas:.3f} ms", flush=True)
    results = dict(requests=args.requests, cublas_ms=cublas, variants={})
    reference_out = None
    for name in args.variants.split(","):
        module = load_variant(name)
        se._WGMMA = module
        for dname, logits in (("fp32", x["logits"]), ("bf16", x["logits_bf16"])):
            fn = lambda: se.soft_embedding_rows(logits, x["row_request"], x["temperature"],
                                                x["lse"], x["embed"], x["normalizer"], out=out,
                                                wgmma=True)
            try:
                fn()
                torch.cuda.synchronize()
                ms = bench(fn)
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
