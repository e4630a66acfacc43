"""Which launch choices of the row-statistics pass change output bits (H200 diagnostic).

    python bench/diag_walk_bits.py [--out bench/results/diag_walk_bits.json]

A request's statistics must not depend on the batch it comes in, so a launch choice that
depends on the number of rows may only be one that changes no bit. This script runs the
pass on the same fp32 / bf16 logits (4 requests x 64 positions, a ragged last group) under
pairs of configs and prints, per output, how many rows differ:

* the register walk against the descriptor (TMA) walk, for a row stride that is a multiple
  of 16 elements (262144) and one that is only a multiple of 4 (261848: TMA still takes it);
* descriptor walks of 2, 3, 4 and 6 stages against each other.

For each compiled variant it also prints the distributed layouts of the kernel's Triton GPU
IR (``#blocked`` lines): the lanes' share of a vocabulary block, and so the order of the
per-lane sums that ``tl.sum`` reduces, follows the layout the compiler chose for the loads.
"""

from __future__ import annotations

import argparse
import json
import re

import torch

from bench_row_stats import compiled_kernels, run_meta  # this script's folder
from dgemma_sampler.kernels import row_stats as rs

N_REQ, WIDTH = 4, 64
OUTPUTS = ("argmax", "sample", "entropy", "lse", "has_nan")


def make_rows(vocab: int, dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(7)
    n = N_REQ * WIDTH
    logits = torch.randn(n, vocab, device="cuda", generator=gen).mul_(2.5)
    head = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    logits[torch.arange(n, device="cuda"), head] += 15.0
    temperature = torch.linspace(0.4, 0.8, N_REQ, device="cuda")
    seeds = torch.randint(-(2**62), 2**62, (N_REQ,), device="cuda", generator=gen)
    draws = torch.randint(0, 48, (N_REQ,), device="cuda", generator=gen)
    row_request = torch.arange(N_REQ, device="cuda", dtype=torch.int32).repeat_interleave(WIDTH)
    row_position = torch.arange(WIDTH, device="cuda", dtype=torch.int32).repeat(N_REQ)
    return logits.to(dtype), row_request, row_position, temperature, seeds, draws


def run(args, cfg):
    key = torch.empty(args[0].shape[0], device="cuda")
    stats = rs.row_stats_rows(*args, config=cfg, sample_key=key)
    torch.cuda.synchronize()
    return {**{name: getattr(stats, name) for name in OUTPUTS}, "sample_key": key}


def differing_rows(a: dict, b: dict) -> dict:
    out = {}
    for name in a:
        x, y = a[name], b[name]
        same = (x == y) | ((x != x) & (y != y)) if x.is_floating_point() else x == y
        out[name] = int((~same).sum())
    return out


def layouts() -> list[str]:
    """The ``#blocked`` layouts of every compiled ``_row_stats_kernel`` variant."""
    found = []
    for kern in compiled_kernels(rs._row_stats_kernel):
        ttgir = kern.asm.get("ttgir", "") if hasattr(kern, "asm") else ""
        tma = "descriptor_load" in ttgir or "async_tma" in ttgir
        lines = sorted(set(re.findall(r"^#blocked\d* = .*$", ttgir, re.M)))
        found.append(f"variant (descriptor loads: {tma}): " + " | ".join(lines))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/diag_walk_bits.json")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    records = []
    for dtype in (torch.float32, torch.bfloat16):
        for stride in (262144, 262144 - 296):
            data = make_rows(stride, dtype)
            vocab = stride - 300  # the last group ragged, the row stride kept
            rows = (data[0][:, :vocab],) + data[1:]
            assert rs._tma_walk(rows[0], dict(tma=True), 256, True)
            base = run(rows, dict(tma=False))
            pairs = [("register", "tma4", dict(tma=True, tma_stages=4))] + [
                ("tma4", f"tma{s}", dict(tma=True, tma_stages=s)) for s in (2, 3, 6)]
            tma4 = None
            for left, right, cfg in pairs:
                got = run(rows, cfg)
                ref = base if left == "register" else tma4
                if right == "tma4":
                    tma4 = got
                diff = differing_rows(ref, got)
                rec = dict(dtype=str(dtype).replace("torch.", ""), row_stride=stride, vocab=vocab,
                           pair=f"{left} vs {right}", differing_rows=diff)
                records.append(rec)
                print(f"{rec['dtype']:9s} stride {stride} {rec['pair']:16s} {diff}", flush=True)
            del data, rows
    found = layouts()
    for line in found:
        print(line)
    with open(args.out, "w") as f:
        json.dump(dict(meta=run_meta(), results=records, layouts=found), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
