"""The canvas-update kernel against its PyTorch twin (``step.denoise_update``), bit for bit:
the outputs and every state tensor it writes, over several steps of requests that denoise,
commit, converge, pin positions, are read-only or have narrow canvases."""

import math

import numpy as np
import pytest
import torch

import dgemma_sampler as ds
from dgemma_sampler import step as step_mod
from dgemma_sampler.reference import RowStats

VOCAB = 4099
WRITTEN = ("canvas", "argmax_canvas", "accepted_canvas_history", "accepted_canvas_history_len",
           "step", "draws", "is_encoder_phase", "confident")


def make_states(device, canvas, widths, *, ring=3, max_steps=6, pins=True, read_only=(1,)):
    """Two equal states (kernel, twin) of requests in slots 1..n; ``ring`` rows in the
    stability ring (``stability_threshold + 1``)."""
    cfg = ds.SamplerConfig(canvas_length=canvas, max_denoising_steps=max_steps,
                           confidence_threshold=0.5, stability_threshold=ring - 1)
    n = len(widths)
    states = []
    for _ in range(2):
        st = ds.DiffusionState(n + 2, cfg, VOCAB, 8, device)
        for j, w in enumerate(widths):
            kw = {}
            if pins and j == 0:
                kw = dict(seed_canvas=[(7 * i) % VOCAB for i in range(w)], pinned=[0, w - 1])
            st.add_request(j + 1, seed=2**63 - 1 - 97 * j, canvas_width=w, read_only=j in read_only,
                           max_steps=3 if j == 2 else None, **kw)
        st.finish_prefill(list(range(1, n + 1)))
        states.append(st)
    return cfg, states


def stats_for(it, n, W, widths, device, *, peaked_after=2):
    """Statistics of step ``it``: random entropies with ties, +inf and zeros, and arg-max
    canvases that settle after ``peaked_after`` steps (so requests converge)."""
    gen = torch.Generator().manual_seed(100 + it)
    ent = (torch.rand(n, W, generator=gen) * 0.3).to(torch.float32)
    ent[:, 1::5] = ent[:, :1]  # ties, broken by position
    ent[0, 2] = 0.0
    ent[n - 1, 3] = float("inf")
    stable = torch.randint(0, VOCAB, (n, W), generator=torch.Generator().manual_seed(7))
    argmax = stable if it >= peaked_after else torch.randint(0, VOCAB, (n, W), generator=gen)
    if it >= peaked_after:
        ent = ent * 1e-3  # confident
    if n > 1:  # request 1 is settled from the start: it converges as soon as the ring is full
        argmax[1] = stable[1]
        ent[1] = ent[1] * 1e-3
    for j, w in enumerate(widths):  # phantom entropy past the valid rows, as the step fills in
        ent[j, w:] = math.log(VOCAB)
    stats = RowStats(argmax=argmax, sample=torch.randint(0, VOCAB, (n, W), generator=gen),
                     entropy=ent, lse=torch.rand(n, W, generator=gen),
                     threshold=torch.full((n, W), float("-inf")),
                     has_nan=torch.zeros(n, W, dtype=torch.bool))
    return RowStats(*(t.to(device) for t in stats.as_tuple()))


def run_both(states, slots, stats, widths, W, valid, cfg, pins):
    twin = step_mod.denoise_update(
        states[1], slots, stats, valid, widths, W, confidence_threshold=cfg.confidence_threshold,
        entropy_bound=cfg.entropy_bound, vocab_size=VOCAB, noise_backend="torch")
    from dgemma_sampler.kernels.canvas_update import canvas_update

    got = canvas_update(states[0], slots, stats.entropy, stats.argmax, stats.sample, widths, valid,
                        confidence_threshold=cfg.confidence_threshold,
                        entropy_bound=cfg.entropy_bound, vocab_size=VOCAB,
                        streams=step_mod.NOISE_STREAMS, pins=pins)
    return got, twin


@pytest.mark.parametrize("canvas,widths,pins,ring", [
    (16, [16, 16, 16], True, 2),        # the default ring
    (24, [20, 24, 9, 24], True, 3),     # narrow canvases (a 24-wide step over widths below it)
    (13, [13, 13, 13], False, 4),        # not a power of two, no pins
])
def test_canvas_update_matches_twin(interpret, canvas, widths, pins, ring):
    cfg, states = make_states(interpret, canvas, widths, pins=pins, ring=ring)
    assert states[0].accepted_canvas_history.shape[1] == ring
    n, W = len(widths), canvas
    slots = torch.arange(1, n + 1, device=interpret)
    width = torch.tensor(widths, device=interpret)
    valid = torch.tensor([w - (j % 2) for j, w in enumerate(widths)], device=interpret)
    states[1].is_encoder_phase[n] = True  # the last request commits on the first step
    states[0].is_encoder_phase[n] = True
    seen = set()
    for it in range(6):
        stats = stats_for(it, n, W, widths, interpret)
        got, twin = run_both(states, slots, stats, width, W, valid, cfg, pins)
        sampled, num_sampled, converged, keep = got
        t_sampled, t_num, t_keep, t_conv, t_pinned = twin
        assert torch.equal(sampled, t_sampled), it
        assert torch.equal(num_sampled, t_num.to(torch.int32)), it
        assert torch.equal(converged, t_conv), it
        want_keep = t_keep.unsqueeze(1).expand(n, W)
        if t_pinned is not None:
            want_keep = want_keep & ~t_pinned
        assert torch.equal(keep, want_keep), it
        for name in WRITTEN:
            assert torch.equal(getattr(states[0], name), getattr(states[1], name)), (it, name)
        seen.update(f"conv{j}" for j in converged.nonzero().flatten().tolist())
        seen.update(f"emit{j}" for j in num_sampled.nonzero().flatten().tolist())
    # the run went through convergence, emission and renoise
    assert any(s.startswith("conv") for s in seen) and any(s.startswith("emit") for s in seen)
    assert (states[0].canvas[1:n + 1] != states[0].argmax_canvas[1:n + 1]).any()


def fp32_prefix_before(sorted_row):
    """``cumsum - x`` of one ascending row accumulated in fp32, in order (what the kernel must
    not do)."""
    total, before = np.float32(0), []
    for v in sorted_row.numpy():
        total = np.float32(total + v)
        before.append(np.float32(total - v))
    return torch.tensor(before)


def separating_bound(row):
    """A bound that PyTorch's CPU prefix sums (double accumulation) and fp32 ones decide
    differently for ``row``: the smaller of the two at the first rank where they differ."""
    ranked, _ = torch.sort(row)
    cpu = torch.cumsum(ranked, 0) - ranked
    f32 = fp32_prefix_before(ranked)
    r = int((cpu[1:] != f32[1:]).nonzero()[0]) + 1
    return min(float(cpu[r]), float(f32[r]))


def test_acceptance_matches_cpu_prefix_sums(interpret):
    """Acceptance alone against ``step.acceptance_mask`` on the CPU, with bounds placed where a
    prefix sum in fp32 would decide otherwise, and on rows of magnitudes 2^-40 .. 2^20, exact
    ties, +inf and NaN entropies."""
    gen = torch.Generator().manual_seed(5)
    W, n = 40, 6
    ent = (torch.rand(n, W, generator=gen) * 0.3).to(torch.float32)
    ent[2] = torch.ldexp(torch.rand(W, generator=gen) + 0.5,
                         torch.randint(-40, 20, (W,), generator=gen)).to(torch.float32)
    ent[3] = 0.25
    ent[4, :20] = float("inf")
    ent[4, 25] = float("nan")
    ent[5, 5] = float("nan")
    ent[5, ::3] = 1e-30
    bounds = [separating_bound(ent[0]), separating_bound(ent[1]), 1.5, 0.5, 0.1, 0.2]
    _, states = make_states(interpret, W, [W] * n, pins=False, read_only=())
    argmax = torch.zeros(n, W, dtype=torch.int64, device=interpret)
    # (a sample id no random token takes: the canvas shows which positions were accepted)
    stats = RowStats(argmax=argmax, sample=argmax + VOCAB + 5, entropy=ent.to(interpret),
                     lse=ent.to(interpret), threshold=ent.to(interpret), has_nan=argmax.bool())
    from dgemma_sampler.kernels.canvas_update import canvas_update

    for j, bound in enumerate(bounds):
        slots = torch.tensor([j + 1], device=interpret)
        width = torch.tensor([W], device=interpret)
        row = RowStats(*(t[j:j + 1] for t in stats.as_tuple()))
        canvas_update(states[0], slots, row.entropy, row.argmax, row.sample, width, width,
                      confidence_threshold=0.5, entropy_bound=bound, vocab_size=VOCAB,
                      streams=step_mod.NOISE_STREAMS, pins=False)
        accepted = states[0].canvas[j + 1, :W].cpu() == VOCAB + 5
        assert torch.equal(accepted, step_mod.acceptance_mask(ent[j:j + 1], bound)[0]), j
        if j < 2:  # the fp32 prefix sums would have decided one position otherwise
            ranked, order = torch.sort(ent[j])
            f32 = fp32_prefix_before(ranked) <= bound
            f32[0] = True
            assert not torch.equal(accepted[order], f32)


def test_canvas_update_asserts_its_arguments(interpret):
    from dgemma_sampler.kernels.canvas_update import canvas_update

    cfg, states = make_states(interpret, 8, [8, 8], pins=False)
    st = states[0]
    slots = torch.arange(1, 3, device=interpret)
    e = torch.zeros(2, 8, device=interpret)
    a = torch.zeros(2, 8, dtype=torch.int64, device=interpret)
    w = torch.full((2,), 8, device=interpret)
    kw = dict(confidence_threshold=0.5, entropy_bound=0.1, vocab_size=VOCAB,
              streams=step_mod.NOISE_STREAMS)
    with pytest.raises(AssertionError, match="entropy must be"):
        canvas_update(st, slots, e[:1], a, a, w, w, **kw)
    with pytest.raises(AssertionError, match="argmax must be"):
        canvas_update(st, slots, e, a.int(), a, w, w, **kw)
    with pytest.raises(AssertionError, match="width must be"):
        canvas_update(st, slots, e, a, a, w[:1], w, **kw)
    with pytest.raises(AssertionError, match="canvas width W"):
        canvas_update(st, slots, torch.zeros(2, 9, device=interpret),
                      *(torch.zeros(2, 9, dtype=torch.int64, device=interpret),) * 2, w, w, **kw)
    st.step = st.step.long()
    with pytest.raises(AssertionError, match="state.step"):
        canvas_update(st, slots, e, a, a, w, w, **kw)
    empty = canvas_update(states[1], slots[:0], e[:0], a[:0], a[:0], w[:0], w[:0], **kw)
    assert [tuple(t.shape) for t in empty] == [(0, 8), (0,), (0,), (0, 8)]


@pytest.mark.gpu
def test_canvas_update_matches_cpu_twin_gpu():
    """On the GPU against the twin run on the CPU (PyTorch's CPU prefix sums), 32 requests of a
    256-wide canvas, one of them narrow."""
    widths = [256] * 31 + [200]
    cfg_gpu, gpu = make_states("cuda", 256, widths)
    _, cpu = make_states("cpu", 256, widths)
    n, W = len(widths), 256
    for it in range(5):
        stats = stats_for(it, n, W, widths, "cpu")
        valid = torch.tensor(widths)
        twin = step_mod.denoise_update(
            cpu[1], torch.arange(1, n + 1), stats, valid, valid, W,
            confidence_threshold=cfg_gpu.confidence_threshold, entropy_bound=cfg_gpu.entropy_bound,
            vocab_size=VOCAB, noise_backend="torch")
        from dgemma_sampler.kernels.canvas_update import canvas_update

        s = RowStats(*(t.cuda() for t in stats.as_tuple()))
        got = canvas_update(gpu[0], torch.arange(1, n + 1, device="cuda"), s.entropy, s.argmax,
                            s.sample, valid.cuda(), valid.cuda(),
                            confidence_threshold=cfg_gpu.confidence_threshold,
                            entropy_bound=cfg_gpu.entropy_bound, vocab_size=VOCAB,
                            streams=step_mod.NOISE_STREAMS)
        assert torch.equal(got[0].cpu(), twin[0]) and torch.equal(got[2].cpu(), twin[3]), it
        for name in WRITTEN:
            assert torch.equal(getattr(gpu[0], name).cpu(), getattr(cpu[1], name)), (it, name)
