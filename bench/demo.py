"""The main job, on whatever machine it runs (``bash scripts/demo.sh``).

With a CUDA device it benchmarks one DiffusionGemma decode step at the real shape
(``bench/bench_step.py``: time, transient memory and agreement with the PyTorch reference;
extra arguments go there) and records the result in the bench of record.

Without one it does not pretend: speed is not measured on a CPU. Instead it

1. runs the Triton kernels through Triton's interpreter (``TRITON_INTERPRET=1``) against the
   PyTorch reference at a small shape and prints how closely they agree: row statistics
   (argmax, sample, entropy, logsumexp) from fp32 and bf16 logits, the soft embedding, and a
   whole decode step of ``DiffusionSampler``;
2. shows that a request's seed reproduces its step whatever batch it comes in: the same
   request alone and in a batch of others, in another slot, gives the same canvas;
3. shows the GPU results recorded in ``bench/results/history.jsonl`` (the latest whole-step run
   per card): a table, and a plot of time and transient memory (log axis) written to a
   temporary folder (``--plot`` to choose the path).

    python bench/demo.py [--plot PATH]          # without a GPU: a minute or two on 2 cores
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# Small, not powers of two; the vocabulary spans three 4096-entry sampling blocks so that the
# two-stage draw (block, then token within it) is exercised.
REQUESTS, WIDTH, VOCAB, HIDDEN = 3, 24, 9001, 40


# ------------------------------------------------------------------------------- output
def table(rows: list[list], headers: list[str]) -> str:
    """``tabulate`` when it is installed (the bench extra), plain columns otherwise."""
    try:
        from tabulate import tabulate

        return tabulate(rows, headers=headers, tablefmt="github", floatfmt=".3g")
    except ImportError:
        cells = [[h for h in headers]] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r]
                                          for r in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
        return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])


def heading(text: str) -> None:
    print(f"\n== {text}\n", flush=True)


# ---------------------------------------------------------------------- agreement checks
def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest relative difference over finite entries."""
    got, want = got.double(), want.double()
    finite = torch.isfinite(want)
    if not finite.any():
        return 0.0
    return float(((got - want).abs()[finite] / want.abs()[finite].clamp(min=1e-6)).max())


def norm_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` over the whole tensor (the soft embedding's measure)."""
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30))


def abs_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference (entropy, in nats: near-zero entropies make relative error
    meaningless)."""
    return float((got.double() - want.double()).abs().max())


def stat_row(name: str, got, want) -> list:
    return [name, f"{float((got.argmax == want.argmax).float().mean()):.1%}",
            f"{float((got.sample == want.sample).float().mean()):.1%}",
            abs_err(got.entropy, want.entropy), rel_err(got.lse, want.lse), "-"]


def agreement(ds) -> list[list]:
    gen = torch.Generator().manual_seed(2026)
    logits = torch.randn(REQUESTS, WIDTH, VOCAB, generator=gen) * 3.0
    head = torch.randint(0, VOCAB, (REQUESTS, WIDTH), generator=gen)
    logits.scatter_add_(2, head.unsqueeze(2), torch.full((REQUESTS, WIDTH, 1), 12.0))  # peaked rows
    temperature = torch.tensor([0.8, 0.55, 0.0])  # the last request is greedy
    seeds = torch.tensor([11, 12, 13])
    draws = torch.tensor([0, 3, 7])
    embed = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05).to(torch.bfloat16)
    normalizer = HIDDEN ** 0.5

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        got, want = (ds.row_stats(x, temperature, seeds, draws, backend=b) for b in ("triton", "torch"))
        rows.append(stat_row(f"row statistics, {str(dtype)[6:]} logits", got, want))
        print(f"  {rows[-1][0]}: done", flush=True)
    want = ds.row_stats(logits, temperature, seeds, draws, backend="torch")
    soft = [ds.soft_embedding(logits, temperature, want.lse, embed, normalizer, backend=b)
            for b in ("triton", "torch")]
    rows.append(["soft embedding, fp32 logits", "-", "-", "-", "-", norm_err(*soft)])
    print(f"  {rows[-1][0]}: done", flush=True)

    # A whole decode step, twice in a row, from identical states and logits.
    outs = []
    for backend in ("triton", "torch"):
        sampler = make_sampler(ds, [101, 102, 103], backend)
        for step in range(2):
            out = sampler.step(logits.reshape(-1, VOCAB) * (1.0 + 0.1 * step), [0, 1, 2])
        outs.append((out, sampler.state))
    (out_t, st_t), (out_r, st_r) = outs
    same_canvas = float((st_t.canvas[:REQUESTS] == st_r.canvas[:REQUESTS]).float().mean())
    sc_t, sc_r = st_t.self_conditioning_embeds[:REQUESTS], st_r.self_conditioning_embeds[:REQUESTS]
    rows.append(["whole decode step x2 (canvas equal)", f"{same_canvas:.1%}",
                 f"{float((out_t.stats.sample == out_r.stats.sample).float().mean()):.1%}",
                 abs_err(out_t.stats.entropy, out_r.stats.entropy),
                 rel_err(out_t.stats.lse, out_r.stats.lse), norm_err(sc_t, sc_r)])
    print(f"  {rows[-1][0]}: done", flush=True)
    return rows


def make_sampler(ds, seeds: list[int], backend: str, slots: list[int] | None = None, max_reqs: int = 4):
    """A sampler whose requests never converge (every step denoises and keeps its soft embedding)."""
    cfg = ds.SamplerConfig(canvas_length=WIDTH, confidence_threshold=0.0, max_denoising_steps=1000)
    state = ds.DiffusionState(max_reqs, cfg, VOCAB, HIDDEN, "cpu")
    slots = list(range(len(seeds))) if slots is None else slots
    for slot, seed in zip(slots, seeds):
        state.add_request(slot, seed=seed)
    gen = torch.Generator().manual_seed(7)
    embed = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05).to(torch.bfloat16)
    sampler = ds.DiffusionSampler(cfg, state, embed, HIDDEN ** 0.5, backend=backend)
    sampler.prefill(slots)
    return sampler


def seed_reproduces(ds) -> list[list]:
    """One request (seed 1234, fixed logits) alone in slot 0, then in slot 2 of a batch of three
    with other seeds and logits around it: the canvas after a step must be the same."""
    gen = torch.Generator().manual_seed(99)
    mine = torch.randn(WIDTH, VOCAB, generator=gen) * 2.0
    others = [torch.randn(WIDTH, VOCAB, generator=gen) * 2.0 for _ in range(2)]

    alone = make_sampler(ds, [1234], "triton")
    alone.step(mine, [0])
    batch = make_sampler(ds, [77, 88, 1234], "triton", slots=[0, 1, 2])
    batch.step(torch.cat([others[0], others[1], mine]), [0, 1, 2])
    other_seed = make_sampler(ds, [1235], "triton")
    other_seed.step(mine, [0])

    a, b, c = alone.state.canvas[0], batch.state.canvas[2], other_seed.state.canvas[0]
    return [
        ["seed 1234 alone (slot 0)", "-", " ".join(map(str, a[:6].tolist())) + " ..."],
        ["seed 1234 in a batch of 3 (slot 2)", f"{int((a == b).sum())} / {WIDTH}",
         " ".join(map(str, b[:6].tolist())) + " ..."],
        ["seed 1235 alone, same logits", f"{int((a == c).sum())} / {WIDTH}",
         " ".join(map(str, c[:6].tolist())) + " ..."],
    ]


# ------------------------------------------------------------------------ recorded results
def recorded_steps(record) -> list[dict]:
    """The latest whole-step run of record per GPU card (history.jsonl)."""
    latest: dict[str, dict] = {}
    for row in record.read_history():
        if row.get("bench") == "step" and row.get("card") not in (None, "cpu"):
            latest[row["card"]] = row  # the file is in time order: the last one wins
    return list(latest.values())


def size(nbytes: float | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def show_recorded(runs: list[dict], plot_path: str) -> None:
    if not runs:
        print("no GPU results recorded yet (bench/results/history.jsonl)")
        return
    for run in runs:
        print(f"{run['card']}, {run['date'][:10]}, commit {run['commit']}, torch {run['torch']}, "
              f"triton {run['triton']}: `{run['command']}`")
        f = run["figures"]
        print(f"CL {f.get('canvas')}, V {f.get('vocab')}, H {f.get('hidden')}, "
              f"{f.get('logits_dtype')} logits\n")
        rows = [[r["requests"], r["ours_ms"], r.get("materialized_ms"), r.get("compiled_ms"),
                 r.get("floor_ms"), size(r.get("ours_transient_bytes")),
                 size(r.get("materialized_transient_bytes")), size(r.get("compiled_transient_bytes"))]
                for r in f["rows"]]
        print(table(rows, ["requests", "dgemma-sampler ms", "PyTorch eager ms", "torch.compile ms",
                           "floor ms", "ours: transient", "eager", "compiled"]))
        print()

    mib = 2**20
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        rows = run["figures"]["rows"]
        n = [r["requests"] for r in rows]
        tag = run["card"].replace("NVIDIA ", "")
        for key, label, style in (("ours_ms", "dgemma-sampler", "o-"),
                                  ("materialized_ms", "PyTorch fp32 eager", "s--"),
                                  ("compiled_ms", "torch.compile", "^--"),
                                  ("floor_ms", "floor: one read + cuBLAS GEMM", "k:")):
            if all(r.get(key) is not None for r in rows):
                ax_t.plot(n, [r[key] for r in rows], style, label=f"{label} ({tag})")
        for key, label, style in (("ours_transient_bytes", "dgemma-sampler", "o-"),
                                  ("materialized_transient_bytes", "PyTorch fp32 eager", "s--"),
                                  ("compiled_transient_bytes", "torch.compile", "^--")):
            if all(r.get(key) is not None for r in rows):
                ax_m.plot(n, [r[key] / mib for r in rows], style, label=f"{label} ({tag})")
    ax_t.set(xlabel="decoding requests", ylabel="ms per decode step", title="time (recorded on the GPU)")
    ax_m.set(xlabel="decoding requests", ylabel="MiB (log scale)", yscale="log",
             title="transient memory of a step")
    for ax in (ax_t, ax_m):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(plot_path)), exist_ok=True)
    fig.savefig(plot_path, dpi=110)
    plt.close(fig)
    print(f"plot: {plot_path}")


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if torch.cuda.is_available():
        import bench_step

        print(f"CUDA device found ({torch.cuda.get_device_name()}): benchmarking the decode step.")
        return bench_step.main(argv)

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plot", default=os.path.join(tempfile.gettempdir(), "dgemma-sampler-demo",
                                                   "recorded-step.png"),
                   help="where to write the plot of the recorded GPU results")
    p.add_argument("--recorded-only", action="store_true",
                   help="only part 3: the recorded GPU results and their plot")
    args = p.parse_args(argv)
    if args.recorded_only:
        import record

        show_recorded(recorded_steps(record), args.plot)
        return 0
    # The interpreter must be chosen before Triton is first imported (dgemma_sampler imports
    # it only when a Triton kernel is first called).
    os.environ["TRITON_INTERPRET"] = "1"
    # The interpreter's numpy emulation warns on the masked lanes' log(0) and 0/0, which the
    # kernels discard by design.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.")
    import record

    import dgemma_sampler as ds

    start = time.perf_counter()
    print("No CUDA device: speed is not measured on a CPU (the kernels are written for GPUs, and\n"
          "the CPU runs them through Triton's interpreter, a Python emulation). This run checks\n"
          "what a CPU can check, then shows the speed and memory recorded on GPUs.")

    heading(f"1. Triton kernels (interpreted) vs the PyTorch reference: {REQUESTS} requests x "
            f"{WIDTH} positions x {VOCAB} vocabulary, H {HIDDEN}")
    rows = agreement(ds)
    print()
    print(table(rows, ["check", "argmax equal", "sample equal", "entropy max abs err",
                       "lse max rel err", "soft embedding rel err"]))
    print("\nSamples agree bit for bit except where two keys tie within a few ulp; the soft\n"
          "embedding multiplies bf16 operands (rel. error 1e-3 to 1e-2 is expected).")

    heading("2. A request's seed reproduces its step whatever the batch (Triton, interpreted)")
    print(table(seed_reproduces(ds), ["request", "positions equal to 'alone'", "canvas after one step"]))

    heading("3. Recorded GPU results of the whole decode step (bench/results/history.jsonl)")
    show_recorded(recorded_steps(record), args.plot)
    print(f"\ndone in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
