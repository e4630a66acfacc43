"""Self-conditioning GEMM: the fused kernel vs cuBLAS on materialized probabilities.

For 1 / 4 / 16 / 32 decoding requests (rows = 256 * requests, V = 262144, H = 2816) it times, with
``triton.testing.do_bench`` (median, L2 flushed between runs):

* cuBLAS bf16 ``probs[rows, V] @ E[V, H]`` with the bf16 probabilities already materialized (the
  reference rate: it does only the GEMM, none of the softmax);
* our kernel from fp32 logits and from bf16 logits (softmax recomputed in the prologue);
* our kernel from fp32 logits with half the rows dropped by ``keep`` (should cost ~half), without
  and with the host-side ``num_kept`` hint that sizes the schedule to the kept rows, and with
  ``keep`` all True (the sampler's path: logits rows gathered by pointers instead of TMA);

and reports TFLOP/s (2 * rows * V * H), our rate as a fraction of cuBLAS's, the tile config the
tuner chose, the split-K plan, and ``torch.cuda.max_memory_allocated`` beyond inputs and output.

``--sweep`` then times every candidate of ``SWEEP_CONFIGS`` at 4 and 32 requests, without tuning:
the tuner's ``GPU_CONFIGS`` from fp32 logits, bf16 logits and fp32 logits with ``keep`` all True
(the row-gather path the sampler uses); the other tile shapes (64 x 512) from fp32 logits only.
With registers / spills of the compiled kernel and the error against cuBLAS, so one run shows
which tile wins.

    python bench/bench_soft_embedding.py [--requests 1 4 16 32] [--sweep] [--out bench/results/soft_embedding.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import torch
import triton
import triton.testing

from dgemma_sampler import reference
from dgemma_sampler.kernels import soft_embedding as se

CANVAS = 256


def make_inputs(requests: int, vocab: int, hidden: int, seed: int = 0) -> dict:
    """Random logits ~ N(0, 3^2), T in [0.4, 0.8], E ~ N(0, 0.03^2) bf16; lse from torch in fp32."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = requests * CANVAS
    logits = torch.randn(rows, vocab, generator=g, device="cuda").mul_(3.0)
    row_request = torch.arange(requests, dtype=torch.int32, device="cuda").repeat_interleave(CANVAS)
    temperature = 0.4 + 0.4 * torch.rand(requests, generator=g, device="cuda")
    inv_t = reference.inverse_temperature(temperature)[row_request.long()]
    lse = torch.empty(rows, device="cuda")
    probs = torch.empty(rows, vocab, dtype=torch.bfloat16, device="cuda")
    for r0 in range(0, rows, 512):
        z = logits[r0:r0 + 512] * inv_t[r0:r0 + 512, None]
        lse[r0:r0 + 512] = torch.logsumexp(z, dim=1)
        probs[r0:r0 + 512] = torch.softmax(z, dim=1).to(torch.bfloat16)
    embed = (torch.randn(vocab, hidden, generator=g, device="cuda") * 0.03).to(torch.bfloat16)
    return dict(logits=logits, logits_bf16=logits.to(torch.bfloat16), row_request=row_request,
                temperature=temperature, lse=lse, probs=probs, embed=embed,
                normalizer=math.sqrt(hidden), out=torch.empty(rows, hidden, device="cuda"))


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def extra_memory_bytes(fn) -> int:
    """Peak allocation during ``fn`` beyond what was allocated before it (inputs, output)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def run_size(requests: int, vocab: int, hidden: int) -> dict:
    x = make_inputs(requests, vocab, hidden)
    rows = requests * CANVAS
    flops = 2.0 * rows * vocab * hidden
    gemm_out = torch.empty(rows, hidden, dtype=torch.bfloat16, device="cuda")
    # Half the rows dropped: every other request (the first half of the canvas at one request).
    if requests > 1:
        keep_half = x["row_request"] % 2 == 0
    else:
        keep_half = torch.arange(rows, device="cuda") < rows // 2
    half = int(keep_half.sum())
    keep_all = torch.ones(rows, dtype=torch.bool, device="cuda")  # the sampler's row-gather path

    def ours(logits, keep=None, num_kept=None, wgmma=None):
        return lambda: se.soft_embedding_rows(logits, x["row_request"], x["temperature"], x["lse"],
                                              x["embed"], x["normalizer"], keep=keep, out=x["out"],
                                              num_kept=num_kept, wgmma=wgmma)

    tune_start = time.perf_counter()
    for fn in (ours(x["logits"]), ours(x["logits_bf16"]), ours(x["logits"], keep_half),
               ours(x["logits"], keep_half, half)):
        fn()  # compiles and tunes once per shape key
    torch.cuda.synchronize()
    tune_s = time.perf_counter() - tune_start

    result = dict(requests=requests, rows=rows, vocab=vocab, hidden=hidden, tune_s=round(tune_s, 2))
    result["cublas_ms"] = bench_ms(lambda: torch.mm(x["probs"], x["embed"], out=gemm_out))
    result["fp32_ms"] = bench_ms(ours(x["logits"]))
    result["bf16_ms"] = bench_ms(ours(x["logits_bf16"]))
    result["keep_half_ms"] = bench_ms(ours(x["logits"], keep_half))
    result["keep_half_hint_ms"] = bench_ms(ours(x["logits"], keep_half, half))
    result["keep_all_ms"] = bench_ms(ours(x["logits"], keep_all))
    # The Triton kernel in the same run (the default on Hopper is the Gluon wgmma kernel).
    result["uses_wgmma"] = se._wgmma_module() is not None and se._wgmma_module().supported(
        x["logits"], x["embed"], 0, None, None)
    ours(x["logits"], wgmma=False)()
    triton_out = x["out"].clone()
    result["triton_fp32_ms"] = bench_ms(ours(x["logits"], wgmma=False))
    result["triton_bf16_ms"] = bench_ms(ours(x["logits_bf16"], wgmma=False))
    result["triton_fp32_vs_cublas"] = result["cublas_ms"] / result["triton_fp32_ms"]
    for name in ("cublas", "fp32", "bf16"):
        result[f"{name}_tflops"] = flops / (result[f"{name}_ms"] * 1e-3) / 1e12
    for name in ("fp32", "bf16"):
        result[f"{name}_vs_cublas"] = result["cublas_ms"] / result[f"{name}_ms"]
    result["extra_bytes_fp32"] = extra_memory_bytes(ours(x["logits"]))
    result["extra_bytes_keep_half"] = extra_memory_bytes(ours(x["logits"], keep_half))

    # What the tuner picked and the schedule it implies.
    masks = (False, False, False, False)
    for name, dtype, planned, keep_mask in (("fp32", torch.float32, rows, False),
                                            ("bf16", torch.bfloat16, rows, False),
                                            ("keep_half", torch.float32, rows, True)):
        key = se.tuning_key(planned, hidden, vocab, dtype, torch.bfloat16, (keep_mask,) + masks[1:])
        cfg = se._TUNED.get(key)
        if cfg is not None:
            plan = se.plan_split(rows, planned, hidden, vocab, cfg, se._num_sms(torch.device("cuda")))
            result[f"{name}_config"] = str(cfg)
            result[f"{name}_split"] = plan.split
            result[f"{name}_scratch_bytes"] = plan.scratch_elems * 4

    # Sanity: the fused result against the cuBLAS one on the same probabilities.
    ours(x["logits"])()
    ref = torch.mm(x["probs"], x["embed"]).float() * x["normalizer"]
    result["rel_err_vs_cublas"] = ((x["out"] - ref).norm() / ref.norm()).item()
    result["max_abs_diff_vs_triton_kernel"] = (x["out"] - triton_out).abs().max().item()
    del x
    torch.cuda.empty_cache()
    return result


def parse_config(text: str) -> "se.TileConfig":
    """``128x256x64:w8:s3`` -> TileConfig."""
    shape, *rest = text.split(":")
    bm, bn, bk = (int(v) for v in shape.split("x"))
    warps = int(next(r[1:] for r in rest if r.startswith("w")))
    stages = int(next(r[1:] for r in rest if r.startswith("s")))
    return se.TileConfig(bm, bn, bk, warps, stages)


def compiled_gemm(fn):
    """Run ``fn`` and return the compiled Triton GEMM (``soft_embedding_kernel``) it launched
    last, for its registers and spills; None if it launched none."""
    from triton.runtime.jit import JITFunction

    launched = []
    run = JITFunction.run

    def record(self, *args, **kwargs):
        kernel = run(self, *args, **kwargs)
        if getattr(getattr(self, "fn", None), "__name__", "") == "soft_embedding_kernel":
            launched.append(kernel)
        return kernel

    JITFunction.run = record
    try:
        fn()
    finally:
        JITFunction.run = run
    return launched[-1] if launched else None


def run_sweep(requests: int, vocab: int, hidden: int, configs=None) -> list[dict]:
    """Every sweep config at one size, no tuning: ms, fraction of cuBLAS, regs, spills, error.

    With ``configs`` (from ``--configs``) every variant (fp32, bf16 logits, keep) runs for each
    config, and each is also checked bit for bit against a second run (``*_deterministic``).
    """
    x = make_inputs(requests, vocab, hidden, seed=1)
    rows = requests * CANVAS
    flops = 2.0 * rows * vocab * hidden
    gemm_out = torch.empty(rows, hidden, dtype=torch.bfloat16, device="cuda")
    cublas_ms = bench_ms(lambda: torch.mm(x["probs"], x["embed"], out=gemm_out))
    ref = torch.mm(x["probs"], x["embed"]).float() * x["normalizer"]
    keep_all = torch.ones(rows, dtype=torch.bool, device="cuda")
    variants = {"fp32": (x["logits"], None), "bf16": (x["logits_bf16"], None),
                "keep": (x["logits"], keep_all)}
    out = []
    for cfg in (configs or se.SWEEP_CONFIGS):
        entry = dict(requests=requests, config=str(cfg), cublas_ms=cublas_ms)
        for name, (logits, keep) in variants.items():
            if se.shared_memory_bytes(cfg, logits.dtype, x["embed"].dtype, False) > se.SHARED_MEMORY_BYTES:
                continue
            if name != "fp32" and cfg not in se.GPU_CONFIGS and not configs:
                continue  # the extra variants answer one question each, from fp32 logits: saves compiles

            def fn(logits=logits, keep=keep, cfg=cfg):
                se.soft_embedding_rows(logits, x["row_request"], x["temperature"], x["lse"], x["embed"],
                                       x["normalizer"], keep=keep, out=x["out"], config=cfg)

            try:
                x["out"].fill_(float("nan"))
                kernel = compiled_gemm(fn)  # compiles
                torch.cuda.synchronize()
                err = ((x["out"] - ref).norm() / ref.norm()).item()
                if configs:
                    first = x["out"].clone()
                    for _ in range(3):
                        x["out"].fill_(float("nan"))
                        fn()
                        if not torch.equal(first, x["out"]):
                            entry[f"{name}_deterministic"] = False
                            break
                    else:
                        entry[f"{name}_deterministic"] = True
                ms = bench_ms(fn)
            except Exception as e:  # noqa: BLE001 - report and go on with the other variants
                entry[f"{name}_error"] = repr(e)[:200]
                continue
            entry[f"{name}_ms"] = ms
            entry[f"{name}_vs_cublas"] = cublas_ms / ms
            entry[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12
            entry[f"{name}_rel_err"] = err
            entry[f"{name}_regs"] = getattr(kernel, "n_regs", None)
            entry[f"{name}_spills"] = getattr(kernel, "n_spills", None)
        out.append(entry)
        print(f"  sweep requests={requests} {cfg}: " + ", ".join(
            f"{n} {entry[n + '_ms']:.3f} ms ({entry[n + '_vs_cublas']:.0%}, err "
            f"{entry[n + '_rel_err']:.1e}{', det ' + str(entry[n + '_deterministic']) if n + '_deterministic' in entry else ''})"
            if n + "_ms" in entry
            else f"{n} {entry.get(n + '_error', 'n/a')}" for n in variants), flush=True)
    del x
    torch.cuda.empty_cache()
    return out


def print_sweep(entries: list[dict]) -> None:
    head = (f"{'req':>3} {'config':<28} | {'fp32 ms':>8} {'vs cuBLAS':>9} | {'bf16 ms':>8} {'vs cuBLAS':>9}"
            f" | {'keep ms':>8} {'vs cuBLAS':>9} | {'regs':>9} {'spill':>7} | {'rel err':>7}")
    print(head)
    print("-" * len(head))
    for e in entries:
        cells = []
        for n in ("fp32", "bf16", "keep"):
            if n + "_ms" in e:
                cells.append(f"{e[n + '_ms']:>8.3f} {e[n + '_vs_cublas']:>8.0%}")
            else:
                cells.append(f"{'n/a':>8} {'':>9}")
        regs = "/".join(str(e.get(n + "_regs", "-")) for n in ("fp32", "keep"))
        spills = "/".join(str(e.get(n + "_spills", "-")) for n in ("fp32", "keep"))
        err = max((e[n + "_rel_err"] for n in ("fp32", "bf16", "keep") if n + "_rel_err" in e),
                  default=float("nan"))
        print(f"{e['requests']:>3} {e['config']:<28} | " + " | ".join(cells)
              + f" | {regs:>9} {spills:>7} | {err:>7.1e}")
    print("(cuBLAS ms: " + ", ".join(sorted({f"{e['requests']} req {e['cublas_ms']:.3f}" for e in entries}))
          + "; regs/spill: fp32/keep kernels; rel err: worst variant vs cuBLAS on bf16 probs)")


def print_table(results: list[dict]) -> None:
    head = (f"{'req':>3} {'rows':>5} | {'cuBLAS ms':>9} {'TF/s':>5} | {'fp32 ms':>8} {'TF/s':>5} {'vs cuBLAS':>9}"
            f" | {'bf16 ms':>8} {'TF/s':>5} {'vs cuBLAS':>9} | {'keep/2 ms':>9} {'+hint':>7} {'keep=all':>8}"
            f" | {'extra MB':>8}"
            f" | config fp32 (split) / bf16 / keep")
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['requests']:>3} {r['rows']:>5} | {r['cublas_ms']:>9.3f} {r['cublas_tflops']:>5.0f} | "
              f"{r['fp32_ms']:>8.3f} {r['fp32_tflops']:>5.0f} {r['fp32_vs_cublas']:>8.0%} | "
              f"{r['bf16_ms']:>8.3f} {r['bf16_tflops']:>5.0f} {r['bf16_vs_cublas']:>8.0%} | "
              f"{r['keep_half_ms']:>9.3f} {r['keep_half_hint_ms']:>7.3f} {r['keep_all_ms']:>8.3f} | "
              f"{r['extra_bytes_fp32'] / 2**20:>8.1f} | "
              f"{r.get('fp32_config')} (S={r.get('fp32_split')}) / {r.get('bf16_config')} / "
              f"{r.get('keep_half_config')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--hidden", type=int, default=2816)
    parser.add_argument("--sweep", action="store_true",
                        help="also time every SWEEP_CONFIGS candidate at --sweep-requests")
    parser.add_argument("--sweep-requests", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--configs", nargs="+", default=None,
                        help="sweep these configs instead (e.g. 128x256x64:w8:s3), every "
                             "variant, with a run-to-run determinism check")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "soft_embedding.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")

    start = time.perf_counter()
    results = []
    for requests in args.requests:
        results.append(run_size(requests, args.vocab, args.hidden))
        r = results[-1]
        print(f"[{time.perf_counter() - start:6.1f}s] requests={requests}: cuBLAS {r['cublas_ms']:.3f} ms, "
              f"fp32 {r['fp32_ms']:.3f} ms ({r['fp32_vs_cublas']:.0%}), bf16 {r['bf16_ms']:.3f} ms "
              f"({r['bf16_vs_cublas']:.0%}), rel err vs cuBLAS {r['rel_err_vs_cublas']:.1e}, "
              f"tuning {r['tune_s']} s; Triton kernel fp32 {r['triton_fp32_ms']:.3f} ms "
              f"({r['triton_fp32_vs_cublas']:.0%}) bf16 {r['triton_bf16_ms']:.3f} ms, wgmma "
              f"{r['uses_wgmma']}, max |wgmma - triton| {r['max_abs_diff_vs_triton_kernel']:.1e}",
              flush=True)
    sweep = []
    if args.sweep:
        for requests in args.sweep_requests:
            sweep += run_sweep(requests, args.vocab, args.hidden,
                               [parse_config(c) for c in args.configs] if args.configs else None)
            print(f"[{time.perf_counter() - start:6.1f}s] sweep at requests={requests} done", flush=True)
    print()
    print_table(results)
    if sweep:
        print()
        print_sweep(sweep)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), total_s=round(time.perf_counter() - start, 1))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, results=results, sweep=sweep), f, indent=2)
    print(f"\nwrote {args.out} ({meta['total_s']} s)")


if __name__ == "__main__":
    main()
