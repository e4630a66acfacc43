"""Row-statistics kernel benchmark: effective logits bandwidth against a device copy.

    python bench/bench_row_stats.py                 # 1 / 4 / 16 / 32 requests, about 3 minutes
    python bench/bench_row_stats.py --quick         # 32 requests only
    python bench/bench_row_stats.py --out /tmp/row_stats.json   # outside the bench of record

Times ``kernels.row_stats.row_stats_rows`` (sampling on) at 1/4/16/32 requests x 256 canvas
positions x 262144 vocabulary, fp32 and bf16 logits, with and without top-k/top-p, with
``triton.testing.do_bench`` (CUDA events, median; it flushes L2 before every call, and the
inputs rotate over two buffers on top). Reported per case:

* effective TB/s = logits bytes / time (each logit is read once by the ideal pass);
* ratio to the device-to-device copy bandwidth measured in the same run (read + write bytes
  per second of ``dst.copy_(src)`` on 4 GiB);
* ratio to the PyTorch backend (``reference.row_stats_rows``, only at 1 and 4 requests:
  it is slow and holds several fp32 copies of a 64-row chunk);
* with top-k/top-p at 1 and 32 requests, the time of each kernel it launches (profiler).

Two kinds of logits: ``lm`` (a normal bulk of sd 3, 32 plausible tokens raised by 5..15
and a head raised by 10..20 per row; temperatures 0.4..0.8 as the DiffusionGemma schedule)
and ``flat`` (the normal bulk alone, at 32 requests only: the worst case for sampling, where
no vocabulary block can be ruled out). ``greedy`` rows (T = 0) show the cost of the pass
without noise. Targets: the plain pass at the copy bandwidth (1.0x), top-k/top-p within 1.5x
of it. The result goes to the bench of record (``bench/record.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record  # noqa: E402

from dgemma_sampler import reference  # noqa: E402
from dgemma_sampler.kernels import row_stats as rs  # noqa: E402

WIDTH, VOCAB = 256, 262144
FIGURES = ("dtype", "requests", "data", "mode", "ms", "tbps", "vs_copy", "speedup_vs_torch")


def make_logits(n_req: int, dtype: torch.dtype, kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n_rows = n_req * WIDTH
    x = torch.empty(n_rows, VOCAB, device="cuda", dtype=dtype)
    for r0 in range(0, n_rows, 1024):  # build in fp32 slices to bound the temporary
        r1 = min(r0 + 1024, n_rows)
        part = torch.randn(r1 - r0, VOCAB, device="cuda", generator=gen) * 3.0
        if kind == "lm":
            rows = torch.arange(r1 - r0, device="cuda").unsqueeze(1)
            plausible = torch.randint(0, VOCAB, (r1 - r0, 32), device="cuda", generator=gen)
            part[rows, plausible] += torch.rand(r1 - r0, 32, device="cuda", generator=gen) * 10 + 5
            head = torch.randint(0, VOCAB, (r1 - r0, 1), device="cuda", generator=gen)
            part[rows, head] += torch.rand(r1 - r0, 1, device="cuda", generator=gen) * 10 + 10
        x[r0:r1] = part.to(dtype)
    return x


def request_params(n_req: int, greedy: bool = False):
    temperature = torch.linspace(0.4, 0.8, n_req, device="cuda")
    if greedy:
        temperature.zero_()
    seeds = torch.arange(n_req, device="cuda", dtype=torch.int64) * 7919 - 3
    draws = torch.full((n_req,), 5, device="cuda", dtype=torch.int64)
    row_request = torch.arange(n_req, device="cuda", dtype=torch.int32).repeat_interleave(WIDTH)
    row_position = torch.arange(WIDTH, device="cuda", dtype=torch.int32).repeat(n_req)
    return temperature, seeds, draws, row_request, row_position


def top_k_top_p(n_req: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-request filters every top-k/top-p case of this benchmark times: top-k 50 and
    top-p 0.9."""
    top_k = torch.full((n_req,), 50, device="cuda", dtype=torch.int64)
    return top_k, torch.full((n_req,), 0.9, device="cuda")


def bench_ms(fn, bufs) -> float:
    state = {"i": 0}

    def step():
        state["i"] += 1
        fn(bufs[state["i"] % len(bufs)])

    return float(triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median"))


def kernel_ms(fn, bufs, reps: int = 10) -> dict[str, float]:
    """Mean device time per call of each kernel ``fn`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn(bufs[0])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            fn(bufs[i % len(bufs)])
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        total = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if total > 0:
            out[ev.key] = total / reps / 1e3
    return out


def copy_tbps() -> float:
    n = 4 * 2**30 // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * n * 4 / (ms * 1e-3) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None,
                    help="JSON results elsewhere (default: the record, bench/results/row_stats-<card>.json)")
    ap.add_argument("--quick", action="store_true", help="32 requests only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    with record.Record("row_stats", args.out) as rec:
        run([32] if args.quick else [1, 4, 16, 32], rec)


def run(sizes: list[int], rec: record.Record) -> None:
    t_start = time.time()
    results: list[dict] = []
    copy = copy_tbps()
    print(f"device-to-device copy: {copy:.2f} TB/s (read + write)", flush=True)
    for dtype in (torch.float32, torch.bfloat16):
        dname = str(dtype).replace("torch.", "")
        for n_req in sizes:
            for kind in ["lm", "flat"] if n_req == 32 else ["lm"]:
                bufs = [make_logits(n_req, dtype, kind, seed) for seed in (1, 2)]
                nbytes = bufs[0].numel() * bufs[0].element_size()
                temperature, seeds, draws, row_request, row_position = request_params(n_req)
                top_k, top_p = top_k_top_p(n_req)
                modes = {"sample": (temperature, {}),
                         "sample+topk/topp": (temperature, dict(top_k=top_k, top_p=top_p))}
                if kind == "lm" and n_req == 32:
                    modes["greedy"] = (torch.zeros_like(temperature), {})
                for mode, (t, kw) in modes.items():
                    def run_kernel(x, kw=kw, t=t):
                        return rs.row_stats_rows(x, row_request, row_position, t, seeds, draws, **kw)

                    ms = bench_ms(run_kernel, bufs)
                    rec_row = dict(dtype=dname, requests=n_req, data=kind, mode=mode, ms=ms,
                                   tbps=nbytes / (ms * 1e-3) / 1e12)
                    rec_row["vs_copy"] = rec_row["tbps"] / copy
                    if n_req <= 4 and mode != "greedy":
                        def ref(x, kw=kw, t=t):
                            return reference.row_stats_rows(x, row_request, row_position, t, seeds,
                                                            draws, **kw)
                        rec_row["torch_ms"] = bench_ms(ref, bufs)
                        rec_row["speedup_vs_torch"] = rec_row["torch_ms"] / ms
                    if n_req in (1, 32) and kind == "lm" and mode == "sample+topk/topp":
                        rec_row["kernels_ms"] = kernel_ms(run_kernel, bufs)
                        print("  per kernel: " + ", ".join(f"{k[:40]} {v:.3f} ms" for k, v in
                                                           rec_row["kernels_ms"].items()), flush=True)
                    results.append(rec_row)
                    print(f"{dname:9s} req={n_req:2d} {kind:4s} {mode:17s} {ms:8.3f} ms "
                          f"{rec_row['tbps']:5.2f} TB/s ({rec_row['vs_copy']:.2f} x copy)"
                          + (f"  torch {rec_row['torch_ms']:.2f} ms ({rec_row['speedup_vs_torch']:.1f}x)"
                             if "torch_ms" in rec_row else ""), flush=True)
                del bufs
                torch.cuda.empty_cache()

    rec.meta.update(copy_tbps=copy, wall_s=round(time.time() - t_start, 1), default_config={
        str(d): rs.default_config(torch.empty(0, dtype=d)) for d in (torch.float32, torch.bfloat16)})
    m = rec.meta
    print(f"\n{m['card']}  torch {m['torch']}  triton {m['triton']}  copy {copy:.2f} TB/s  "
          f"({m['wall_s']:.0f} s)")
    print(f"{'dtype':9s} {'req':>3s} {'data':4s} {'mode':17s} {'ms':>8s} {'TB/s':>5s} {'xcopy':>5s} "
          f"{'xtorch':>6s}")
    for r in results:
        print(f"{r['dtype']:9s} {r['requests']:3d} {r['data']:4s} {r['mode']:17s} {r['ms']:8.3f} "
              f"{r['tbps']:5.2f} {r['vs_copy']:5.2f} {r.get('speedup_vs_torch', float('nan')):6.1f}")
    rec.save({"results": results}, [record.pick(r, FIGURES) for r in results])


if __name__ == "__main__":
    main()
