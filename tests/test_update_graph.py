"""The state update replayed from a CUDA graph (``update_graph.py``) is the eager update, bit for bit."""

import pytest
import torch

import dgemma_sampler as ds
from dgemma_sampler import step_graph

FIELDS = ("canvas", "argmax_canvas", "accepted_canvas_history", "accepted_canvas_history_len",
          "step", "draws", "is_encoder_phase", "confident", "self_conditioning_embeds")


def make(device, graph_update, vocab, hidden, embed, widths=(64, 48, 64, 64), canvas=64):
    cfg = ds.SamplerConfig(canvas_length=canvas, max_denoising_steps=4, confidence_threshold=6.0,
                           entropy_bound=0.5)
    state = ds.DiffusionState(len(widths) + 2, cfg, vocab, hidden, device)
    for j, w in enumerate(widths):
        kw = {}
        if j == 1:
            kw = dict(seed_canvas=list(range(5, 5 + w)), pinned=[0, 3, w - 1])
        if j == 3:
            kw = dict(top_k=40)
        state.add_request(j + 1, seed=500 + j, canvas_width=w, read_only=(j == 2), **kw)
    sampler = ds.DiffusionSampler(cfg, state, embed, 2.0, graph_update=graph_update)
    sampler.prefill(list(range(1, len(widths) + 1)))
    return sampler


def test_graph_update_is_off_and_refused_without_cuda():
    embed = torch.zeros(11, 4)
    assert not make("cpu", None, 11, 4, embed, widths=(3,), canvas=3).graph_update
    with pytest.raises(ValueError, match="CUDA"):
        make("cpu", True, 11, 4, embed, widths=(3,), canvas=3)


@pytest.mark.gpu
@pytest.mark.parametrize("valid", [None, (64, 40, 64, 17)])
def test_graph_update_matches_the_eager_update_gpu(valid, monkeypatch):
    # (these batches would replay their whole step, test_step_graph.py: here the parts)
    monkeypatch.setattr(step_graph, "MAX_GRAPH_BYTES", 0)
    device, vocab, hidden = "cuda", 4099, 96
    gen = torch.Generator(device=device).manual_seed(3)
    embed = torch.randn(vocab, hidden, device=device, generator=gen).to(torch.bfloat16)
    graphed, eager = make(device, True, vocab, hidden, embed), make(device, False, vocab, hidden, embed)
    slots = [1, 2, 3, 4]
    rows = sum(valid) if valid else 64 + 48 + 64 + 64
    kept = []
    for t in range(12):  # past max_denoising_steps: converge, commit, denoise again
        if t == 8:  # a new batch shape: a new plan, captured anew
            slots, rows, valid = [1, 3, 4], 64 * 3, None
        logits = torch.randn(rows, vocab, device=device, generator=gen) * (1 + t % 3)
        a = graphed.step(logits, slots, valid_len=valid)
        b = eager.step(logits, slots, valid_len=valid)
        for x, y in zip((a.sampled, a.num_sampled, a.just_converged, *a.stats.as_tuple()),
                        (b.sampled, b.num_sampled, b.just_converged, *b.stats.as_tuple())):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
        for name in FIELDS:
            assert torch.equal(getattr(graphed.state, name), getattr(eager.state, name)), (t, name)
        kept.append((a, b))
    # Outputs of earlier steps were not overwritten by later replays.
    for a, b in kept:
        assert torch.equal(a.sampled, b.sampled) and torch.equal(a.stats.argmax, b.stats.argmax)
    captured = [p.update_graph.graph is not None and p.update_graph.prologue_graph is not None
                for p in graphed.runner.plans.values()]
    assert captured and all(captured)
    assert all(p.update_graph is None for p in eager.runner.plans.values())


@pytest.mark.gpu
def test_step_captured_by_the_caller_after_the_update_graph_gpu(monkeypatch):
    """A caller that captures ``step`` in a graph of its own after the plan's parts were
    captured gets the parts' operators in that graph (not a replay of ours inside it); so
    with the whole step graphed (``step_graph.py``)."""
    for whole in (False, True):
        monkeypatch.setattr(step_graph, "MAX_GRAPH_BYTES", 1 << 28 if whole else 0)
        _captured_by_the_caller(whole)


def _captured_by_the_caller(whole: bool) -> None:
    device, vocab, hidden = "cuda", 4099, 96
    gen = torch.Generator(device=device).manual_seed(4)
    embed = torch.randn(vocab, hidden, device=device, generator=gen).to(torch.bfloat16)
    graphed, eager = make(device, True, vocab, hidden, embed), make(device, False, vocab, hidden, embed)
    slots, valid = [1, 2, 3, 4], (64, 40, 64, 17)
    logits = torch.empty(sum(valid), vocab, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # eager, capture, replay
            logits.normal_(generator=gen)
            graphed.step(logits, slots, valid_len=valid)
            eager.step(logits, slots, valid_len=valid)
    torch.cuda.current_stream().wait_stream(stream)
    plans = list(graphed.runner.plans.values())
    if whole:
        assert all(p.step_graph is not None and p.step_graph.graph is not None for p in plans)
    else:
        assert all(p.update_graph.graph is not None for p in plans)
    user = torch.cuda.CUDAGraph()
    with torch.cuda.graph(user):
        captured = graphed.step(logits, slots, valid_len=valid)
    for _ in range(4):
        logits.normal_(generator=gen).mul_(2)
        user.replay()
        ref = eager.step(logits, slots, valid_len=valid)
        torch.cuda.synchronize()
        assert torch.equal(captured.sampled, ref.sampled)
        for name in FIELDS:
            assert torch.equal(getattr(graphed.state, name), getattr(eager.state, name)), name
