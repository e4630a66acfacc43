"""vLLM's own sampler device paths without vLLM (``bench/vllm_paths.py``), on the CPU.

The paths run vLLM's row-statistics kernel from a module given at run time; here a stand-in
with its signature (a PyTorch ``sample_row_stats``) takes its place, and, where
``tools/fetch_vllm_kernels.sh`` has made ``.vllm_kernels/diffusion_gemma_sampler.py``, the real
kernel runs through the Triton interpreter. Checked: both paths' soft embeddings are
``normalizer * softmax(z / T) @ E`` (z the softcapped projection for 0.34, the logits for 0.33,
T each request's schedule temperature) within bf16 rounding, truncated canvases pad as vLLM's
do, tiles follow each release's budget, the kernel gets vLLM's arguments, and ``load_kernels``
says what is wrong with a bad file.
"""

from __future__ import annotations

import importlib
import os
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
REAL_KERNELS = ROOT / ".vllm_kernels" / "diffusion_gemma_sampler.py"
CL, V, H = 8, 301, 16
SOFTCAP = 30.0


@pytest.fixture
def vp(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return importlib.import_module("vllm_paths")


def stand_in_kernels():
    """A module with vLLM's ``sample_row_stats`` signature and outputs, in PyTorch; it records
    each call's arguments in ``calls``."""
    calls = []

    def sample_row_stats(logits, temps, canvas_len, seed, probs_dtype):
        calls.append(dict(rows=logits.shape[0], temps=temps.clone(), canvas_len=canvas_len,
                          seed=seed, probs_dtype=probs_dtype))
        t = temps.float().repeat_interleave(canvas_len)[:, None]
        z = logits.float() / t.clamp(min=1e-10)
        gen = torch.Generator(device=logits.device).manual_seed(seed)
        u = torch.rand(z.shape, generator=gen, device=logits.device).clamp(min=1e-20)
        noisy = z - torch.log(-torch.log(u)) * (t > 0).float()
        log_p = z.log_softmax(dim=-1)
        p = log_p.exp()
        entropy = -torch.where(p > 0, p * log_p, 0.0).sum(dim=-1)
        probs = p.to(probs_dtype) if probs_dtype is not None else None
        return z.argmax(dim=-1), noisy.argmax(dim=-1), entropy, probs

    return types.SimpleNamespace(sample_row_stats=sample_row_stats, calls=calls)


def schedule_temperature(schedule, steps):
    remaining = (schedule.max_denoising_steps - steps.double()).clamp(min=1.0)
    return schedule.t_min + (schedule.t_max - schedule.t_min) * remaining / schedule.max_denoising_steps


def expected_soft(z, temps, valid, embed, normalizer):
    """``normalizer * softmax(z / T) @ E`` in float64, each request padded to CL with uniform
    rows (vLLM's phantom positions), as ``[n, CL, H]``."""
    out, r = [], 0
    for t, k in zip(temps.tolist(), valid):
        rows = torch.zeros(CL, z.shape[1], dtype=torch.float64)
        rows[:k] = z[r:r + k].double()
        out.append(normalizer * torch.softmax(rows / t, dim=-1) @ embed.double())
        r += k
    return torch.stack(out)


def assert_bf16_close(got, want):
    """bf16 probabilities, a bf16 GEMM output and a bf16 scaling each round by up to 2^-9: about
    2e-3 of the norm in all (a temperature 10% off moves it by 2e-2)."""
    err = (got.double() - want).norm() / want.norm()
    assert err < 5e-3, err
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def inputs(n_rows, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(V, H, generator=gen) * 0.5).to(torch.bfloat16)
    hidden = (torch.randn(n_rows, H, generator=gen) * 2).to(torch.bfloat16)
    return hidden, weight


def run_one_step(vp, version, n, valid=None, steps=None, kernels=None, device="cpu", **kw):
    """One step of ``version`` on fresh inputs (eager: ``compile=False``); returns the step, its
    z (softcapped projection or the logits given), the temperatures it should use, and E, the
    last three on the CPU."""
    valid = valid or [CL] * n
    hidden, weight = inputs(sum(valid), seed=n)
    kernels = kernels or stand_in_kernels()
    schedule = vp.Schedule(max_denoising_steps=48)
    if version == "0.34":
        z = torch.tanh(F.linear(hidden, weight).double() / SOFTCAP) * SOFTCAP
        step = vp.v034_step(hidden.to(device), weight.to(device), kernels, canvas=CL, valid=valid,
                            schedule=schedule, compile=False, **kw)
    else:
        z = torch.randn(sum(valid), V, generator=torch.Generator().manual_seed(7)) * 3
        step = vp.v033_step(z.to(device), weight.to(device), kernels, canvas=CL, valid=valid,
                            schedule=schedule, compile=False, **kw)
    if steps is not None:
        step.state.step.copy_(torch.tensor(steps, dtype=torch.int32))
    temps = schedule_temperature(schedule, step.state.step.cpu())
    step()
    return step, z, temps, weight, kernels


@pytest.mark.parametrize("version", ["0.34", "0.33"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_soft_embedding_is_the_scaled_softmax_times_e(vp, version, n):
    steps = [0, 20, 45][:n]
    step, z, temps, weight, kernels = run_one_step(vp, version, n, steps=steps)
    want = expected_soft(z, temps, [CL] * n, weight, H ** 0.5)
    assert_bf16_close(step.state.sc_embeds, want)
    # vLLM's kernel arguments: one temperature per request, the canvas width, bf16 probabilities.
    (call,) = kernels.calls
    assert call["rows"] == n * CL and call["canvas_len"] == CL
    assert call["probs_dtype"] == torch.bfloat16 and 0 <= call["seed"] < 2**31 - 1
    torch.testing.assert_close(call["temps"].double(), temps, rtol=1e-6, atol=0)
    st = step.state
    assert st.step.tolist() == [s + 1 for s in steps]
    assert torch.equal(st.draft_tokens, st.canvas) and st.num_sampled.eq(0).all()
    assert torch.equal(step.num_rejected, torch.full((n,), CL, dtype=torch.int32))


@pytest.mark.parametrize("version", ["0.34", "0.33"])
def test_truncated_canvas_is_padded_with_uniform_rows(vp, version):
    valid = [CL, 5, 3]
    step, z, temps, weight, _ = run_one_step(vp, version, 3, valid=valid)
    want = expected_soft(z, temps, valid, weight, H ** 0.5)
    assert_bf16_close(step.state.sc_embeds, want)
    assert step.num_rejected.tolist() == valid  # denoising: the whole query goes back


def test_the_first_ranked_position_takes_its_sample(vp):
    """Entropy-bound acceptance: a canvas's lowest-entropy position always takes the sample."""
    kernels = stand_in_kernels()
    outs = []
    inner = kernels.sample_row_stats
    kernels.sample_row_stats = lambda *a: outs.append(inner(*a)) or outs[-1]
    step, *_ = run_one_step(vp, "0.33", 2, kernels=kernels)
    _, sample, entropy, _ = outs[0]
    first = entropy.view(2, CL).argmin(dim=-1)
    got = step.state.canvas.gather(1, first[:, None])
    assert torch.equal(got, sample.view(2, CL).gather(1, first[:, None]))


@pytest.mark.parametrize("version, copies", [("0.34", 5), ("0.33", 3)])
@pytest.mark.parametrize("fit, tiles", [(1, [1, 1, 1]), (2, [2, 1]), (3, [3]), (7, [3])])
def test_tiles_follow_the_budget(vp, monkeypatch, version, copies, fit, tiles):
    per_request = CL * V * 4 * copies
    # vLLM budgets half the free memory: room for exactly ``fit`` requests, plus change.
    monkeypatch.setattr(vp, "free_device_memory", lambda device: 2 * fit * per_request + 2 * per_request - 2)
    assert vp.tile_requests(version, 2 * fit * per_request + 2 * per_request - 2, CL, V) == fit
    step, z, temps, weight, kernels = run_one_step(vp, version, 3)
    assert step.tiles == tiles
    assert [c["rows"] for c in kernels.calls] == [k * CL for k in tiles]
    assert_bf16_close(step.state.sc_embeds, expected_soft(z, temps, [CL] * 3, weight, H ** 0.5))


def test_budget_formula(vp):
    # DiffusionGemma's canvas and vocabulary with 64 GiB free: 0.34 budgets 5 fp32 copies.
    free = 64 << 30
    assert vp.tile_requests("0.34", free, 256, 262144) == int(free * 0.5) // (256 * 262144 * 20)
    assert vp.tile_requests("0.33", free, 256, 262144) == int(free * 0.5) // (256 * 262144 * 12)
    assert vp.tile_requests("0.34", 0, 256, 262144) == 1
    with pytest.raises(KeyError):
        vp.tile_requests("0.32", free, 256, 262144)


def test_free_bytes_overrides_the_device(vp, monkeypatch):
    monkeypatch.setattr(vp, "free_device_memory", lambda device: pytest.fail("read the device"))
    step, *_ = run_one_step(vp, "0.34", 3, free_bytes=0)
    assert step.tiles == [1, 1, 1]


def test_two_gemm_floor(vp):
    hidden, weight = inputs(2 * CL)
    embed = (torch.randn(V, H) * 0.1).to(torch.bfloat16)
    head, soft = vp.two_gemm_floor(hidden, weight, embed)
    torch.testing.assert_close(head(), F.linear(hidden, weight))
    z = torch.tanh(F.linear(hidden, weight).double() / SOFTCAP) * SOFTCAP
    want = torch.softmax(z / 0.8, dim=-1) @ embed.double()
    assert_bf16_close(soft(), want)
    p = torch.rand(2 * CL, V).to(torch.bfloat16)
    _, soft = vp.two_gemm_floor(hidden, weight, embed, probs=p)
    torch.testing.assert_close(soft(), p @ embed)


def test_load_kernels_errors(vp, tmp_path):
    with pytest.raises(FileNotFoundError, match="fetch_vllm_kernels"):
        vp.load_kernels(tmp_path / "missing.py")
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def other():\n    pass\n")
    with pytest.raises(ImportError, match="no sample_row_stats"):
        vp.load_kernels(wrong)
    unrewritten = tmp_path / "unrewritten.py"
    unrewritten.write_text("from vllm.triton_utils import tl, triton\n\ndef sample_row_stats():\n    pass\n")
    with pytest.raises(ImportError, match="does not import"):
        vp.load_kernels(unrewritten)
    good = tmp_path / "good.py"
    good.write_text("# Taken from vllm==9.9.9 (wheel x.whl) by tools/fetch_vllm_kernels.sh.\n"
                    "def sample_row_stats(logits, temps, canvas_len, seed, probs_dtype):\n    pass\n")
    module = vp.load_kernels(good)
    assert module.origin == "vllm==9.9.9 (wheel x.whl)" and len(module.sha256) == 64


@pytest.mark.skipif(not REAL_KERNELS.is_file(), reason="no .vllm_kernels/ (tools/fetch_vllm_kernels.sh)")
# The interpreter evaluates both sides of the kernel's guarded where(): -inf - -inf warns.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("version", ["0.34", "0.33"])
def test_real_vllm_kernel(vp, version):
    """vLLM's own kernel in both paths (on a GPU, else interpreted), checked the same way."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")
    kernels = vp.load_kernels(REAL_KERNELS)
    assert kernels.origin.startswith("vllm==")
    step, z, temps, weight, _ = run_one_step(vp, version, 2, steps=[0, 30], kernels=kernels,
                                             device=device)
    assert_bf16_close(step.state.sc_embeds.cpu(), expected_soft(z, temps, [CL] * 2, weight, H ** 0.5))
