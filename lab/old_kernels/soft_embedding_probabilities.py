"""The soft-embedding GEMM's A operand made from a logits tile: ``p = exp(z - lse)`` in registers.

One spelling shared by the fused GEMM's prologue (``soft_embedding.py``) and the pass that writes
the operand over the logits (``soft_embedding_operand.py``), so that both give the same ``p`` bit
for bit. ``z = softcap(x) * inv_t`` is the fp32 product the row-statistics pass computed (the
contract with its ``lse``, ``soft_embedding.py``'s docstring), and ``p`` is formed in base 2 with
the exponent's product rounded toward -inf (``neg_lse2``), so a greedy row's arg-max gets exactly
1. Masked entries (below the threshold, outside the allowed set, ``-inf``) give 0; NaN stays NaN
until ``nan_to_zero`` clears it on the MMA operand.
"""

import triton
import triton.language as tl

from .logit_row import exp2_ftz as _exp2
from .logit_row import softcapped


@triton.jit
def rounded_as_fp32(p, dtype: tl.constexpr):
    """Interpreter only: ``p`` rounded to ``dtype`` as the GPU rounds (nearest even), back in fp32.
    The interpreter's own fp32 -> bf16 cast truncates, which would bias every probability down."""
    if dtype == tl.bfloat16:
        bits = p.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return p.to(dtype).to(tl.float32)


LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def nan_to_zero(p):
    """NaN -> 0 (maxnum with 0) on MMA operands: one ``max.bf16x2`` / ``max.f16x2`` per two
    entries (Triton's own maximum would compute 16-bit types in fp32)."""
    if p.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [p, tl.zeros_like(p)],
                                         dtype=tl.bfloat16, is_pure=True, pack=2)
    elif p.dtype == tl.float16:
        return tl.inline_asm_elementwise("max.f16x2 $0, $1, $2;", "=r,r,r", [p, tl.zeros_like(p)],
                                         dtype=tl.float16, is_pure=True, pack=2)
    else:
        return tl.maximum(p, 0.0)


@triton.jit
def neg_lse2(lse):
    """``-lse * log2(e)`` with the product rounded toward -inf, so that
    ``fma(z, log2e, neg_lse2) >= 0`` whenever ``z >= lse``: a greedy row's arg-max entry
    (``z == lse`` ~ 1e11) gets exactly ``p = 1`` after the clamp to 0 instead of a rounding error
    of thousands of nats."""
    lse2 = lse * LOG2E
    residual = tl.fma(lse, LOG2E, -lse2)  # exact on the GPU (0 where fma is not fused)
    bits = lse2.to(tl.int32, bitcast=True)
    below = tl.where(lse2 > 0, bits - 1, bits + 1).to(tl.float32, bitcast=True)
    return -tl.where(residual < 0, below, lse2)


@triton.jit
def probabilities(x, inv_t, neg_lse2, threshold, allowed, SOFTCAP: tl.constexpr,
                  HAS_THRESHOLD: tl.constexpr, HAS_ALLOWED: tl.constexpr, INTERPRET: tl.constexpr):
    """``exp(z - lse)`` of a logits tile, clamped to ``p <= 1``; 0 where masked, NaN where the
    logit is NaN (``nan_to_zero`` zeroes those after the cast to the MMA dtype).

    ``z = x * inv_t`` is the fp32 product the row-statistics pass computed; then in base 2
    ``d2 = z * log2e + neg_lse2`` (FMUL + FFMA; z is rounded as in the statistics pass, which a
    greedy row, ``inv_t = 1e10``, needs to get exactly ``E[argmax]``).
    ``min.NaN(d2, 0)`` (NaN stays NaN) replaces the ``z <= FLT_MAX`` clamp: +inf logits give
    ``p = 1``, as ``exp(FLT_MAX - lse)`` with ``lse = FLT_MAX``, and a greedy arg-max's rounding
    residue ``d2 >= 0`` gives exactly 1. ``-inf`` logits and rows not computed (``neg_lse2 =
    -inf``) give ``2^-inf = 0``. Only threshold / allowed need a select. Per entry on the GPU:
    FMUL, FFMA, FMNMX, MUFU.EX2, half an F2FP and half an HMNMX2.
    """
    x = softcapped(x.to(tl.float32), SOFTCAP)
    d2 = tl.fma(x * inv_t[:, None], LOG2E, neg_lse2[:, None])
    if HAS_THRESHOLD:
        d2 = tl.where(x >= threshold[:, None], d2, float("-inf"))
    if HAS_ALLOWED:
        d2 = tl.where(allowed, d2, float("-inf"))
    if INTERPRET:  # NaN -> -inf here (maxnum), as the interpreter path has no nan_to_zero
        return _exp2(tl.minimum(tl.maximum(d2, float("-inf")), 0.0), INTERPRET)
    else:
        return _exp2(tl.minimum(d2, 0.0, propagate_nan=tl.PropagateNan.ALL), INTERPRET)
