"""Whole decode steps from hidden states under tensor parallelism, without a logits gather.

Each of 1, 2 and 3 gloo ranks on the CPU holds one vocabulary slice of the (tied) LM head and
embedding (``tensor_parallel.vocab_slice``: whole sampling blocks) and runs
``DiffusionSampler.step(hidden_states=..., output_weight=<its slice>)``: it projects only its
slice, merges the statistics' per-row partials over the group and all-reduces its share of the
soft embedding. Every rank must end each step in the single-rank state: the same tokens,
canvases, counters and statistics (lse / entropy within fp32 rounding of the merge), and the
same soft embeddings up to the order of the fp32 sum.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import pytest
import torch

import dgemma_sampler as ds
from dgemma_sampler import tensor_parallel as tp

VOCAB = 3 * 4096 + 5  # three whole sampling blocks and a ragged one
HIDDEN, CANVAS, STEPS = 16, 6, 3
WORLDS = (1, 2, 3)


def inputs():
    g = torch.Generator().manual_seed(11)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.7).to(torch.bfloat16)
    hidden = [(torch.randn(3 * CANVAS, HIDDEN, generator=g) * (1 + 2 * t)).to(torch.bfloat16)
              for t in range(STEPS)]
    return weight, hidden


def run(rank: int, world: int, group) -> dict:
    """STEPS steps of three requests (one truncated) on ``rank``'s slice; what each step left."""
    weight, hidden = inputs()
    start, end = tp.vocab_slice(VOCAB, rank, world)
    cfg = ds.SamplerConfig(t_min=0.5, t_max=0.9, max_denoising_steps=2, canvas_length=CANVAS,
                           softcap=30.0, entropy_bound=0.8, confidence_threshold=0.0)
    state = ds.DiffusionState(4, cfg, VOCAB, HIDDEN, "cpu")
    slots = [0, 1, 3]
    for j, s in enumerate(slots):
        state.add_request(s, seed=40 + j)
    state.finish_prefill(slots)

    def all_reduce(t: torch.Tensor) -> None:
        torch.distributed.all_reduce(t, group=group)

    sampler = ds.DiffusionSampler(cfg, state, weight[start:end], 2.5, backend="torch",
                                  vocab_start=start, sc_reduce=all_reduce if world > 1 else None,
                                  tp_group=group if world > 1 else None)
    trace = []
    for t in range(STEPS):
        valid = [CANVAS, CANVAS - 2, CANVAS]
        rows = torch.cat([hidden[t][j * CANVAS: j * CANVAS + v] for j, v in enumerate(valid)])
        out = sampler.step(None, slots, valid, hidden_states=rows, output_weight=weight[start:end])
        trace.append(dict(
            sampled=out.sampled.clone(), stats=[f.clone() for f in out.stats.as_tuple()],
            canvas=state.canvas.clone(), step=state.step.clone(),
            history=state.accepted_canvas_history.clone(),
            sc=state.self_conditioning_embeds.clone()))
    return trace


def _worker(rank: int, store_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    world_max = max(WORLDS)
    store = dist.FileStore(os.path.join(store_dir, "store"), world_max)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_max,
                            timeout=timedelta(seconds=120))
    try:
        for world in WORLDS:
            group = None if world == world_max else dist.new_group(list(range(world)))
            if rank < world:
                torch.save(run(rank, world, group if world < world_max else dist.group.WORLD),
                           os.path.join(store_dir, f"world{world}_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def traces():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as store_dir:
        mp.start_processes(_worker, args=(store_dir,), nprocs=max(WORLDS), start_method="spawn")
        return {w: [torch.load(os.path.join(store_dir, f"world{w}_rank{r}.pt"))
                    for r in range(w)] for w in WORLDS}


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_end_every_step_in_the_single_rank_state(traces, world):
    want = run(0, 1, None)
    for rank_trace in traces[world]:
        for t, (got, ref) in enumerate(zip(rank_trace, want)):
            for name in ("sampled", "canvas", "step", "history"):
                assert torch.equal(got[name], ref[name]), (world, t, name)
            argmax, sample, entropy, lse, threshold, has_nan = got["stats"]
            r_argmax, r_sample, r_entropy, r_lse, r_threshold, r_has_nan = ref["stats"]
            assert torch.equal(argmax, r_argmax) and torch.equal(sample, r_sample)
            assert torch.equal(has_nan, r_has_nan) and torch.equal(threshold, r_threshold)
            torch.testing.assert_close(lse, r_lse, rtol=1e-5, atol=1e-5, equal_nan=True)
            torch.testing.assert_close(entropy, r_entropy, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["sc"], ref["sc"], rtol=1e-4, atol=1e-4)


def test_one_rank_in_a_group_is_the_plain_step(traces):
    want = run(0, 1, None)
    for got, ref in zip(traces[1][0], want):
        assert torch.equal(got["sampled"], ref["sampled"])
        assert torch.equal(got["sc"], ref["sc"])
