"""Whole steps of small batches replayed from one CUDA graph (``step_graph.py``).

A sampler with graph replay and one without, from the same requests and inputs, step after
step: the replayed steps (projection, statistics, support pass, GEMMs, update) give the eager
steps' outputs and state bit for bit, for hidden-state and logits input, for two batch shapes
taking turns (their graphs share one memory pool), and a step that stashes logprobs runs eagerly
in between without disturbing the graph. Larger batches are not graphed.
"""

from __future__ import annotations

import pytest
import torch

import dgemma_sampler as ds
from dgemma_sampler import step_graph

pytestmark = pytest.mark.gpu

V, H, CL = 32768, 512, 256
STATE = ("canvas", "argmax_canvas", "step", "is_encoder_phase", "confident", "draws",
         "accepted_canvas_history", "accepted_canvas_history_len", "self_conditioning_embeds")


def samplers(n_slots: int):
    cfg = ds.SamplerConfig(canvas_length=CL, softcap=30.0, max_denoising_steps=5,
                           confidence_threshold=0.01)
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(V, H, generator=g, device="cuda") / H ** 0.5).to(torch.bfloat16)
    made = []
    for graphs in (True, False):
        state = ds.DiffusionState(n_slots, cfg, V, H, "cuda")
        for s in range(n_slots):
            state.add_request(s, seed=7 + s, canvas_width=CL if s else 200)
        state.finish_prefill(list(range(n_slots)))
        made.append(ds.DiffusionSampler(cfg, state, weight, 3.0, graph_update=graphs))
    return weight, made


def assert_same(a: ds.DiffusionSampler, b: ds.DiffusionSampler, out_a, out_b) -> None:
    assert torch.equal(out_a.sampled, out_b.sampled)
    assert torch.equal(out_a.num_sampled, out_b.num_sampled)
    assert torch.equal(out_a.just_converged, out_b.just_converged)
    for x, y in zip(out_a.stats.as_tuple(), out_b.stats.as_tuple()):
        assert torch.equal(x.view(torch.uint8) if x.dtype.is_floating_point else x,
                           y.view(torch.uint8) if y.dtype.is_floating_point else y)
    for name in STATE:
        assert torch.equal(getattr(a.state, name), getattr(b.state, name)), name


@pytest.mark.parametrize("input", ["hidden", "logits"])
def test_replayed_steps_are_the_eager_steps(input):
    weight, (graphed, eager) = samplers(3)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [[0], [1, 2]]  # two shapes taking turns (one pool)
    for t in range(8):
        slots = batches[t % 2]
        valid = [CL if s else 200 for s in slots]
        hidden = (torch.randn(sum(valid), H, generator=g, device="cuda") * (1 + t)).to(torch.bfloat16)
        logprobs = {slots[0]: 2} if t == 5 else None  # an eager step between replays
        if input == "hidden":
            kw = dict(hidden_states=hidden, output_weight=weight, logprobs=logprobs)
            out_a = graphed.step(None, slots, valid, **kw)
            out_b = eager.step(None, slots, valid, **kw)
        else:
            logits = torch.nn.functional.linear(hidden, weight).float()
            out_a = graphed.step(logits, slots, valid, logprobs=logprobs)
            out_b = eager.step(logits, slots, valid, logprobs=logprobs)
        assert_same(graphed, eager, out_a, out_b)
    replayed = [p.step_graph for p in graphed.runner.plans.values() if p.step_graph is not None]
    assert len(replayed) == 2 and all(g.graph is not None for g in replayed)


def test_large_batches_are_not_graphed(monkeypatch):
    monkeypatch.setattr(step_graph, "MAX_GRAPH_BYTES", 1)
    weight, (graphed, _) = samplers(2)
    hidden = torch.randn(CL + 200, H, device="cuda").to(torch.bfloat16)
    for _ in range(3):
        graphed.step(None, [0, 1], hidden_states=hidden, output_weight=weight)
    assert all(p.step_graph is None for p in graphed.runner.plans.values())
