"""The per-request prologue kernel against its PyTorch twin (bit for bit), and its use in the step."""

import pytest
import torch

import dgemma_sampler as ds
from dgemma_sampler.kernels import contract


def torch_twin(slots, step, seeds, draws, table):
    """``StepRunner.request_inputs`` without the kernel: its operators, as written there."""
    temperature = table[step[slots].clamp(min=0, max=table.numel() - 1)]
    return (temperature, contract.inverse_temperature(temperature), seeds[slots], draws[slots])


def state_vectors(n_slots, gen, device):
    step = torch.randint(-3, 14, (n_slots,), generator=gen, dtype=torch.int32).to(device)
    seeds = torch.randint(-(2**63), 2**63 - 1, (n_slots,), generator=gen).to(device)
    draws = torch.randint(0, 2**62, (n_slots,), generator=gen).to(device)
    return step, seeds, draws


# Greedy (0), below the clamp, ordinary schedule values, one whose reciprocal rounds, large,
# and NaN (no schedule makes one: SamplerConfig refuses non-finite bounds; NaN stays NaN).
TABLE = [0.0, 1e-12, 1e-10, 0.3, 1.0 / 3.0, 0.7, 1.0, 1.5, 3.0, 1e30, float("nan")]


def assert_same(got, want, name=""):
    """Equal bit for bit, NaN where the other is NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape, name
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("n,n_slots", [(0, 4), (1, 1), (5, 9), (130, 300)])
def test_request_prologue_matches_twin(interpret, n, n_slots):
    from dgemma_sampler.kernels.request_prologue import request_prologue

    gen = torch.Generator().manual_seed(n)
    step, seeds, draws = state_vectors(n_slots, gen, interpret)
    table = torch.tensor(TABLE, dtype=torch.float32, device=interpret)
    slots = torch.randint(0, n_slots, (n,), generator=gen).to(interpret)
    if n >= 5:
        step[slots[:3]] = torch.tensor([-1, 0, table.numel() + 7], dtype=torch.int32,
                                       device=interpret)
    got = request_prologue(slots, step, seeds, draws, table)
    want = torch_twin(slots, step, seeds, draws, table)
    for name, g, w in zip(("temperature", "inv_t", "seeds", "draws"), got, want):
        assert g.shape == (n,), name
        assert_same(g, w, name)
    # greedy rows get 1 / GREEDY_CLAMP, not inf
    assert got[1][got[0] == 0].eq(1.0 / torch.tensor(contract.GREEDY_CLAMP)).all()


@pytest.mark.parametrize("bad,match", [
    (dict(slots=torch.zeros(2, dtype=torch.int32)), "slots"),
    (dict(step=torch.zeros(4, dtype=torch.int64)), "step"),
    (dict(table=torch.zeros(0)), "table"),
    (dict(draws=torch.zeros(3, dtype=torch.int64)), "same length"),
])
def test_request_prologue_rejects(interpret, bad, match):
    from dgemma_sampler.kernels.request_prologue import request_prologue

    args = dict(slots=torch.zeros(2, dtype=torch.int64), step=torch.zeros(4, dtype=torch.int32),
                seeds=torch.zeros(4, dtype=torch.int64), draws=torch.zeros(4, dtype=torch.int64),
                table=torch.ones(3))
    args.update(bad)
    args = {k: v.to(interpret) for k, v in args.items()}
    with pytest.raises(AssertionError, match=match):
        request_prologue(**args)


def runner_inputs(backend, device):
    cfg = ds.SamplerConfig(canvas_length=6, max_denoising_steps=4)
    state = ds.DiffusionState(5, cfg, 97, 8, device=device)
    sampler = ds.DiffusionSampler(cfg, state, torch.randn(97, 8, device=device), 1.0,
                                  backend=backend)
    for s, seed in zip((4, 0, 2), (7, 8, 9)):
        state.add_request(s, seed=seed)
    state.step[torch.tensor([4, 0, 2], device=device)] = torch.tensor(
        [0, 3, 9], dtype=torch.int32, device=device)  # 9: past the schedule's end
    slots = torch.tensor([2, 4, 0], device=device)
    return sampler.runner, slots


def test_runner_request_inputs_kernel_equals_operators(interpret):
    """The runner's two ways (the kernel where the update runs Triton, else its operators)."""
    from dgemma_sampler import step as step_mod

    kernel_runner, slots = runner_inputs("triton", interpret)
    torch_runner, _ = runner_inputs("torch", interpret)
    assert step_mod.use_triton_update(slots.device, kernel_runner.backend)
    got = kernel_runner.request_inputs(slots)
    want = torch_runner.request_inputs(slots)
    if interpret == "cuda":  # both runners take the kernel on a GPU: compare with the operators
        want = torch_twin(slots, torch_runner.state.step, torch_runner.state.seeds,
                          torch_runner.state.draws, torch_runner._temperature_table)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    want_t = torch_runner.cfg.temperature(
        torch.tensor([9, 0, 3], device=slots.device).clamp(max=4)).to(torch.float32)
    assert torch.equal(got[0], want_t)


@pytest.mark.gpu
def test_request_prologue_matches_twin_gpu():
    from dgemma_sampler.kernels.request_prologue import request_prologue

    gen = torch.Generator().manual_seed(5)
    step, seeds, draws = state_vectors(1000, gen, "cuda")
    table = torch.tensor(TABLE, dtype=torch.float32, device="cuda")
    slots = torch.randperm(1000, generator=gen)[:300].cuda()
    got = request_prologue(slots, step, seeds, draws, table)
    for g, w in zip(got, torch_twin(slots, step, seeds, draws, table)):
        assert_same(g, w)
