"""The PyTorch oracle against independent float64 computations."""

import math

import pytest
import torch

import dgemma_sampler as ds
from dgemma_sampler import reference


def float64_stats(x, temperature, softcap=None):
    """Independent float64 lse / entropy / argmax of [R, W, V] logits (masked = -inf)."""
    x = x.double()
    if softcap is not None:
        x = torch.tanh(x / softcap) * softcap
    t = temperature.double().clamp(min=1e-10)[:, None, None]
    z = x / t
    lse = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - lse[..., None])
    ent = -torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).sum(-1)
    return lse, ent, torch.argmax(z, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 7), (3, 5, 1001), (2, 17, 2053)])
def test_row_stats_matches_float64(dtype, shape):
    r, w, v = shape
    x = (torch.randn(shape) * 3).to(dtype)
    x[..., ::7] = float("-inf")  # masked entries
    x[..., 0] = torch.randn(r, w).to(dtype)  # keep every row alive
    temp = torch.tensor([0.0, 0.4, 1.3])[:r]
    seeds = torch.arange(r, dtype=torch.int64) * 977
    draws = torch.zeros(r, dtype=torch.int64)
    s = ds.row_stats(x, temp, seeds, draws, backend="torch")
    lse, ent, am = float64_stats(x, temp)
    assert not torch.isnan(s.entropy).any()
    torch.testing.assert_close(s.lse.double(), lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s.entropy.double(), ent, rtol=1e-4, atol=2e-5)
    assert torch.equal(s.argmax, am)
    greedy = temp == 0
    assert torch.equal(s.sample[greedy], s.argmax[greedy])
    assert ((s.sample >= 0) & (s.sample < v)).all()
    # a sampled token is never a masked one
    picked = x.gather(-1, s.sample.unsqueeze(-1)).squeeze(-1)
    assert torch.isfinite(picked).all()


def test_softcap_matches_float64():
    x = torch.randn(2, 3, 301) * 40
    temp = torch.tensor([0.5, 1.0])
    s = ds.row_stats(x, temp, torch.tensor([1, 2]), torch.tensor([0, 0]), softcap=30.0, backend="torch")
    lse, ent, am = float64_stats(x, temp, softcap=30.0)
    torch.testing.assert_close(s.lse.double(), lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s.entropy.double(), ent, rtol=1e-4, atol=2e-5)


def test_nan_and_inf_rows():
    x = torch.randn(1, 4, 50)
    x[0, 0, 3] = float("nan")
    x[0, 1, :] = float("-inf")  # fully masked
    x[0, 2, 10] = float("inf")
    x[0, 2, 20] = float("inf")
    x[0, 3, 5] = float("-inf")
    s = ds.row_stats(x, torch.tensor([0.7]), torch.tensor([5]), torch.tensor([3]), backend="torch")
    assert s.has_nan.tolist() == [[True, False, False, False]]
    assert s.argmax[0, 0] != 3 and s.sample[0, 0] != 3  # NaN entries are masked
    assert s.argmax[0, 1] == 0 and s.sample[0, 1] == 0 and s.entropy[0, 1] == 0
    assert s.lse[0, 1] == float("-inf")
    assert s.argmax[0, 2] == 10 and s.sample[0, 2] in (10, 20)
    assert math.isclose(s.entropy[0, 2].item(), math.log(2), rel_tol=1e-5)
    assert torch.isfinite(s.entropy).all()


def test_top_k_top_p_thresholds_follow_vllm_semantics():
    x = torch.tensor([[[3.0, 1.0, 2.0, 2.0, 0.5, -1.0]]])
    one = torch.tensor([1])
    s = ds.row_stats(x, torch.tensor([1.0]), one, one, top_k=torch.tensor([3]), backend="torch")
    assert s.threshold.item() == 2.0  # the 3rd largest; its tie is kept too
    p = torch.softmax(x[0, 0].double(), -1)
    # top-p: keep the head plus every value whose strictly-greater mass is < p
    s = ds.row_stats(x, torch.tensor([1.0]), one, one, top_p=torch.tensor([float(p[0]) + 1e-3]),
                     backend="torch")
    assert s.threshold.item() == 2.0
    s = ds.row_stats(x, torch.tensor([1.0]), one, one, top_p=torch.tensor([1e-6]), backend="torch")
    assert s.threshold.item() == 3.0 and s.sample.item() == 0 and s.entropy.item() == 0


@pytest.mark.parametrize("e_dtype", [torch.float32, torch.bfloat16])
def test_soft_embedding_matches_float64(e_dtype):
    r, w, v, h = 2, 5, 777, 48
    x = torch.randn(r, w, v) * 2
    x[..., 1::5] = float("-inf")
    temp = torch.tensor([0.0, 0.8])
    s = ds.row_stats(x, temp, torch.tensor([1, 2]), torch.tensor([0, 0]), backend="torch")
    e = torch.randn(v, h).to(e_dtype)
    keep = torch.rand(r, w) > 0.3
    out = ds.soft_embedding(x, temp, s.lse, e, 3.5, keep=keep, backend="torch")
    z = x.double() / temp.double().clamp(min=1e-10)[:, None, None]
    ref = torch.softmax(z, -1) @ e.double() * 3.5
    ref = torch.where(keep[..., None], ref, 0.0)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-5
    assert (out[~keep] == 0).all()


def test_soft_embedding_vocab_slice_sums_to_whole():
    x = torch.randn(1, 3, 100)
    temp = torch.tensor([0.6])
    s = ds.row_stats(x, temp, torch.tensor([0]), torch.tensor([0]), backend="torch")
    e = torch.randn(100, 8)
    whole = ds.soft_embedding(x, temp, s.lse, e, 1.0, backend="torch")
    parts = sum(ds.soft_embedding(x, temp, s.lse, e[a:b].contiguous(), 1.0, vocab_start=a, backend="torch")
                for a, b in [(0, 37), (37, 64), (64, 100)])
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)


def test_logprobs_layout_and_ranks():
    x = torch.randn(4, 60)
    inv = torch.full((4,), 2.0)
    thr = torch.full((4,), float("-inf"))
    sel = torch.argmax(x, -1)
    ids, lp, ranks = reference.token_logprobs_rows(x, inv, thr, None, sel, 3)
    ref = torch.log_softmax(x.double() * 2, -1)
    assert torch.equal(ids[:, 0], sel) and (ranks == 1).all()
    torch.testing.assert_close(lp.double(), ref.gather(1, ids), rtol=1e-5, atol=1e-5)
    assert torch.equal(ids[:, 1], sel)  # the top-1 is the argmax
