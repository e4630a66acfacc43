"""Keyed random numbers: the noise of a draw is a pure function of its coordinates.

Every random number the sampler uses is ``bits(seed, draw, position, stream, token)``: a
32-bit hash of the request's seed, that request's draw counter, the canvas position, a
stream id (Gumbel noise, renoise token, fresh canvas) and the token id. Nothing depends
on which other requests share the batch, how requests were tiled, which tensor-parallel
rank holds the token, or which backend ran, so a request seed makes a generation
reproducible and the Triton kernels can be checked bit for bit against this file.

The hash is built only from 32-bit multiply, xor, shift and rotate (wrapping), which
Triton does on ``uint32`` and PyTorch here emulates on ``int64`` masked to 32 bits.
``kernels/keyed_noise.py`` is the Triton twin; change both together.

Row key (once per canvas position, not per token)::

    k = fmix32(seed_lo ^ GOLDEN); k = fmix32(k ^ seed_hi)
    k = fmix32(k ^ draw_lo);      k = fmix32(k ^ draw_hi)
    k = fmix32(k ^ position);     k = fmix32(k ^ (stream * GOLDEN))

Token bits (murmur3's one-block body with the row key as its seed)::

    c = rotl(token * C1, 15) * C2
    h = rotl(k ^ c, 13) * 5 + 0xE6546B64
    bits = fmix32(h)

Combining the row key and the token with xor inside the hash (rather than adding a
per-row offset to a token counter) keeps the streams of two rows from being shifted
copies of each other.

Exponential and Gumbel noise from the bits, exactly in fp32 (see ``exponential``)::

    w = (f32(bits) + 0.5) * 2^-32                 # uniform in (0, 1)
    E = -log1p(-w)                                # Exp(1); small E <=> small w
    G = -log(E)                                   # Gumbel(0, 1), up to about 22.9

Small E decides the tail of the sampler (a token far below the head wins only through
a tiny E), so E keeps full relative precision for small w: below 1/32 it is a
five-term series, above 1/2 it is ``-log`` of the complement formed in integers
(``~bits``), exact in fp32; in between ``-log(1 - w)`` loses at most 2^-20 relative.
With 32-bit uniforms E reaches 2^-33, so G covers the Gumbel tail up to about 22.9
nats, against 16.6 for the common ``-log(-log(tl.rand))`` (DESIGN section 7).
"""

from __future__ import annotations

import enum

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
C1 = 0xCC9E2D51
C2 = 0x1B873593
F1 = 0x85EBCA6B
F2 = 0xC2B2AE35
MURMUR_ADD = 0xE6546B64
TWO_POW_M32 = 2.0**-32
SERIES_LIMIT = 1.0 / 32.0


class Stream(enum.IntEnum):
    """Independent noise streams of one draw. Values are part of the hash."""

    GUMBEL = 1  # per-token noise of the categorical sample
    RENOISE = 2  # the random token a rejected canvas position takes
    CANVAS = 3  # the fresh canvas after prefill and after a commit
    BLOCK = 4  # per-sampling-block noise of the categorical sample (keyed by block index)


def _u32(x: torch.Tensor) -> torch.Tensor:
    return x & MASK32


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    # Both factors are below 2^32, so the int64 product wraps at most past bit 63 and
    # its low 32 bits are exact (two's complement keeps them).
    return (a * b) & MASK32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & MASK32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finalizer on int64 tensors holding uint32 values."""
    h = h ^ (h >> 16)
    h = _mul32(h, F1)
    h = h ^ (h >> 13)
    h = _mul32(h, F2)
    return h ^ (h >> 16)


def row_key(seed: torch.Tensor, draw: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """The 32-bit key of one (request seed, draw counter, canvas position, stream).

    All arguments broadcast; ``seed`` and ``draw`` are int64 (any 64-bit value),
    ``position`` a non-negative integer tensor. Returns int64 values in [0, 2^32).
    """
    seed = seed.to(torch.int64)
    draw = draw.to(torch.int64)
    k = fmix32(_u32(seed) ^ GOLDEN)
    k = fmix32(k ^ _u32(seed >> 32))
    k = fmix32(k ^ _u32(draw))
    k = fmix32(k ^ _u32(draw >> 32))
    k = fmix32(k ^ _u32(position.to(torch.int64)))
    return fmix32(k ^ ((int(stream) * GOLDEN) & MASK32))


def token_bits(key: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """32 random bits for ``token`` under a row ``key`` (both broadcast, int64)."""
    c = _mul32(_u32(token.to(torch.int64)), C1)
    c = _mul32(_rotl32(c, 15), C2)
    h = _rotl32(key ^ c, 13)
    h = (h * 5 + MURMUR_ADD) & MASK32
    return fmix32(h)


def exponential(bits: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise from 32 random bits, in fp32 with full precision for small values.

    The fp32 operation sequence is the contract the Triton twin follows.
    """
    w = (bits.to(torch.float32) + 0.5) * TWO_POW_M32
    # Series for -log1p(-w) = w + w^2/2 + w^3/3 + w^4/4 + w^5/5 (Horner; the next
    # term is below 2^-30 relative for w < 1/32).
    series = w * (1.0 + w * (0.5 + w * (1.0 / 3.0 + w * (0.25 + w * 0.2))))
    # For w >= 1/2 the complement 1 - w = (~bits + 0.5) * 2^-32 is exact in fp32.
    complement = ((MASK32 - bits).to(torch.float32) + 0.5) * TWO_POW_M32
    upper = bits >= 2**31
    one_minus_w = torch.where(upper, complement, 1.0 - w)
    return torch.where(w < SERIES_LIMIT, series, -torch.log(one_minus_w))


def gumbel(bits: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise ``-log(E)`` from 32 random bits, fp32."""
    return -torch.log(exponential(bits))


def random_tokens(
    seed: torch.Tensor, draw: torch.Tensor, position: torch.Tensor, stream: int, vocab_size: int
) -> torch.Tensor:
    """A uniform token in [0, vocab_size) per (seed, draw, position): ``(bits * V) >> 32``.

    The multiply-shift map is biased by at most ``vocab_size / 2^32`` (6e-5 relative at
    V = 262144), far below anything a generation can notice.
    """
    key = row_key(seed, draw, position, stream)
    bits = token_bits(key, torch.zeros_like(key))
    return (bits * int(vocab_size)) >> 32
