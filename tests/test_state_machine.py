"""Whole-step trajectories of the PyTorch reference sampler."""

import math

import torch

import dgemma_sampler as ds

V, H, CL = 64, 16, 8


def make(max_reqs=4, **cfg_kw):
    cfg = ds.SamplerConfig(canvas_length=CL, max_denoising_steps=cfg_kw.pop("steps", 10), **cfg_kw)
    state = ds.DiffusionState(max_reqs, cfg, V, H)
    sampler = ds.DiffusionSampler(cfg, state, torch.randn(V, H), 2.0, backend="torch")
    return cfg, state, sampler


def peaked(targets, valid):
    """Logits rows sharply peaked at ``targets[j, :valid[j]]`` (entropy ~ 0)."""
    rows = torch.cat([t[:k] for t, k in zip(targets, valid)])
    x = torch.randn(len(rows), V)
    x[torch.arange(len(rows)), rows] += 60.0
    return x


def test_peaked_logits_converge_after_ring_and_commit_emits_argmax():
    cfg, state, sampler = make(stability_threshold=2)
    state.add_request(1, seed=7)
    sampler.prefill([1])
    target = torch.randint(0, V, (1, CL))
    ring = cfg.ring_size
    for step in range(1, ring + 1):
        out = sampler.step(peaked(target, [CL]), [1])
        assert out.num_sampled.item() == 0
        assert state.is_encoder_phase[1].item() == (step == ring)  # converged on the ring-th step
    assert torch.equal(state.canvas[1], target[0])  # converged canvas = argmax canvas
    out = sampler.step(peaked(target, [CL]), [1])  # the commit step
    assert out.num_sampled.item() == CL
    assert torch.equal(out.sampled[0], target[0])
    assert state.step[1].item() == 0 and not state.is_encoder_phase[1]
    assert state.accepted_canvas_history_len[1].item() == 0


def test_flat_logits_never_confident_and_hit_step_cap():
    cfg, state, sampler = make(steps=5)
    state.add_request(0, seed=1, max_steps=3)
    sampler.prefill([0])
    for step in range(1, 4):
        out = sampler.step(torch.zeros(CL, V) + torch.randn(CL, V) * 1e-3, [0])
        assert not state.confident[0]
        assert state.is_encoder_phase[0].item() == (step == 3)
    out = sampler.step(torch.randn(CL, V) * 1e-3, [0])
    assert out.num_sampled.item() == CL


def test_truncated_canvas_commits_exactly_its_valid_length():
    cfg, state, sampler = make(steps=4)
    state.add_request(0, seed=3)
    sampler.prefill([0])
    target = torch.randint(0, V, (1, CL))
    k = 5
    for _ in range(4):  # phantom rows keep it unconfident: the step cap converges it
        out = sampler.step(peaked(target, [k]), [0], valid_len=[k])
        assert not state.confident[0]
    out = sampler.step(peaked(target, [k]), [0], valid_len=[k])
    assert out.num_sampled.item() == k
    assert torch.equal(out.sampled[0, :k], target[0, :k])


def test_pinned_positions_never_change_and_get_no_soft_embedding():
    cfg, state, sampler = make()
    seed_canvas = torch.randint(0, V, (CL,)).tolist()
    state.add_request(2, seed=11, seed_canvas=seed_canvas, pinned=[0, 3])
    sampler.prefill([2])
    assert state.canvas[2].tolist() == seed_canvas
    for _ in range(4):
        sampler.step(torch.randn(CL, V) * 3, [2])
        assert state.canvas[2, 0].item() == seed_canvas[0]
        assert state.canvas[2, 3].item() == seed_canvas[3]
        sc = state.self_conditioning_embeds[2]
        assert (sc[[0, 3]] == 0).all() and (sc[1].abs() > 0).any()


def test_read_only_request_emits_on_convergence():
    cfg, state, sampler = make()
    state.add_request(0, seed=5, read_only=True)
    sampler.prefill([0])
    target = torch.randint(0, V, (1, CL))
    out = sampler.step(peaked(target, [CL]), [0])
    assert out.num_sampled.item() == 0
    out = sampler.step(peaked(target, [CL]), [0])
    assert out.num_sampled.item() == CL and torch.equal(out.sampled[0], target[0])
    assert not state.is_encoder_phase[0]  # read-only requests never run a commit step


def test_per_request_widths_and_step_caps_mixed_batch():
    cfg, state, sampler = make(steps=6)
    state.add_request(0, seed=1, canvas_width=3, max_steps=2)
    state.add_request(1, seed=2)
    sampler.prefill([0, 1])
    x = torch.randn(3 + CL, V)
    out = sampler.step(x, [0, 1], valid_len=[3, CL])
    assert out.sampled.shape == (2, CL)
    out = sampler.step(torch.randn(3 + CL, V), [0, 1], valid_len=[3, CL])
    assert state.is_encoder_phase.tolist()[:2] == [True, False]  # slot 0 hit its cap of 2
    out = sampler.step(torch.randn(3 + CL, V), [0, 1], valid_len=[3, CL])
    assert out.num_sampled.tolist() == [3, 0]


def test_allowed_set_constrains_samples_and_argmax():
    cfg, state, sampler = make()
    allowed = [3, 9, 40]
    state.add_request(0, seed=9, allowed_ids=allowed)
    state.add_request(1, seed=10)
    sampler.prefill([0, 1])
    out = sampler.step(torch.randn(2 * CL, V) * 2, [0, 1])
    assert set(out.stats.argmax[0].tolist()) <= set(allowed)
    assert set(out.stats.sample[0].tolist()) <= set(allowed)
    assert not set(out.stats.argmax[1].tolist()) <= set(allowed)


def test_logprobs_stashed_until_commit():
    cfg, state, sampler = make(stability_threshold=0)
    state.add_request(0, seed=4)
    sampler.prefill([0])
    target = torch.randint(0, V, (1, CL))
    out = sampler.step(peaked(target, [CL]), [0], logprobs={0: 2})
    assert out.logprobs == {} and 0 in sampler.pending_logprobs
    out = sampler.step(peaked(target, [CL]), [0], logprobs={0: 2})
    ids, lp, ranks = out.logprobs[0]
    assert ids.shape == (CL, 3) and torch.equal(ids[:, 0], target[0])
    assert (ranks == 1).all() and (lp <= 0).all()


def test_config_defaults_and_schedule():
    cfg = ds.SamplerConfig()
    assert (cfg.t_min, cfg.t_max, cfg.entropy_bound, cfg.confidence_threshold) == (0.4, 0.8, 0.1, 0.005)
    assert (cfg.stability_threshold, cfg.max_denoising_steps, cfg.canvas_length) == (1, 48, 256)
    assert math.isclose(cfg.temperature(0), 0.8) and math.isclose(cfg.temperature(48), 0.4 + 0.4 / 48)
