"""The Triton row-statistics kernel against the PyTorch oracle and a float64 recomputation.

* argmax, sample, threshold, has_nan: equal to ``reference.row_stats_rows`` (the same keyed
  noise). A differing sample must be a near-tie: both tokens' keys ``z + G`` (the oracle's
  keys) within 1e-5 of each other, relative to max(1, |key|). A differing top-p threshold
  must be a near-tie of the cumulative mass with p.
* lse and entropy: within 1e-5 relative of a float64 recomputation from the same fp32 z.

CPU (Triton interpreter, small shapes, small blocks so every row spans several blocks):
``TRITON_INTERPRET=1 pytest -q tests/test_row_stats_kernel.py``. GPU: ``pytest -m gpu``.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import poisoned_row_stats

from dgemma_sampler import keyed_noise, ops, reference
from dgemma_sampler.kernels import row_stats as rs
from dgemma_sampler.keyed_noise import Stream

FLT_MAX = torch.finfo(torch.float32).max
# Small blocks and a small candidate buffer so that the interpreter exercises multi-block
# rows, the top-k/top-p fallback passes and the candidate path on a few thousand entries.
CPU_CONFIG = dict(block=256, num_warps=4, prefetch=True, num_stages=1,
                  threshold=dict(cap=64, tile=256, scan_tile=512, pivots=8))


@pytest.fixture
def poisoned(monkeypatch):
    """Outputs start as garbage so a row the kernels forget to write cannot pass."""

    def empty(n, device):
        return poisoned_row_stats(n, device)

    monkeypatch.setattr(rs, "_empty_stats", empty)


def _masked_z(logits, row_request, temperature, softcap, threshold, allowed):
    """fp32 z exactly as the oracle forms it, -inf where masked; float64 copy for sums."""
    req = row_request.long()
    x = reference.softcapped(logits, softcap)
    if softcap is not None:
        # The kernel's threshold is its own softcap of the boundary logit, a few ulp from
        # torch's: compare with that slack, or the boundary token may flip.
        threshold = threshold - 1e-6 * threshold.abs()
    masked = torch.isnan(x) | (x == float("-inf")) | (x < threshold.unsqueeze(1))
    if allowed is not None:
        masked |= ~allowed[req]
    inv = reference.inverse_temperature(temperature)[req]
    z = torch.clamp(x * inv.unsqueeze(1), max=FLT_MAX)
    return torch.where(masked, float("-inf"), z), masked


def _oracle64(z):
    """(lse, entropy) in float64 from masked fp32 z; all-masked rows give (-inf, 0).

    ``Z = 1 + R`` with R summed without one arg-max entry, so that log1p(R) keeps a peaked
    row's tiny entropy (1 + 1e-30 is 1 even in float64).
    """
    z64 = z.double()
    m, arg = z64.max(dim=1)
    kept = torch.isfinite(m)
    safe_m = torch.where(kept, m, 0.0).unsqueeze(1)
    e = torch.exp(z64 - safe_m)
    e.scatter_(1, arg.unsqueeze(1), 0.0)
    rest = e.sum(dim=1)
    a = torch.where(e > 0, (z64 - safe_m) * e, 0.0).sum(dim=1)
    lse = torch.where(kept, m + torch.log1p(rest), float("-inf"))
    ent = torch.where(kept, torch.log1p(rest) - a / (1.0 + rest), 0.0)
    return lse, ent


def _keys(z, row_request, row_position, seeds, draws, tokens):
    req = row_request.long()
    key = keyed_noise.row_key(seeds[req].unsqueeze(1), draws[req].unsqueeze(1),
                              row_position.long().unsqueeze(1), Stream.GUMBEL)
    g = keyed_noise.gumbel(keyed_noise.token_bits(key, tokens.unsqueeze(0)))
    return z + g  # -inf where masked


def _columns_of(tokens):
    """Map returned token ids back to logits columns (tokens: the id of every column)."""
    first = int(tokens[0])
    if torch.equal(tokens, torch.arange(first, first + tokens.numel(), device=tokens.device)):
        return lambda ids: ids - first
    order = torch.argsort(tokens)
    return lambda ids: order[torch.searchsorted(tokens[order], ids)]


def _assert_same_or_near_tie(got, want, score, tokens, what):
    """got == want, or both columns score within 1e-5 (relative to max(1, |score|))."""
    differ = (got != want).nonzero().flatten()
    if differ.numel() == 0:
        return 0
    col = _columns_of(tokens)
    sg = score[differ, col(got[differ])].double()
    sw = score[differ, col(want[differ])].double()
    assert bool(torch.isfinite(sg).all() and torch.isfinite(sw).all()), f"{what}: {differ.tolist()}"
    gap = (sg - sw).abs() / sw.abs().clamp(min=1.0)
    assert float(gap.max()) <= 1e-5, f"{what} rows {differ.tolist()}: {sg.tolist()} vs {sw.tolist()}"
    return differ.numel()


def _assert_thresholds(got, want, logits, row_request, softcap, allowed, top_k, top_p):
    """Equal, or (top-p) the mass at the larger one lies within 1e-5 of p, or (softcap) a few
    ulp apart: the kernels' tanh is within a few ulp of torch's, not bit-identical to it on
    the GPU, so the k-th largest softcapped value can move by an ulp (seen on the H200 with
    saturated logits, c * tanh(x / c) ~ c, in test_softcap_special_rows)."""
    differ = (got != want).nonzero().flatten().tolist()
    req = row_request.long()
    for r in differ:
        close = abs(float(got[r]) - float(want[r])) <= 1e-6 * max(1.0, abs(float(want[r])))
        if softcap is not None and close:
            continue
        assert top_p is not None and float(top_p[req[r]]) < 1, f"top-k threshold row {r} differs"
        x = reference.softcapped(logits[r:r + 1], softcap)[0].double()
        valid = ~torch.isnan(x) & (x > float("-inf"))
        if allowed is not None:
            valid &= allowed[req[r]]
        if top_k is not None and 0 < int(top_k[req[r]]) < x.numel():
            k = int(top_k[req[r]])
            kth = torch.sort(torch.where(valid, x, float("-inf")), descending=True).values[k - 1]
            valid &= x >= kth
        w = torch.where(valid, torch.exp(x - x[valid].max()), 0.0)
        frac = float(w[x >= max(float(got[r]), float(want[r]))].sum() / w.sum())
        assert abs(frac - float(top_p[req[r]])) <= 1e-5, f"threshold row {r}: {got[r]} vs {want[r]}"


def _assert_same_draw_or_near_tie(got, want, keys, block_keys, block_of_column, tokens):
    """Samples equal, or a near-tie of the stage that split them: the two sampling blocks'
    keys (different blocks) or the two tokens' keys (same block) within 1e-5."""
    differ = (got != want).nonzero().flatten()
    col = _columns_of(tokens)
    for r in differ.tolist():
        cg, cw = int(col(got[r:r + 1])), int(col(want[r:r + 1]))
        bg, bw = int(block_of_column[cg]), int(block_of_column[cw])
        sg, sw = ((block_keys[r, bg], block_keys[r, bw]) if bg != bw
                  else (keys[r, cg], keys[r, cw]))
        sg, sw = float(sg), float(sw)
        assert math.isfinite(sg) and math.isfinite(sw), f"sample row {r}: {sg} vs {sw}"
        assert abs(sg - sw) / max(1.0, abs(sw)) <= 1e-5, f"sample row {r}: {sg} vs {sw}"
    return differ.numel()


def check(logits, row_request, row_position, temperature, seeds, draws, *, softcap=None,
          top_k=None, top_p=None, allowed=None, vocab_offset=0, column_tokens=None,
          config=CPU_CONFIG, near_ties_allowed=0, sample_block=None):
    """Run both backends on the same rows and compare everything; return the kernel result.

    ``sample_block`` defaults to 512 on the CPU (rows of a few thousand entries then span
    several sampling blocks) and to the production size on a GPU.
    """
    if sample_block is None:
        sample_block = 512 if logits.device.type == "cpu" else reference.SAMPLE_BLOCK
    kw = dict(softcap=softcap, top_k=top_k, top_p=top_p, allowed=allowed,
              vocab_offset=vocab_offset, column_tokens=column_tokens, sample_block=sample_block)
    n = logits.shape[0]
    got_key = torch.full((n,), float("nan"), device=logits.device)
    want_key = torch.full((n,), float("nan"), device=logits.device)
    got = rs.row_stats_rows(logits, row_request, row_position, temperature, seeds, draws,
                            config=config, sample_key=got_key, **kw)
    want = reference.row_stats_rows(logits, row_request, row_position, temperature, seeds,
                                    draws, sample_key=want_key, **kw)
    _assert_thresholds(got.threshold, want.threshold, logits, row_request, softcap, allowed,
                       top_k, top_p)
    assert torch.equal(got.has_nan, want.has_nan)
    vocab = logits.shape[1]
    tokens = (column_tokens if column_tokens is not None
              else torch.arange(vocab, device=logits.device) + vocab_offset)
    # Entries are compared under the kernel's own threshold (the near-tie case above).
    z, _ = _masked_z(logits, row_request, temperature, softcap, got.threshold, allowed)
    ties = _assert_same_or_near_tie(got.argmax, want.argmax, z, tokens, "argmax")
    keys = _keys(z, row_request, row_position, seeds, draws, tokens)
    greedy = (temperature.float() == 0)[row_request.long()]
    sampled = ~greedy
    assert torch.equal(got.sample[greedy], got.argmax[greedy])
    block_keys, block_of_column = reference.sampling_block_keys(
        z, seeds[row_request.long()], draws[row_request.long()], row_position.long(),
        vocab_offset, sample_block)
    ties += _assert_same_draw_or_near_tie(got.sample[sampled], want.sample[sampled],
                                          keys[sampled], block_keys[sampled], block_of_column,
                                          tokens)
    assert ties <= near_ties_allowed
    # The winning block's key (what a tensor-parallel merge compares): -inf for greedy and
    # all-masked rows, else the oracle's within rounding.
    assert not torch.isnan(got_key).any()
    same_inf = torch.isinf(got_key) == torch.isinf(want_key)
    assert bool(same_inf.all()), (got_key, want_key)
    fin = torch.isfinite(want_key)
    if fin.any():
        key_err = (got_key[fin] - want_key[fin]).abs() / want_key[fin].abs().clamp(min=1.0)
        assert float(key_err.max()) <= 1e-5
    lse64, ent64 = _oracle64(z)
    kept = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(got.lse), kept)
    assert (got.lse[~kept] == float("-inf")).all() and (got.entropy[~kept] == 0).all()
    lse_err = (got.lse.double()[kept] - lse64[kept]).abs() / lse64[kept].abs().clamp(min=1.0)
    assert (float(lse_err.max()) if kept.any() else 0.0) <= 1e-5
    ent_err = (got.entropy.double()[kept] - ent64[kept]).abs() / ent64[kept].abs().clamp(min=1e-30)
    assert (float(ent_err.max()) if kept.any() else 0.0) <= 1e-5
    assert (got.entropy[kept] >= 0).all()
    return got


def _on(device, *tensors):
    return [t.to(device) for t in tensors]


def _requests(n_req, gen, temps=(0.7, 0.0, 1.3, 1e-3, 0.45)):
    temperature = torch.tensor([temps[i % len(temps)] for i in range(n_req)], dtype=torch.float32)
    seeds = torch.randint(-(2**63), 2**63 - 1, (n_req,), generator=gen)
    seeds[0] = -1
    draws = torch.randint(0, 2**40, (n_req,), generator=gen)
    return temperature, seeds, draws


def _rows(n_rows, n_req, gen):
    row_request = torch.randint(0, n_req, (n_rows,), generator=gen, dtype=torch.int64).to(torch.int32)
    row_position = torch.randint(0, 256, (n_rows,), generator=gen, dtype=torch.int64).to(torch.int32)
    return row_request, row_position


def _mixed_rows(n_rows, vocab, gen):
    """Logits of sd 3 whose rows 1-4 hold a NaN, a +inf, a leading run of -inf (1000
    entries) and a new maximum in every block (n_rows >= 5, vocab > 1500)."""
    logits = torch.randn(n_rows, vocab, generator=gen) * 3
    logits[1, 700] = float("nan")
    logits[2, 1500] = float("inf")
    logits[3, :1000] = float("-inf")
    logits[4] = torch.linspace(-4, 4, vocab)
    return logits


# ----------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_rows(interpret, poisoned, dtype):
    gen = torch.Generator().manual_seed(11)
    n_rows, vocab, n_req = 13, 1500, 5  # vocab not a multiple of the block
    wide = torch.randn(n_rows, vocab + 37, generator=gen) * 3.0
    logits = wide[:, 5:5 + vocab].to(dtype)  # strided rows, offset start
    if dtype != torch.float32:
        logits = wide.to(dtype)[:, 5:5 + vocab]
    assert logits.stride(0) == vocab + 37
    temperature, seeds, draws = _requests(n_req, gen)
    row_request, row_position = _rows(n_rows, n_req, gen)
    # per-request vectors as strided views (every other element of a larger tensor)
    temperature, seeds, draws = (torch.stack([t, t], 1).flatten()[::2] for t in (temperature, seeds, draws))
    assert seeds.stride(0) == 2
    check(*_on(interpret, logits, row_request, row_position, temperature, seeds, draws),
          vocab_offset=777)


def test_many_rows(interpret, poisoned):
    """Many short rows of many requests (one program per row)."""
    gen = torch.Generator().manual_seed(20)
    n_rows, vocab, n_req = 96, 300, 17
    logits = (torch.randn(n_rows, vocab, generator=gen) * 4).to(torch.float16)
    temperature, seeds, draws = _requests(n_req, gen)
    row_request, row_position = _rows(n_rows, n_req, gen)
    check(*_on(interpret, logits, row_request, row_position, temperature, seeds, draws),
          config=dict(CPU_CONFIG, block=128))


def test_single_row_and_one_block(interpret, poisoned):
    gen = torch.Generator().manual_seed(12)
    temperature, seeds, draws = _requests(1, gen, temps=(0.9,))
    one = torch.zeros(1, dtype=torch.int32)
    for vocab in (1, 200, 700):
        logits = torch.randn(1, vocab, generator=gen)
        check(*_on(interpret, logits, one, one + 3, temperature, seeds, draws))


def _special_rows(vocab, gen):
    """Rows that stress masking, rescaling and ties (one per case, fp32)."""
    rows = []
    r = torch.randn(vocab, generator=gen)
    r[::97] = float("nan")
    rows.append(r)                                            # NaNs among normal logits
    r = torch.randn(vocab, generator=gen)
    r[333] = float("inf")
    rows.append(r)                                            # one +inf: it takes all the mass
    r = torch.randn(vocab, generator=gen)
    r[[10, vocab // 2, vocab - 100]] = float("inf")
    rows.append(r)                                            # tied +inf entries
    rows.append(torch.full((vocab,), float("-inf")))          # all masked
    r = torch.full((vocab,), float("-inf"))
    r[vocab - 1] = -3.0
    rows.append(r)                                            # one entry, the last one
    r = torch.randn(vocab, generator=gen)
    r[vocab // 2] = 60.0
    rows.append(r)                                            # peaked: entropy ~ 1e-23
    r = torch.randn(vocab, generator=gen)
    r[vocab // 3] = 14.0
    rows.append(r)                                            # peaked: entropy ~ 1e-3
    rows.append(torch.linspace(-20.0, 20.0, vocab))            # ascending: a new max every block
    r = torch.randn(vocab, generator=gen)
    r[[7, 70, vocab - 300]] = 8.0
    rows.append(r)                                            # tied maxima: lowest id
    rows.append(torch.full((vocab,), 0.25))                   # all equal
    rows.append(torch.randn(vocab, generator=gen) * 1e30)     # huge logits
    r = torch.randn(vocab, generator=gen)
    r[::2] = float("nan")
    r[1::2] = float("-inf")
    rows.append(r)                                            # NaN and -inf only
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_rows(interpret, poisoned, dtype):
    gen = torch.Generator().manual_seed(13)
    vocab = 1000
    logits = _special_rows(vocab, gen).to(dtype)
    n_rows = logits.shape[0]
    temperature = torch.tensor([0.8, 0.0, 1e-8, 50.0])
    seeds = torch.tensor([3, -(2**63), 2**63 - 1, 12345])
    draws = torch.tensor([0, 1, 2**33, 7])
    # the peaked rows 5 and 6 sample at T = 0.8 and T = 50; the others cycle through all four
    row_request = torch.tensor([0, 1, 2, 3, 0, 0, 3, 3, 2, 1, 0, 1], dtype=torch.int32)
    row_position = torch.arange(n_rows, dtype=torch.int32) * 5
    got = check(*_on(interpret, logits, row_request, row_position, temperature, seeds, draws))
    assert got.has_nan.tolist()[0] and got.has_nan.tolist()[-1]
    assert got.argmax[3] == 0 and got.lse[3] == float("-inf")     # all masked
    assert got.argmax[4] == vocab - 1 and got.entropy[4] == 0     # a single entry
    assert got.argmax[8] == 7                                     # lowest id of tied maxima
    assert 0 < float(got.entropy[5]) < 1e-20                      # tiny but not zero


def test_allowed_sets(interpret, poisoned):
    gen = torch.Generator().manual_seed(14)
    n_rows, vocab, n_req = 9, 1200, 3
    logits = torch.randn(n_rows, vocab, generator=gen) * 2
    temperature, seeds, draws = _requests(n_req, gen)
    row_request, row_position = _rows(n_rows, n_req, gen)
    allowed = torch.rand(n_req, vocab, generator=gen) < 0.3
    allowed[1] = False
    allowed[1, 1111] = True         # request 1: a single allowed token
    allowed[2] = False              # request 2: nothing allowed
    logits, row_request, row_position, temperature, seeds, draws, allowed = _on(
        interpret, logits, row_request, row_position, temperature, seeds, draws, allowed)
    got = check(logits, row_request, row_position, temperature, seeds, draws, allowed=allowed)
    assert (got.argmax[row_request == 1] == 1111).all()
    assert (got.lse[row_request == 2] == float("-inf")).all()


def test_column_tokens_and_softcap(interpret, poisoned):
    gen = torch.Generator().manual_seed(15)
    n_rows, vocab, n_req = 7, 900, 2
    logits = torch.randn(n_rows, vocab, generator=gen) * 20
    temperature, seeds, draws = _requests(n_req, gen)
    row_request, row_position = _rows(n_rows, n_req, gen)
    column_tokens = torch.randperm(262144, generator=gen)[:vocab]
    *args, column_tokens = _on(interpret, logits, row_request, row_position, temperature, seeds,
                               draws, column_tokens)
    check(*args, softcap=30.0, column_tokens=column_tokens, near_ties_allowed=2)


def test_given_inverse_temperature(interpret):
    """A step's own ``inv_t`` gives the same statistics as the one each backend computes, and
    one of the wrong shape or dtype is refused."""
    gen = torch.Generator().manual_seed(16)
    n_rows, vocab, n_req = 6, 700, 3
    logits = torch.randn(n_rows, vocab, generator=gen) * 3
    temperature, seeds, draws = _requests(n_req, gen)
    row_request, row_position = _rows(n_rows, n_req, gen)
    args = _on(interpret, logits, row_request, row_position, temperature, seeds, draws)
    inv_t = reference.inverse_temperature(args[3])
    for run, kw in ((rs.row_stats_rows, dict(config=CPU_CONFIG)), (reference.row_stats_rows, {})):
        own = run(*args, softcap=30.0, sample_block=512, **kw)
        given = run(*args, softcap=30.0, sample_block=512, inv_t=inv_t, **kw)
        for a, b in zip(own.as_tuple(), given.as_tuple()):
            assert torch.equal(a, b)
        with pytest.raises(AssertionError, match="inv_t must be fp32"):
            run(*args, inv_t=inv_t[:1], **kw)
        with pytest.raises(AssertionError, match="inv_t must be fp32"):
            run(*args, inv_t=inv_t.double(), **kw)


def test_softcap_special_rows(interpret, poisoned):
    """With a softcap, -inf logits become -c (kept, as in the oracle) but the padding past
    the row end must stay masked: rows of one NaN entry, special rows, and top-k/top-p."""
    gen = torch.Generator().manual_seed(21)
    temperature = torch.tensor([1e-12, 0.9])
    seeds, draws = torch.tensor([291, 96675]), torch.tensor([57, 8])
    one = torch.tensor([[float("nan")], [3.0], [float("-inf")]])
    rows = torch.arange(3, dtype=torch.int32) % 2
    got = check(*_on(interpret, one, rows, rows, temperature, seeds, draws), softcap=0.5,
                config=dict(CPU_CONFIG, block=64))
    assert got.argmax.tolist() == [0, 0, 0] and got.lse[0] == float("-inf")
    special = _special_rows(700, gen)
    rows = (torch.arange(special.shape[0]) % 2).to(torch.int32)
    args = _on(interpret, special, rows, rows * 3, temperature, seeds, draws)
    check(*args, softcap=0.5, near_ties_allowed=special.shape[0])
    k, p = _on(interpret, torch.tensor([3, 0]), torch.tensor([1.0, 0.8]))
    check(*args, softcap=30.0, top_k=k, top_p=p, near_ties_allowed=special.shape[0])


def test_blocking_and_noise_filter_do_not_change_results(interpret):
    """Block size, warps, prefetch and the hash filter are invisible in the results."""
    gen = torch.Generator().manual_seed(16)
    n_rows, vocab, n_req = 6, 2000, 3
    logits = torch.randn(n_rows, vocab, generator=gen) * 4
    logits[0] = torch.linspace(-5, 5, vocab)
    temperature, seeds, draws = _requests(n_req, gen, temps=(0.5, 1.0, 2.0))
    row_request, row_position = _rows(n_rows, n_req, gen)
    args = _on(interpret, logits, row_request, row_position, temperature, seeds, draws)
    base = rs.row_stats_rows(*args, config=CPU_CONFIG)
    variants = [dict(block=128, num_warps=1, prefetch=False, num_stages=1),
                dict(block=1024, num_warps=8, prefetch=True, num_stages=2)]
    for cfg in variants:
        other = rs.row_stats_rows(*args, config=cfg)
        assert torch.equal(other.argmax, base.argmax) and torch.equal(other.sample, base.sample)
        torch.testing.assert_close(other.lse, base.lse, rtol=2e-6, atol=0)
        torch.testing.assert_close(other.entropy, base.entropy, rtol=1e-5, atol=1e-7)
    unfiltered = rs.row_stats_rows(*args, config=CPU_CONFIG, noise_filter=False)
    assert torch.equal(unfiltered.sample, base.sample)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_walk_shape_changes_no_bit(interpret, dtype):
    """The group size (blocks per max check), the register prefetch (0-2 groups ahead, the
    walk unrolled to match) and the key buffer (sampling-block keys drawn 1 to 16 at a time)
    only regroup branches and reorder loads and draws: every output is
    bit-identical, including rows whose length is not a multiple of the unrolled step, an
    unaligned vocabulary slice, NaN / +inf, a greedy row and several sampling blocks."""
    gen = torch.Generator().manual_seed(27)
    n_rows, vocab, n_req = 5, 1999, 3
    logits = _mixed_rows(n_rows, vocab, gen)
    temperature, seeds, draws = _requests(n_req, gen, temps=(0.0, 0.7, 1.3))
    row_request, row_position = _rows(n_rows, n_req, gen)
    # (16-bit logits on the GPU: groups take their max on the raw values, see RAW_MAX)
    args = _on(interpret, logits.to(dtype), row_request, row_position, temperature, seeds, draws)
    key = torch.empty(n_rows, device=args[0].device)
    outs = []
    for group, ahead, keys in ((1, 0, 64), (1, 1, 1), (1, 2, 64), (2, 0, 2), (2, 2, 64),
                               (4, 1, 4), (4, 2, 64)):
        cfg = dict(block=64, num_warps=1, group=group, prefetch=ahead, num_stages=1,
                   key_buffer=keys)
        stats = rs.row_stats_rows(*args, config=cfg, vocab_offset=100, sample_block=256,
                                  sample_key=key)
        outs.append((stats, key.clone()))
    (base, base_key), *others = outs
    for stats, other_key in others:
        for name in ("argmax", "sample", "entropy", "lse", "has_nan"):
            assert torch.equal(getattr(stats, name), getattr(base, name)), name
        assert torch.equal(other_key, base_key)


def test_public_api_triton_backend(interpret):
    gen = torch.Generator().manual_seed(17)
    logits = torch.randn(2, 5, 600, generator=gen)
    temperature, seeds, draws = _requests(2, gen)
    logits, temperature, seeds, draws = _on(interpret, logits, temperature, seeds, draws)
    got = ops.row_stats(logits, temperature, seeds, draws, backend="triton")
    want = ops.row_stats(logits, temperature, seeds, draws, backend="torch")
    assert torch.equal(got.argmax, want.argmax) and torch.equal(got.sample, want.sample)
    torch.testing.assert_close(got.lse, want.lse, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_top_p(interpret, poisoned, dtype):
    """Candidate path (small k / peaked top-p) and pivot fallback (large k, flat top-p)."""
    gen = torch.Generator().manual_seed(18)
    vocab = 1500
    requests = [  # (top_k, top_p)
        (1, 1.0), (5, 0.9), (0, 0.5), (150, 1.0),     # 150 > cap 64: pivot passes
        (0, 0.995), (vocab, 1e-6), (40, 0.95), (vocab - 1, 0.999),
    ]
    n_req = len(requests)
    top_k = torch.tensor([k for k, _ in requests])
    top_p = torch.tensor([p for _, p in requests])
    temperature, seeds, draws = _requests(n_req, gen)
    n_rows = 2 * n_req
    row_request = torch.arange(n_rows, dtype=torch.int32) % n_req
    row_position = torch.randint(0, 256, (n_rows,), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(n_rows, vocab, generator=gen) * 2
    logits[n_req:] = logits[n_req:] * 0.3  # flatter second half
    logits[n_req + 1, 100] = 9.0           # one peaked row
    *args, top_k, top_p = _on(interpret, logits.to(dtype), row_request, row_position,
                              temperature, seeds, draws, top_k, top_p)
    got = check(*args, top_k=top_k, top_p=top_p)
    row_request = args[1]
    assert (got.threshold[row_request == 0] > float("-inf")).all()


def test_top_k_top_p_default_config_short_rows(interpret, poisoned):
    """Default search config on rows shorter than the candidate buffer: fewer sub-blocks than
    k, so the table gives no bound and the whole row is the candidate set."""
    gen = torch.Generator().manual_seed(22)
    logits = torch.randn(4, 301, generator=gen) * 3
    rows = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    temperature, seeds, draws = _requests(2, gen, temps=(0.8, 0.6))
    top_k, top_p = torch.tensor([0, 165]), torch.tensor([0.81, 1.0])
    *args, top_k, top_p = _on(interpret, logits, rows, rows, temperature, seeds, draws, top_k, top_p)
    check(*args, top_k=top_k, top_p=top_p, config=None)


@pytest.mark.parametrize("knob", [dict(table_ways=3), dict(table_ways=1), dict(stats_blocks=12),
                                  dict(stats_blocks=0)])
def test_search_config_rejects(interpret, knob):
    """Search knobs that must be powers of two (table pivots per round >= 2, sampling blocks
    per reduction) are refused before anything runs."""
    gen = torch.Generator().manual_seed(23)
    logits = torch.randn(2, 300, generator=gen)
    rows = torch.tensor([0, 1], dtype=torch.int32)
    temperature, seeds, draws = _requests(2, gen)
    top_k = torch.tensor([5, 0])
    *args, top_k = _on(interpret, logits, rows, rows, temperature, seeds, draws, top_k)
    with pytest.raises(ValueError, match="must be a power of two"):
        rs.row_stats_rows(*args, top_k=top_k, config=dict(threshold=knob))


def test_top_k_top_p_edge_rows(interpret, poisoned):
    """Masked rows, +inf logits, k above the number of kept entries, mass ties."""
    gen = torch.Generator().manual_seed(19)
    vocab = 700
    rows = _special_rows(vocab, gen)
    rows = torch.cat([rows, torch.full((1, vocab), 1.5).to(torch.bfloat16).float()])  # all tied
    n_rows = rows.shape[0]
    requests = [(3, 0.8), (0, 0.6), (650, 0.9), (2, 1.0)]
    n_req = len(requests)
    top_k = torch.tensor([k for k, _ in requests], dtype=torch.int32)
    top_p = torch.tensor([p for _, p in requests], dtype=torch.bfloat16)
    temperature, seeds, draws = _requests(n_req, gen)
    row_request = (torch.arange(n_rows) % n_req).to(torch.int32)
    row_position = torch.arange(n_rows, dtype=torch.int32)
    allowed = torch.rand(n_req, vocab, generator=gen) < 0.9
    *args, top_k, top_p, allowed = _on(interpret, rows, row_request, row_position, temperature,
                                       seeds, draws, top_k, top_p, allowed)
    check(*args, top_k=top_k, top_p=top_p)
    check(*args, top_k=top_k, top_p=top_p, allowed=allowed)


# The split walk (``part_blocks``): with the CPU's sampling blocks of 512 entries, rows of 700
# to 2000 entries split into 2-4 parts, and an unaligned slice moves the part boundaries.
PARTS_CONFIG = dict(CPU_CONFIG, part_blocks=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocabulary_parts_special_rows(interpret, poisoned, dtype):
    """Parts that hold the maximum, parts with nothing kept, NaN and +inf in one part only,
    tied maxima in different parts (the lowest id wins), a new maximum in every part."""
    gen = torch.Generator().manual_seed(31)
    vocab = 1000
    logits = _special_rows(vocab, gen)
    extra = torch.randn(3, vocab, generator=gen)
    extra[0, :600] = float("-inf")            # the first part empty
    extra[1, [100, 900]] = 7.0                # a tied maximum in the first and second part
    extra[2, 800] = float("nan")              # NaN in the last part only
    logits = torch.cat([logits, extra]).to(dtype)
    n_rows = logits.shape[0]
    temperature = torch.tensor([0.8, 0.0, 1e-8, 50.0])
    seeds = torch.tensor([3, -(2**63), 2**63 - 1, 12345])
    draws = torch.tensor([0, 1, 2**33, 7])
    row_request = (torch.arange(n_rows) % 4).to(torch.int32)
    row_position = torch.arange(n_rows, dtype=torch.int32) * 5
    args = _on(interpret, logits, row_request, row_position, temperature, seeds, draws)
    got = check(*args, config=PARTS_CONFIG)
    assert got.argmax[3] == 0 and got.lse[3] == float("-inf")     # all masked
    assert got.argmax[4] == vocab - 1 and got.entropy[4] == 0     # one entry, in the last part
    assert got.argmax[13] == 100                                  # lowest id across parts
    assert got.has_nan.tolist()[14] and not got.has_nan.tolist()[12]
    check(*args, config=PARTS_CONFIG, vocab_offset=300)           # unaligned: a lead, 3 parts


def test_vocabulary_parts_masks(interpret, poisoned):
    """Allowed sets, top-k / top-p (rows the threshold search finishes skip the walk),
    column tokens and a softcap through the split walk; sample keys for the tensor-parallel
    merge."""
    gen = torch.Generator().manual_seed(32)
    n_rows, vocab, n_req = 10, 1700, 4
    logits = torch.randn(n_rows, vocab, generator=gen) * 2
    temperature, seeds, draws = _requests(n_req, gen)
    row_request, row_position = _rows(n_rows, n_req, gen)
    allowed = torch.rand(n_req, vocab, generator=gen) < 0.4
    allowed[1, :1100] = False                 # request 1: nothing in the first two parts
    top_k, top_p = torch.tensor([3, 0, 200, 0]), torch.tensor([1.0, 0.7, 1.0, 1.0])
    column_tokens = torch.randperm(262144, generator=gen)[:vocab]
    *args, allowed, top_k, top_p, column_tokens = _on(
        interpret, logits, row_request, row_position, temperature, seeds, draws, allowed, top_k,
        top_p, column_tokens)
    check(*args, allowed=allowed, config=PARTS_CONFIG)
    check(*args, top_k=top_k, top_p=top_p, allowed=allowed, config=PARTS_CONFIG)
    check(*args, softcap=30.0, column_tokens=column_tokens, config=PARTS_CONFIG,
          near_ties_allowed=2)


def test_vocabulary_parts_bits_independent_of_rows(interpret):
    """A row's results do not depend on the other rows of the launch (the split is set by
    the config and the row length), nor on the walk's shape within a part."""
    gen = torch.Generator().manual_seed(33)
    n_rows, vocab, n_req = 6, 1999, 3
    logits = torch.randn(n_rows, vocab, generator=gen) * 3
    logits[2, 1500] = float("inf")
    temperature, seeds, draws = _requests(n_req, gen, temps=(0.0, 0.7, 1.3))
    row_request, row_position = _rows(n_rows, n_req, gen)
    args = _on(interpret, logits, row_request, row_position, temperature, seeds, draws)
    kw = dict(vocab_offset=100, sample_block=256)
    whole = rs.row_stats_rows(*args, config=dict(PARTS_CONFIG, part_blocks=3), **kw)
    x, rr, rp, *per_request = args
    pick = torch.tensor([4, 2], device=x.device)
    few = rs.row_stats_rows(x[pick], rr[pick], rp[pick], *per_request,
                            config=dict(PARTS_CONFIG, part_blocks=3, group=1, prefetch=0),
                            **kw)
    for name in ("argmax", "sample", "entropy", "lse", "has_nan"):
        assert torch.equal(getattr(few, name), getattr(whole, name)[pick]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_part_group_changes_no_bit(interpret, dtype):
    """Programs that walk several consecutive parts of a row (a choice by the number of rows)
    file each part's state as a program of its own would: the same bits for 1, 2, 3 and all
    parts per program, with a part of NaN, +inf, nothing kept, a new maximum in every block,
    an unaligned slice, an allowed set and a softcap, and the same sample keys."""
    gen = torch.Generator().manual_seed(34)
    n_rows, vocab, n_req = 6, 1999, 3
    logits = _mixed_rows(n_rows, vocab, gen)
    temperature, seeds, draws = _requests(n_req, gen, temps=(0.0, 0.7, 1.3))
    row_request, row_position = _rows(n_rows, n_req, gen)
    allowed = torch.rand(n_req, vocab, generator=gen) < 0.7
    args = _on(interpret, logits.to(dtype), row_request, row_position, temperature, seeds, draws)
    allowed = allowed.to(args[0].device)
    key = torch.empty(n_rows, device=args[0].device)
    for kw in (dict(vocab_offset=100), dict(allowed=allowed, softcap=30.0)):
        outs = []
        # 9 parts at vocab_offset 100 (8 with the allowed set): group 8 leaves a short last
        # program there and walks the whole row in one program here
        for group in (1, 2, 3, 8):
            cfg = dict(PARTS_CONFIG, part_blocks=1, part_group=group)
            stats = rs.row_stats_rows(*args, config=cfg, sample_block=256, sample_key=key, **kw)
            outs.append((stats, key.clone()))
        (base, base_key), *others = outs
        for stats, other_key in others:
            for name in ("argmax", "sample", "entropy", "lse", "has_nan"):
                torch.testing.assert_close(getattr(stats, name), getattr(base, name), rtol=0,
                                           atol=0, equal_nan=True, msg=name)
            torch.testing.assert_close(other_key, base_key, rtol=0, atol=0)


def test_part_group_follows_rows():
    """One program per part while the parts of all rows fill the GPU once, then programs of
    2, 4, ... parts, never fewer programs than that; a config's ``part_group`` wins."""
    sms = 132
    assert rs.part_group({}, 256, 8, sms) == 1          # 2048 programs: under one fill
    assert rs.part_group({}, 1024, 8, sms) == 2         # 4096 programs of 2 parts
    assert rs.part_group({}, 8192, 8, sms) == 8         # one program per row still fills it
    assert rs.part_group({}, 8192, 1, sms) == 1
    assert rs.part_group(dict(part_group=3), 1, 8, sms) == 3
    assert rs.part_group(dict(part_group=16), 1, 8, sms) == 8
    for rows in (256, 512, 1024, 2048, 4096, 8192):
        group = rs.part_group({}, rows, 8, sms)
        programs = rows * -(-8 // group)
        assert group == 1 or programs >= rs.PROGRAMS_PER_SM * sms, (rows, group)
        if group < 8:  # and the next power of two would have left fewer
            assert rows * -(-8 // (2 * group)) < rs.PROGRAMS_PER_SM * sms, (rows, group)


@pytest.mark.parametrize("group", [0, -1, 2.0, True])
def test_part_group_config_rejects(group):
    with pytest.raises(ValueError, match="part_group"):
        rs.part_group(dict(part_group=group), 256, 8, 132)


def test_default_split_follows_dtype_and_softcap_only():
    """The split sets the rounding of lse and entropy, so it may follow the logits' dtype and
    the model's softcap but never the number of rows: fp32 rows and softcapped 16-bit rows
    split into parts of 32 sampling blocks, other 16-bit rows stay whole."""
    for rows in (1, 256, 8192):
        for dtype, softcap, blocks in ((torch.float32, None, 32), (torch.float32, 30.0, 32),
                                       (torch.bfloat16, None, None), (torch.float16, None, None),
                                       (torch.bfloat16, 30.0, 32), (torch.float16, 0.5, 32)):
            cfg = rs.default_config(torch.empty(rows, 8, dtype=dtype), softcap)
            assert cfg["part_blocks"] == blocks, (rows, dtype, softcap)


@pytest.mark.parametrize("blocks", [-1, 2.0, "2", True])
def test_vocabulary_parts_config_rejects(interpret, blocks):
    with pytest.raises(ValueError, match="part_blocks"):
        rs.vocabulary_parts(dict(part_blocks=blocks), 4096, 512)
    assert rs.vocabulary_parts(dict(part_blocks=2), 1024, 512) == (1, 0)  # one part: unsplit
    assert rs.vocabulary_parts(dict(part_blocks=2), 1025, 512) == (2, 1024)


def test_kernel_compiles_for_sm90_without_spills():
    """The kernel, unsplit and split (one and four parts per program; with a softcap one and
    two), compiles for sm_90 with the Triton installed here (in CI the latest release; the
    device runs 3.6) without register spills, and the split kernel issues one atomic,
    acq_rel from its thread 0, as its merge needs (``tools/compile_sm90.py --row-stats``: a stand-in
    driver, no GPU)."""
    tools = Path(__file__).resolve().parents[1] / "tools"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(tools / "compile_sm90.py"), "--row-stats",
                          "--dtypes", "float32,bfloat16"], env=env, capture_output=True,
                         text=True, timeout=600)
    report = [line for line in run.stdout.splitlines() if " shared " in line]
    assert run.returncode == 0 and len(report) == 10, run.stdout[-2000:] + run.stderr[-2000:]
    for line in report:
        assert "0 bytes spill stores" in line and "UNEXPECTED" not in line, line


# ----------------------------------------------------------------------------------- GPU


def _gpu_rows(n_req, width, vocab, dtype, gen_seed):
    gen = torch.Generator(device="cuda").manual_seed(gen_seed)
    logits = torch.randn(n_req * width, vocab, device="cuda", generator=gen, dtype=torch.float32)
    logits.mul_(2.5)
    # a peaked head on a third of the rows, as a language model would have
    head = torch.randint(0, vocab, (n_req * width,), device="cuda", generator=gen)
    rows = torch.arange(0, n_req * width, 3, device="cuda")
    logits[rows, head[rows]] += 15.0
    logits = logits.to(dtype)
    temperature = torch.linspace(0.4, 0.8, n_req, device="cuda")
    temperature[0] = 0.0
    seeds = torch.randint(-(2**63), 2**63 - 1, (n_req,), device="cuda", generator=gen)
    draws = torch.randint(0, 48, (n_req,), device="cuda", generator=gen)
    row_request = torch.arange(n_req, device="cuda", dtype=torch.int32).repeat_interleave(width)
    row_position = torch.arange(width, device="cuda", dtype=torch.int32).repeat(n_req)
    return logits, row_request, row_position, temperature, seeds, draws


def _gpu_check(logits, row_request, row_position, temperature, seeds, draws, rows=None,
               config=None, **kw):
    """Kernel on all rows; oracle and float64 checks on ``rows`` (all rows when None), chunked."""
    got = rs.row_stats_rows(logits, row_request, row_position, temperature, seeds, draws,
                            config=config, **kw)
    torch.cuda.synchronize()
    rows = torch.arange(logits.shape[0], device="cuda") if rows is None else rows
    ties = 0
    for start in range(0, rows.numel(), 256):
        sel = rows[start:start + 256]
        sub = (logits[sel], row_request[sel], row_position[sel], temperature, seeds, draws)
        want_kw = dict(kw)
        part = reference.RowStats(*(t[sel] for t in got.as_tuple()))
        ref = reference.row_stats_rows(*sub, **want_kw)
        _assert_thresholds(part.threshold, ref.threshold, sub[0], sub[1], kw.get("softcap"),
                           kw.get("allowed"), kw.get("top_k"), kw.get("top_p"))
        assert torch.equal(part.has_nan, ref.has_nan)
        z, _ = _masked_z(sub[0], sub[1], temperature, kw.get("softcap"), part.threshold, kw.get("allowed"))
        tokens = torch.arange(logits.shape[1], device="cuda")
        ties += _assert_same_or_near_tie(part.argmax, ref.argmax, z, tokens, "argmax")
        keys = _keys(z, sub[1], sub[2], seeds, draws, tokens)
        greedy = (temperature == 0)[sub[1].long()]
        keys = torch.where(greedy.unsqueeze(1), z, keys)
        ties += _assert_same_or_near_tie(part.sample, ref.sample, keys, tokens, "sample")
        lse64, ent64 = _oracle64(z)
        kept = torch.isfinite(lse64)
        lse_err = (part.lse.double() - lse64).abs()[kept] / lse64[kept].abs().clamp(min=1.0)
        assert (float(lse_err.max()) if kept.any() else 0.0) <= 1e-5
        ent_err = (part.entropy.double() - ent64).abs()[kept] / ent64[kept].clamp(min=1e-30)
        assert (float(ent_err.max()) if kept.any() else 0.0) <= 1e-5
    assert ties <= max(2, rows.numel() // 2000)
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_real_shape(dtype):
    """32 requests x 256 positions x 262144 vocabulary, every row checked."""
    data = _gpu_rows(32, 256, 262144, dtype, 21)
    _gpu_check(*data)


@pytest.mark.gpu
def test_gpu_real_shape_top_k_top_p():
    n_req = 8
    data = _gpu_rows(n_req, 256, 262144, torch.bfloat16, 22)
    top_k = torch.tensor([0, 1, 20, 50, 0, 400, 2000, 262144], device="cuda")
    top_p = torch.tensor([0.9, 1.0, 0.95, 0.8, 0.99, 1.0, 0.5, 1.0], device="cuda")
    _gpu_check(*data, top_k=top_k, top_p=top_p)


@pytest.mark.gpu
def test_gpu_rows_times_vocab_above_2_pow_31():
    """8200 rows x 262144 bf16 (4.3 GB): offsets past 2^31 elements; a sample of rows checked."""
    n_rows, vocab = 8200, 262144
    data = _gpu_rows(1, n_rows, vocab, torch.bfloat16, 23)
    logits, row_request, _, temperature, seeds, draws = data
    row_position = torch.arange(n_rows, device="cuda", dtype=torch.int32) % 256
    temperature.fill_(0.6)
    rows = torch.cat([torch.arange(0, 64, device="cuda"), torch.arange(n_rows - 192, n_rows, device="cuda"),
                      torch.randint(64, n_rows - 192, (64,), device="cuda")])
    _gpu_check(logits, row_request, row_position, temperature, seeds, draws, rows=rows)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_descriptor_walk_changes_no_bit(dtype):
    """Whole groups through the TMA descriptor (the default on Hopper), 3 or 4 stages deep,
    against the register-prefetch walk: every output bit-identical for a row stride that is a
    multiple of 16 elements (with another, the register walk sums in another order), with a
    ragged last group (a column slice of a wider tensor), NaN / +inf / -inf rows, a new maximum in
    every block, greedy rows, a sliced vocabulary
    (vocab_offset on a sampling-block boundary), sample keys and top-k / top-p thresholds."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or later")
    n_req, width, vocab = 3, 64, 262144 - 4096 - 296
    data = _gpu_rows(n_req, width, 262144, dtype, 24)
    logits = data[0][:, :vocab]  # row stride 262144, the last group ragged
    logits[1, 700] = float("nan")
    logits[2, 150000] = float("inf")
    logits[3, :100000] = float("-inf")
    logits[4] = torch.linspace(-4, 4, vocab, device="cuda").to(dtype)
    args = (logits,) + data[1:]
    assert rs._tma_walk(logits, dict(tma=True), 256, True)
    top_k = torch.tensor([0, 50, 2000], device="cuda")
    top_p = torch.tensor([0.9, 1.0, 0.5], device="cuda")
    for kw in (dict(), dict(vocab_offset=2 * 4096), dict(top_k=top_k, top_p=top_p)):
        outs = []
        for cfg in (dict(tma=False), dict(tma=True, tma_stages=3), dict(tma=True, tma_stages=4)):
            key = torch.empty(logits.shape[0], device="cuda")
            stats = rs.row_stats_rows(*args, config=cfg, sample_key=key, **kw)
            outs.append((stats, key))
        base, base_key = outs[0]
        for other, other_key in outs[1:]:
            for name in ("argmax", "sample", "entropy", "lse", "has_nan", "threshold"):
                assert torch.equal(getattr(other, name), getattr(base, name)), (name, kw)
            assert torch.equal(other_key, base_key), kw


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_request_bits_independent_of_batch(dtype):
    """One request's rows alone (256 rows: the chip mostly idle) and inside a batch of 6
    requests give bit-identical statistics and sample keys under the default config. The
    row stride (262144 - 296) is not a multiple of 16 elements: there the register walk sums
    in another order than the descriptor walk, so a walk chosen by
    the number of rows would show here."""
    width, n_req = 256, 6
    logits, row_request, row_position, temperature, seeds, draws = _gpu_rows(
        n_req, width, 262144 - 296, dtype, 31)
    key_all = torch.empty(logits.shape[0], device="cuda")
    batch = rs.row_stats_rows(logits, row_request, row_position, temperature, seeds, draws,
                              sample_key=key_all)
    for r in (1, n_req - 1):
        rows = slice(r * width, (r + 1) * width)
        key = torch.empty(width, device="cuda")
        alone = rs.row_stats_rows(logits[rows], torch.zeros(width, dtype=torch.int32, device="cuda"),
                                  row_position[rows], temperature[r:r + 1], seeds[r:r + 1],
                                  draws[r:r + 1], sample_key=key)
        for name in ("argmax", "sample", "entropy", "lse", "has_nan", "threshold"):
            assert torch.equal(getattr(alone, name), getattr(batch, name)[rows]), (name, r)
        assert torch.equal(key, key_all[rows]), r


@pytest.mark.gpu
def test_gpu_search_config_changes_no_bit():
    """The top-k / top-p search under its register cap (96 registers, spilling: the default
    for many rows), uncapped, at 128 registers, with other pivots per table round, other
    collection tiles and fewer programs per SM: every output bit-identical. Weighing fewer
    sampling blocks at once, or 4 warps per row instead of 2, changes the order of some fp32
    sums (block masses; the entropy and lse of rows the search finishes): those outputs then
    agree to fp32 rounding, the tokens and thresholds exactly."""
    n_req, width = 6, 256
    data = _gpu_rows(n_req, width, 262144, torch.bfloat16, 25)
    top_k = torch.tensor([0, 50, 1, 2000, 20, 0], device="cuda")
    top_p = torch.tensor([0.9, 1.0, 0.8, 0.5, 0.95, 1.0], device="cuda")

    def run(threshold_cfg):
        key = torch.empty(n_req * width, device="cuda")
        stats = rs.row_stats_rows(*data, config=dict(threshold=threshold_cfg), sample_key=key,
                                  top_k=top_k, top_p=top_p)
        return dict(zip(("argmax", "sample", "entropy", "lse", "threshold", "has_nan", "key"),
                        stats.as_tuple() + (key,)))

    base = run(dict(maxnreg=96))
    reordering = (dict(stats_blocks=8), dict(num_warps=4, programs_per_sm=5))
    for cfg in (dict(maxnreg=None), dict(maxnreg=128, programs_per_sm=4), dict(table_ways=8),
                dict(group=8), dict(programs_per_sm=3)) + reordering:
        got = run(cfg)
        for name, b in base.items():
            if cfg in reordering and name in ("entropy", "lse", "key"):
                torch.testing.assert_close(got[name], b, rtol=2e-6, atol=1e-6, msg=f"{cfg} {name}")
            else:
                assert torch.equal(got[name], b), (cfg, name)


STATS = ("argmax", "sample", "entropy", "lse", "has_nan", "threshold")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_vocabulary_parts(dtype):
    """The split walk at the real row length (16 and 8 sampling blocks per part: 4 and 8
    programs per row) against the oracle and float64, with and without top-k / top-p; at 32
    requests (65536 programs racing to merge) repeated launches give the same bits."""
    data = _gpu_rows(4, 256, 262144, dtype, 41)
    for blocks in (16, 8):
        _gpu_check(*data, config=dict(part_blocks=blocks))
    top_k = torch.tensor([0, 20, 2000, 0], device="cuda")
    top_p = torch.tensor([0.9, 1.0, 0.5, 1.0], device="cuda")
    _gpu_check(*data, config=dict(part_blocks=16), top_k=top_k, top_p=top_p)
    data = _gpu_rows(32, 256, 262144, dtype, 42)
    rows = torch.randint(0, 32 * 256, (512,), device="cuda")
    first = _gpu_check(*data, rows=rows, config=dict(part_blocks=8))
    for _ in range(3):
        again = rs.row_stats_rows(*data, config=dict(part_blocks=8))
        for name in STATS:
            assert torch.equal(getattr(again, name), getattr(first, name)), name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_vocabulary_parts_bits_independent_of_batch(dtype):
    """As ``test_gpu_request_bits_independent_of_batch``, through the split walk; and its
    descriptor walk against its register walk, bit for bit."""
    width, n_req = 256, 6
    logits, row_request, row_position, temperature, seeds, draws = _gpu_rows(
        n_req, width, 262144, dtype, 43)
    cfg = dict(part_blocks=16)
    batch = rs.row_stats_rows(logits, row_request, row_position, temperature, seeds, draws,
                              config=cfg)
    registers = rs.row_stats_rows(logits, row_request, row_position, temperature, seeds, draws,
                                  config=dict(cfg, tma=False))
    for name in STATS:
        assert torch.equal(getattr(registers, name), getattr(batch, name)), name
    for r in (1, n_req - 1):
        rows = slice(r * width, (r + 1) * width)
        alone = rs.row_stats_rows(logits[rows], torch.zeros(width, dtype=torch.int32, device="cuda"),
                                  row_position[rows], temperature[r:r + 1], seeds[r:r + 1],
                                  draws[r:r + 1], config=cfg)
        for name in STATS:
            assert torch.equal(getattr(alone, name), getattr(batch, name)[rows]), (name, r)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_part_group_changes_no_bit(dtype):
    """At the real row length, with the descriptor walk: programs of 1, 2, 3 and 8 parts of 8
    sampling blocks give the same bits, with a softcap (12: the peaked heads and the bulk's
    largest entries pass it, so groups take both of its paths) and with top-k / top-p, the
    sample keys of the tensor-parallel merge included; the default choice for the batch
    matches them."""
    data = _gpu_rows(4, 256, 262144, dtype, 45)
    top_k = torch.tensor([0, 20, 2000, 0], device="cuda")
    top_p = torch.tensor([0.9, 1.0, 0.5, 1.0], device="cuda")
    key = torch.empty(data[0].shape[0], device="cuda")
    for kw in (dict(softcap=12.0), dict(top_k=top_k, top_p=top_p)):
        outs = []
        for each in (1, 2, 3, 8, None):
            stats = rs.row_stats_rows(*data, config=dict(part_blocks=8, part_group=each),
                                      sample_key=key, **kw)
            outs.append((stats, key.clone()))
        (base, base_key), *others = outs
        for stats, other_key in others:
            for name in STATS:
                assert torch.equal(getattr(stats, name), getattr(base, name)), name
            assert torch.equal(other_key, base_key)


@pytest.mark.gpu
def test_gpu_vocabulary_parts_graph_replay():
    """Captured in a CUDA graph and replayed, the split walk gives the eager bits every time:
    the arrival counters come back to zero after each launch."""
    data = _gpu_rows(1, 256, 262144, torch.float32, 44)
    cfg = dict(part_blocks=16)
    eager = rs.row_stats_rows(*data, config=cfg)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rs.row_stats_rows(*data, config=cfg)  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=stream):
            captured = rs.row_stats_rows(*data, config=cfg)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        for t in captured.as_tuple():
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for name in STATS:
            assert torch.equal(getattr(captured, name), getattr(eager, name)), name
