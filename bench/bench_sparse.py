"""The tail-tolerant soft embedding on peaked, broad and mixed workloads (issue #31).

For each number of requests and each workload family (``workloads.py``) it reports, in one run:

* per family (peaked k = 1..6, broad) at the default ``tail_eps``, from the support pass run
  on every row: the fraction of rows with a support of at most K tokens, and its size |S|;
* the fraction of rows per path of the step (``StepOutput.sc_path_rows``);
* the soft embedding alone: cuBLAS dense (bf16 probabilities @ E, probabilities given), our
  dense GEMM (``tail_eps = 0``), ours with the tail tolerance (support + dense rows compacted
  + gather), the same two on the Triton kernel instead of the Hopper one (``*_triton``), and
  the support pass and the gather alone;
* the whole step with the tail tolerance against the dense-only step, and the floor (one
  logits read + the cuBLAS GEMM) of ``bench_step.measure_floor``;
* with 1 request, the all-peaked step (k 3..6) replayed from a CUDA graph.

Targets (H200, CL 256, V 262144, H 2816, fp32 logits): 32 requests all peaked, step <= 5 ms;
half peaked, step <= 0.6 x the dense floor; broad only, step <= 1.03 x the dense-only step;
1 request all peaked, graph-replayed step <= 0.5 ms.

    python bench_sparse.py            # ~2-3 minutes on an H100/H200
    python bench_sparse.py --quick    # 32 requests, 7 families, 5 reps; + the graph replay
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record  # noqa: E402
import workloads  # noqa: E402
from bench_step import device_timer, make_sampler, measure_floor  # noqa: E402

import dgemma_sampler as ds  # noqa: E402
from dgemma_sampler import support as sp  # noqa: E402
from dgemma_sampler.backend import kernels  # noqa: E402

PATH_NAMES = ("not_kept", "top1", "support", "stats_dense", "support_dense")


def support_sizes(logits, ks, temperature, eps):
    """Per family, from the support pass run on every row (tiers 1 and 2 off): the fraction
    of rows with a support of at most K tokens, and |S| of those (median, p90, max)."""
    rows, vocab = logits.shape
    t = torch.full((1,), temperature, device=logits.device)
    st = ds.row_stats(logits.view(1, rows, vocab), t, torch.zeros(1, dtype=torch.int64, device=logits.device),
                      torch.zeros(1, dtype=torch.int64, device=logits.device))
    find = kernels(ds.ops.resolve_backend("auto", logits.device)).support_rows
    res = sp.decide_support(find, logits, torch.zeros(rows, dtype=torch.int64, device=logits.device),
                            t, st.lse.reshape(-1), tail_eps=eps)
    count, sparse = res.count.cpu().float(), res.sparse().cpu()
    out = {}
    for k in sorted(set(ks.tolist())):
        mine = ks == k
        c = count[mine & sparse]
        name = "broad" if k == 0 else f"peaked_k{k}"
        out[name] = {"sparse": float(sparse[mine].float().mean())}
        if c.numel():
            out[name].update(median=float(c.median()), p90=float(c.quantile(0.9)), max=float(c.max()))
    return out


def bench_family(family, n, args, embed, backend, device, cuda, gen, floor):
    rows = n * args.canvas
    t = args.temperature
    logits, ks = workloads.make_logits(family, n, args.canvas, args.vocab, t, gen, device)
    row = {"family": family, "requests": n, "rows": rows,
           "peaked_fraction": float((ks > 0).float().mean())}
    if family in ("peaked", "broad", "peaked36") or args.sizes_all:
        row["support_size"] = support_sizes(logits, ks, t, args.eps)
    slots = list(range(n))
    tail = make_sampler(n, args.canvas, args.vocab, args.hidden, embed, backend, device, args.eps)
    dense = make_sampler(n, args.canvas, args.vocab, args.hidden, embed, backend, device, 0.0)
    out = tail.step(logits, slots)
    paths = out.sc_path_rows.cpu().tolist()
    row["path_fraction"] = {name: paths[i] / rows for i, name in enumerate(PATH_NAMES)}
    row["step_tail_ms"] = device_timer(lambda: tail.step(logits, slots), 2, args.reps, cuda)
    row["step_dense_ms"] = device_timer(lambda: dense.step(logits, slots), 2, args.reps, cuda)
    # the soft embedding alone, all rows kept
    x = logits.view(n, args.canvas, args.vocab)
    temp = torch.full((n,), t, device=device)
    seeds = torch.arange(n, device=device)
    st = ds.row_stats(x, temp, seeds, torch.zeros_like(seeds))
    norm = float(args.hidden) ** 0.5
    buf = torch.empty(n, args.canvas, args.hidden, device=device)
    row["se_dense_ms"] = device_timer(
        lambda: ds.soft_embedding(x, temp, st.lse, embed, norm, out=buf), 2, args.reps, cuda)
    row["se_tail_ms"] = device_timer(
        lambda: ds.soft_embedding(x, temp, st.lse, embed, norm, out=buf, tail_eps=args.eps,
                                  argmax=st.argmax, entropy=st.entropy), 2, args.reps, cuda)
    if cuda:
        # The Triton kernel in place of the Hopper one, for the dense rows and for all rows.
        from dgemma_sampler.kernels.soft_embedding_dispatch import soft_embedding_rows
        triton = kernels("triton")
        find, gather = triton.support_rows, triton.gather_rows
        triton_dense = functools.partial(soft_embedding_rows, wgmma=False)
        flat = logits
        flat_buf = buf.view(rows, args.hidden)
        req = torch.arange(n, device=device).repeat_interleave(args.canvas)
        row["se_tail_triton_ms"] = device_timer(
            lambda: sp.soft_embedding_tail(find, triton_dense, gather, flat, req, temp,
                                           st.lse.reshape(-1), embed, norm, tail_eps=args.eps,
                                           out=flat_buf, argmax=st.argmax.reshape(-1),
                                           entropy=st.entropy.reshape(-1)), 2, args.reps, cuda)
        row["se_dense_triton_ms"] = device_timer(
            lambda: triton_dense(flat, req, temp, st.lse.reshape(-1), embed, norm, out=flat_buf),
            2, args.reps, cuda)
        # the tail path's own passes: the support decision, then the gather of the sparse rows
        bound = sp.entropy_skip_f32(args.eps, sp.MAX_SUPPORT, args.vocab)

        def decide():
            return sp.decide_support(find, flat, req, temp, st.lse.reshape(-1), tail_eps=args.eps,
                                     argmax=st.argmax.reshape(-1), entropy=st.entropy.reshape(-1),
                                     entropy_bound=bound)

        s = decide()
        row["se_support_ms"] = device_timer(decide, 2, args.reps, cuda)
        row["se_gather_ms"] = device_timer(
            lambda: gather(flat, req, temp, st.lse.reshape(-1), embed, norm, s.path, s.count, s.ids,
                           out=flat_buf), 2, args.reps, cuda)
    if floor:
        row["cublas_ms"] = floor["gemm_ms"]
        row["floor_ms"] = floor["floor_ms"]
        row["step_tail_over_floor"] = row["step_tail_ms"] / floor["floor_ms"]
    row["step_tail_over_dense"] = row["step_tail_ms"] / row["step_dense_ms"]
    return row


def bench_graph(args, embed, backend, device, gen):
    """1 request, every row peaked: the step captured in a CUDA graph, replay time."""
    logits, _ = workloads.make_logits("peaked36", 1, args.canvas, args.vocab, args.temperature, gen, device)
    res = {}
    for name, eps in (("tail", args.eps), ("dense", 0.0)):
        sampler = make_sampler(1, args.canvas, args.vocab, args.hidden, embed, backend, device, eps)
        run = sampler.graphable([0])
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run(logits)
            run(logits)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(logits)
        res[f"graph_step_{name}_ms"] = device_timer(graph.replay, 3, max(args.reps, 20), True)
    return res


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", default=None, help="default 1,32 on a GPU (32 with --quick)")
    p.add_argument("--families", default=None, help=f"comma list of {workloads.FAMILIES}")
    p.add_argument("--canvas", type=int, default=256 if cuda else 16)
    p.add_argument("--vocab", type=int, default=262144 if cuda else 2048)
    p.add_argument("--hidden", type=int, default=2816 if cuda else 64)
    p.add_argument("--temperature", type=float, default=0.8, help="the step's (t_max, early steps)")
    p.add_argument("--eps", type=float, default=ds.SamplerConfig().tail_eps)
    p.add_argument("--reps", type=int, default=10 if cuda else 2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sizes-all", action="store_true", help="support sizes for every family")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    default_requests = ("32" if args.quick else "1,32") if cuda else "2"
    requests = [int(r) for r in (args.requests or default_requests).split(",")]
    families = (args.families.split(",") if args.families else
                ["broad", "mix50", "mix50c", "half36", "peaked", "peaked36", "trajectory"] if args.quick
                else list(workloads.FAMILIES))
    if args.quick:
        args.reps = min(args.reps, 5)
    backend = ds.ops.resolve_backend("auto", device)
    gen = torch.Generator(device=device).manual_seed(0)
    embed = (torch.randn(args.vocab, args.hidden, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    with record.Record("sparse", args.out) as rec:
        results = []
        for n in requests:
            floor = None
            if cuda:
                x = torch.empty(n * args.canvas, args.vocab, device=device)
                floor = measure_floor(n * args.canvas, args.vocab, args.hidden, x, embed, 2, 10)
                del x
            for family in families:
                row = bench_family(family, n, args, embed, backend, device, cuda, gen, floor)
                if cuda:
                    torch.cuda.empty_cache()  # the family's logits and samplers are gone
                results.append(row)
                print(json.dumps(row), flush=True)
        graph = bench_graph(args, embed, backend, device, gen) if cuda else None
        shape = {"canvas": args.canvas, "vocab": args.vocab, "hidden": args.hidden, "eps": args.eps,
                 "temperature": args.temperature, "max_support": sp.MAX_SUPPORT}
        rec.meta.update(shape)
        print(f"\n{name}: eps {args.eps:g}, K {sp.MAX_SUPPORT}, T {args.temperature}")
        print(f"{'req':>4} {'family':>10} {'sparse%':>8} {'se cuBLAS':>9} {'se dense':>9} {'se tail':>8} "
              f"{'step dense':>10} {'step tail':>9} {'tail/dense':>10} {'tail/floor':>10} "
              f"{'se dense Triton':>15} {'se tail Triton':>14}")
        for r in results:
            pf = r["path_fraction"]
            sparse = 100 * (pf["top1"] + pf["support"])
            cublas = r.get('cublas_ms', float('nan'))
            print(f"{r['requests']:>4} {r['family']:>10} {sparse:>7.1f}% {cublas:>9.2f} "
                  f"{r['se_dense_ms']:>9.2f} {r['se_tail_ms']:>8.2f} {r['step_dense_ms']:>10.2f} "
                  f"{r['step_tail_ms']:>9.2f} {r['step_tail_over_dense']:>10.2f} "
                  f"{r.get('step_tail_over_floor', float('nan')):>10.2f} "
                  f"{r.get('se_dense_triton_ms', float('nan')):>15.2f} "
                  f"{r.get('se_tail_triton_ms', float('nan')):>14.2f}")
            if "support_size" in r:
                sizes = [f"{k} {100 * v['sparse']:.0f}%"
                         + (f" {v['median']:.0f}/{v['p90']:.0f}" if "median" in v else "")
                         for k, v in r["support_size"].items()]
                print("      sparse, |S| median/p90: " + ", ".join(sizes))
        if graph:
            print("1 request, all peaked, graph replay: " +
                  ", ".join(f"{k} {v:.3f} ms" for k, v in graph.items()))
        rec.save({"results": results, "graph": graph}, {**shape, "rows": results, "graph": graph})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
