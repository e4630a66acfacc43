"""The per-logit helpers every row kernel shares (``kernels/logit_row.py``): the softcap."""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from dgemma_sampler.kernels.logit_row import softcapped


@triton.jit
def _softcap_kernel(x_ptr, out_ptr, n, SOFTCAP: tl.constexpr, BELOW: tl.constexpr,
                    BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, softcapped(x, SOFTCAP, BELOW), mask=offs < n)


def _softcap(x: torch.Tensor, c: float, below: bool = False) -> torch.Tensor:
    out = torch.empty_like(x)
    block = 1024
    _softcap_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), SOFTCAP=c, BELOW=below,
                                                      BLOCK=block)
    return out


def _every_bf16(device) -> torch.Tensor:
    """Every bf16 value but NaN, in increasing order, as fp32."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = bits.to(torch.float32)
    x = x[~torch.isnan(x)]
    return torch.unique(x).to(device)  # sorted; -0 and +0 collapse


def _check_softcap(device, tolerance):
    x = _every_bf16(device)
    for c in (30.0, 0.5, 50.0, 1e4):
        got = _softcap(x, c)
        want = c * torch.tanh(x.double() / c)
        ulp = torch.from_numpy(np.spacing(np.abs(want.float().cpu().numpy()))).double().to(device)
        err = (got.double() - want).abs()
        # within `tolerance` ulp (torch's own fp32 c * tanh(x / c): 1.7 at c = 30), or below
        # the smallest normal, where the kernels flush to zero
        assert bool(((err <= tolerance * ulp) | (err < 1.2e-38)).all()), \
            (c, float((err / ulp).max()))
        assert bool((got[1:] >= got[:-1]).all()), c                # monotone
        assert torch.equal(_softcap(-x, c), -got), c               # odd, bit for bit
        assert got[0] == -c and got[-1] == c                       # -inf and +inf
        # Below the cap the polynomial alone gives the same bits as the general path.
        inside = x[x.abs() < c]
        assert torch.equal(_softcap(inside, c, below=True), _softcap(inside, c)), c
    assert torch.isnan(_softcap(torch.full((4,), float("nan"), device=device), 30.0)).all()


def test_softcap_every_bf16(interpret):
    """``softcapped`` over every bf16 value: within 2 ulp of float64 ``c tanh(x / c)`` (1.5
    at most, at c from 0.5 to 1e4), monotone, odd, exactly +-c at infinity, NaN for NaN; its
    polynomial-only variant (``BELOW``, for groups whose every entry is below the cap)
    equals it bit for bit."""
    _check_softcap(interpret, 2)


@pytest.mark.gpu
def test_gpu_softcap_every_bf16():
    """The same on the GPU, where ``exp2`` and the reciprocal are MUFU ops and the polynomial
    runs as FMAs: the two code paths of the row statistics must round alike. ``ex2.approx``
    adds up to an ulp above the cap."""
    _check_softcap("cuda", 3)
