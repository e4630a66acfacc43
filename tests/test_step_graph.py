"""Whole steps of small batches replayed from one CUDA graph (``step_graph.py``).

A sampler with graph replay and one without, from the same requests and inputs, step after
step: the replayed steps (projection, statistics, support pass, GEMMs, update) give the eager
steps' outputs and state bit for bit, for hidden-state and logits input, for two batch shapes
taking turns (their graphs share one memory pool), and a step that stashes logprobs runs eagerly
in between without disturbing the graph. Larger batches are not graphed. A step whose
projection makes other logits (another head, softcap or slice) is not replayed from the graph of
the old one, and a caller's projection (vLLM's ``compute_logits``) is never captured.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dgemma_sampler as ds
from dgemma_sampler import step_graph
from dgemma_sampler.head import LmHead, Projection
from dgemma_sampler.update_graph import UpdateGraph

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


@pytest.mark.gpu
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


@pytest.mark.gpu
def test_large_batches_are_not_graphed(monkeypatch):
    monkeypatch.setattr(step_graph, "MAX_GRAPH_BYTES", 1)
    weight, (graphed, _) = samplers(2)
    hidden = torch.randn(CL + 200, H, device="cuda").to(torch.bfloat16)
    for _ in range(3):
        graphed.step(None, [0, 1], hidden_states=hidden, output_weight=weight)
    assert all(p.step_graph is None for p in graphed.runner.plans.values())


def test_projection_keys_tell_which_logits_a_graph_may_replay():
    """Two projections of one head (new ``LmHead`` objects, as every ``step`` makes) share a key;
    another head, softcap or slice does not; a caller's projection has none."""
    w = torch.randn(64, 8).to(torch.bfloat16)
    key = LmHead(w, softcap=30.0).projection().key
    assert key is not None and key == LmHead(w, softcap=30.0).projection().key
    assert key != LmHead(w.clone(), softcap=30.0).projection().key
    assert key != LmHead(w, softcap=20.0).projection().key
    assert key != LmHead(w[:32], softcap=30.0, vocab_size=64).projection().key
    assert Projection(project=lambda h, n: h, itemsize=6).key is None


def test_a_new_projection_drops_the_graph():
    """``StepGraph.use``: the same key keeps the captured graph; another drops it (the plan runs
    eagerly once and is captured again)."""
    w = torch.randn(64, 8).to(torch.bfloat16)
    first = LmHead(w, softcap=30.0).projection()
    graph = step_graph.StepGraph(None, None, first, pool=None)
    graph.graph, graph.calls = "captured", 5
    graph.use(LmHead(w, softcap=30.0).projection())
    assert graph.graph == "captured" and graph.calls == 5
    other = LmHead(w.clone(), softcap=30.0).projection()
    graph.use(other)
    assert graph.graph is None and graph.calls == 0 and graph.projection is other


def test_a_callers_projection_is_never_captured():
    """The runner does not graph steps through a projection without a key."""
    cfg = ds.SamplerConfig(canvas_length=4)
    state = ds.DiffusionState(2, cfg, 64, 8, "cpu")
    state.add_request(0, seed=1)
    state.finish_prefill([0])
    sampler = ds.DiffusionSampler(cfg, state, torch.randn(64, 8), 1.0)
    runner = sampler.runner
    runner.graph_update = True  # (as on CUDA; no graph is run here)
    widths = np.array([4])
    plan = runner.plan([0], np.array([0]), widths, widths, 64)
    plan.update_graph = UpdateGraph()  # (what a CUDA runner's plans carry)
    rows = torch.randn(4, 8)
    caller = Projection(project=lambda h, n: h, itemsize=2)
    assert runner._step_graph(plan, rows, 64, caller, None, None, whole=True) is None
    ours = LmHead(torch.randn(64, 8), softcap=None).projection()
    assert runner._step_graph(plan, rows, 64, ours, None, None, whole=True) is not None
