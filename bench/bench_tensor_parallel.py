"""Vocabulary-sharded sampler step vs the single-GPU step, one process per GPU.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node N bench/bench_tensor_parallel.py \
        [--requests 32 --width 256 --vocab 262144 --hidden 2816] [--out PATH]

Every rank builds the same full inputs (logits [R, W, V], embedding [V, H] bf16) from one
seed on its own GPU and runs:

1. the single-GPU step on the full vocabulary: ``ds.row_stats`` + ``ds.soft_embedding``;
2. the sharded step on its vocabulary slice ``tp.vocab_slice(V, rank, N)``:
   ``row_stats_sharded`` (one all_gather) + ``soft_embedding_sharded`` (one all_reduce),
   first checked against step 1, then timed after the full tensors are freed, so the
   memory figures are those of a rank that only ever held its slice;
3. the sharded step's local work alone (no collectives), to show what communication costs.

Times are CUDA-event medians after warm-up, each iteration started after a barrier (a step
ends when the slowest rank's collective does). Memory: ``torch.cuda.max_memory_allocated``
during the step, absolute and minus what was allocated before it (transient). Rank 0 prints
a table and writes the result to the bench of record (``bench/record.py``), or to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from importlib.util import find_spec

# Set before NCCL initializes: NVLink SHARP (multicast) is unavailable on the lent machines.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record  # noqa: E402

import dgemma_sampler as ds  # noqa: E402
from dgemma_sampler import keyed_noise, ops, reference  # noqa: E402
from dgemma_sampler import tensor_parallel as tp  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--width", type=int, default=256, help="canvas positions per request")
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--hidden", type=int, default=2816)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="logits dtype")
    p.add_argument("--softcap", type=float, default=30.0, help="<= 0: none")
    p.add_argument("--backend", choices=["auto", "triton", "torch"], default="auto")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="JSON results elsewhere (default: the record, "
                   "bench/results/tensor_parallel-<card>.json; --cpu-smoke: not written)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run the script's logic on CPU with gloo and the torch backend (tiny "
                        "shapes, e.g. --requests 2 --width 8 --vocab 1001 --hidden 32); no timing value")
    return p.parse_args()


def make_inputs(args, device):
    """The same full inputs on every rank (one seed), fresh random values, never zeros."""
    g = torch.Generator(device=device).manual_seed(args.seed)
    r, w, v, h = args.requests, args.width, args.vocab, args.hidden
    logits = torch.empty(r, w, v, dtype=DTYPES[args.dtype], device=device)
    for i in range(r):  # one request at a time keeps the fp32 temporary small
        logits[i] = (torch.randn(w, v, generator=g, device=device) * 4.0).to(logits.dtype)
    embed = (torch.randn(v, h, generator=g, device=device) * 0.02).to(torch.bfloat16)
    temperature = torch.linspace(0.4, 0.8, r, device=device)
    temperature[::8] = 0.0  # some greedy requests
    seeds = torch.randint(0, 2**62, (r,), generator=g, device=device, dtype=torch.int64)
    draws = torch.randint(0, 48, (r,), generator=g, device=device, dtype=torch.int64)
    keep = torch.rand(r, w, generator=g, device=device) < 0.9
    normalizer = torch.tensor(h**0.5, device=device)
    return logits, embed, temperature, seeds, draws, keep, normalizer


def time_step(fn, args, device, group_barrier: bool) -> list[float]:
    times = []
    for i in range(args.warmup + args.iters):
        if group_barrier:
            dist.barrier()
        if device.type != "cuda":  # --cpu-smoke: wall clock, only to exercise the code
            t0 = time.perf_counter()
            fn()
            if i >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
            continue
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= args.warmup:
            times.append(start.elapsed_time(end))
    return times


def peak_of(fn, device) -> dict:
    if device.type != "cuda":
        fn()
        return {"peak_bytes": 0, "transient_bytes": 0}
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_bytes": peak, "transient_bytes": peak - before}


def score_gap(logits, temperature, seeds, draws, softcap, req, pos, a, b, use_key) -> float:
    """Relative gap of the two candidates' scores (z, or z + Gumbel) in the single-GPU math."""
    tokens = torch.tensor([a, b], device=logits.device)
    x = reference.softcapped(logits[req, pos, tokens], softcap)
    z = torch.clamp(x * reference.inverse_temperature(temperature[req:req + 1]), max=reference.FLT_MAX)
    if use_key:
        key = keyed_noise.row_key(seeds[req], draws[req], torch.tensor(pos, device=logits.device),
                                  keyed_noise.Stream.GUMBEL)
        z = z + keyed_noise.gumbel(keyed_noise.token_bits(key, tokens))
    za, zb = z.double().tolist()
    return abs(za - zb) / max(abs(za), abs(zb), 1.0)


def compare(got, want, soft, want_soft, full, temperature, seeds, draws, softcap) -> dict:
    out = {}
    for field in ("argmax", "sample"):
        diff = (getattr(got, field) != getattr(want, field)).nonzero().tolist()
        gaps = []
        for req, pos in diff[:32]:
            use_key = field == "sample" and float(temperature[req]) != 0.0
            gaps.append(score_gap(full, temperature, seeds, draws, softcap, req, pos,
                                  int(getattr(got, field)[req, pos]),
                                  int(getattr(want, field)[req, pos]), use_key))
        out[f"{field}_mismatches"] = len(diff)
        out[f"{field}_mismatch_max_rel_score_gap"] = max(gaps) if gaps else 0.0
    finite = torch.isfinite(want.lse)
    out["masked_rows_agree"] = bool(torch.equal(finite, torch.isfinite(got.lse)))
    rel = ((got.lse - want.lse).abs() / want.lse.abs().clamp(min=1e-30))[finite]
    out["lse_max_rel_err"] = float(rel.max()) if rel.numel() else 0.0
    ent = (got.entropy - want.entropy).abs()
    out["entropy_max_abs_err"] = float(ent.max())
    out["entropy_max_rel_err"] = float((ent / want.entropy.abs().clamp(min=1e-6)).max())
    scale = want_soft.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    out["soft_max_err_of_row_scale"] = float(((soft - want_soft).abs() / scale).max())
    out["has_nan_agree"] = bool(torch.equal(got.has_nan, want.has_nan))
    return out


def main() -> int:
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    distributed = "WORLD_SIZE" in os.environ
    if args.cpu_smoke:
        device = torch.device("cpu")
        args.backend = "torch"
        if distributed:
            dist.init_process_group("gloo")
    else:
        if not torch.cuda.is_available():
            print("bench_tensor_parallel needs CUDA GPUs (one process per GPU via torchrun); "
                  "--cpu-smoke checks the script on CPU", file=sys.stderr)
            return 2
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        if distributed:
            dist.init_process_group("nccl", device_id=device)
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    backend = ops.resolve_backend(args.backend, device)
    if backend == "triton" and find_spec("dgemma_sampler.kernels.row_stats") is None:
        raise SystemExit("the Triton row-statistics kernel is not installed yet; run with --backend torch")
    softcap = args.softcap if args.softcap > 0 else None
    start, end = tp.vocab_slice(args.vocab, rank, world)

    logits, embed, temperature, seeds, draws, keep, normalizer = make_inputs(args, device)

    def single_step():
        st = ds.row_stats(logits, temperature, seeds, draws, softcap=softcap, backend=backend)
        return st, ds.soft_embedding(logits, temperature, st.lse, embed, normalizer, keep=keep,
                                     softcap=softcap, backend=backend)

    want, want_soft = single_step()
    single_mem = peak_of(single_step, device)
    single_ms = time_step(single_step, args, device, group_barrier=False)

    local = logits[..., start:end].contiguous()
    local_embed = embed[start:end].contiguous()

    def sharded_step():
        st = tp.row_stats_sharded(local, temperature, seeds, draws, vocab_start=start,
                                  vocab_size=args.vocab, softcap=softcap, backend=backend)
        return st, tp.soft_embedding_sharded(local, temperature, st.lse, local_embed, normalizer,
                                             keep=keep, softcap=softcap, backend=backend)

    got, got_soft = sharded_step()
    check = compare(got, want, got_soft, want_soft, logits, temperature, seeds, draws, softcap)

    # From here on this rank holds only its slice, as it would under tensor parallelism.
    logits = embed = want = want_soft = got = got_soft = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    sharded_mem = peak_of(sharded_step, device)
    sharded_ms = time_step(sharded_step, args, device, group_barrier=distributed)

    n = args.requests * args.width
    greedy = (temperature == 0).repeat_interleave(args.width)

    def local_only():  # the same step without its two collectives
        packed, _ = tp.local_row_partials(local, temperature, seeds, draws, vocab_start=start,
                                          softcap=softcap, backend=backend)
        merged = tp.merge_row_partials(packed.view(1, n, -1), greedy)
        ds.soft_embedding(local, temperature, merged.lse.view(args.requests, args.width),
                          local_embed, normalizer, keep=keep, softcap=softcap, backend=backend)

    local_ms = time_step(local_only, args, device, group_barrier=False)

    row = {
        "rank": rank, "vocab_start": start, "vocab_end": end,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "single_ms": statistics.median(single_ms),
        "sharded_ms": statistics.median(sharded_ms),
        "sharded_local_only_ms": statistics.median(local_ms),
        "single_mem": single_mem, "sharded_mem": sharded_mem, "check": check,
    }
    rows = [None] * world
    if distributed:
        dist.all_gather_object(rows, row)
    else:
        rows = [row]
    if rank == 0 and not (args.cpu_smoke and args.out is None):
        with record.Record("tensor_parallel", args.out, device) as rec:
            report_rank0(args, rows, world, backend, softcap, rec)
    elif rank == 0:
        report_rank0(args, rows, world, backend, softcap, None)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def report_rank0(args, rows, world, backend, softcap, rec) -> None:
    """Rank 0: the table, and (with ``rec``) the result of record."""
    config = {**vars(args), "world_size": world, "backend": backend,
              "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")}
    summary = {
        "single_ms": statistics.median(r["single_ms"] for r in rows),
        "sharded_ms_slowest_rank": max(r["sharded_ms"] for r in rows),
        "speedup": statistics.median(r["single_ms"] for r in rows)
        / max(r["sharded_ms"] for r in rows),
        "sharded_peak_gib_max": max(r["sharded_mem"]["peak_bytes"] for r in rows) / 2**30,
        "single_transient_gib": rows[0]["single_mem"]["transient_bytes"] / 2**30,
        "sharded_transient_gib_max": max(r["sharded_mem"]["transient_bytes"] for r in rows) / 2**30,
        "argmax_mismatches": sum(r["check"]["argmax_mismatches"] for r in rows),
        "sample_mismatches": sum(r["check"]["sample_mismatches"] for r in rows),
    }
    gib = 2**30
    print(f"\n{args.requests} req x {args.width} x {args.vocab} {args.dtype}, H={args.hidden}, "
          f"softcap={softcap}, backend={backend}, world={world}")
    print(f"{'rank':>4} {'slice':>17} {'single ms':>10} {'shard ms':>9} {'local ms':>9} "
          f"{'single peak/trans GiB':>22} {'shard peak/trans GiB':>21} "
          f"{'argmax/sample diff':>19} {'lse rel':>8} {'H abs':>8} {'soft':>8}")
    for r in rows:
        c, one, shard = r["check"], r["single_mem"], r["sharded_mem"]
        print(f"{r['rank']:>4} {r['vocab_start']:>8}-{r['vocab_end']:<8} {r['single_ms']:>10.3f} "
              f"{r['sharded_ms']:>9.3f} {r['sharded_local_only_ms']:>9.3f} "
              f"{one['peak_bytes'] / gib:>11.2f}/{one['transient_bytes'] / gib:<10.2f} "
              f"{shard['peak_bytes'] / gib:>10.2f}/{shard['transient_bytes'] / gib:<10.2f} "
              f"{c['argmax_mismatches']:>9}/{c['sample_mismatches']:<9} {c['lse_max_rel_err']:>8.1e} "
              f"{c['entropy_max_abs_err']:>8.1e} {c['soft_max_err_of_row_scale']:>8.1e}")
    s = summary
    print(f"step: single {s['single_ms']:.3f} ms, sharded (slowest rank) "
          f"{s['sharded_ms_slowest_rank']:.3f} ms, speedup {s['speedup']:.2f}x")
    if rec is not None:
        rec.meta.update(world_size=world, backend=backend)
        rec.save({"config": config, "ranks": rows, "summary": summary},
                 {"world_size": world, "requests": args.requests, "logits_dtype": args.dtype, **summary})


if __name__ == "__main__":
    sys.exit(main())
