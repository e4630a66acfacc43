"""The step vLLM runs: ``FusedDiffusionSampler``'s device path through the runner, without vLLM.

For each number of decoding requests it times one decode step as each vLLM adapter runs it
(``dgemma_sampler.vllm.device.decode`` over ``runner.StepRunner``, with stand-ins for vLLM's
host objects, as ``tests/test_vllm_device_path.py`` builds them), and in the same run what it
is made of:

* ``v0.34`` — hidden states ``[N * CL, H]`` in the model dtype; ``compute_logits`` (a bf16 LM
  head GEMM and the fp32 softcap, as DiffusionGemma's) one tile at a time, tiles sized by the
  runner's budget; then the fused step over each tile's logits;
* ``v0.33`` — fp32 softcapped logits ``[N * CL, V]`` projected beforehand (not timed), the
  fused step over them in one tile;
* ``projection`` — ``compute_logits`` over all rows alone: what 0.34's path adds to 0.33's;
* ``sampler`` — ``DiffusionSampler.step`` over the same logits (the public API; the same
  runner, so it should time as ``v0.33``).

Speed target: ``v0.34 <= 1.05 x (projection + v0.33)`` (tiling the projection costs no more
than 5%) and ``v0.33 <= 1.02 x sampler`` (the adapter adds no device work). Transient memory
(peak allocated beyond inputs and state): ``v0.34`` one tile of projected logits
(``bytes_per_request`` with 6 bytes per logit), ``v0.33`` O(1) per row.

    bash bench/on_device.sh runner python bench_runner.py             # on the GPU
    python bench/bench_runner.py --requests 1,2 --canvas 8 --vocab 301 --hidden 16   # CPU smoke
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record  # noqa: E402
from bench_step import GIB, device_timer, transient_bytes  # noqa: E402

import dgemma_sampler as ds  # noqa: E402
from dgemma_sampler.ops import resolve_backend  # noqa: E402
from dgemma_sampler.runner import StepRunner  # noqa: E402
from dgemma_sampler.vllm.device import VllmRequestOptions, decode, projected_logit_bytes  # noqa: E402

SOFTCAP = 30.0


def compute_logits(weight: torch.Tensor):
    """DiffusionGemma's ``compute_logits``: the tied head in its dtype, then the softcap in
    fp32 in place (vLLM compiles it into one kernel: the head's output and its fp32 copy are
    all it holds)."""

    def project(hidden: torch.Tensor, lengths=None) -> torch.Tensor:
        logits = torch.nn.functional.linear(hidden, weight).float()
        return logits.div_(SOFTCAP).tanh_().mul_(SOFTCAP)

    return project


class VllmStandIn:
    """vLLM's host objects around the adapter's runner: diffusion states (a ``DiffusionState``
    with the same tensors), sampling states without top-k / top-p, the output buffers."""

    def __init__(self, n, canvas, vocab, hidden, weight, device, hidden_tile_bytes):
        # Never converge: every timed step is a denoise step with its soft embedding.
        cfg = ds.SamplerConfig(canvas_length=canvas, confidence_threshold=0.0,
                               max_denoising_steps=1_000_000)
        self.states = ds.DiffusionState(n, cfg, vocab, hidden, device)
        for s in range(n):
            self.states.add_request(s, seed=1000 + s)
        self.states.finish_prefill(list(range(n)))
        off = SimpleNamespace(np=np.full(n, vocab, dtype=np.int32),
                              gpu=torch.full((n,), vocab, dtype=torch.int32, device=device))
        one = SimpleNamespace(np=np.ones(n, dtype=np.float32),
                              gpu=torch.ones(n, dtype=torch.float32, device=device))
        options = VllmRequestOptions(SimpleNamespace(top_k=off, top_p=one), self.states, vocab)
        self.runner = StepRunner(cfg, self.states, options, weight, float(hidden) ** 0.5,
                                 backend=resolve_backend("auto", torch.device(device)),
                                 vocab_size=vocab, hidden_tile_bytes=hidden_tile_bytes)
        self.n, self.canvas, self.vocab = n, canvas, vocab
        self.sampled = torch.zeros(n, canvas, dtype=torch.int32, device=device)
        self.num_sampled = torch.zeros(n, dtype=torch.int32, device=device)
        self.draft_tokens = torch.zeros(n, canvas, dtype=torch.int64, device=device)
        self.all_slots = torch.arange(n, device=device)
        self.weight = weight

    def step(self, rows: torch.Tensor, project=None) -> None:
        n = self.n
        decode(self.runner, rows, decode_slots=np.arange(n), decode_idx=np.arange(n),
               valid=np.full(n, self.canvas), vocab=self.vocab, column_tokens=None,
               sampled=self.sampled, num_sampled=self.num_sampled,
               draft_tokens=self.draft_tokens, all_slots=self.all_slots, project=project,
               logits_itemsize=projected_logit_bytes(self.weight) if project else 0)


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", default="1,4,16,32" if cuda else "1,2")
    p.add_argument("--canvas", type=int, default=256 if cuda else 8)
    p.add_argument("--vocab", type=int, default=262144 if cuda else 301)
    p.add_argument("--hidden", type=int, default=2816 if cuda else 16)
    p.add_argument("--reps", type=int, default=10 if cuda else 2)
    p.add_argument("--hidden-tile-bytes", type=int, default=1 << 30,
                   help="the runner's cap on one tile of projected logits")
    p.add_argument("--out", default=None, help="JSON results elsewhere than the record "
                   "(default bench/results/runner-<card>.json)")
    args = p.parse_args(argv)
    device = "cuda" if cuda else "cpu"
    warmup = 3 if cuda else 1
    gen = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen, device=device)
              / args.hidden ** 0.5).to(torch.bfloat16)
    project = compute_logits(weight)
    shape = dict(canvas=args.canvas, vocab=args.vocab, hidden=args.hidden, reps=args.reps,
                 hidden_tile_bytes=args.hidden_tile_bytes)
    with record.Record("runner", args.out) as rec:
        results = []
        for n in [int(x) for x in args.requests.split(",")]:
            row = measure(n, args, weight, project, device, gen, warmup)
            results.append(row)
            print_row(row, args)
        rec.save({"shape": shape, "results": results}, {**shape, "rows": results})
    return 0


def measure(n, args, weight, project, device, gen, warmup) -> dict:
    """One row of the table: both adapters' paths and their parts at ``n`` requests."""
    cuda = device == "cuda"
    rows = n * args.canvas
    hidden = torch.randn(rows, args.hidden, generator=gen, device=device).to(torch.bfloat16)
    logits = project(hidden)
    row = {"requests": n}
    for name, rows_in, proj in (("v0.34", hidden, project), ("v0.33", logits, None)):
        s = VllmStandIn(n, args.canvas, args.vocab, args.hidden, weight, device,
                        args.hidden_tile_bytes)

        def step(s=s, rows_in=rows_in, proj=proj):
            s.step(rows_in, proj)

        row[f"{name}_ms"] = device_timer(step, warmup, args.reps, cuda)
        row[f"{name}_transient_bytes"] = transient_bytes(step, cuda)
        row[f"{name}_tile_requests"] = s.runner.last_tile_requests
    row["projection_ms"] = device_timer(lambda: project(hidden), warmup, args.reps, cuda)
    cfg = ds.SamplerConfig(canvas_length=args.canvas, confidence_threshold=0.0,
                           max_denoising_steps=1_000_000)
    state = ds.DiffusionState(n, cfg, args.vocab, args.hidden, device)
    for s in range(n):
        state.add_request(s, seed=1000 + s)
    sampler = ds.DiffusionSampler(cfg, state, weight, float(args.hidden) ** 0.5)
    sampler.prefill(list(range(n)))
    row["sampler_ms"] = device_timer(lambda: sampler.step(logits, list(range(n))), warmup,
                                     args.reps, cuda)
    row["v0.34_vs_parts"] = row["v0.34_ms"] / (row["projection_ms"] + row["v0.33_ms"])
    row["v0.33_vs_sampler"] = row["v0.33_ms"] / row["sampler_ms"]
    return row


def print_row(row, args) -> None:
    def gib(b):
        return "-" if b is None else f"{b / GIB:.3f}"

    one = args.canvas * args.vocab * 6 / GIB
    print(f"{row['requests']:3d} requests | v0.34 {row['v0.34_ms']:8.2f} ms "
          f"(tile {row['v0.34_tile_requests']}, transient {gib(row['v0.34_transient_bytes'])} GiB; "
          f"one request's projection {one:.3f} GiB) | v0.33 {row['v0.33_ms']:8.2f} ms "
          f"(transient {gib(row['v0.33_transient_bytes'])} GiB) | projection "
          f"{row['projection_ms']:7.2f} ms | sampler {row['sampler_ms']:8.2f} ms | "
          f"v0.34/(proj+v0.33) {row['v0.34_vs_parts']:.3f} (target <= 1.05) | "
          f"v0.33/sampler {row['v0.33_vs_sampler']:.3f} (target <= 1.02)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
