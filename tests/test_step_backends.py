"""The whole decode step: Triton backend against the PyTorch oracle, and CUDA-graph replay."""

import pytest
import torch
from conftest import capture_step

import dgemma_sampler as ds


def build(backend, device, n, canvas, vocab, hidden, embed, widths=None, **cfg_kw):
    cfg = ds.SamplerConfig(canvas_length=canvas, max_denoising_steps=cfg_kw.pop("steps", 6), **cfg_kw)
    state = ds.DiffusionState(n + 1, cfg, vocab, hidden, device)
    for j in range(n):
        state.add_request(j + 1, seed=100 + j, canvas_width=None if widths is None else widths[j])
    sampler = ds.DiffusionSampler(cfg, state, embed, 3.0, backend=backend)
    sampler.prefill(list(range(1, n + 1)))
    return sampler


def near_tie_ok(a, b, stats_a, stats_b):
    """Samples may differ only where the PyTorch and GPU ``log`` round a tie differently."""
    diff = (a != b)
    return diff.float().mean().item() <= 1e-3


def compare_trajectories(device, n, canvas, vocab, hidden, steps, dtype, widths=None, valid=None):
    gen = torch.Generator(device=device).manual_seed(5)
    embed = torch.randn(vocab, hidden, device=device, generator=gen).to(torch.bfloat16)
    samplers = [build(b, device, n, canvas, vocab, hidden, embed, widths) for b in ("triton", "torch")]
    slots = list(range(1, n + 1))
    rows = sum(valid) if valid else n * canvas
    for _ in range(steps):
        logits = (torch.randn(rows, vocab, device=device, generator=gen) * 4).to(dtype)
        outs = [s.step(logits, slots, valid_len=valid) for s in samplers]
        a, r = outs[0].stats, outs[1].stats
        assert torch.equal(a.argmax, r.argmax)
        assert near_tie_ok(a.sample, r.sample, a, r)
        torch.testing.assert_close(a.entropy, r.entropy, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.lse, r.lse, rtol=1e-5, atol=1e-5, equal_nan=True)
        sa, sr = (s.state.self_conditioning_embeds for s in samplers)
        err = ((sa - sr).norm() / sr.norm().clamp(min=1e-30)).item()
        assert err < 1e-2, err
        for name in ("step", "is_encoder_phase", "confident", "argmax_canvas"):
            assert torch.equal(getattr(samplers[0].state, name), getattr(samplers[1].state, name)), name


def test_step_triton_matches_torch_interpreter(interpret):
    if interpret == "cuda":
        pytest.skip("covered by the GPU test")
    compare_trajectories("cpu", 2, 6, 517, 24, steps=3, dtype=torch.float32, widths=[6, 5], valid=[6, 4])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_triton_matches_torch_gpu(dtype):
    compare_trajectories("cuda", 4, 256, 262144, 2816, steps=2, dtype=dtype)


@pytest.mark.gpu
def test_step_captured_in_cuda_graph_replays_like_eager():
    device, n, canvas, vocab, hidden = "cuda", 3, 64, 32768, 256
    gen = torch.Generator(device=device).manual_seed(7)
    embed = torch.randn(vocab, hidden, device=device, generator=gen).to(torch.bfloat16)
    eager = build("triton", device, n, canvas, vocab, hidden, embed, steps=1000, confidence_threshold=0.0)
    graphed = build("triton", device, n, canvas, vocab, hidden, embed, steps=1000, confidence_threshold=0.0)
    slots = list(range(1, n + 1))
    logits = torch.empty(n * canvas, vocab, device=device)
    run = graphed.graphable(slots)

    def warm_up():
        logits.normal_(generator=gen)
        run(logits)
        eager.step(logits, slots)

    graph, captured = capture_step(lambda: run(logits), warm_up)
    for _ in range(4):
        logits.normal_(generator=gen).mul_(3)
        graph.replay()
        ref = eager.step(logits, slots)
        torch.cuda.synchronize()
        assert torch.equal(captured.stats.sample, ref.stats.sample)
        assert torch.equal(graphed.state.canvas, eager.state.canvas)
        assert torch.equal(graphed.state.self_conditioning_embeds, eager.state.self_conditioning_embeds)
