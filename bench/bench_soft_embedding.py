"""Self-conditioning GEMM: the fused kernel vs cuBLAS on materialized probabilities.

For 1 / 4 / 16 / 32 decoding requests (rows = 256 * requests, V = 262144, H = 2816) it times, with
``triton.testing.do_bench`` (median, L2 flushed between runs):

* cuBLAS bf16 ``probs[rows, V] @ E[V, H]`` with the bf16 probabilities already materialized (the
  reference rate: it does only the GEMM, none of the softmax);
* our kernel from fp32 logits and from bf16 logits (softmax recomputed in the prologue);
* our kernel from fp32 logits with half the rows dropped by ``keep`` (should cost ~half), without
  and with the host-side ``num_kept`` hint that sizes the schedule to the kept rows, and with
  ``keep`` all True (the sampler's path);

and reports TFLOP/s (2 * rows * V * H), our rate as a fraction of cuBLAS's (target: 90%), the
tile config the tuner chose, the split-K plan, and ``torch.cuda.max_memory_allocated`` beyond
inputs and output. On Hopper the default kernel is the Gluon one; the portable Triton kernel is
timed in the same run.

    python bench/bench_soft_embedding.py [--requests 1 4 16 32] [--out /tmp/soft_embedding.json]

By default the result goes to the bench of record (``bench/record.py``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record  # noqa: E402

from dgemma_sampler import reference  # noqa: E402
from dgemma_sampler.kernels import contract  # noqa: E402
from dgemma_sampler.kernels import soft_embedding_dispatch as se  # noqa: E402

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
            sms = contract.sm_count(torch.device("cuda"))
            result[f"{name}_config"] = str(cfg)
            if keep_mask:  # the count stays on the device: the plans of every count
                plan = se.plans_by_count(rows, hidden, vocab, cfg, sms, torch.device("cuda"))
            else:
                plan = se.plan_split(rows, planned, hidden, vocab, cfg, sms)
                result[f"{name}_split"] = plan.split
            result[f"{name}_scratch_bytes"] = plan.scratch_elems * 4

    # Sanity: the fused result against the cuBLAS one on the same probabilities.
    ours(x["logits"])()
    ref = torch.mm(x["probs"], x["embed"]).float() * x["normalizer"]
    result["rel_err_vs_cublas"] = ((x["out"] - ref).norm() / ref.norm()).item()
    result["max_abs_diff_vs_triton_kernel"] = (x["out"] - triton_out).abs().max().item()
    x.clear()  # free the inputs before the next size
    torch.cuda.empty_cache()
    return result


def print_table(results: list[dict]) -> None:
    head = (f"{'req':>3} {'rows':>5} | {'cuBLAS ms':>9} {'TF/s':>5} | {'fp32 ms':>8} {'TF/s':>5} "
            f"{'vs cuBLAS':>9}"
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


FIGURES = ("requests", "cublas_ms", "fp32_ms", "bf16_ms", "fp32_vs_cublas", "bf16_vs_cublas",
           "triton_fp32_ms", "keep_half_ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--hidden", type=int, default=2816)
    parser.add_argument("--out", default=None, help="JSON results elsewhere (default: the record, "
                        "bench/results/soft_embedding-<card>.json)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    with record.Record("soft_embedding", args.out) as rec:
        start = time.perf_counter()
        results = []
        for requests in args.requests:
            results.append(run_size(requests, args.vocab, args.hidden))
            r = results[-1]
            print(f"[{time.perf_counter() - start:6.1f}s] requests={requests}: "
                  f"cuBLAS {r['cublas_ms']:.3f} ms, "
                  f"fp32 {r['fp32_ms']:.3f} ms ({r['fp32_vs_cublas']:.0%}), bf16 {r['bf16_ms']:.3f} ms "
                  f"({r['bf16_vs_cublas']:.0%}), rel err vs cuBLAS {r['rel_err_vs_cublas']:.1e}, "
                  f"tuning {r['tune_s']} s; Triton kernel fp32 {r['triton_fp32_ms']:.3f} ms "
                  f"({r['triton_fp32_vs_cublas']:.0%}) bf16 {r['triton_bf16_ms']:.3f} ms, wgmma "
                  f"{r['uses_wgmma']}, max |wgmma - triton| {r['max_abs_diff_vs_triton_kernel']:.1e}",
                  flush=True)
        print()
        print_table(results)
        rec.meta.update(total_s=round(time.perf_counter() - start, 1), vocab=args.vocab, hidden=args.hidden)
        rec.save({"results": results}, [record.pick(r, FIGURES) for r in results])


if __name__ == "__main__":
    main()
