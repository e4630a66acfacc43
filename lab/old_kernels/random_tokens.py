"""Keyed uniform random tokens of whole canvases: one launch for every request and stream.

A decode step needs, per decoding request j and canvas position i, a renoise token (the
token a rejected position takes) and a fresh-canvas token (the canvas after a commit).
Both are the keyed hash of ``dgemma_sampler.keyed_noise``::

    key  = row_key(seed_j, draw_j, i, stream)        # six murmur3 finalizers
    bits = token_bits(key, 0)                        # murmur3's one-block body
    tok  = (bits * V) >> 32                          # uniform in [0, V), bias <= V / 2^32

The PyTorch twin (``keyed_noise.random_tokens``) spells each 32-bit operation as a few
int64 tensor ops, about 60 launches per stream; here one program computes a block of
positions of one request for one or two streams in registers. Pure integer arithmetic, so
the result is bit-identical to the twin.

Layout: ``out[s, j, i]`` for stream ``streams[s]``, request ``j < n``, position ``i < W``,
int64, contiguous.
"""

import torch
import triton
import triton.language as tl

from .keyed_noise import row_key, token_bits

BLOCK_POSITIONS = 256


@triton.jit
def _canvas_tokens(seed, draw, pos, STREAM: tl.constexpr, VOCAB: tl.constexpr):
    bits = token_bits(row_key(seed, draw, pos, STREAM), tl.zeros_like(pos))
    # (bits * V) >> 32 in 64 bits: bits < 2^32 and V < 2^32, so the product cannot wrap.
    return ((bits.to(tl.uint64) * VOCAB) >> 32).to(tl.int64)


@triton.jit
def _random_tokens_kernel(
    seeds_ptr, draws_ptr, out_ptr, plane, width,
    STREAM_A: tl.constexpr, STREAM_B: tl.constexpr, VOCAB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (j, b): positions ``b*BLOCK ..`` of request j, stream A (and B if B != 0,
    stored ``plane = n * width`` entries further on)."""
    j = tl.program_id(0)
    pos = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = pos < width
    seed = tl.load(seeds_ptr + j)
    draw = tl.load(draws_ptr + j)
    offs = j.to(tl.int64) * width + pos
    tl.store(out_ptr + offs, _canvas_tokens(seed, draw, pos, STREAM_A, VOCAB), mask=live)
    if STREAM_B != 0:
        tl.store(out_ptr + plane + offs, _canvas_tokens(seed, draw, pos, STREAM_B, VOCAB),
                 mask=live)


def random_tokens_canvas(
    seeds: torch.Tensor, draws: torch.Tensor, width: int, streams, vocab_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[len(streams), n, width]`` int64 keyed tokens for positions ``0 .. width-1``.

    ``seeds`` / ``draws`` are ``[n]`` int64 on the device (any 64-bit values); ``streams``
    holds one or two ``keyed_noise.Stream`` values (non-zero). ``vocab_size`` is a
    compile-time constant: a model has one vocabulary, so the kernel compiles once.
    ``out`` (optional) is a contiguous int64 tensor of that shape to fill.
    """
    streams = tuple(int(s) for s in streams)
    # Asserts only: the step builds these arguments (``dgemma_sampler.step.noise_canvases``).
    assert 1 <= len(streams) <= 2 and 0 not in streams, \
        f"streams must be one or two non-zero stream ids, got {streams}"
    for name, t in (("seeds", seeds), ("draws", draws)):
        assert isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype == torch.int64, \
            f"{name} must be a 1-D int64 tensor"
    assert draws.shape == seeds.shape and draws.device == seeds.device, \
        "seeds and draws must have the same shape and device"
    assert 1 <= int(vocab_size) < 2**32, f"vocab_size must be in [1, 2^32), got {vocab_size!r}"
    n, width = seeds.numel(), int(width)
    assert 0 <= width and n * width < 2**62, f"bad canvas width {width!r}"
    shape = (len(streams), n, width)
    if out is None:
        out = torch.empty(shape, dtype=torch.int64, device=seeds.device)
    assert out.shape == shape and out.dtype == torch.int64 and out.is_contiguous() \
        and out.device == seeds.device, \
        f"out must be a contiguous int64 tensor of shape {shape} on {seeds.device}"
    if n == 0 or width == 0:
        return out
    block = min(BLOCK_POSITIONS, triton.next_power_of_2(width))
    grid = (n, triton.cdiv(width, block))
    _random_tokens_kernel[grid](
        seeds.contiguous(), draws.contiguous(), out, n * width, width,
        STREAM_A=streams[0], STREAM_B=streams[1] if len(streams) == 2 else 0,
        VOCAB=int(vocab_size), BLOCK=block,
    )
    return out
