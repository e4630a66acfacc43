"""Which tiles of the LM-head GEMM keep a request's logits bit for bit, and what each costs.

``kernels/head_gemm.py`` runs one fixed tile (``CONFIG``) at every batch size, because the tile
fixes the order of the fp32 sums and so the bits of a request's logits. A tile that gives
``CONFIG``'s bits on every shape (the same K step, and MMA instructions that add the K terms of
an element in the same order whatever the tile's M and N) could be chosen by the number of rows
without breaking batch invariance: a smaller tile for few requests, where the shipped one is
behind cuBLAS. This tool answers both halves on the device: for each candidate tile and each
number of requests it times ``head_gemm.project`` with that tile and cuBLAS's ``hidden @ W^T``
(bf16 out) in the same run, and compares the logits with ``CONFIG``'s bit for bit.

    python tools/head_configs.py                          # DiffusionGemma's head, 1,4,16,32 req
    python tools/head_configs.py --requests 1,4 --configs 128x256x64/g8/w8/s3,64x256x64/g8/w4/s4

A tile is ``BMxBNxBK/gGROUP_M/wWARPS/sSTAGES``. Without CUDA it runs the Triton interpreter at a
small shape against ``INTERPRETER_CONFIG`` (bits only: a CPU's time says nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Must be set before Triton is imported (the kernels import it on first use).
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_step import device_timer  # noqa: E402
from tabulate import tabulate  # noqa: E402

from dgemma_sampler.kernels import head_gemm  # noqa: E402

# Tiles worth trying on Hopper: the shipped one, narrower and shorter tiles for few rows, other
# groups, and another K step (expected to change the bits: the control). Each fits sm_90's
# shared memory (``python tools/compile_sm90.py --head --head-configs ...`` says so without a GPU).
CANDIDATES = ("128x256x64/g8/w8/s3", "128x128x64/g8/w8/s4", "128x128x64/g8/w4/s4",
              "64x256x64/g8/w4/s4", "64x128x64/g8/w4/s5", "256x128x64/g8/w8/s3",
              "128x256x64/g4/w8/s3", "128x256x64/g16/w8/s3", "128x256x32/g8/w8/s5",
              "128x256x64/g8/w8/s3/e2", "128x256x64/g8/w8/s4/e2", "256x128x64/g8/w8/s4/e2",
              "128x256x64/g16/w8/s4/e2", "64x256x64/g8/w4/s5/e2")
# Small enough for the interpreter; rows and vocabulary not multiples of any tile.
INTERPRETER_CANDIDATES = ("16x32x16/g2/w4/s1", "32x16x16/g1/w4/s1", "16x16x16/g4/w4/s1",
                          "16x32x32/g2/w4/s1", "16x32x16/g2/w4/s1/e2")

def compare(specs, requests, canvas, vocab, hidden, reps, device) -> list[dict]:
    """One row per (tile, requests): whether the logits equal the reference tile's bit for bit,
    and on CUDA the milliseconds of that tile and of cuBLAS. The first rows are the reference."""
    cuda = device.type == "cuda"
    reference = head_gemm.CONFIG if cuda else head_gemm.INTERPRETER_CONFIG
    gen = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(vocab, hidden, generator=gen, device=device)
              / hidden ** 0.5).to(torch.bfloat16)
    rows_out = []
    for n in requests:
        h = torch.randn(n * canvas, hidden, generator=gen, device=device).to(torch.bfloat16)
        want = head_gemm.project(h, weight, config=reference)
        got = head_gemm.empty_logits(h.shape[0], vocab, h.dtype, device)
        cublas_ms = None
        if cuda:
            out = torch.empty(h.shape[0], vocab, dtype=h.dtype, device=device)
            cublas_ms = device_timer(lambda h=h, out=out: torch.mm(h, weight.t(), out=out), 3, reps,
                                     True)
            del out
        for spec in specs:
            cfg = head_gemm.HeadConfig.parse(spec)
            head_gemm.project(h, weight, got, config=cfg)
            row = {"tile": spec, "requests": n, "same_bits": bool(torch.equal(got, want))}
            if cuda:
                row["ms"] = device_timer(
                    lambda h=h, got=got, c=cfg: head_gemm.project(h, weight, got, config=c),
                    3, reps, True)
                row["cublas_ms"] = cublas_ms
                row["vs_cublas"] = row["ms"] / cublas_ms
            rows_out.append(row)
        del want, got, h
        if cuda:
            torch.cuda.empty_cache()
    return rows_out


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", default="1,4,16,32" if cuda else "1,2")
    p.add_argument("--canvas", type=int, default=256 if cuda else 9)
    p.add_argument("--vocab", type=int, default=262144 if cuda else 301)
    p.add_argument("--hidden", type=int, default=2816 if cuda else 40)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--configs", default=",".join(CANDIDATES if cuda else INTERPRETER_CANDIDATES),
                   help="comma-separated tiles, BMxBNxBK/gGROUP_M/wWARPS/sSTAGES")
    args = p.parse_args(argv)
    try:
        specs = [s for s in args.configs.split(",") if s]
        for s in specs:
            head_gemm.HeadConfig.parse(s)
    except ValueError as e:
        p.error(str(e))
    device = torch.device("cuda" if cuda else "cpu")
    rows = compare(specs, [int(x) for x in args.requests.split(",")], args.canvas, args.vocab,
                   args.hidden, args.reps, device)
    reference = head_gemm.CONFIG if cuda else head_gemm.INTERPRETER_CONFIG
    print(f"bits compared with {reference}")
    print(tabulate(rows, headers="keys", floatfmt=".3f"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
