"""Sampling is distributionally right: goodness of fit of many keyed draws to softmax(z)."""

import math

import pytest
import torch
from scipy import stats as sps

import dgemma_sampler as ds
from dgemma_sampler import keyed_noise, reference


def draws_from_one_row(logits_row, temperature, n_draws, seed=123, backend="torch"):
    """n_draws independent samples of one row: a 0-stride canvas, one position per draw."""
    x = logits_row.view(1, 1, -1).expand(1, n_draws, -1)
    s = ds.row_stats(x, torch.tensor([temperature]), torch.tensor([seed]), torch.tensor([0]),
                     backend=backend)
    return s.sample.view(-1)


def chi_square_p(samples, probs):
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    return sps.chisquare(obs.numpy(), exp.numpy()).pvalue


@pytest.mark.parametrize("temperature", [0.4, 0.8, 1.7])
def test_goodness_of_fit(temperature):
    gen = torch.Generator().manual_seed(int(temperature * 100))
    logits = torch.randn(61, generator=gen) * 2
    samples = draws_from_one_row(logits, temperature, 30000, seed=int(temperature * 1000))
    probs = torch.softmax(logits.double() / temperature, -1)
    assert chi_square_p(samples, probs) > 1e-3


def test_greedy_is_argmax_and_masked_never_drawn():
    logits = torch.randn(40)
    logits[::3] = float("-inf")
    s = draws_from_one_row(logits, 1.0, 5000)
    assert torch.isfinite(logits[s]).all()
    g = draws_from_one_row(logits, 0.0, 100)
    assert (g == torch.argmax(logits)).all()


def test_gumbel_tail_reaches_past_22_nats():
    # The smallest 32-bit draw gives E = 2^-33 exactly in relative terms, so G ~ 22.87:
    # tokens ~18 nats below the head stay reachable (tl.rand-based noise stops at 16.6).
    bits = torch.tensor([0, 1, 2**20, 2**31 - 1, 2**31, 2**32 - 1], dtype=torch.int64)
    e = keyed_noise.exponential(bits)
    w = (bits.double() + 0.5) * 2.0**-32
    ref = -torch.log1p(-w)
    torch.testing.assert_close(e.double(), ref, rtol=3e-6, atol=0)
    g = keyed_noise.gumbel(bits)
    assert g[0].item() > 22.8 and math.isfinite(g[-1].item())


def test_uniform_bits_are_uniform():
    key = keyed_noise.row_key(torch.tensor(5), torch.tensor(0), torch.tensor(0), 1)
    bits = keyed_noise.token_bits(key, torch.arange(200000))
    counts = torch.bincount(bits >> 24, minlength=256).double()
    assert sps.chisquare(counts.numpy()).pvalue > 1e-3


@pytest.mark.parametrize("temperature", [0.4, 1.7])
def test_goodness_of_fit_across_sampling_blocks(temperature):
    # 203 tokens in sampling blocks of 16 (the last one partial): stage a draws a block by its
    # key lse_b + G_b, stage b a token inside it; together they must draw softmax(z).
    gen = torch.Generator().manual_seed(7 + int(temperature * 10))
    logits = torch.randn(203, generator=gen) * 2
    logits[40:56] -= 6.0  # one block far below the others
    n = 20000
    rows = logits.unsqueeze(0).expand(n, -1)
    s = reference.row_stats_rows(rows, torch.zeros(n, dtype=torch.int64), torch.arange(n),
                                 torch.tensor([temperature]), torch.tensor([99]),
                                 torch.tensor([3]), sample_block=16)
    probs = torch.softmax(logits.double() / temperature, -1)
    assert chi_square_p(s.sample, probs) > 1e-3
    blocks = torch.bincount(s.sample // 16, minlength=13).double() / n
    want = probs.new_zeros(13).index_add(0, torch.arange(203) // 16, probs)
    torch.testing.assert_close(blocks, want, atol=0.015, rtol=0)
