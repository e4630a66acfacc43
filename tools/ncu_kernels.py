"""One launch of each hot kernel at the real shape, for Nsight Compute.

Everything (inputs, compiles, tuning) happens before ``cudaProfilerStart``; inside the
profiled range each kernel runs once, so

    ncu --profile-from-start off --clock-control none --set full -o rep python tools/ncu_kernels.py
    ncu --import rep.ncu-rep --page details > details.txt

gives one report per kernel: the soft-embedding GEMM from fp32 and bf16 logits next to cuBLAS on
materialized bf16 probabilities (32 requests x 256 positions, V 262144, H 2816; inputs as
``bench_soft_embedding.py`` and ``bench_row_stats.py`` make them), and the
row-statistics pass from fp32 and bf16 logits, plain and with top-k / top-p (its scan and
search kernels). ``--only gemm`` or ``--only rows`` profiles one half.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_row_stats import make_logits, request_params, top_k_top_p  # noqa: E402
from bench_soft_embedding import make_inputs  # noqa: E402

from dgemma_sampler.kernels import row_stats as rs  # noqa: E402
from dgemma_sampler.kernels import soft_embedding_dispatch as se  # noqa: E402

VOCAB, HIDDEN = 262144, 2816


def gemm_cases(requests: int):
    x = make_inputs(requests, VOCAB, HIDDEN)
    gemm_out = torch.empty(x["out"].shape, device="cuda", dtype=torch.bfloat16)

    def fused(logits):
        return lambda: se.soft_embedding_rows(logits, x["row_request"], x["temperature"], x["lse"],
                                              x["embed"], x["normalizer"], out=x["out"])

    return [("soft_embedding fp32 logits", fused(x["logits"])),
            ("soft_embedding bf16 logits", fused(x["logits_bf16"])),
            ("cuBLAS bf16 probs @ E", lambda: torch.mm(x["probs"], x["embed"], out=gemm_out))]


def row_cases(requests: int):
    cases = []
    temperature, seeds, draws, row_request, row_position = request_params(requests)
    top_k, top_p = top_k_top_p(requests)
    for dtype in (torch.float32, torch.bfloat16):
        x = make_logits(requests, dtype, "flat", 1)
        name = str(dtype).replace("torch.", "")
        cases.append((f"row_stats {name} sample", lambda x=x: rs.row_stats_rows(
            x, row_request, row_position, temperature, seeds, draws)))
        cases.append((f"row_stats {name} top-k/top-p", lambda x=x: rs.row_stats_rows(
            x, row_request, row_position, temperature, seeds, draws, top_k=top_k, top_p=top_p)))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--only", choices=("gemm", "rows"))
    args = ap.parse_args()
    cases = []
    if args.only != "rows":
        cases += gemm_cases(args.requests)
    if args.only != "gemm":
        cases += row_cases(args.requests)
    for _, fn in cases:  # compile and tune outside the profiled range
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, fn in cases:
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled: " + "; ".join(name for name, _ in cases))


if __name__ == "__main__":
    main()
