"""The Triton keyed noise is the PyTorch keyed noise: bits exact, Gumbel values within 4 ulp.

CPU: ``TRITON_INTERPRET=1 pytest -q tests/test_keyed_noise.py``; the ``gpu`` tests repeat the
comparison compiled on a CUDA device at a size with every seed/position/token pattern.
"""

import pytest
import torch
import triton
import triton.language as tl

from dgemma_sampler import keyed_noise as ref
from dgemma_sampler.kernels import keyed_noise as kn

SEEDS = [0, 1, -1, 7, -(2**63), 2**63 - 1, 2**62 + 3, -(2**40) - 17, 0x0123456789ABCDEF]
DRAWS = [0, 1, 2**32 - 1, 2**32, 2**40 + 5, 2**63 - 1]


@triton.jit
def _noise_kernel(seed_ptr, draw_ptr, position_ptr, token_ptr, n_tokens,
                  key_ptr, bits_ptr, prod_bits_ptr, exp_ptr, gumbel_ptr,
                  STREAM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    key = kn.row_key(tl.load(seed_ptr + row), tl.load(draw_ptr + row), tl.load(position_ptr + row),
                     STREAM)
    tl.store(key_ptr + row, key.to(tl.int64))
    offs = tl.arange(0, BLOCK)
    mask = offs < n_tokens
    token = tl.load(token_ptr + offs, mask=mask, other=0)
    bits = kn.token_bits(key, token)
    out = row * n_tokens + offs
    tl.store(bits_ptr + out, bits.to(tl.int64), mask=mask)
    prod = kn.token_bits_of_product(key, token.to(tl.uint32) * kn.C1)
    tl.store(prod_bits_ptr + out, prod.to(tl.int64), mask=mask)
    tl.store(exp_ptr + out, kn.exponential(bits), mask=mask)
    tl.store(gumbel_ptr + out, kn.gumbel(bits), mask=mask)


def _ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between fp32 tensors (same sign assumed)."""
    ia = a.view(torch.int32).to(torch.int64)
    ib = b.view(torch.int32).to(torch.int64)
    return (ia - ib).abs()


def _run(device: str, seeds, draws, positions, tokens, stream: int):
    n = len(seeds)
    seed_t = torch.tensor(seeds, dtype=torch.int64, device=device)
    draw_t = torch.tensor(draws, dtype=torch.int64, device=device)
    pos_t = torch.tensor(positions, dtype=torch.int32, device=device)
    tok_t = torch.as_tensor(tokens, dtype=torch.int64, device=device)
    nt = tok_t.numel()
    key = torch.full((n,), -1, dtype=torch.int64, device=device)
    bits = torch.full((n, nt), -1, dtype=torch.int64, device=device)
    prod_bits = torch.full((n, nt), -1, dtype=torch.int64, device=device)
    exp = torch.full((n, nt), float("nan"), device=device)
    gum = torch.full((n, nt), float("nan"), device=device)
    _noise_kernel[(n,)](seed_t, draw_t, pos_t, tok_t, nt, key, bits, prod_bits, exp, gum,
                        STREAM=stream, BLOCK=triton.next_power_of_2(nt))
    want_key = ref.row_key(seed_t, draw_t, pos_t, stream)
    want_bits = ref.token_bits(want_key.unsqueeze(1), tok_t.unsqueeze(0))
    assert torch.equal(key & ref.MASK32, want_key)
    assert torch.equal(bits & ref.MASK32, want_bits)
    assert torch.equal(prod_bits & ref.MASK32, want_bits)
    want_exp = ref.exponential(want_bits)
    want_gum = ref.gumbel(want_bits)
    assert torch.isfinite(exp).all() and torch.isfinite(gum).all()
    assert (exp > 0).all()
    assert int(_ulp_distance(exp, want_exp).max()) <= 4
    # G = -log(E) crosses 0 at E = 1, where one ulp of E is 1.2e-7 of G in absolute terms:
    # compare within 4 ulp of max(|G|, 1), the scale at which G enters a key z + G.
    ulp = torch.finfo(torch.float32).eps * torch.maximum(want_gum.abs(), gum.abs()).clamp(min=1.0)
    assert bool(((gum - want_gum).abs() <= 4 * ulp).all()), float(((gum - want_gum).abs() / ulp).max())
    return want_bits, gum


def test_constants_mirror_the_oracle():
    for name in ("GOLDEN", "C1", "C2", "F1", "F2", "MURMUR_ADD", "TWO_POW_M32", "SERIES_LIMIT"):
        assert getattr(kn, name).value == getattr(ref, name), name


def test_twin_bits_exact_and_gumbel_close(interpret):
    if interpret == "cuda":
        pytest.skip("CPU variant; the gpu test covers CUDA")
    gen = torch.Generator().manual_seed(5)
    seeds = SEEDS + [int(s) for s in torch.randint(-(2**63), 2**63 - 1, (3,), generator=gen)]
    draws = [DRAWS[i % len(DRAWS)] for i in range(len(seeds))]
    positions = [i * 37 % 256 for i in range(len(seeds))]
    tokens = torch.cat([torch.tensor([0, 1, 2, 262143, 2**31 - 1]),
                        torch.randint(0, 262144, (250,), generator=gen)])
    for stream in (1, 3):
        _run("cpu", seeds, draws, positions, tokens, stream)


def test_exponential_covers_both_ends(interpret):
    """Bits 0 and 2^32 - 1 (the ends of the uniform) and both sides of the series switch."""
    if interpret == "cuda":
        pytest.skip("CPU variant")

    @triton.jit
    def gumbel_of_bits(bits_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        b = tl.load(bits_ptr + offs, mask=offs < n, other=0).to(tl.uint32)
        tl.store(out_ptr + offs, kn.gumbel(b), mask=offs < n)

    edge = torch.tensor([0, 1, 2, 2**27 - 1, 2**27, 2**27 + 1, 2**31 - 1, 2**31, 2**31 + 1,
                         2**32 - 2, 2**32 - 1], dtype=torch.int64)
    out = torch.full((edge.numel(),), float("nan"))
    gumbel_of_bits[(1,)](edge, out, edge.numel(), BLOCK=16)
    want = ref.gumbel(edge)
    assert torch.allclose(out, want, rtol=4 * 2**-23, atol=0)
    assert 22.8 < float(out[0]) < 22.9  # the largest Gumbel value: 33 ln 2
    assert -3.2 < float(out[-1]) < -3.1


@pytest.mark.gpu
def test_twin_on_gpu():
    gen = torch.Generator().manual_seed(6)
    n = 512
    seeds = [int(s) for s in torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen)]
    seeds[: len(SEEDS)] = SEEDS
    draws = [int(d) for d in torch.randint(0, 2**62, (n,), generator=gen)]
    draws[: len(DRAWS)] = DRAWS
    positions = [i % 256 for i in range(n)]
    tokens = torch.cat([torch.tensor([0, 1, 262143]), torch.randint(0, 262144, (4093,), generator=gen)])
    bits, gum = _run("cuda", seeds, draws, positions, tokens, 1)
    # The noise is uniform: each byte of the bits is close to uniform over many draws.
    counts = torch.bincount((bits & 0xFF).flatten(), minlength=256).double()
    expected = bits.numel() / 256
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 255 + 10 * (2 * 255) ** 0.5
