"""Triton twin of ``dgemma_sampler.keyed_noise``: the same hash on ``uint32`` lanes.

The PyTorch file holds the specification and the reasons; this file must produce the
same bits for the same (seed, draw, position, stream, token). The integer part is exact
in both; the fp32 part (``exponential``) follows the same operation sequence, so its
results agree up to the last bit of ``log`` (PyTorch and the GPU's ``log`` may round
differently), which only matters for keys tied within a few ulp.
"""

import triton
import triton.language as tl

# Mirrors of dgemma_sampler.keyed_noise; tests assert they are equal.
GOLDEN = tl.constexpr(0x9E3779B9)
C1 = tl.constexpr(0xCC9E2D51)
C2 = tl.constexpr(0x1B873593)
F1 = tl.constexpr(0x85EBCA6B)
F2 = tl.constexpr(0xC2B2AE35)
MURMUR_ADD = tl.constexpr(0xE6546B64)
TWO_POW_M32 = tl.constexpr(2.0**-32)
SERIES_LIMIT = tl.constexpr(1.0 / 32.0)


@triton.jit
def _rotl32(x, r: tl.constexpr):
    return (x << r) | (x >> (32 - r))


@triton.jit
def fmix32(h):
    """murmur3's finalizer on uint32 values (wrapping multiplies)."""
    h = h ^ (h >> 16)
    h = h * F1
    h = h ^ (h >> 13)
    h = h * F2
    return h ^ (h >> 16)


@triton.jit
def row_key(seed, draw, position, STREAM: tl.constexpr):
    """uint32 key of (int64 seed, int64 draw counter, int position, stream).

    ``seed``, ``draw`` and ``position`` must be tensors (loaded values or ``tl.arange``
    expressions), not Python ints: compiled Triton has no ``.to`` on a constexpr.
    """
    seed = seed.to(tl.int64)
    draw = draw.to(tl.int64)
    k = fmix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ GOLDEN)
    k = fmix32(k ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    k = fmix32(k ^ (draw & 0xFFFFFFFF).to(tl.uint32))
    k = fmix32(k ^ ((draw >> 32) & 0xFFFFFFFF).to(tl.uint32))
    k = fmix32(k ^ position.to(tl.uint32))
    return fmix32(k ^ ((STREAM * 0x9E3779B9) & 0xFFFFFFFF))


@triton.jit
def token_bits(key, token):
    """32 random bits (uint32) for ``token`` (any int tensor) under a uint32 row ``key``."""
    return token_bits_of_product(key, token.to(tl.uint32) * C1)


@triton.jit
def token_bits_of_product(key, c):
    """``token_bits`` given ``c = uint32(token) * C1`` (wrapping): a kernel walking blocks of
    consecutive tokens forms it as ``offs * C1 + start * C1`` with one add per token."""
    c = _rotl32(c, 15) * C2
    h = _rotl32(key ^ c, 13)
    h = h * 5 + MURMUR_ADD
    return fmix32(h)


@triton.jit
def exponential(bits):
    """Exp(1) noise (fp32) from uint32 bits; same operation sequence as the oracle."""
    w = (bits.to(tl.float32) + 0.5) * TWO_POW_M32
    series = w * (1.0 + w * (0.5 + w * (1.0 / 3.0 + w * (0.25 + w * 0.2))))
    complement = ((0xFFFFFFFF - bits).to(tl.float32) + 0.5) * TWO_POW_M32
    upper = bits >= 0x80000000
    one_minus_w = tl.where(upper, complement, 1.0 - w)
    return tl.where(w < SERIES_LIMIT, series, -tl.log(one_minus_w))


@triton.jit
def gumbel(bits):
    """Gumbel(0, 1) noise ``-log(E)`` (fp32) from uint32 bits."""
    return -tl.log(exponential(bits))
