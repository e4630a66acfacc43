"""The LM-head projection kernel (``kernels/head_gemm.py``) against its oracle, and its batch invariance.

The oracle is the float64 product rounded once to the model dtype: the kernel's fp32 sums (in
another order) may round to the neighbouring value, never further. Batch invariance is checked
bit for bit: a request's rows projected alone, and inside batches at other offsets, give the same
logits; so do the TMA and the pointer loads (the same tiles in the same order). On the GPU at
DiffusionGemma's shape (V = 2^18, H = 2816): a request alone and in batches of 2, 16 and 32.
"""

from __future__ import annotations

import pytest
import torch

from dgemma_sampler.kernels import head_gemm as hg


def oracle(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (hidden.double() @ weight.double().T).to(hidden.dtype)


def assert_within_one_rounding(got: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor):
    """Each logit is the exact product, up to the fp32 sum's error (``H 2^-24`` of the sum of
    the magnitudes: it shows where terms cancel), rounded to a neighbouring value of the dtype:
    within one unit in the last place."""
    exact = hidden.double() @ weight.double().T
    magnitude = hidden.double().abs() @ weight.double().abs().T
    ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp(min=2.0**-100)))
                  - (7 if hidden.dtype == torch.bfloat16 else 10))
    assert ((got.double() - exact).abs() <= ulp + hidden.shape[1] * 2.0**-24 * magnitude).all()
    assert (got == oracle(hidden, weight)).float().mean() > 0.97


SHAPES = [(40, 301, 48), (5, 77, 24), (33, 160, 40), (1, 64, 16), (70, 1000, 72)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,v,h", SHAPES)
def test_matches_oracle_and_is_batch_invariant(interpret, dtype, m, v, h):
    g = torch.Generator().manual_seed(m * 1000 + v)
    hidden = torch.randn(m, h, generator=g).to(dtype).to(interpret)
    weight = torch.randn(v, h, generator=g).to(dtype).to(interpret)
    out = hg.empty_logits(m, v, dtype, hidden.device)
    out.fill_(float("nan"))  # poisoned: every element must be written
    got = hg.project(hidden, weight, out)
    assert got is out and not got.isnan().any()
    assert got.stride(0) % (16 // got.element_size()) == 0
    assert_within_one_rounding(got.cpu(), hidden.cpu(), weight.cpu())
    for lo, hi in ((0, 1), (m // 3, m // 3 + 2), (m - 1, m)):
        alone = hg.project(hidden[lo:hi].clone(), weight)
        assert torch.equal(alone, got[lo:hi])
    # the same rows inside a larger batch, at another offset
    pad = torch.randn(7, h, generator=g).to(dtype).to(interpret)
    bigger = hg.project(torch.cat([pad, hidden, pad]), weight)
    assert torch.equal(bigger[7:7 + m], got)


def test_tma_and_pointer_loads_give_the_same_bits(interpret):
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(37, 64, generator=g).to(torch.bfloat16).to(interpret)
    weight = torch.randn(520, 64, generator=g).to(torch.bfloat16).to(interpret)
    a = hg.project(hidden, weight, tma=False)
    b = hg.project(hidden, weight, tma=True)
    assert torch.equal(a, b)


def test_non_finite_inputs_propagate(interpret):
    """An inf or NaN hidden state makes that row's logits non-finite (as a BLAS would); the
    other rows are untouched by it (the kernels that read the logits mask NaN per row)."""
    hidden = torch.randn(6, 16).to(torch.bfloat16)
    hidden[2, 3] = float("nan")
    hidden[4, 0] = float("inf")
    weight = torch.randn(40, 16).to(torch.bfloat16)
    got = hg.project(hidden.to(interpret), weight.to(interpret)).cpu()
    assert got[2].isnan().all()
    assert (~torch.isfinite(got[4])).all()
    keep = [0, 1, 3, 5]
    assert torch.equal(got[keep], hg.project(hidden[keep].to(interpret), weight.to(interpret)).cpu())


def test_empty_and_asserted_inputs(interpret):
    w = torch.randn(10, 8).to(torch.bfloat16).to(interpret)
    assert hg.project(torch.empty(0, 8, dtype=torch.bfloat16, device=interpret), w).shape == (0, 10)
    with pytest.raises(AssertionError):
        hg.project(torch.randn(3, 8, device=interpret), w)  # fp32 hidden
    with pytest.raises(AssertionError):
        hg.project(torch.randn(3, 9).to(torch.bfloat16).to(interpret), w)  # hidden size


@pytest.mark.gpu
def test_batch_invariant_at_diffusiongemma_shape_gpu():
    """A request's 256 rows alone and inside batches of 2, 16 and 32 requests (at every position
    a request can take in a tile): bit for bit. cuBLAS's result is reported beside it (a
    library GEMM picks its kernel by the batch), and ours is within one bf16 rounding of it."""
    v, h, canvas = 262144, 2816, 256
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(v, h, generator=g, device="cuda") / h ** 0.5).to(torch.bfloat16)
    hidden = torch.randn(32 * canvas, h, generator=g, device="cuda").to(torch.bfloat16)
    full = hg.project(hidden, weight)
    for n in (1, 2, 4, 16):  # up to 4 requests hg.FEW_ROWS_CONFIG, CONFIG beyond
        for first in sorted({0, 31 - n + 1, 7}):
            rows = slice(first * canvas, (first + n) * canvas)
            part = hg.project(hidden[rows].contiguous(), weight)
            assert torch.equal(part, full[rows]), (n, first)
    cublas = torch.nn.functional.linear(hidden[:canvas], weight)
    differ = (cublas != full[:canvas]).float().mean().item()
    assert differ < 0.02, differ
    ratio = (full[:canvas].float() - cublas.float()).abs().max() / cublas.float().abs().max()
    assert ratio < 2.0**-7


def test_config_by_rows_keeps_the_tile():
    """What the row count chooses (pipeline depth, the store's split) never the tile or K step,
    which fix the bits."""
    few, many = hg.config_for(1, tma=True), hg.config_for(hg.FEW_ROWS + 1, tma=True)
    assert hg.config_for(hg.FEW_ROWS, tma=True) == few == hg.FEW_ROWS_CONFIG and many == hg.CONFIG
    assert (few.block_m, few.block_n, few.block_k) == (many.block_m, many.block_n, many.block_k)
    # pointer loads and stores (GPUs before Hopper, unaligned rows) keep CONFIG's shared memory
    assert hg.config_for(1, tma=False) == hg.CONFIG
