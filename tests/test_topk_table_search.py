"""The top-k / top-p table search (``topk_topp._largest_reaching``) against a brute force.

The search returns the largest sub-block maximum ``v`` with ``sum(weight where maxima >= v)
>= target`` (-inf when even the whole table falls short). It weighs several pivots per
round; the answer must not depend on how many (``WAYS``), and must equal the brute force on
tables with ties, -inf padding, +inf entries and zero weights. Weights are multiples of
1/64 (exact in fp64 whatever the summation order), so the comparison is exact.

    TRITON_INTERPRET=1 pytest -q tests/test_topk_table_search.py
"""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from dgemma_sampler.kernels.topk_topp import _largest_reaching

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                reason="needs TRITON_INTERPRET=1 or a CUDA device")


@triton.jit
def _search_kernel(maxima_ptr, weight_ptr, target_ptr, out_ptr, N: tl.constexpr,
                   WAYS: tl.constexpr, MASS: tl.constexpr):
    slot = tl.arange(0, N)
    maxima = tl.load(maxima_ptr + slot)
    if MASS:  # fp64 weights and target, as the top-p phase passes them
        found = _largest_reaching(maxima, tl.load(weight_ptr + slot), tl.load(target_ptr), WAYS)
    else:  # int32 counts, an int64 target (k)
        found = _largest_reaching(maxima, tl.load(weight_ptr + slot).to(tl.int32),
                                  tl.load(target_ptr).to(tl.int64), WAYS)
    tl.store(out_ptr, found)


def brute_force(maxima: torch.Tensor, weight: torch.Tensor, target: float) -> float:
    best = float("-inf")
    for v in maxima.unique().tolist():
        if float(weight[maxima >= v].sum()) >= target:
            best = max(best, v)
    return best


def table_search(maxima, weight, target, ways: int, mass: bool) -> float:
    n = maxima.numel()
    out = torch.empty(1, dtype=torch.float32, device=DEVICE)
    w = weight.to(torch.float64 if mass else torch.int64).to(DEVICE)
    t = torch.tensor([target], dtype=torch.float64 if mass else torch.int64, device=DEVICE)
    _search_kernel[(1,)](maxima.to(DEVICE), w, t, out, N=n, WAYS=ways, MASS=mass)
    return float(out)


@st.composite
def tables(draw):
    n = draw(st.sampled_from([2, 16, 64, 256]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    # few distinct values (ties), a wide range or tiny gaps (neighbouring floats)
    style = draw(st.sampled_from(["ties", "wide", "ulps"]))
    if style == "ties":
        maxima = torch.randint(-3, 4, (n,), generator=gen).float() * 0.5
    elif style == "wide":
        maxima = torch.randn(n, generator=gen) * 10.0 ** draw(st.integers(-3, 30))
    else:
        maxima = torch.nextafter(torch.full((n,), 7.0), torch.tensor(8.0)) + \
            torch.randint(0, 5, (n,), generator=gen) * 2.0 ** -20
    special = torch.rand(n, generator=gen)
    maxima[special < draw(st.sampled_from([0.0, 0.3]))] = float("-inf")   # padding
    maxima[special > 1 - draw(st.sampled_from([0.0, 0.05]))] = float("inf")
    mass = draw(st.booleans())
    if mass:
        weight = torch.randint(0, 65, (n,), generator=gen).double() / 64  # zeros included
    else:
        weight = torch.ones(n, dtype=torch.float64)
    total = float(weight.sum())
    target = draw(st.sampled_from([0.25, 0.5, 0.9, 1.0, 1.5])) * total
    if not mass:
        target = float(max(1, round(target)))
    return maxima.float(), weight, target, mass


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(case=tables(), ways=st.sampled_from([2, 4, 16]))
def test_table_search_matches_brute_force(case, ways):
    maxima, weight, target, mass = case
    assert table_search(maxima, weight, target, ways, mass) == brute_force(maxima, weight, target)


def test_table_search_all_masked_and_single_entry():
    """A table of -inf only finds -inf; one finite entry is found for k = 1 and not k = 2."""
    neg = torch.full((16,), float("-inf"))
    assert table_search(neg, torch.ones(16), 1, 4, False) == float("-inf")
    one = neg.clone()
    one[5] = -2.5
    assert table_search(one, torch.ones(16), 1, 16, False) == -2.5
    assert table_search(one, (one > float("-inf")).double(), 2, 16, False) == float("-inf")
