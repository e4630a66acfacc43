"""Row-statistics kernel benchmark: effective logits bandwidth against a device copy.

    python bench/bench_row_stats.py [--out bench/results/bench_row_stats.json] [--quick]
    python bench/bench_row_stats.py --alternate 3     # only the top-k/top-p ratio, 3 rounds
    python bench/bench_row_stats.py --few-rows        # walk and TMA depth at 1..32 requests
    python bench/bench_row_stats.py --few-rows --parts  # the split walk at 1..32 requests

Times ``kernels.row_stats.row_stats_rows`` (sampling on) at 1/4/16/32 requests x 256 canvas
positions x 262144 vocabulary, fp32 and bf16 logits, with and without top-k/top-p, with
``triton.testing.do_bench`` (CUDA events, median; it flushes L2 before every call, and the
inputs rotate over two buffers on top). Reported per case:

* effective TB/s = logits bytes / time (each logit is read once by the ideal pass);
* ratio to the device-to-device copy bandwidth measured in the same run (read + write bytes
  per second of ``dst.copy_(src)`` on 4 GiB);
* ratio to the PyTorch backend (``reference.row_stats_rows``, only at 1 and 4 requests:
  it is slow and holds several fp32 copies of a 64-row chunk).

Two kinds of logits: ``lm`` (a normal bulk of sd 3, 32 plausible tokens raised by 5..15
and a head raised by 10..20 per row; temperatures 0.4..0.8 as the DiffusionGemma schedule)
and ``flat`` (the normal bulk alone, at 32 requests only: the worst case for sampling, where
no vocabulary block can be ruled out). ``greedy`` rows (T = 0) show the cost of the pass
without noise. A config sweep at 32 requests (``lm`` data; greedy and sampling; ``--full-sweep``
for more configs, ``--no-sweep`` to skip it) prints the best launch configuration of the
stats pass (and, with ``--threshold-sweep``, of the top-k/top-p search; ``--threshold-only``
runs just the 1- and 32-request ``lm`` cases, plain and with top-k/top-p, and the sweep of
the search's own knobs, ``SEARCH_SWEEP``). Fresh machines compile every
variant (the top-k/top-p search kernel takes ~25 s per variant; ``--threshold-only``
compiles its variants first in parallel processes); the default run is meant to stay near 3
minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone

import torch
import triton
import triton.testing


from dgemma_sampler import reference  # noqa: E402
from dgemma_sampler.kernels import row_stats as rs  # noqa: E402

WIDTH, VOCAB = 256, 262144
SWEEP = [  # stats pass launch configs (keys of row_stats.default_config), merged into the default
    # tma: whole groups through a TMA descriptor, tma_stages deep (16-bit default on Hopper);
    # tma=False: the register-prefetch walk (group blocks per max check, prefetch groups ahead)
    dict(tma=False),
    dict(tma=False, group=4, prefetch=2),
] + [dict(tma=True, tma_stages=s) for s in (3, 4, 6)] + [dict(tma=True, group=2)]
FULL_SWEEP = SWEEP + [
    dict(block=512, num_warps=2, group=1, prefetch=0, num_stages=4),
    dict(block=1024, num_warps=4, group=1, prefetch=2, num_stages=1),
    dict(block=256, num_warps=1, group=4, prefetch=2, num_stages=1, maxnreg=96),
]
THRESHOLD_SWEEP = [  # top-k / top-p scan and search (each search variant compiles ~25 s)
    dict(cap=256, num_warps=4, group=4), dict(cap=256, num_warps=4, group=8),
    dict(cap=256, num_warps=2, group=4), dict(cap=128, num_warps=4, group=4),
]
# --threshold-only: the search's warps per row and programs per SM, the sampling blocks its
# candidate statistics weigh at once, and its candidate buffer; at 1 request the first two
SEARCH_SWEEP = [dict(), dict(num_warps=4, programs_per_sm=5), dict(stats_blocks=32),
                dict(stats_blocks=8), dict(num_warps=4, programs_per_sm=5, stats_blocks=8),
                dict(cap=256), dict(programs_per_sm=8)]
SEARCH_SWEEP_1REQ = SEARCH_SWEEP[:2]
# --few-rows: launch configs of the stats pass from 1 request (256 rows, 2 one-warp programs
# per SM) to 32: the register walk against the descriptor walk at several depths (groups in
# flight in shared memory)
FEW_ROWS_REQUESTS = (1, 2, 4, 8, 16, 32)
FEW_ROWS_SWEEP = [dict(tma=False)] + [dict(tma=True, tma_stages=s) for s in (2, 3, 4, 6)]
# --few-rows --parts: the split walk, 32 / 16 / 8 / 4 sampling blocks per part (2 / 4 / 8 / 16
# programs per row of 262144), with the descriptor walk and, at 8, the register walk.
PARTS_SWEEP = [dict(part_blocks=b) for b in (32, 16, 8, 4)] + [dict(part_blocks=8, tma=False)]


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


def _precompile_one(case) -> str:
    """Worker of ``precompile``: one top-k/top-p call on a few rows of the real width."""
    dtype_name, n_rows, tcfg = case
    dtype = getattr(torch, dtype_name)
    n_req = -(-n_rows // WIDTH)
    x = torch.randn(n_rows, VOCAB, device="cuda").to(dtype)
    temperature, seeds, draws, row_request, row_position = request_params(n_req)
    row_request = row_request[:n_rows].contiguous()
    row_position = row_position[:n_rows].contiguous()
    top_k, top_p = top_k_top_p(n_req)
    rs.row_stats_rows(x, row_request, row_position, temperature, seeds, draws, top_k=top_k,
                      top_p=top_p, config=dict(threshold=tcfg))
    torch.cuda.synchronize()
    return f"{dtype_name} {n_rows} rows {tcfg}"


def precompile(cases) -> None:
    """Compile the top-k/top-p variants in parallel processes before timing anything.

    Each search variant takes ~25 s to compile, mostly ptxas, one after another in a single
    process; the processes share Triton's on-disk cache, so the timed runs find them built.
    ``cases``: (dtype name, rows, threshold config); the rows (a multiple of 16, like the
    timed shapes, so the integer specialisations match) decide the "auto" register cap.
    """
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.time()
    workers = max(1, min(len(cases), (os.cpu_count() or 2) - 1))
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        for done in pool.map(_precompile_one, cases):
            print(f"  compiled {done}", flush=True)
    print(f"precompiled {len(cases)} variants in {time.time() - t0:.0f} s", flush=True)


def copy_tbps() -> float:
    n = 4 * 2**30 // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    del src, dst
    return 2 * n * 4 / (ms * 1e-3) / 1e12


def compiled_kernels(fn) -> list:
    """The compiled variants of the ``@triton.jit`` function ``fn`` in this process (best
    effort: the cache layout differs between Triton versions)."""
    found = []
    for cache in (getattr(fn, "device_caches", None) or {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        found.extend(getattr(kernels, "values", lambda: [])())
    return found


def run_meta(**extra) -> dict:
    """The ``meta`` of a results file: device, versions, date and command line of this run."""
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, python=platform.python_version(),
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                command=" ".join(sys.argv), **extra)


def kernel_resources() -> list[dict]:
    """n_regs / n_spills of every compiled row-stats and threshold kernel (best effort)."""
    from dgemma_sampler.kernels import topk_topp

    out = []
    for name, fn in (("row_stats", rs._row_stats_kernel), ("topk_topp scan", topk_topp._scan_kernel),
                     ("topk_topp search", topk_topp._search_kernel)):
        for kern in compiled_kernels(fn):
            try:
                kern._init_handles()
                consts = getattr(getattr(kern, "src", None), "constants", {}) or {}
                out.append(dict(kernel=name, n_regs=getattr(kern, "n_regs", None),
                                n_spills=getattr(kern, "n_spills", None),
                                num_warps=getattr(kern.metadata, "num_warps", None),
                                shared=getattr(kern.metadata, "shared", None),
                                constants={str(k): str(v) for k, v in consts.items()}))
            except Exception as exc:  # the cache layout differs between Triton versions
                out.append(dict(kernel=name, error=repr(exc)))
    return out


def alternate_rounds(rounds: int) -> None:
    """The top-k/top-p ratio against the plain pass, timed in alternation so that drift of
    the machine during the run affects both sides alike (32 requests, lm logits, sampling,
    top-k 50 / top-p 0.9; bf16 then fp32)."""
    temperature, seeds, draws, row_request, row_position = request_params(32)
    top_k, top_p = top_k_top_p(32)
    cases = {"plain": dict(), "top-k/top-p": dict(top_k=top_k, top_p=top_p),
             "top-k/top-p cap 256": dict(top_k=top_k, top_p=top_p,
                                         config=dict(threshold=dict(cap=256)))}
    for dtype in (torch.bfloat16, torch.float32):
        bufs = [make_logits(32, dtype, "lm", seed) for seed in (1, 2)]
        for i in range(rounds):
            ms = {name: bench_ms(lambda x, kw=kw: rs.row_stats_rows(
                x, row_request, row_position, temperature, seeds, draws, **kw), bufs)
                for name, kw in cases.items()}
            print(f"{str(dtype).replace('torch.', ''):9s} round {i}: " + "  ".join(
                f"{name} {v:.3f} ms ({v / ms['plain']:.3f}x)" for name, v in ms.items()),
                flush=True)
        del bufs
        torch.cuda.empty_cache()


HOST_VOCAB = 8192


def host_us(fns: dict, rounds: int = 15, calls: int = 40) -> dict[str, float]:
    """Median over ``rounds`` of the mean wall time of ``calls`` calls of each ``fns[name]()``
    (microseconds), the functions taking turns every round so that drift of the host during
    the run (it is large on the device machine) affects them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(10):
            fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def few_rows_sweep(out_path: str, kernel: bool = True, sweep=None) -> None:
    """Kernel time of the stats pass (sampling, ``lm`` logits) for each ``sweep`` config
    (default ``FEW_ROWS_SWEEP``) at ``FEW_ROWS_REQUESTS``, next to the default config of the
    same run. Kernel time (torch.profiler), not ``do_bench``: at 1 request the Python launch
    takes about as long as the kernel (``kernel=False`` skips this part); ``all kernels`` adds
    what else a call launches (the split walk's zeroed scratch). Then the host time of one
    call: the default, the register walk and the sweep's configs."""
    sweep = FEW_ROWS_SWEEP if sweep is None else sweep
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        dname = str(dtype).replace("torch.", "")
        for n_req in FEW_ROWS_REQUESTS if kernel else ():
            bufs = [make_logits(n_req, dtype, "lm", seed) for seed in (1, 2)]
            nbytes = bufs[0].numel() * bufs[0].element_size()
            temperature, seeds, draws, row_request, row_position = request_params(n_req)
            for cfg in [None] + sweep:
                def run(x, cfg=cfg):
                    return rs.row_stats_rows(x, row_request, row_position, temperature, seeds,
                                             draws, config=cfg)

                times = kernel_ms(run, bufs, reps=20)
                ms = times.get("_row_stats_kernel", float("nan"))
                all_ms = sum(times.values())
                rec = dict(dtype=dname, requests=n_req, config=cfg or "default", kernel_ms=ms,
                           all_kernels_ms=all_ms, tbps=nbytes / (ms * 1e-3) / 1e12)
                results.append(rec)
                print(f"{dname:9s} req={n_req:2d} {str(cfg or 'default'):50s} {ms:7.3f} ms "
                      f"{rec['tbps']:5.2f} TB/s (all kernels {all_ms:7.3f} ms)", flush=True)
            del bufs
            torch.cuda.empty_cache()
        # Host time of one call (Python, the descriptor, the launch): 1 request of a short
        # vocabulary, so that the GPU never holds the loop back.
        x = make_logits(1, dtype, "lm", 3)[:, :HOST_VOCAB].contiguous()
        temperature, seeds, draws, row_request, row_position = request_params(1)
        configs = {"register walk": dict(tma=False), "default": None}
        if any("part_blocks" in cfg for cfg in sweep):
            configs["split, 2 parts"] = dict(part_blocks=1)  # HOST_VOCAB: 2 sampling blocks
        us = host_us({name: (lambda cfg=cfg: rs.row_stats_rows(
            x, row_request, row_position, temperature, seeds, draws, config=cfg))
            for name, cfg in configs.items()})
        for name, cfg in configs.items():
            gpu_ms = sum(kernel_ms(lambda b, cfg=cfg: rs.row_stats_rows(
                b, row_request, row_position, temperature, seeds, draws, config=cfg),
                [x], reps=20).values())
            results.append(dict(dtype=dname, requests=1, vocab=HOST_VOCAB,
                                config=cfg or "default", host_us=us[name], kernel_us=gpu_ms * 1e3))
            print(f"{dname:9s} host time per call, vocab {HOST_VOCAB}, {name:14s} "
                  f"{us[name]:6.1f} us (kernel {gpu_ms * 1e3:5.1f} us)", flush=True)
    with open(out_path, "w") as f:
        json.dump(dict(meta=run_meta(), results=results), f, indent=1)
    print(f"wrote {out_path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "bench_row_stats.json"))
    ap.add_argument("--quick", action="store_true", help="32 requests only, no sweep")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--full-sweep", action="store_true", help="more launch configs (slower)")
    ap.add_argument("--threshold-sweep", action="store_true",
                    help="also top-k/top-p search configs at 32 requests (~25 s compile each)")
    ap.add_argument("--threshold-only", action="store_true",
                    help="only 1 and 32 requests of lm logits, plain and top-k/top-p, and the "
                         "search sweep")
    ap.add_argument("--alternate", type=int, default=0, metavar="ROUNDS",
                    help="only the top-k/top-p ratio: ROUNDS rounds of plain, default search and "
                         "a 256-entry candidate buffer, one after another (32 requests, lm)")
    ap.add_argument("--few-rows", action="store_true",
                    help="only the launch-config sweep of the stats pass at 1-32 requests "
                         "(FEW_ROWS_SWEEP), kernel time from the profiler, and the host time "
                         "of one call")
    ap.add_argument("--parts", action="store_true",
                    help="with --few-rows: sweep the split walk (PARTS_SWEEP) instead")
    ap.add_argument("--host-only", action="store_true",
                    help="with --few-rows: only the host time of one call")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    if args.few_rows:
        few_rows_sweep(args.out, kernel=not args.host_only,
                       sweep=PARTS_SWEEP if args.parts else None)
        return
    if args.alternate:
        alternate_rounds(args.alternate)
        return
    t_start = time.time()
    results: list[dict] = []
    copy = copy_tbps()
    print(f"device-to-device copy: {copy:.2f} TB/s (read + write)", flush=True)
    sizes = [32] if args.quick else [1, 32] if args.threshold_only else [1, 4, 16, 32]
    if args.threshold_only:
        # 1040 rows pick the capped search ("auto") like 32 requests, 256 rows the uncapped one
        precompile([(d, rows, cfg) for d in ("float32", "bfloat16")
                    for rows, sweep in ((1040, SEARCH_SWEEP), (256, SEARCH_SWEEP_1REQ))
                    for cfg in sweep])

    for dtype in (torch.float32, torch.bfloat16):
        dname = str(dtype).replace("torch.", "")
        for n_req in sizes:
            kinds = ["lm", "flat"] if n_req == 32 and not args.threshold_only else ["lm"]
            for kind in kinds:
                bufs = [make_logits(n_req, dtype, kind, seed) for seed in (1, 2)]
                nbytes = bufs[0].numel() * bufs[0].element_size()
                temperature, seeds, draws, row_request, row_position = request_params(n_req)
                top_k, top_p = top_k_top_p(n_req)
                modes = {
                    "sample": dict(),
                    "sample+topk/topp": dict(top_k=top_k, top_p=top_p),
                }
                if kind == "lm" and n_req == 32 and not args.threshold_only:
                    modes["greedy"] = dict(greedy=True)
                for mode, extra in modes.items():
                    t = temperature if not extra.get("greedy") else torch.zeros_like(temperature)
                    kw = {k: v for k, v in extra.items() if k != "greedy"}

                    def run(x, kw=kw, t=t):
                        return rs.row_stats_rows(x, row_request, row_position, t, seeds, draws, **kw)

                    ms = bench_ms(run, bufs)
                    rec = dict(dtype=dname, requests=n_req, data=kind, mode=mode, ms=ms,
                               tbps=nbytes / (ms * 1e-3) / 1e12)
                    rec["vs_copy"] = rec["tbps"] / copy
                    if n_req <= 4 and mode != "greedy" and not args.threshold_only:
                        def ref(x, kw=kw, t=t):
                            return reference.row_stats_rows(x, row_request, row_position, t, seeds,
                                                            draws, **kw)
                        ref_ms = bench_ms(ref, bufs)
                        rec["torch_ms"] = ref_ms
                        rec["speedup_vs_torch"] = ref_ms / ms
                    if n_req in (1, 32) and kind == "lm" and mode == "sample+topk/topp":
                        rec["kernels_ms"] = kernel_ms(run, bufs)
                        print("  per kernel: " + ", ".join(f"{k[:40]} {v:.3f} ms" for k, v in
                                                           rec["kernels_ms"].items()), flush=True)
                    results.append(rec)
                    print(f"{dname:9s} req={n_req:2d} {kind:4s} {mode:17s} {ms:8.3f} ms "
                          f"{rec['tbps']:5.2f} TB/s ({rec['vs_copy']:.2f} x copy)"
                          + (f"  torch {rec['torch_ms']:.2f} ms ({rec['speedup_vs_torch']:.1f}x)"
                             if "torch_ms" in rec else ""), flush=True)
                stats_sweep = n_req == 32 and kind == "lm" and not (
                    args.quick or args.no_sweep or args.threshold_only)
                if stats_sweep:
                    greedy_t = torch.zeros_like(temperature)
                    for cfg in (FULL_SWEEP if args.full_sweep else SWEEP):
                        for mode, t in (("sweep", temperature), ("sweep greedy", greedy_t)):
                            def run(x, cfg=cfg, t=t):
                                return rs.row_stats_rows(x, row_request, row_position, t,
                                                         seeds, draws, config=cfg)

                            ms = bench_ms(run, bufs)
                            rec = dict(dtype=dname, requests=n_req, data=kind, mode=mode, config=cfg,
                                       ms=ms, tbps=nbytes / (ms * 1e-3) / 1e12)
                            rec["vs_copy"] = rec["tbps"] / copy
                            results.append(rec)
                            print(f"  {mode} {cfg}: {ms:.3f} ms {rec['tbps']:.2f} TB/s", flush=True)
                if args.threshold_only:
                    threshold_sweep = SEARCH_SWEEP if n_req == 32 else SEARCH_SWEEP_1REQ
                elif stats_sweep and args.threshold_sweep:
                    threshold_sweep = THRESHOLD_SWEEP if dtype == torch.float32 else THRESHOLD_SWEEP[:1]
                else:
                    threshold_sweep = []
                for tcfg in threshold_sweep:
                    def run(x, tcfg=tcfg):
                        return rs.row_stats_rows(x, row_request, row_position, temperature,
                                                 seeds, draws, top_k=top_k, top_p=top_p,
                                                 config=dict(threshold=tcfg))

                    ms = bench_ms(run, bufs)
                    rec = dict(dtype=dname, requests=n_req, data=kind, mode="sweep topk/topp",
                               config=tcfg, ms=ms, tbps=nbytes / (ms * 1e-3) / 1e12)
                    results.append(rec)
                    print(f"  sweep top-k/top-p {tcfg}: {ms:.3f} ms {rec['tbps']:.2f} TB/s",
                          flush=True)
                if stats_sweep:
                    unfiltered = bench_ms(lambda x: rs.row_stats_rows(
                        x, row_request, row_position, temperature, seeds, draws,
                        noise_filter=False), bufs)
                    results.append(dict(dtype=dname, requests=n_req, data=kind,
                                        mode="no hash filter", ms=unfiltered,
                                        tbps=nbytes / (unfiltered * 1e-3) / 1e12))
                    print(f"  without the hash filter: {unfiltered:.3f} ms", flush=True)
                del bufs
                torch.cuda.empty_cache()

    resources = kernel_resources()
    meta = run_meta(copy_tbps=copy, default_config={
        d: rs.default_config(torch.empty(0, dtype=d)) for d in (torch.float32, torch.bfloat16)},
        wall_s=time.time() - t_start)
    meta["default_config"] = {str(k): v for k, v in meta["default_config"].items()}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, results=results, kernels=resources), f, indent=1)

    print(f"\n{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  "
          f"copy {copy:.2f} TB/s  ({meta['wall_s']:.0f} s)")
    print(f"{'dtype':9s} {'req':>3s} {'data':4s} {'mode':17s} {'ms':>8s} {'TB/s':>5s} {'xcopy':>5s} {'xtorch':>6s}")
    for r in results:
        if r["mode"].startswith("sweep"):
            continue
        print(f"{r['dtype']:9s} {r['requests']:3d} {r['data']:4s} {r['mode']:17s} {r['ms']:8.3f} "
              f"{r['tbps']:5.2f} {r.get('vs_copy', float('nan')):5.2f} "
              f"{r.get('speedup_vs_torch', float('nan')):6.1f}")
    for mode in ("sweep", "sweep greedy", "sweep topk/topp"):
        sweeps = [r for r in results if r["mode"] == mode]
        for d in sorted({r["dtype"] for r in sweeps}):
            best = min((r for r in sweeps if r["dtype"] == d), key=lambda r: r["ms"])
            print(f"best {mode} config {d}: {best['config']} {best['ms']:.3f} ms {best['tbps']:.2f} TB/s")
    for k in resources:
        print(f"{k['kernel']}: n_regs={k.get('n_regs')} n_spills={k.get('n_spills')} "
              f"num_warps={k.get('num_warps')} shared={k.get('shared')} {k.get('error', '')}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
