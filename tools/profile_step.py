"""Where the time of one decode step goes: host work, launches and kernels.

Timing mode (CUDA only). For each number of requests this times ``DiffusionSampler.step``
three ways and prints a torch.profiler table of the host-side operators:

* ``events``  CUDA events around the eager step (what ``bench_step.py`` reports);
* ``wall``    host wall clock of the eager step, synchronised at both ends;
* ``graph``   replay of the step captured in a CUDA graph (``sampler.graphable``): kernel
              time with no host work at all, the floor of what the eager step could reach;
* ``host``    host time of one eager step started on an idle GPU and not waited for (launches
              are asynchronous, so this is the Python and launch cost alone), split into the
              row-statistics call, the soft-embedding call and the rest (planning, state update);
* ``kernels`` device time per step of the step's kernels (torch.profiler) by part: head GEMM,
              statistics, operand pass, support pass, soft-embedding GEMM, the rest
              (``KERNEL_PARTS``). Their sum against ``events`` is the time the GPU waits.

    python tools/profile_step.py --requests 1,32
    python tools/profile_step.py --requests 1,32 --hidden-states

``--hidden-states`` (both modes): the step from bf16 hidden states through the tied bf16 head
with DiffusionGemma's softcap (``DiffusionSampler.step(hidden_states=..., output_weight=E)``,
the path of the vLLM 0.34 adapter) instead of from fp32 logits. Batches whose logits fit a
whole-step graph (``step_graph.py``) replay it inside ``step``, so there the host phases are
those of the replay; the separate ``graph`` figure is not measured in this mode.

Count mode (``--count``, any device; on a CPU the Triton kernels run in the interpreter,
``TRITON_INTERPRET=1`` is set for you). It runs a few steps of the Triton backend at a small
shape and counts, per step, what the host does: aten operators dispatched (split into those
that launch work and the view/metadata ones), Triton kernel launches, host->device copies
(``Tensor.to``/``copy_``/``torch.tensor(device=...)`` from host memory; on CUDA also whether
the source was pinned: a pageable source makes ``cudaMemcpyAsync`` wait for the stream) and
device->host reads (``_local_scalar_dense``, ``.cpu()``, ``.tolist()``):

    python tools/profile_step.py --count                        # 4 requests x 32 x 4099, CPU
    python tools/profile_step.py --count --device cuda --requests 1,32 --canvas 256 --vocab 262144
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if "--count" in sys.argv and not torch.cuda.is_available():
    # Must be set before Triton is imported (dgemma_sampler's kernels import it lazily).
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_runner import SOFTCAP  # noqa: E402
from bench_step import device_timer, make_sampler  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


def host_phases(sampler, step, reps):
    """Median host milliseconds of ``step`` and of its row-statistics / soft-embedding calls,
    each step started on an idle device and not synchronised at its end."""
    spent = collections.Counter()

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper

    # The runner calls its backend's kernels through ``runner.kernels`` (``backend.Kernels``).
    runner = sampler.runner
    kernels = runner.kernels
    runner.kernels = dataclasses.replace(
        kernels, row_stats_rows=timed("stats", kernels.row_stats_rows),
        soft_embedding_rows=timed("soft", kernels.soft_embedding_rows))
    rows = []
    try:
        for _ in range(reps):
            torch.cuda.synchronize()
            spent.clear()
            t0 = time.perf_counter()
            step()
            total = time.perf_counter() - t0
            rows.append((total, spent["stats"], spent["soft"]))
    finally:
        runner.kernels = kernels
        torch.cuda.synchronize()
    total, stats, soft = (statistics.median(c) * 1e3 for c in zip(*rows))
    return {"host_ms": total, "host_stats_ms": stats, "host_soft_ms": soft,
            "host_rest_ms": total - stats - soft}


# The step's parts, by the exact names of our kernels (Triton and Gluon name a kernel after its
# function; a substring would also catch PyTorch's, e.g. ``_scatter_gather_elementwise_kernel``);
# every other kernel (PyTorch's elementwise and index kernels, copies) is "rest".
KERNEL_PARTS = {"head": {"head_gemm_kernel"},
                "statistics": {"_row_stats_kernel", "_scan_kernel", "_search_kernel"},
                "operand": {"operand_in_place_kernel"},
                "support": {"support_kernel", "kept_first_kernel", "gather_kernel"},
                "canvas update": {"_canvas_update_kernel", "_random_tokens_kernel"},
                "soft embedding": {"soft_embedding_kernel", "soft_embedding_wgmma_kernel",
                                   "split_sum_kernel"}}


def kernel_parts(kernels, steps: int) -> dict:
    """Device milliseconds per step of each part of ``KERNEL_PARTS`` and of the rest, from
    ``(name, total microseconds)`` pairs of the kernels of ``steps`` profiled steps."""
    parts = dict.fromkeys([*KERNEL_PARTS, "rest"], 0.0)
    for name, us in kernels:
        part = next((p for p, names in KERNEL_PARTS.items() if name in names), "rest")
        parts[part] += us / 1e3 / steps
    return parts


def _profiled_kernels(averages):
    """``(name, total device microseconds)`` of the device kernels among torch.profiler's
    ``key_averages()``."""
    return [(e.key, e.device_time_total) for e in averages
            if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]


def wall_ms(fn, reps):
    """Median host wall clock of ``fn``, the device synchronised at both ends."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ------------------------------------------------------------------------- count mode
def _is_view(func) -> bool:
    """Operators that only make a new view of existing storage (no kernel, no allocation)."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


_NO_LAUNCH = {"empty", "empty_strided", "lift_fresh", "_local_scalar_dense", "resize_", "set_"}


def _caller() -> str:
    """The innermost project file (``dgemma_sampler/...``) that issued the current operator."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename.replace(os.sep, "/")
        for root in ("/dgemma_sampler/", "/kernels/"):
            if root in path and "_python_dispatch" not in path:
                return root.strip("/") + "/" + path.rsplit(root, 1)[1]
        f = f.f_back
    return "?"


class _AtenCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.where = collections.Counter()  # launching ops by the project file that issued them
        self.views = 0
        self.reads = 0  # device -> host scalar reads (a sync on CUDA)
        self.paused = 0  # > 0 inside a Triton launch: the interpreter's own tensor copies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.reads += 1
        if _is_view(func):
            self.views += 1
        elif name not in _NO_LAUNCH:
            self.ops[name] += 1
            self.where[_caller()] += 1
        return func(*args, **(kwargs or {}))


def _names_device(args, kwargs) -> bool:
    if "device" in kwargs and kwargs["device"] is not None:
        return True
    return any(isinstance(a, (torch.device, str)) for a in args)


class _TransferCounter(TorchFunctionMode):
    """Host->device copies as the code writes them. On a CPU run the "device" is the CPU, so
    a copy counts when host data is sent to the step's device by name (``x.to(device)``,
    ``torch.tensor(data, device=...)``, ``dst.copy_(host)``): exactly the calls that are
    ``cudaMemcpyAsync`` host->device on a GPU."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.h2d = collections.Counter()
        self.d2h = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name == "to" and args and isinstance(args[0], torch.Tensor):
            src = args[0]
            if src.device.type == "cpu" and _names_device(args[1:], kwargs):
                self.h2d["pinned" if _pinned(src) else "pageable"] += 1
        elif name == "copy_" and len(args) >= 2:
            dst, src = args[0], args[1]
            if isinstance(src, torch.Tensor) and src.device.type == "cpu" \
                    and dst.device.type == self.device.type and self.device.type != "cpu":
                self.h2d["pinned" if _pinned(src) else "pageable"] += 1
        elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            self.h2d["pageable"] += 1
        elif name in ("cpu", "tolist", "item", "numpy"):
            self.d2h += 1
        return func(*args, **kwargs)


def _pinned(t: torch.Tensor) -> bool:
    return torch.cuda.is_available() and t.is_pinned()


class _TritonLaunches:
    """Counts kernel launches by wrapping ``run`` of compiled and interpreted Triton functions."""

    def __init__(self, aten: _AtenCounter):
        self.launches = collections.Counter()
        self.aten = aten
        self._saved = []

    def __enter__(self):
        from triton.runtime import interpreter, jit

        for cls in (jit.JITFunction, interpreter.InterpretedFunction):
            orig = cls.run

            def run(fn_self, *args, _orig=orig, **kwargs):
                if not kwargs.get("warmup", False):
                    self.launches[getattr(fn_self, "__name__", "?")] += 1
                self.aten.paused += 1
                try:
                    return _orig(fn_self, *args, **kwargs)
                finally:
                    self.aten.paused -= 1

            self._saved.append((cls, orig))
            cls.run = run
        return self

    def __exit__(self, *exc):
        for cls, orig in self._saved:
            cls.run = orig


def stepper(n, canvas, vocab, hidden, embed, backend, device, gen, hidden_states):
    """(sampler, step, input) for ``n`` requests: a step from fp32 logits (the input), or from
    bf16 hidden states (the input) through the tied head ``embed`` with DiffusionGemma's
    softcap."""
    slots = list(range(n))
    if hidden_states:
        sampler = make_sampler(n, canvas, vocab, hidden, embed, backend, device, softcap=SOFTCAP)
        h = torch.randn(n * canvas, hidden, device=device, generator=gen).to(embed.dtype)
        return sampler, lambda: sampler.step(None, slots, hidden_states=h, output_weight=embed), h
    sampler = make_sampler(n, canvas, vocab, hidden, embed, backend, device)
    logits = torch.randn(n * canvas, vocab, device=device, generator=gen) * 3
    return sampler, lambda: sampler.step(logits, slots), logits


def count_step(n, canvas, vocab, hidden, steps, device, backend, top, hidden_states=False):
    """Per-step host work of ``sampler.step`` (after one warm-up step)."""
    gen = torch.Generator(device=device).manual_seed(0)
    embed = (torch.randn(vocab, hidden, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    sampler, step, _ = stepper(n, canvas, vocab, hidden, embed, backend, device, gen, hidden_states)
    step()  # warm-up: compiles / rewrites the kernels
    aten, moves = _AtenCounter(), _TransferCounter(torch.device(device))
    with _TritonLaunches(aten) as triton_runs, moves, aten:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    # A step whose batch shape is new (no cached tile plan).
    sampler.runner.plans.clear()
    aten1, moves1 = _AtenCounter(), _TransferCounter(torch.device(device))
    with _TritonLaunches(aten1), moves1, aten1:
        step()
    per = lambda c: c / steps  # noqa: E731
    res = {
        "requests": n, "canvas": canvas, "vocab": vocab, "device": str(device), "backend": backend,
        "input": "hidden states" if hidden_states else "logits",
        "new_shape_aten_launching_ops": sum(aten1.ops.values()),
        "new_shape_h2d_copies": sum(moves1.h2d.values()),
        "new_shape_h2d_pageable": moves1.h2d["pageable"],
        "aten_launching_ops": per(sum(aten.ops.values())),
        "aten_view_ops": per(aten.views),
        "triton_launches": per(sum(triton_runs.launches.values())),
        "h2d_copies": per(sum(moves.h2d.values())),
        "h2d_pageable": per(moves.h2d["pageable"]),
        "host_reads": per(aten.reads + moves.d2h),
        "wall_ms_per_step": wall,
        "top_ops": {k: per(v) for k, v in aten.ops.most_common(top)},
        "ops_by_file": {k: per(v) for k, v in aten.where.most_common()},
        "triton_kernels": {k: per(v) for k, v in triton_runs.launches.items()},
    }
    return res


def count_main(args) -> None:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    for n in [int(r) for r in args.requests.split(",")]:
        results.append(count_step(n, args.canvas, args.vocab, args.hidden, args.steps, device,
                                  args.backend, args.rows, args.hidden_states))
    for r in results:
        print(f"\n== {r['requests']} requests x {r['canvas']} x {r['vocab']} on {r['device']} "
              f"({r['backend']} backend, from {r['input']}): top aten ops per step")
        for k, v in r["top_ops"].items():
            print(f"  {k:<28s} {v:6.1f}")
        print("  launching ops by file: " + ", ".join(f"{k} {v:.0f}" for k, v in r["ops_by_file"].items()))
        print("  triton kernels: " + ", ".join(f"{k} {v:.0f}" for k, v in r["triton_kernels"].items()))
    print("\nper step  requests  aten ops (launching)  views  triton  h2d (pageable)  host reads"
          "  | new batch shape: aten ops  h2d (pageable)")
    for r in results:
        print(f"{'':10s}{r['requests']:8d}  {r['aten_launching_ops']:20.1f}  {r['aten_view_ops']:5.0f}"
              f"  {r['triton_launches']:6.0f}  {r['h2d_copies']:4.0f} ({r['h2d_pageable']:.0f})"
              f"{'':8s}{r['host_reads']:4.0f}  | {r['new_shape_aten_launching_ops']:24d}"
              f"  {r['new_shape_h2d_copies']:4d} ({r['new_shape_h2d_pageable']})")
    write_json(args.out, results)


def write_json(path: str | None, results) -> None:
    """The results as JSON at ``path`` (a diagnosis, not the bench of record: nothing by default)."""
    if path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
        print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--count", action="store_true",
                   help="count per-step host work (aten ops, launches, copies) on any device")
    p.add_argument("--device", default=None, help="count mode: cpu or cuda (default: cuda if present)")
    p.add_argument("--backend", default="triton", help="count mode: triton or torch")
    p.add_argument("--steps", type=int, default=3, help="count mode: steps counted")
    p.add_argument("--requests", default=None, help="default 1,32 (timing) / 4 (count)")
    p.add_argument("--canvas", type=int, default=None, help="default 256 (timing) / 32 (count)")
    p.add_argument("--vocab", type=int, default=None, help="default 262144 (timing) / 4099 (count)")
    p.add_argument("--hidden", type=int, default=None, help="default 2816 (timing) / 64 (count)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rows", type=int, default=25, help="profiler table rows")
    p.add_argument("--cprofile", action="store_true",
                   help="timing mode: also print cProfile's top functions (cumulative) of the eager steps")
    p.add_argument("--hidden-states", action="store_true",
                   help="the step from bf16 hidden states through the tied head (softcap "
                        f"{SOFTCAP}) instead of from fp32 logits")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args()
    small = args.count
    for name, big, little in (("requests", "1,32", "4"), ("canvas", 256, 32), ("vocab", 262144, 4099),
                              ("hidden", 2816, 64)):
        if getattr(args, name) is None:
            setattr(args, name, little if small else big)
    if args.count:
        count_main(args)
        return
    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    embed = (torch.randn(args.vocab, args.hidden, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    for n in [int(r) for r in args.requests.split(",")]:
        sampler, step, source = stepper(n, args.canvas, args.vocab, args.hidden, embed, "auto",
                                        "cuda", gen, args.hidden_states)
        slots = list(range(n))
        for _ in range(3):
            step()
        ev = device_timer(step, 0, args.reps, True)
        wall = wall_ms(step, args.reps)
        host = host_phases(sampler, step, args.reps)
        graph_ms = float("nan")
        if not args.hidden_states:  # source: the step's logits
            run = sampler.graphable(slots)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                run(source)  # warm-up outside capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run(source)
            graph_ms = device_timer(graph.replay, 0, args.reps, True)
        print(f"\n== {n} requests: events {ev:.3f} ms  wall {wall:.3f} ms  graph replay {graph_ms:.3f} ms"
              f"  host {host['host_ms']:.3f} ms (row stats {host['host_stats_ms']:.3f}, soft embedding"
              f" {host['host_soft_ms']:.3f}, rest {host['host_rest_ms']:.3f})")
        results.append({"requests": n, "events_ms": ev, "wall_ms": wall, "graph_ms": graph_ms, **host})
        if args.cprofile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.reps):
                step()
            prof.disable()
            torch.cuda.synchronize()
            print(f"cProfile of {args.reps} eager steps, {n} requests (cumulative):")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(args.rows * 2)
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.rows)
            pstats.Stats(prof).sort_stats("cumulative").print_callees("decode_step|__call__|row_stats_rows|soft_embedding_rows")
        profiled_steps = 3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(profiled_steps):
                step()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        print(ka.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        print(ka.table(sort_by="self_device_time_total", row_limit=12))
        parts = kernel_parts(_profiled_kernels(ka), profiled_steps)
        results[-1]["kernel_ms"] = parts
        print(f"kernels per step, {n} requests: " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
              + f" = {sum(parts.values()):.3f} ms")
        source = sampler = step = graph = run = None  # free before the next size
        torch.cuda.empty_cache()
    print("\nrequests  events ms  wall ms  graph replay ms  host ms (row stats / soft emb. / rest)"
          "  kernels ms")
    for r in results:
        print(f"{r['requests']:8d}  {r['events_ms']:9.3f}  {r['wall_ms']:7.3f}  {r['graph_ms']:15.3f}"
              f"  {r['host_ms']:7.3f} ({r['host_stats_ms']:.3f} / {r['host_soft_ms']:.3f}"
              f" / {r['host_rest_ms']:.3f})  {sum(r['kernel_ms'].values()):.3f}")
    write_json(args.out, results)


if __name__ == "__main__":
    main()
