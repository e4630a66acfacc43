"""What every row kernel does to one logit before it counts: softcap, mask, scale, and the end formulas.

The semantics are those of ``dgemma_sampler.reference`` (its module docstring is the spec);
these helpers are the Triton spelling shared by ``row_stats``, ``topk_topp`` and ``logprobs``
so that the three kernels mask and scale a logit the same way.

Streaming statistics are kept in base 2 so that each entry costs one ``exp2`` (one MUFU op):
with ``m`` the row maximum of ``z`` and ``u = (z - m) * log2(e)``::

    Z = sum 2^u = 1 + R       (R: every kept entry except one arg-max entry)
    A2 = sum u 2^u            (A = A2 * ln 2 = sum (z - m) e^(z - m))
    lse = m + log1p(R)        entropy = log1p(R) - A / Z

Keeping the arg-max entry's exact 1 out of ``R`` matters for peaked rows: ``Z = 1 + 1e-9``
rounds to 1 in fp32, while ``R`` keeps its relative precision, so ``log1p(R)`` and a tiny
entropy stay accurate to fp32 relative precision instead of fp32 absolute precision.
"""

import os

import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)
NEG_INF = tl.constexpr(float("-inf"))
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# exp2 of anything below this is 0 in fp32; clamping u here turns -inf (masked) into an
# exact 0 weight with u * 2^u = 0 instead of -inf * 0 = NaN.
U_FLOOR = tl.constexpr(-160.0)
# Larger than every token index (an int32 "no index" for lowest-index reductions).
NO_INDEX = tl.constexpr(2**31 - 1)


def interpreting() -> bool:
    """True when the kernels run in Triton's interpreter (CPU tensors, no inline assembly)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def exp2_ftz(d2, INTERPRET: tl.constexpr):
    """``2^d2`` as one ``MUFU.EX2``: ``ex2.approx.ftz`` skips the range fix-up that plain
    ``exp2`` wraps around it for subnormal results (< 2^-126: 87 nats below the reference
    entry, nothing a sum, a bf16/fp16 MMA operand or a sampling key can notice). The
    interpreter has no inline assembly and takes ``tl.exp2``."""
    if INTERPRET:
        return tl.exp2(d2)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [d2],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def scatter_store(ptrs, values, mask, INTERPRET: tl.constexpr):
    """``tl.store(ptrs, values, mask=mask)`` for scattered ``ptrs`` (32- or 64-bit values), in
    the layout the values already have.

    Triton gives a store whose pointers are not contiguous a layout of one element per
    thread, and its layout propagation then moves that conversion up through whatever
    computed the operands: a cumsum of a 1024-entry tile that feeds the store positions
    ran as 8 strided scans with shared-memory round trips (Nsight Compute: 616 instructions
    and 11 CTA barriers per tile in the top-k candidate collection). An inline-assembly
    store is elementwise and leaves the layout alone. The interpreter takes ``tl.store``."""
    if INTERPRET:
        tl.store(ptrs, values, mask=mask)
    else:
        # $0 a dummy result, $1 the address, $2 the value, $3 the mask
        if values.dtype.primitive_bitwidth == 64:
            asm: tl.constexpr = ("{ .reg .pred p; setp.ne.b32 p, $3, 0; "
                                 "@p st.global.b64 [$1], $2; mov.b32 $0, 0; }")
            constraints: tl.constexpr = "=r,l,l,r"
        else:
            asm: tl.constexpr = ("{ .reg .pred p; setp.ne.b32 p, $3, 0; "
                                 "@p st.global.b32 [$1], $2; mov.b32 $0, 0; }")
            constraints: tl.constexpr = "=r,l,r,r"
        tl.inline_asm_elementwise(asm, constraints, [ptrs.to(tl.int64), values, mask.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def reciprocal(x, INTERPRET: tl.constexpr):
    """``1 / x`` as one ``MUFU.RCP`` (``rcp.approx.ftz``, within an ulp) instead of the division
    sequence; the interpreter divides."""
    if INTERPRET:
        return 1.0 / x
    else:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)


# Triton's interpreter is chosen when a kernel is decorated, from the same variable.
INTERPRETING = tl.constexpr(interpreting())


# c tanh(x / c) = x (1 + s Q(s)) with s = (x / c)^2, for |x| < c: Q's coefficients are a
# near-minimax fit of (tanh(a) / a - 1) / a^2 on 0 <= a < 1 (relative error below 5e-9). x
# enters exactly and carries its sign; only the correction s Q(s) (at most a third of the
# result) sees the rounding of x / c. x is scaled before it is squared, so that neither x^2
# nor 1 / c^2 leaves fp32's range at any cap whose reciprocal is finite. Over every finite
# bf16 logit, c from 1e-3 to 1e6, the polynomial is within 1.3 ulp of float64 (torch's fp32
# c * tanh(x / c): 1.7 at c = 30), and monotone.
Q0 = tl.constexpr(-0.3333329741984866)
Q1 = tl.constexpr(0.13332380037181285)
Q2 = tl.constexpr(-0.053881977411647484)
Q3 = tl.constexpr(0.021492889248557717)
Q4 = tl.constexpr(-0.007955221894904031)
Q5 = tl.constexpr(0.002307964775488308)
Q6 = tl.constexpr(-0.00036032866479095843)


@triton.jit
def _softcap_poly(x, SOFTCAP: tl.constexpr):
    """``c tanh(x / c)`` for ``|x| < c`` by the odd polynomial (FMAs only)."""
    y = x * (1.0 / SOFTCAP)
    s = y * y
    q = Q0 + s * (Q1 + s * (Q2 + s * (Q3 + s * (Q4 + s * (Q5 + s * Q6)))))
    return x * (s * q + 1.0)


@triton.jit
def softcapped(x, SOFTCAP: tl.constexpr, BELOW: tl.constexpr = False):
    """``c * tanh(x / c)`` in fp32 when ``SOFTCAP`` (a constexpr float) is > 0, else ``x``;
    within a few ulp of torch's, without libdevice (the interpreter has none).

    Below the cap (``|x| < c``) an odd polynomial; at and above it ``c - 2c / (e^(2a) + 1)``
    with ``a = |x|`` times the fp32 reciprocal of ``c`` (two MUFU ops, ``exp2`` and ``rcp``),
    ``x``'s sign copied in. Both are computed and one selected (a branch would diverge within
    a warp). ``BELOW``: the caller knows that every ``|x| < c`` (``below_softcap``), so only
    the polynomial is computed: the same bits, about half the instructions and no MUFU op.
    Every kernel's softcap is this code, so that they all see the same fp32 ``z`` (at T = 0 an
    ulp moves ``z`` by thousands of nats).
    """
    if SOFTCAP > 0:
        r = _softcap_poly(x, SOFTCAP)
        if not BELOW:
            # e^(2a) = inf gives exactly c. The exponential's argument is >= 0, so its
            # flush-to-zero variant is exact here.
            a = tl.abs(x) * (1.0 / SOFTCAP)
            t = exp2_ftz(a * (2.0 * LOG2E), INTERPRETING)
            large = reciprocal(t + 1.0, INTERPRETING) * (-2.0 * SOFTCAP) + SOFTCAP  # >= 0, or NaN
            large = (large.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & -2147483648)
                     ).to(tl.float32, bitcast=True)
            r = tl.where(tl.abs(x) < SOFTCAP, r, large)
        x = r
    return x


@triton.jit
def below_softcap(top, SOFTCAP: tl.constexpr):
    """Whether ``softcapped(x, SOFTCAP, BELOW=True)`` holds for entries whose largest ``|x|``
    is ``top``."""
    return top < SOFTCAP


@triton.jit
def scaled(x, inv_t):
    """``z = min(x * inv_t, FLT_MAX)``: +inf logits become the largest finite value.

    NaN stays NaN here (callers mask it); the compare-and-select keeps that true on the
    GPU, where ``min`` would turn NaN into FLT_MAX.
    """
    z = x * inv_t
    return tl.where(z > FLT_MAX, FLT_MAX, z)


@triton.jit
def log1p(r):
    """``log(1 + r)`` for r >= 0, accurate for tiny r (Goldberg's trick, no libdevice)."""
    u = 1.0 + r
    return tl.where(u == 1.0, r, tl.log(u) * (r / (u - 1.0)))


@triton.jit
def finish_stats(m, rest, a2):
    """(entropy, lse) of a row from its max ``m``, ``R`` = ``rest`` and ``A2`` = ``a2``.

    A row with no kept entry (``m == -inf``) gets entropy 0 and lse -inf.
    """
    kept = m > NEG_INF
    l1p = log1p(rest)
    entropy = tl.where(kept, l1p - (a2 * LN2) / (1.0 + rest), 0.0)
    lse = tl.where(kept, m + l1p, NEG_INF)
    return entropy, lse


@triton.jit
def ordered_key(x):
    """int32 key with the order of fp32 ``x`` (for sorting values with their ids)."""
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def from_ordered_key(k):
    """Inverse of ``ordered_key``."""
    b = k ^ ((k >> 31) & 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def pack_value_id(x, idx):
    """int64 that sorts descending by value, then ascending by id (lowest id first on ties)."""
    low32 = tl.full((), 0xFFFFFFFF, tl.int64)
    hi = ordered_key(x).to(tl.int64) << 32
    return hi | (low32 - idx.to(tl.int64))


@triton.jit
def unpack_value_id(packed):
    """(value fp32, id int32) from ``pack_value_id``."""
    low32 = tl.full((), 0xFFFFFFFF, tl.int64)
    value = from_ordered_key((packed >> 32).to(tl.int32))
    idx = (low32 - (packed & low32)).to(tl.int32)
    return value, idx
