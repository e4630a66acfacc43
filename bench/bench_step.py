"""Whole decode step benchmark: the main job of dgemma-sampler.

For each number of decoding requests it times one full decode step of ``DiffusionSampler``
(statistics, acceptance, convergence bookkeeping and the self-conditioning soft embedding)
and the reference paths measured in the same run:

* ``materialized`` — the all-PyTorch fp32 step, eager (``bench/baselines.py``);
* ``compiled`` — the same under ``torch.compile`` (GPU only; slow to build on a CPU);
* ``floor`` (GPU) — one read of the logits at the measured copy bandwidth plus the cuBLAS
  bf16 GEMM ``[rows, V] @ [V, H]``, the least any step can cost;
* ``vllm033`` (with ``--vllm-kernels FILE``) — what a vLLM 0.33 user runs on the same logits:
  vLLM's own row-statistics kernel (the module ``tools/fetch_vllm_kernels.sh`` makes) in vLLM's
  device path around it (``bench/vllm_paths.py``), and our step's ratio to it.

It reports median time, transient memory (peak allocated beyond inputs and persistent
state) and agreement of our step with the PyTorch reference backend on the same inputs.
Shapes: DiffusionGemma's (CL 256, V 262144, H 2816) on a GPU, scaled down on a CPU.

    python bench/bench_step.py                      # sized for the device found (GPU: real shape)
    python bench/bench_step.py --requests 1,4 --out /tmp/step.json
    bash tools/fetch_vllm_kernels.sh          # -> .vllm_kernels/diffusion_gemma_sampler.py
    python bench/bench_step.py --vllm-kernels .vllm_kernels/diffusion_gemma_sampler.py

By default the result goes to the bench of record (``bench/record.py``):
``bench/results/step-<card>.json/.log/.png`` and a line of ``bench/results/history.jsonl``
(on a CPU: a temporary folder, out of the record).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines  # noqa: E402
import record  # noqa: E402
import vllm_paths  # noqa: E402
import workloads  # noqa: E402

import dgemma_sampler as ds  # noqa: E402

GIB = 1024**3


def _time_once(fn, cuda: bool, lead: int = 0) -> float:
    """Milliseconds of one call of ``fn`` (CUDA events, then a synchronisation, on a GPU).

    ``lead`` > 0: the stream first spins that many GPU cycles (``torch.cuda._sleep``),
    queued before the start event, so the host gets that head start: the call is timed as in a
    server, where the model's forward pass still runs on the GPU when the sampler is called and
    the host work before the first kernel overlaps it. Host work longer than the lead, and any
    host synchronisation, still shows."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead:
            torch.cuda._sleep(lead)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


@functools.cache
def _sleep_cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles per millisecond on the current card, measured once."""
    probe = 1_000_000
    torch.cuda._sleep(probe)  # the first call loads the kernel
    return probe / statistics.median(_time_once(lambda: torch.cuda._sleep(probe), True)
                                     for _ in range(5))


def lead_cycles(ms: float, cuda: bool) -> int:
    """GPU cycles that ``torch.cuda._sleep`` spins for about ``ms`` milliseconds (0 without CUDA
    or for ``ms`` 0)."""
    if not cuda or ms <= 0:
        return 0
    return int(ms * _sleep_cycles_per_ms())


def device_timer(fn, warmup: int, reps: int, cuda: bool) -> float:
    """Median milliseconds of ``fn`` after warm-up (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    return statistics.median(_time_once(fn, cuda) for _ in range(reps))


def interleaved_timer(fns: dict, warmup: int, reps: int, cuda: bool, *, lead_ms: float = 0.0,
                      no_lead: frozenset = frozenset()) -> dict:
    """Median milliseconds of each of ``fns`` (name -> function), timed in turns.

    Each of ``reps`` rounds times every function once, in an order shuffled anew every round
    (seeded: a run repeats). A card's clock moves during a run (power limit, heat): timed one
    after the other, the last functions would see another clock than the first, and a ratio
    of two of them would carry the drift; in turns every function sees the whole run alike. At
    the power limit a call is also slowed by the heavy one before it, so a fixed cyclic order
    would give every function the same predecessor in every round; shuffled, none keeps one.
    ``lead_ms``: the host's head start of every call (``_time_once``) but those named in
    ``no_lead``."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    lead = lead_cycles(lead_ms, cuda)
    names = list(fns)
    times: dict = {name: [] for name in names}
    order = random.Random(0)
    for _ in range(reps):
        round_names = names[:]
        order.shuffle(round_names)
        for name in round_names:
            times[name].append(_time_once(fns[name], cuda, 0 if name in no_lead else lead))
    return {name: statistics.median(t) for name, t in times.items()}


def transient_bytes(fn, cuda: bool) -> float | None:
    """Peak bytes allocated by ``fn`` beyond what was allocated before it (CUDA only)."""
    if not cuda:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return float(torch.cuda.max_memory_allocated() - base)


def never_converging(canvas, *, softcap=None, tail_eps=None) -> ds.SamplerConfig:
    """A configuration under which no request converges: every timed step is a denoise step
    with its soft embedding. ``tail_eps`` None: the configuration's default."""
    extra = {} if tail_eps is None else {"tail_eps": tail_eps}
    return ds.SamplerConfig(canvas_length=canvas, confidence_threshold=0.0,
                            max_denoising_steps=1_000_000, softcap=softcap, **extra)


def make_sampler(n, canvas, vocab, hidden, embed, backend, device, tail_eps=None, softcap=None):
    """A sampler of ``n`` requests under ``never_converging``."""
    cfg = never_converging(canvas, softcap=softcap, tail_eps=tail_eps)
    state = ds.DiffusionState(n, cfg, vocab, hidden, device)
    for s in range(n):
        state.add_request(s, seed=1000 + s)
    sampler = ds.DiffusionSampler(cfg, state, embed, float(hidden) ** 0.5, backend=backend)
    sampler.prefill(list(range(n)))
    return sampler


def agreement(n, logits, canvas, vocab, hidden, embed, device, backend):
    """Ours vs the PyTorch reference backend from identical states and logits."""
    outs = []
    for b in (backend, "torch"):
        sampler = make_sampler(n, canvas, vocab, hidden, embed, b, device)
        out = sampler.step(logits, list(range(n)))
        outs.append((out.stats, sampler.state.self_conditioning_embeds[:n].clone()))
    (a, sa), (r, sr) = outs
    ent_err = ((a.entropy - r.entropy).abs() / r.entropy.abs().clamp(min=1e-6)).max().item()
    lse_err = ((a.lse - r.lse).abs() / r.lse.abs().clamp(min=1e-6)).max().item()
    soft_err = ((sa - sr).norm() / sr.norm().clamp(min=1e-30)).item()
    return {
        "argmax_equal": (a.argmax == r.argmax).float().mean().item(),
        "sample_equal": (a.sample == r.sample).float().mean().item(),
        "entropy_max_rel_err": ent_err,
        "lse_max_rel_err": lse_err,
        "soft_embedding_rel_err": soft_err,
    }


def measure_vllm033(logits, embed, normalizer, kernels, canvas, warmup, reps, cuda):
    """vLLM 0.33's own step over ``logits`` (``vllm_paths.v033_step``, vLLM's kernel from
    ``kernels``): time, transient memory and the requests per tile its budget gave."""
    if cuda:
        # vLLM sizes its tiles from the device's free memory: blocks the eager baseline left in
        # PyTorch's cache would shrink them and make the figure depend on what ran before.
        torch.cuda.empty_cache()
    step = vllm_paths.v033_step(logits, embed, kernels, canvas=canvas, normalizer=normalizer)
    # The first calls build the compiled pieces (torch.compile): one more warm-up than ours.
    ms = device_timer(step, warmup + 1, reps, cuda)
    return {"vllm033_ms": ms, "vllm033_transient_bytes": transient_bytes(step, cuda),
            "vllm033_tile_requests": step.tiles}


def measure_floor(rows, vocab, hidden, logits, embed, warmup, reps):
    """One read of the logits at copy bandwidth + cuBLAS bf16 GEMM of the step's shape."""
    src = torch.empty(256 * 1024**2 // 4, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy_ms = device_timer(lambda: dst.copy_(src), warmup, reps, True)
    copy_bw = 2 * src.numel() * 4 / (copy_ms * 1e-3)
    probs = torch.empty(rows, vocab, dtype=torch.bfloat16, device="cuda").normal_()
    gemm_ms = device_timer(lambda: probs @ embed, warmup, reps, True)
    read_ms = logits.numel() * logits.element_size() / copy_bw * 1e3
    return {"copy_TBps": copy_bw / 1e12, "gemm_ms": gemm_ms, "read_ms": read_ms,
            "floor_ms": read_ms + gemm_ms}


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", default="1,4,16,32" if cuda else "1,2,4")
    p.add_argument("--canvas", type=int, default=256 if cuda else 32)
    p.add_argument("--vocab", type=int, default=262144 if cuda else 4099)
    p.add_argument("--hidden", type=int, default=2816 if cuda else 96)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--workload", default="broad", choices=workloads.FAMILIES,
                   help="logits family (bench/workloads.py; broad = Gaussian rows)")
    p.add_argument("--reps", type=int, default=10 if cuda else 3)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--no-check", action="store_true", help="skip the agreement check")
    p.add_argument("--hidden-requests", type=int, default=128 if cuda else 8,
                   help="also time the hidden-state input path at this many requests (0: skip)")
    p.add_argument("--vllm-kernels", default=None, metavar="FILE",
                   help="vLLM's diffusion_gemma_sampler.py as tools/fetch_vllm_kernels.sh makes it: also "
                        "time vLLM 0.33's own device path on the same logits (GPU; on a CPU under "
                        "TRITON_INTERPRET=1)")
    p.add_argument("--out", default=None,
                   help="JSON results elsewhere (default: the record, bench/results/step-<card>.json)")
    p.add_argument("--plot", default=None, help="PNG plot (default next to the JSON)")
    args = p.parse_args(argv)
    if args.vllm_kernels and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--vllm-kernels runs vLLM's Triton kernel: a GPU, or TRITON_INTERPRET=1 on a CPU")
    with record.Record("step" if args.workload == "broad" else f"step-{args.workload}", args.out) as rec:
        return run(args, rec)


def run(args, rec) -> int:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    plot_path = args.plot or str(rec.path(".png"))
    dtype = getattr(torch, args.dtype)
    requests = [int(r) for r in args.requests.split(",")]
    backend = ds.ops.resolve_backend(args.backend, device)
    warmup = 2 if cuda else 1
    use_compile = cuda and not args.no_compile
    gen = torch.Generator(device=device).manual_seed(0)
    embed = (torch.randn(args.vocab, args.hidden, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    vllm_kernels = None
    if args.vllm_kernels:
        vllm_kernels = vllm_paths.load_kernels(args.vllm_kernels)
        rec.meta["vllm_kernels"] = {"file": args.vllm_kernels, "origin": vllm_kernels.origin,
                                    "sha256": vllm_kernels.sha256}

    results = []
    bar = tqdm(requests, desc="decode step", unit="size", file=sys.stderr)
    for n in bar:
        bar.set_postfix(requests=n)
        rows = n * args.canvas
        if args.workload == "broad":
            logits = (torch.randn(rows, args.vocab, device=device, generator=gen) * 3).to(dtype)
        else:
            logits, _ = workloads.make_logits(args.workload, n, args.canvas, args.vocab, 0.8, gen,
                                              device, dtype)
        temps = torch.full((rows,), 0.8, device=device)
        row = {"requests": n, "rows": rows}
        sampler = make_sampler(n, args.canvas, args.vocab, args.hidden, embed, backend, device)
        slots = list(range(n))
        ours = lambda: sampler.step(logits, slots)  # noqa: E731
        row["ours_ms"] = device_timer(ours, warmup, args.reps, cuda)
        row["ours_transient_bytes"] = transient_bytes(ours, cuda)
        norm = float(args.hidden) ** 0.5
        mat = lambda: baselines.materialized_step(logits, temps, embed, norm)  # noqa: E731
        row["materialized_ms"] = device_timer(mat, 1, max(3, args.reps // 2), cuda)
        row["materialized_transient_bytes"] = transient_bytes(mat, cuda)
        if use_compile:
            comp = lambda: baselines.compiled_step(logits, temps, embed, norm)  # noqa: E731
            row["compiled_ms"] = device_timer(comp, 2, max(3, args.reps // 2), cuda)
            row["compiled_transient_bytes"] = transient_bytes(comp, cuda)
        if vllm_kernels is not None:
            row.update(measure_vllm033(logits, embed, norm, vllm_kernels, args.canvas, warmup,
                                       args.reps, cuda))
            row["ours_over_vllm033"] = row["ours_ms"] / row["vllm033_ms"]
        if cuda:
            row.update(measure_floor(rows, args.vocab, args.hidden, logits, embed, 2, 10))
            row["ours_over_floor"] = row["ours_ms"] / row["floor_ms"]
        row["speedup_vs_materialized"] = row["materialized_ms"] / row["ours_ms"]
        if not args.no_check:
            row["agreement"] = agreement(n, logits, args.canvas, args.vocab, args.hidden, embed,
                                         device, backend)
        results.append(row)
        logits = sampler = None  # free before the next size
        if cuda:
            torch.cuda.empty_cache()

    hidden_row = None
    if args.hidden_requests:
        hidden_row = bench_hidden_input(args, embed, backend, device, cuda, warmup)

    shape = {"backend": backend, "canvas": args.canvas, "vocab": args.vocab, "hidden": args.hidden,
             "logits_dtype": args.dtype, "workload": args.workload}
    rec.meta.update(shape)
    meta = rec.meta
    plot(results, plot_path, meta)
    print_table(results, meta, plot_path)
    if hidden_row:
        mib = hidden_row["transient_bytes"]
        print(f"hidden-state input, {hidden_row['requests']} requests: {hidden_row['ms']:.2f} ms, "
              f"tile {hidden_row['tile_requests']} requests, transient "
              f"{'n/a' if mib is None else f'{mib / GIB:.2f} GiB'} (full-batch fp32 logits would be "
              f"{hidden_row['full_logits_bytes'] / GIB:.1f} GiB)")
    figures = [record.pick(r, FIGURES) for r in results]
    rec.save({"results": results, "hidden_input": hidden_row}, {**shape, "rows": figures})
    return 0


def bench_hidden_input(args, embed, backend, device, cuda, warmup):
    """Hidden states in, logits projected one tile at a time: time and transient memory."""
    n = args.hidden_requests
    rows = n * args.canvas
    gen = torch.Generator(device=device).manual_seed(1)
    hidden = torch.randn(rows, args.hidden, device=device, generator=gen).to(embed.dtype)
    sampler = make_sampler(n, args.canvas, args.vocab, args.hidden, embed, backend, device)
    slots = list(range(n))
    run = lambda: sampler.step(None, slots, hidden_states=hidden, output_weight=embed)  # noqa: E731
    ms = device_timer(run, 1, max(2, args.reps // 3), cuda)
    transient = transient_bytes(run, cuda)
    return {"requests": n, "rows": rows, "ms": ms, "transient_bytes": transient,
            "tile_requests": sampler.last_tile_requests, "full_logits_bytes": rows * args.vocab * 4}


FIGURES = ("requests", "ours_ms", "materialized_ms", "compiled_ms", "floor_ms", "vllm033_ms",
           "ours_over_vllm033", "ours_transient_bytes", "materialized_transient_bytes",
           "compiled_transient_bytes", "vllm033_transient_bytes", "vllm033_tile_requests")


def print_table(results, meta, plot_path):
    def mib(b):
        return "n/a" if b is None else f"{b / 2**20:.1f}"

    print(f"\n{meta['card']} | backend={meta['backend']} | CL={meta['canvas']} V={meta['vocab']} "
          f"H={meta['hidden']} logits={meta['logits_dtype']} | {meta['date']}")
    head = f"{'reqs':>5} {'ours ms':>9} {'mat. ms':>9} {'comp. ms':>9} {'floor ms':>9} {'x floor':>8} " \
           f"{'ours MiB':>9} {'mat. MiB':>9} {'argmax=':>8} {'sample=':>8} {'ent err':>8} {'soft err':>9}"
    # vLLM's own path, where it was timed: its time, our step's ratio to it, its memory.
    with_vllm = any("vllm033_ms" in r for r in results)
    if with_vllm:
        head += f" {'vLLM ms':>9} {'x vLLM':>7} {'vLLM MiB':>9}"
    print(head)
    for r in results:
        ag = r.get("agreement", {})
        line = (f"{r['requests']:>5} {r['ours_ms']:>9.2f} {r['materialized_ms']:>9.2f} "
                f"{r.get('compiled_ms', float('nan')):>9.2f} {r.get('floor_ms', float('nan')):>9.2f} "
                f"{r.get('ours_over_floor', float('nan')):>8.2f} {mib(r['ours_transient_bytes']):>9} "
                f"{mib(r['materialized_transient_bytes']):>9} {ag.get('argmax_equal', float('nan')):>8.4f} "
                f"{ag.get('sample_equal', float('nan')):>8.4f} "
                f"{ag.get('entropy_max_rel_err', float('nan')):>8.1e} "
                f"{ag.get('soft_embedding_rel_err', float('nan')):>9.1e}")
        if with_vllm:
            line += (f" {r.get('vllm033_ms', float('nan')):>9.2f} "
                     f"{r.get('ours_over_vllm033', float('nan')):>7.2f} "
                     f"{mib(r.get('vllm033_transient_bytes')):>9}")
        print(line)
    if with_vllm:
        tiles = ", ".join(f"{r['requests']}: {r['vllm033_tile_requests']}" for r in results
                          if "vllm033_tile_requests" in r)
        print(f"vLLM: 0.33's device path around vLLM's own row-statistics kernel (from "
              f"{meta['vllm_kernels']['origin']}; the same file in 0.31-0.34); x vLLM = ours / vLLM; "
              f"requests per tile by its budget: {tiles}")
    print(f"plot: {plot_path}")


def plot(results, path, meta):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["requests"] for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in [("ours_ms", "dgemma-sampler"), ("materialized_ms", "PyTorch fp32 eager"),
                       ("compiled_ms", "PyTorch fp32 compiled"), ("vllm033_ms", "vLLM 0.33's own path"),
                       ("floor_ms", "floor (read + GEMM)")]:
        if key in results[0]:
            ax1.plot(n, [r[key] for r in results], marker="o", label=label)
    ax1.set(xlabel="decoding requests", ylabel="ms per step", title="decode step time")
    ax1.legend()
    for key, label in [("ours_transient_bytes", "dgemma-sampler"),
                       ("materialized_transient_bytes", "PyTorch fp32 eager"),
                       ("compiled_transient_bytes", "PyTorch fp32 compiled"),
                       ("vllm033_transient_bytes", "vLLM 0.33's own path")]:
        vals = [r.get(key) for r in results]
        if all(v is not None for v in vals):
            ax2.plot(n, [v / 2**20 for v in vals], marker="o", label=label)
    ax2.set(xlabel="decoding requests", ylabel="MiB (log scale)", title="transient memory", yscale="log")
    if ax2.lines:
        ax2.legend()
    fig.suptitle(f"{meta['card']} — {meta['date'][:10]}, commit {meta['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
