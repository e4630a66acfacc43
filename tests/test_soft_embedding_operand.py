"""The soft-embedding operand written over the logits (``kernels/soft_embedding_operand.py``).

In the interpreter: the kept rows hold ``p = exp(z - lse)`` in the logits' dtype (masks,
softcap, temperature, NaN and +-inf as the oracle's ``reference.probabilities``, to one rounding
of the dtype), and every other row is untouched bit for bit. On the GPU: the Hopper GEMM fed the
given operand gives the fused GEMM's result bit for bit (no softcap, where the fused GEMM runs),
and with a softcap it agrees with the portable Triton kernel; ``soft_embedding_rows`` with
``logits_scratch`` leaves the rows it does not multiply as they were.
"""

from __future__ import annotations

import pytest
import torch

from dgemma_sampler import reference
from dgemma_sampler.kernels.kept_rows import kept_first
from dgemma_sampler.kernels.soft_embedding_operand import operand_in_place

SOFTCAP = 30.0


def make_rows(device, dtype, *, n=14, vocab=3001, seed=0, greedy=True):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, vocab, generator=g) * 12).to(dtype)
    x[2, 5] = float("nan")
    x[3, 7] = float("inf")
    x[4, :] = float("-inf")  # nothing kept: p = 0 everywhere
    x[5, 11] = float("-inf")
    request = torch.tensor([0] * (n // 2) + [1] * (n - n // 2), dtype=torch.int32)
    # (greedy: the second request at T = 0)
    temperature = torch.tensor([0.6, 0.0 if greedy else 0.9])
    seeds, draws = torch.tensor([3, 4]), torch.tensor([0, 5])
    return x.to(device), request.to(device), temperature.to(device), seeds.to(device), draws.to(device)


def expected(x, request, inv_t, lse, threshold, allowed, softcap):
    extra = None if allowed is None else ~allowed[request.long()]
    thr = threshold if threshold is not None else torch.full((x.shape[0],), float("-inf"))
    return reference.probabilities(x.float(), inv_t[request.long()], lse, thr, extra, softcap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masks", ["none", "threshold", "allowed", "slice"])
def test_kept_rows_hold_the_operand(interpret, dtype, masks):
    """(With a softcap the kernels' tanh is within a few ulp of torch's, which at T = 0 moves
    ``z`` by thousands of nats: the softcap cases run at T > 0, greedy rows without one.)"""
    softcap = SOFTCAP if masks in ("none", "slice") else None
    x, request, temperature, seeds, draws = make_rows("cpu", dtype, greedy=softcap is None)
    n, vocab = x.shape
    top_k = torch.tensor([40, 0]) if masks == "threshold" else None
    allowed = None
    if masks == "allowed":
        allowed = torch.rand(2, vocab, generator=torch.Generator().manual_seed(1)) > 0.4
    stats = reference.row_stats_rows(x, request, torch.arange(n), temperature, seeds, draws,
                                     softcap=softcap, top_k=top_k, allowed=allowed)
    threshold = stats.threshold if top_k is not None else None
    vocab_start, v_local = (1000, 1500) if masks == "slice" else (0, vocab)
    keep = torch.ones(n, dtype=torch.bool)
    keep[[1, 6, 9]] = False
    order, count = kept_first(keep)
    inv_t = reference.inverse_temperature(temperature)
    got = x.clone().to(interpret)
    operand_in_place(got, request.to(interpret), inv_t.to(interpret), stats.lse.to(interpret),
                     row_order=order.to(interpret), kept_count=count.to(interpret),
                     threshold=None if threshold is None else threshold.to(interpret),
                     allowed=None if allowed is None else allowed.to(interpret),
                     vocab_start=vocab_start, v_local=v_local, softcap=softcap)
    got = got.cpu()
    cols = slice(vocab_start, vocab_start + v_local)
    # rows not kept, and columns outside the slice: untouched
    assert torch.equal(got[~keep].view(torch.int16), x[~keep].view(torch.int16))
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[cols] = False
    assert torch.equal(got[:, outside].view(torch.int16), x[:, outside].view(torch.int16))
    want = expected(x[:, cols], request, inv_t, stats.lse, threshold, None if allowed is None
                    else allowed[:, cols], softcap)
    p = got[keep][:, cols].float()
    w = want[keep]
    assert torch.isfinite(p).all() and (p >= 0).all() and (p <= 1).all()
    # one rounding of the dtype: relative, or fp16's subnormal spacing (2^-24) near 0
    unit, floor = (2.0**-8, 1e-30) if dtype == torch.bfloat16 else (2.0**-11, 2.0**-24)
    assert ((p - w).abs() <= unit * w + floor).all()
    assert (p[w == 0] == 0).all()  # masked, NaN, -inf and dead rows give exactly 0


def test_every_row_without_an_order(interpret):
    x, request, temperature, seeds, draws = make_rows("cpu", torch.bfloat16, n=8, vocab=700)
    stats = reference.row_stats_rows(x, request, torch.arange(8), temperature, seeds, draws)
    inv_t = reference.inverse_temperature(temperature)
    got = x.clone().to(interpret)
    operand_in_place(got, request.to(interpret), inv_t.to(interpret), stats.lse.to(interpret),
                     row_order=None, kept_count=None, threshold=None, allowed=None,
                     vocab_start=0, v_local=700, softcap=None)
    want = expected(x, request, inv_t, stats.lse, None, None, None)
    assert ((got.cpu().float() - want).abs() <= 2.0**-8 * want + 1e-30).all()


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [None, SOFTCAP])
def test_given_operand_gemm_matches_the_fused_gemm_gpu(softcap):
    """DiffusionGemma's shape, 2 requests, a random two thirds of the rows kept, bf16 logits
    and E. Without a softcap the fused Hopper GEMM runs on the read-only logits: the given
    operand reproduces it bit for bit. With one the portable Triton kernel is the reference
    (another summation order: within bf16 operand tolerance). Rows not kept keep their logits."""
    from dgemma_sampler.kernels import soft_embedding_dispatch as se
    from dgemma_sampler.kernels.row_stats import row_stats_rows

    n, vocab, hidden = 512, 262144, 2816
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(n, vocab, generator=g, device="cuda") * 3).to(torch.bfloat16)
    e = (torch.randn(vocab, hidden, generator=g, device="cuda") / 8).to(torch.bfloat16)
    request = torch.arange(n, device="cuda", dtype=torch.int32) // 256
    temperature = torch.tensor([0.7, 0.5], device="cuda")
    seeds = torch.tensor([1, 2], device="cuda")
    stats = row_stats_rows(x, request, request, temperature, seeds, seeds, softcap=softcap)
    keep = torch.rand(n, generator=g, device="cuda") < 0.66
    if softcap is None:
        want = se.soft_embedding_rows(x, request, temperature, stats.lse, e, 2.0, keep=keep)
    else:
        want = se.soft_embedding_rows(x, request, temperature, stats.lse, e, 2.0, keep=keep,
                                      softcap=softcap, wgmma=False)
    scratch = x.clone()
    got = se.soft_embedding_rows(scratch, request, temperature, stats.lse, e, 2.0, keep=keep,
                                 softcap=softcap, logits_scratch=True)
    assert torch.equal(scratch[~keep].view(torch.int16), x[~keep].view(torch.int16))
    if softcap is None:
        assert torch.equal(got, want)
    else:
        assert ((got - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kept", ["all", "two_thirds"])
def test_tall_tile_matches_the_wide_tile_gpu(monkeypatch, kept):
    """One canvas of DiffusionGemma's shape (256 rows, bf16, softcap 30): the given operand
    multiplied on the TALL tile (``soft_embedding_wgmma.tile_shape``) agrees with the WIDE
    tile (the same K pieces summed in another tile: within fp32 rounding), writes zeros on rows
    not kept, and repeats bit for bit."""
    from dgemma_sampler.kernels import soft_embedding_dispatch as se
    from dgemma_sampler.kernels import soft_embedding_wgmma as wg
    from dgemma_sampler.kernels.row_stats import row_stats_rows

    n, vocab, hidden = 256, 262144, 2816
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(n, vocab, generator=g, device="cuda") * 3).to(torch.bfloat16)
    e = (torch.randn(vocab, hidden, generator=g, device="cuda") / 8).to(torch.bfloat16)
    request = torch.zeros(n, device="cuda", dtype=torch.int32)
    temperature, seeds = torch.tensor([0.7], device="cuda"), torch.tensor([1], device="cuda")
    stats = row_stats_rows(x, request, torch.arange(n, device="cuda"), temperature, seeds, seeds,
                           softcap=SOFTCAP)
    keep = torch.ones(n, dtype=torch.bool, device="cuda")
    if kept == "two_thirds":
        keep = torch.rand(n, generator=g, device="cuda") < 0.66

    def run(tall_rows):
        monkeypatch.setattr(wg, "TALL_MAX_ROWS", tall_rows)
        assert wg.tile_shape(True, n) == (wg.TALL if tall_rows else wg.WIDE)
        return se.soft_embedding_rows(x.clone(), request, temperature, stats.lse, e, 2.0,
                                      keep=keep, softcap=SOFTCAP, logits_scratch=True)

    tall, wide = run(256), run(0)
    assert (tall[~keep] == 0).all() and not tall.isnan().any()
    assert ((tall - wide).norm() / wide.norm()).item() < 1e-5
    assert torch.equal(run(256), tall)
