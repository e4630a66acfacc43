"""Row statistics in one streaming pass: lse, entropy, arg-max and a keyed two-stage sample.

One program per logits row (a canvas position of a request) walks the vocabulary in
blocks of ``BLOCK`` entries and keeps every per-token quantity in registers; it writes six
numbers per row. Semantics: ``dgemma_sampler.reference.row_stats_rows`` (masking, NaN, +inf,
all-masked rows, greedy rows, lowest id on ties, the two sampling stages).

Statistics, with ``z = x * inv_t`` (``inv_t`` computed once per request on the host side by
``contract.inverse_temperature``, so ``z`` is bit-identical to the oracle's), per
vocabulary block, relative to the row's running maximum ``m``::

    bm = max z over the block
    if bm > m:  rescale the running sums by 2^((m - bm) log2 e); m = bm; arg = lowest such id
    u = (z - m) log2 e;  R += 2^u (all but the arg-max entry);  A2 += u 2^u

(see ``logit_row.py`` for why the arg-max entry's 1 is kept out of ``R``). The per-lane sums
restart at every sampling block (``SAMPLE_BLOCK`` positions); when one ends, its sums join
the row's, and its key ``lse_b + G_b = m + log(R_b) + G(seed, draw, position, BLOCK
stream, b)`` competes for the sample (stage a of the reference). The maximum is not reset
per sampling block, so rescaling stays as rare as in a single running softmax. A
tensor-parallel rank computes the same block keys up to rounding (its running maximum
differs), so a cross-rank draw can differ only at a near-tie of two block keys.

Per entry the hot loop is about eight instructions: convert, scale, max, one FMA, ``exp2``,
two accumulations and a clamp. NaN and +inf logits cost nothing there: they make the
block's sum NaN (``2^NaN``, or ``inf - inf``), and a sampling block whose sum is NaN is
read again on a clean path that masks NaN, clamps +inf to FLT_MAX and flags the row, the
reference semantics. ``-inf`` (masked) entries give ``2^-inf = 0`` and a clamped ``u``.

Traffic: the pass reads each logit once (plus one sampling block again for stage b), so it
is bound by memory, and its target is the copy bandwidth. One warp per row, and what keeps
it from that target is latency, not arithmetic (at ~128 registers, 16 one-warp programs fit
on an SM, 4 per scheduler). What keeps each warp busy:

* Groups: the new-maximum test runs once per group of ``GROUP`` blocks (4 x 256 entries)
  instead of once per block. Its cross-lane max is a chain of five shuffles and a branch
  that nothing else in the warp could overlap; per group it is one chain for 32 entries
  per lane. Only a group that raises the maximum (rare once a row is under way) goes
  block by block, so the sums are bit-identical to block-by-block processing. With
  16-bit logits and no mask the group max is taken on the raw values, two per
  ``max.bf16x2`` (``RAW_MAX``).
* Deferred keys: a sampling block's end only files its (max, R) in a key buffer; the
  logs and the keyed noise of stage a run for ``KEY_BUFFER`` (64) blocks at once, one
  per lane, when the buffer is full or the row ends.
* Prefetch: the walk is unrolled per group, each group's buffers reloaded right after it
  is consumed; whole blocks load unmasked from addresses known to be aligned, as 16-byte
  vectors (``_walk_load``).
* Descriptor walk (``TMA_WALK``, on Hopper): register prefetch keeps only one group (2 KB
  of bf16) in flight per warp, too little to cover the memory latency at 16 warps per SM.
  With a tensor descriptor over the logits, whole groups load by TMA into shared memory in
  a loop that Triton pipelines ``TMA_STAGES`` deep, so the bytes in flight no longer cost
  registers. The ragged last group is left to the register walk, whose masked loads give
  -inf (TMA pads zeros).
* Split walk (``PARTS``, config ``part_blocks``; by default 32 blocks for fp32 logits and
  for 16-bit ones with a softcap, off for 16-bit ones without, see ``default_config``): at 1
  request the 256 rows give two one-warp programs per SM, too few to keep the memory (or,
  with a softcap's tanh per entry, the ALUs) busy whatever each one does. Each row's walk
  is then cut into parts of ``part_blocks`` sampling blocks. A part walks
  exactly as the whole row would, except that its running maximum starts afresh; it files
  its row state (max, arg-max, sums, NaN flag, best block key and column) in a scratch slot
  and its program counts itself in on a per-row counter once its parts are filed. The
  program that arrives last merges the parts in vocabulary order (``_merge_partials``), runs
  stage b and writes the row, and puts the counter back to zero (so a CUDA graph replays
  it). The count is a program's only atomic: issued by its thread 0 after a barrier, with
  acq_rel semantics, it publishes the slots' plain stores (release) and orders the merger's
  reads after every part's (acquire). Atomic slot words would each cost a fence (on sm_90 a
  ``MEMBAR.ALL.GPU`` and an L1 invalidation each), one after the other in the row's tail.
  The split depends on the config and the row length only, never on the number of rows, so
  a request's bits stay independent of its batch. How many programs walk a row's parts may
  follow the batch (``part_group``): at many rows one program walks several consecutive
  parts, each filed in its own slot exactly as a program of its own would, so that a split
  fine enough to fill the GPU at one request does not pay a program's start, count and tail
  per part at many.

Why two stages and not one Gumbel-max over the row: the keyed per-token noise costs a
32-bit hash per entry, about 20 instructions even behind a filter, several times the
statistics above, which makes a one-stage pass compute-bound well below the copy
bandwidth. Exact inverse-CDF sampling would need the row's total before the search and a
second pass. The two-stage draw needs one random number per sampling block in the stream,
and after the stream it reads the winning block again (``SAMPLE_BLOCK`` entries, 1/64 of a
262144 row) for stage b: a per-token Gumbel-max with a hash filter. There the noise ``G``
(murmur hash, two accurate logarithms) is computed only where it can win: ``G = -log E <=
-log w`` for the uniform ``w`` of the hash, so an entry can reach the best key only if ``w
<= exp(z - best)``; one compare per entry on the hash (with a relative slack far above
every rounding error) decides whether a vocabulary block needs the exact noise. The result
is exactly the Gumbel-max (the test is conservative), so the sample matches the oracle bit
for bit up to the last ulp of ``log`` and of the block lse (keys closer than that can
resolve differently; tests check that such differences are near-ties).

Rows with top-k / top-p: ``topk_topp.py`` finds the threshold first and, when the kept set
is small, computes the whole row's statistics from its candidates and marks the row done;
this kernel then skips the row. Other thresholded rows come here with ``x < threshold``
masked.
"""

import torch
import triton
import triton.language as tl

from . import contract
from . import keyed_noise as kn
from .contract import RowStats, cuda_capability
from .logit_row import (
    INTERPRETING,
    LOG2E,
    NEG_INF,
    NO_INDEX,
    U_FLOOR,
    below_softcap,
    exp2_ftz,
    finish_stats,
    interpreting,
    log1p,
    scaled,
    softcapped,
)

# Largest Gumbel value of keyed_noise: bits = 0 gives E = 2^-33, G = 33 ln 2 = 22.87.
GUMBEL_MAX = tl.constexpr(22.9)
TWO_POW_32 = tl.constexpr(4294967296.0)
# Use the hash filter only while exp(m - best + slack) * 2^32 stays finite and the weights
# e = 2^u of every possible winner (z > best - 23) stay above fp32's underflow.
FILTER_MAX_GAP = tl.constexpr(60.0)
GUMBEL_STREAM = tl.constexpr(1)  # keyed_noise.Stream.GUMBEL
BLOCK_STREAM = tl.constexpr(4)   # keyed_noise.Stream.BLOCK
# Below this |M| the exp2 argument is formed with one FMA, z * log2(e) - M * log2(e). The FMA
# subtracts the rounded M * log2(e), off by up to half its ulp: 2^-13 at |M| < 2048, but ~1e4
# for a greedy row (z = x * 1e10), where an entry tied with the max would get 2^16384 = inf
# (seen on the H200 with bf16 logits, whose ties are common). Larger |M| takes z - M exactly.
EXP_FAST_LIMIT = tl.constexpr(2048.0)


@triton.jit
def _block_z(x, offs, start, vocab, inv_t, threshold, allowed_row,
             SOFTCAP: tl.constexpr, HAS_THRESHOLD: tl.constexpr, HAS_ALLOWED: tl.constexpr,
             CLEAN: tl.constexpr, BELOW: tl.constexpr = False, WHOLE: tl.constexpr = False):
    """``z`` of one vocabulary block of fp32 logits ``x`` (padding past the row end is -inf).

    ``CLEAN``: the reference semantics (NaN masked, +inf clamped to FLT_MAX). Otherwise NaN
    and +inf pass through unmasked so that the block's sum turns NaN and the caller re-reads
    it cleanly; masks are written ``~(x < t)`` so that they keep a NaN. ``BELOW``: every
    ``|x|`` is below the softcap (``logit_row.softcapped``). ``WHOLE``: the block lies inside
    the row (the descriptor walk's groups), so no padding needs masking.
    """
    x = softcapped(x, SOFTCAP, BELOW)
    keep = tl.full(x.shape, 1, tl.int1)
    inside = (offs >= -start) & (offs < vocab - start)  # start < 0 before an unaligned slice
    if HAS_THRESHOLD:
        keep = ~(x < threshold)
    if SOFTCAP > 0 and not WHOLE:
        # the padding outside the row is -inf, which the softcap turns into -c
        keep = keep & inside
    if HAS_ALLOWED:
        allowed = tl.load(allowed_row + start + offs, mask=inside, other=0) != 0
        if CLEAN:
            keep = keep & allowed
        else:
            keep = keep & (allowed | (x != x))  # the NaN flag counts disallowed NaN too
    if CLEAN:
        z = tl.where(keep & (x == x), scaled(x, inv_t), NEG_INF)
    else:
        z = x * inv_t
        if HAS_THRESHOLD or HAS_ALLOWED or (SOFTCAP > 0 and not WHOLE):
            z = tl.where(keep, z, NEG_INF)
    return z


@triton.jit
def _accumulate(z, offs, start, big_m, holds, arg, rest, a_rest, r_acc, a_acc,
                PLAIN_EXP2: tl.constexpr):
    """Add one vocabulary block's ``z`` to a sampling block's running sums.

    The sums are relative to ``big_m``: the row's running maximum when the sampling block
    began, raised when the block holds a larger ``z``; ``holds`` (0. or 1.) says whether the
    block holds that maximum's entry ``arg``, whose 1 is then kept out of ``R``.
    """
    bm = tl.max(z, 0)
    if bm > big_m:
        # A new maximum (rare after the first blocks of a row): rescale, move the arg-max.
        had_max = big_m > NEG_INF
        # clamped: 2^-160 is already 0, and -inf * 0 would poison the sums with NaN
        d = tl.where(had_max, tl.maximum((big_m - bm) * LOG2E, U_FLOOR), 0.0)
        alpha = tl.exp2(d)
        # A' = alpha (A + d Z) with Z = r_acc + rest + holds (the old arg-max entry's 1)
        a_acc = (a_acc + d * r_acc) * alpha
        a_rest = tl.where(had_max, (a_rest + d * (rest + holds)) * alpha, 0.0)
        r_acc = r_acc * alpha
        rest = tl.where(had_max, (rest + holds) * alpha, 0.0)
        at = tl.min(tl.where(z == bm, offs, NO_INDEX), 0)
        arg = start + at
        big_m = bm
        holds = tl.full((), 1.0, tl.float32)
        u = (z - big_m) * LOG2E
        e = exp2_ftz(u, PLAIN_EXP2)
        r_acc += tl.where(offs == at, 0.0, e)
        a_acc += tl.maximum(u, U_FLOOR) * e
    else:
        r_acc, a_acc = _add_group(z, z, z, z, big_m, r_acc, a_acc, 1, PLAIN_EXP2)
    return big_m, holds, arg, rest, a_rest, r_acc, a_acc


@triton.jit
def _add_weights(z, big_m, r_acc, a_acc, EXACT: tl.constexpr, PLAIN_EXP2: tl.constexpr,
                 FINITE: tl.constexpr = False):
    """``R += 2^u``, ``A2 += u 2^u`` for one block whose entries are all ``<= big_m``.
    ``FINITE``: no entry is -inf (unmasked softcapped logits), so ``u`` needs no clamp."""
    if EXACT:
        # z * log2(e) would overflow near FLT_MAX.
        u = (z - big_m) * LOG2E
    else:
        # One FMA per entry; exact enough for sums (not used for any comparison).
        u = z * LOG2E - tl.where(big_m > NEG_INF, big_m * LOG2E, 0.0)
    e = exp2_ftz(u, PLAIN_EXP2)
    # u = -inf (masked) has e = 0: clamped, it adds 0 instead of NaN. NaN stays NaN. A finite
    # u below the floor has e = 0 too, and adds -0 either way: the clamp changes no bit there.
    if FINITE:
        return r_acc + e, a_acc + u * e
    return r_acc + e, a_acc + tl.maximum(u, U_FLOOR) * e


@triton.jit
def _add_blocks(z0, z1, z2, z3, big_m, r_acc, a_acc, G: tl.constexpr, EXACT: tl.constexpr,
                PLAIN_EXP2: tl.constexpr, FINITE: tl.constexpr):
    """``_add_weights`` for the first ``G`` of four blocks, in order."""
    r_acc, a_acc = _add_weights(z0, big_m, r_acc, a_acc, EXACT, PLAIN_EXP2, FINITE)
    if G > 1:
        r_acc, a_acc = _add_weights(z1, big_m, r_acc, a_acc, EXACT, PLAIN_EXP2, FINITE)
    if G > 2:
        r_acc, a_acc = _add_weights(z2, big_m, r_acc, a_acc, EXACT, PLAIN_EXP2, FINITE)
        r_acc, a_acc = _add_weights(z3, big_m, r_acc, a_acc, EXACT, PLAIN_EXP2, FINITE)
    return r_acc, a_acc


@triton.jit
def _add_group(z0, z1, z2, z3, big_m, r_acc, a_acc, G: tl.constexpr, PLAIN_EXP2: tl.constexpr,
               FINITE: tl.constexpr = False):
    """The weights of the first ``G`` blocks of a group behind one branch: the same sums, bit
    for bit, as ``G`` separate blocks without a new maximum."""
    if (tl.abs(big_m) < EXP_FAST_LIMIT) | (big_m == NEG_INF):
        r_acc, a_acc = _add_blocks(z0, z1, z2, z3, big_m, r_acc, a_acc, G, False, PLAIN_EXP2,
                                    FINITE)
    else:
        r_acc, a_acc = _add_blocks(z0, z1, z2, z3, big_m, r_acc, a_acc, G, True, PLAIN_EXP2,
                                    FINITE)
    return r_acc, a_acc


@triton.jit
def _sampling_block_start(m, BLOCK: tl.constexpr):
    """The state ``_accumulate`` starts a sampling block from: sums relative to the row's
    maximum ``m`` so far, no arg-max entry held, nothing summed."""
    return (m, tl.full((), 0.0, tl.float32), tl.full((), 0, tl.int32),
            tl.full((), 0.0, tl.float32), tl.full((), 0.0, tl.float32),
            tl.zeros([BLOCK], tl.float32), tl.zeros([BLOCK], tl.float32))


@triton.jit
def _filter_gap(top, best):
    """``top - best`` plus a relative slack far above the rounding of exp2, the product and the
    two logs of the exact noise: the hash filters compare a uniform against exp(gap)."""
    return (top - best) + (1e-3 + 1e-6 * (tl.abs(top) + tl.abs(best)))


@triton.jit
def _max16(a, b):
    """Elementwise max of two 16-bit tensors, one ``max.bf16x2`` / ``max.f16x2`` per two
    entries (Triton's own maximum would widen to fp32); NaN loses, as in ``tl.max``."""
    if a.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise("max.f16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _abs_max16(a, b):
    """Elementwise ``max(|a|, |b|)`` of two 16-bit tensors, the sign bits cleared and one
    ``max.bf16x2`` / ``max.f16x2`` per two entries; NaN loses, as in ``_max16``."""
    if a.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, u; and.b32 t, $1, 0x7fff7fff; and.b32 u, $2, 0x7fff7fff; "
            "max.bf16x2 $0, t, u; }", "=r,r,r", [a, b], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, u; and.b32 t, $1, 0x7fff7fff; and.b32 u, $2, 0x7fff7fff; "
            "max.f16x2 $0, t, u; }", "=r,r,r", [a, b], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _empty_keys(KEY_BUFFER: tl.constexpr):
    """An empty key buffer: per buffered sampling block its max, R and whether it holds the
    arg-max entry (whose 1 is not in R); a slot never filled has m = -inf."""
    return (tl.full([KEY_BUFFER], NEG_INF, tl.float32), tl.zeros([KEY_BUFFER], tl.float32),
            tl.zeros([KEY_BUFFER], tl.float32))


@triton.jit
def _flush_keys(key_m, key_r, key_h, first_slot, first_block, lead, block_key, best, best_start,
                SAMPLE_BLOCK: tl.constexpr, KEY_BUFFER: tl.constexpr):
    """Stage a for ``KEY_BUFFER`` sampling blocks at once: key ``lse_b + G_b`` of the blocks
    at walk slots ``first_slot + j`` (lse_b = -inf where nothing is kept or the slot is past
    the row), one per lane instead of one at a time on the walk's critical path. The best
    key wins, the lowest slot on ties, earlier flushes on ties with later ones: the same
    winner as comparing the keys one by one."""
    j = tl.arange(0, KEY_BUFFER)
    lse_b = tl.where(key_h > 0, key_m + log1p(key_r), key_m + tl.log(key_r))
    kept = (key_r + key_h > 0) & (key_m > NEG_INF)
    bits = kn.token_bits(block_key, first_block + first_slot + j)
    keys = tl.where(kept, lse_b + kn.gumbel(bits), NEG_INF)
    top = tl.max(keys, 0)
    if top > best:
        best = top
        best_start = (first_slot + tl.min(tl.where(keys == top, j, NO_INDEX), 0)) * SAMPLE_BLOCK - lead
    return best, best_start


@triton.jit
def _walk_load(row_ptr, walk, offs, lead, n_walk, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """The vocabulary block at walk position ``walk`` (column ``walk - lead``); -inf outside
    the slice and past its end (those loads are masked off, never issued to memory).

    ``ALIGNED`` (lead = 0): every block but the last loads without a mask from an address
    the compiler knows is a multiple of BLOCK entries, so it vectorizes (one 16-byte load per
    8 bf16 or 4 fp32 entries). A per-entry mask against a runtime bound, or an offset of
    unknown alignment, would make it load entry by entry: as many load instructions per
    entry for bf16 as for fp32, which made the bf16 pass cost as much as the fp32 one.
    """
    if ALIGNED:
        if walk + BLOCK <= n_walk:
            x = tl.load(row_ptr + walk + offs)
        else:
            x = tl.load(row_ptr + walk + offs, mask=walk + offs < n_walk, other=NEG_INF)
    else:
        pos = walk + offs
        x = tl.load(row_ptr + (walk - lead) + offs, mask=(pos >= lead) & (pos < n_walk),
                    other=NEG_INF)
    return x


@triton.jit
def _load_group(row_ptr, walk, offs, lead, n_walk, G: tl.constexpr, BLOCK: tl.constexpr,
                ALIGNED: tl.constexpr):
    """The ``G`` blocks of a group (``G`` of 1, 2, 4) starting at walk position ``walk``;
    the unused buffers repeat the first one (no load, no register)."""
    x0 = _walk_load(row_ptr, walk, offs, lead, n_walk, BLOCK, ALIGNED)
    x1 = x0
    x2 = x0
    x3 = x0
    if G > 1:
        x1 = _walk_load(row_ptr, walk + BLOCK, offs, lead, n_walk, BLOCK, ALIGNED)
    if G > 2:
        x2 = _walk_load(row_ptr, walk + 2 * BLOCK, offs, lead, n_walk, BLOCK, ALIGNED)
        x3 = _walk_load(row_ptr, walk + 3 * BLOCK, offs, lead, n_walk, BLOCK, ALIGNED)
    return x0, x1, x2, x3


@triton.jit
def _desc_group(logits_desc, row, walk, G: tl.constexpr, BLOCK: tl.constexpr):
    """``_load_group`` through the tensor descriptor (a whole group, inside the row)."""
    x0 = logits_desc.load([row, walk]).reshape([BLOCK])
    x1 = x0
    x2 = x0
    x3 = x0
    if G > 1:
        x1 = logits_desc.load([row, walk + BLOCK]).reshape([BLOCK])
    if G > 2:
        x2 = logits_desc.load([row, walk + 2 * BLOCK]).reshape([BLOCK])
        x3 = logits_desc.load([row, walk + 3 * BLOCK]).reshape([BLOCK])
    return x0, x1, x2, x3


@triton.jit
def _group_z_of(xg0, xg1, xg2, xg3, offs, start, vocab, inv_t, threshold, allowed_row,
             SOFTCAP: tl.constexpr, HAS_THRESHOLD: tl.constexpr, HAS_ALLOWED: tl.constexpr,
             G: tl.constexpr, BLOCK: tl.constexpr, BELOW: tl.constexpr, WHOLE: tl.constexpr):
    """``_block_z`` of the ``G`` blocks of a group starting at column ``start``."""
    zg0 = _block_z(xg0.to(tl.float32), offs, start, vocab, inv_t, threshold, allowed_row,
                   SOFTCAP, HAS_THRESHOLD, HAS_ALLOWED, False, BELOW, WHOLE)
    zg1 = zg0
    zg2 = zg0
    zg3 = zg0
    if G > 1:
        zg1 = _block_z(xg1.to(tl.float32), offs, start + BLOCK, vocab, inv_t, threshold,
                       allowed_row, SOFTCAP, HAS_THRESHOLD, HAS_ALLOWED, False, BELOW, WHOLE)
    if G > 2:
        zg2 = _block_z(xg2.to(tl.float32), offs, start + 2 * BLOCK, vocab, inv_t, threshold,
                       allowed_row, SOFTCAP, HAS_THRESHOLD, HAS_ALLOWED, False, BELOW, WHOLE)
        zg3 = _block_z(xg3.to(tl.float32), offs, start + 3 * BLOCK, vocab, inv_t, threshold,
                       allowed_row, SOFTCAP, HAS_THRESHOLD, HAS_ALLOWED, False, BELOW, WHOLE)
    return zg0, zg1, zg2, zg3


@triton.jit
def _group_z(xg0, xg1, xg2, xg3, offs, start, vocab, inv_t, threshold, allowed_row,
             SOFTCAP: tl.constexpr, HAS_THRESHOLD: tl.constexpr, HAS_ALLOWED: tl.constexpr,
             G: tl.constexpr, BLOCK: tl.constexpr, WHOLE: tl.constexpr):
    """``_block_z`` of the ``G`` blocks of a group starting at column ``start``. With a
    softcap over 16-bit logits (the hidden-state path), a group whose every ``|x|`` is below
    it (all but a few groups of a row) takes the softcap's polynomial alone: the same bits
    without the two MUFU ops per entry that otherwise bound the pass with the ALU work
    beside them. (fp32 logits keep one path: with both they spill at 128 registers.)"""
    POLY_GROUPS: tl.constexpr = (SOFTCAP > 0) & (xg0.dtype.primitive_bitwidth == 16)
    if POLY_GROUPS:
        # The group's largest |x| on the raw 16-bit registers (no fp32 copy live across the
        # branch: that would cost registers, hence programs per SM).
        if INTERPRETING:
            top = tl.abs(xg0.to(tl.float32))
            if G > 1:
                top = tl.maximum(top, tl.abs(xg1.to(tl.float32)))
            if G > 2:
                top = tl.maximum(top, tl.maximum(tl.abs(xg2.to(tl.float32)),
                                                 tl.abs(xg3.to(tl.float32))))
        else:
            top = xg0
            if G > 1:
                top = _abs_max16(xg0, xg1)
            if G > 2:
                top = _abs_max16(top, _abs_max16(xg2, xg3))
            top = tl.abs(top.to(tl.float32))
        if below_softcap(tl.max(top, 0), SOFTCAP):
            zg0, zg1, zg2, zg3 = _group_z_of(xg0, xg1, xg2, xg3, offs, start, vocab, inv_t,
                                             threshold, allowed_row, SOFTCAP, HAS_THRESHOLD,
                                             HAS_ALLOWED, G, BLOCK, True, WHOLE)
        else:
            zg0, zg1, zg2, zg3 = _group_z_of(xg0, xg1, xg2, xg3, offs, start, vocab, inv_t,
                                             threshold, allowed_row, SOFTCAP, HAS_THRESHOLD,
                                             HAS_ALLOWED, G, BLOCK, False, WHOLE)
    else:
        zg0, zg1, zg2, zg3 = _group_z_of(xg0, xg1, xg2, xg3, offs, start, vocab, inv_t,
                                         threshold, allowed_row, SOFTCAP, HAS_THRESHOLD,
                                         HAS_ALLOWED, G, BLOCK, False, WHOLE)
    return zg0, zg1, zg2, zg3


@triton.jit
def _walk_group(xg0, xg1, xg2, xg3, walk, offs, lead, n_walk, n_cols, row_ptr, allowed_row,
                block_key, first_block, vocab, inv_t, threshold, sampling,
                m, arg, r_row, a_row, has_nan, best, best_start, key_m, key_r, key_h,
                big_m, holds, arg_b, rest, a_rest, r_acc, a_acc,
                SOFTCAP: tl.constexpr, HAS_THRESHOLD: tl.constexpr, HAS_ALLOWED: tl.constexpr,
                SAMPLE_BLOCK: tl.constexpr, BLOCK: tl.constexpr, G: tl.constexpr,
                KEY_BUFFER: tl.constexpr, RAW_MAX: tl.constexpr, PLAIN_EXP2: tl.constexpr,
                WHOLE: tl.constexpr = False):
    """One group of ``G`` vocabulary blocks of the walk: accumulate them; where the group
    ends a sampling block, merge that block into the row and let its key compete (stage a).
    Returns the updated state: the row's (m, arg, r_row, a_row, has_nan, best, best_start,
    key_m, key_r, key_h: the key buffer) and the sampling block's.

    The group's maximum is one lane-wise max and one cross-lane reduction; only when it
    beats the running maximum (rare once a row is under way) do the blocks go one by one
    through ``_accumulate``. Otherwise every block adds its weights relative to the same
    maximum, in order, exactly as ``G`` separate blocks would: the group size changes no bit.
    What it saves is ``G - 1`` cross-lane reductions and branches per group, a chain of
    shuffles each that one warp could not overlap with anything.
    """
    start = walk - lead  # column of the group's first entry
    zg0, zg1, zg2, zg3 = _group_z(xg0, xg1, xg2, xg3, offs, start, vocab, inv_t, threshold,
                                  allowed_row, SOFTCAP, HAS_THRESHOLD, HAS_ALLOWED, G, BLOCK, WHOLE)
    group_max = NEG_INF
    if G > 1:
        if RAW_MAX:
            # 16-bit logits, nothing masked: z = x * inv_t is monotone in x, so the group's
            # max z is max(x) * inv_t, and max(x) takes one max.bf16x2 per two entries on the
            # raw registers.
            x_max = _max16(xg0, xg1)
            if G > 2:
                x_max = _max16(x_max, _max16(xg2, xg3))
            group_max = tl.max(x_max.to(tl.float32), 0) * inv_t
        else:
            lane_max = tl.maximum(zg0, zg1)
            if G > 2:
                lane_max = tl.maximum(lane_max, tl.maximum(zg2, zg3))
            group_max = tl.max(lane_max, 0)
    if G == 1:
        big_m, holds, arg_b, rest, a_rest, r_acc, a_acc = _accumulate(
            zg0, offs, start, big_m, holds, arg_b, rest, a_rest, r_acc, a_acc, PLAIN_EXP2)
    elif group_max > big_m:
        big_m, holds, arg_b, rest, a_rest, r_acc, a_acc = _accumulate(
            zg0, offs, start, big_m, holds, arg_b, rest, a_rest, r_acc, a_acc, PLAIN_EXP2)
        big_m, holds, arg_b, rest, a_rest, r_acc, a_acc = _accumulate(
            zg1, offs, start + BLOCK, big_m, holds, arg_b, rest, a_rest, r_acc, a_acc, PLAIN_EXP2)
        if G > 2:
            big_m, holds, arg_b, rest, a_rest, r_acc, a_acc = _accumulate(
                zg2, offs, start + 2 * BLOCK, big_m, holds, arg_b, rest, a_rest, r_acc, a_acc,
                PLAIN_EXP2)
            big_m, holds, arg_b, rest, a_rest, r_acc, a_acc = _accumulate(
                zg3, offs, start + 3 * BLOCK, big_m, holds, arg_b, rest, a_rest, r_acc, a_acc,
                PLAIN_EXP2)
    else:
        # A whole group of softcapped logits with nothing masked holds no -inf.
        FINITE: tl.constexpr = (SOFTCAP > 0) & WHOLE & (not HAS_THRESHOLD) & (not HAS_ALLOWED)
        r_acc, a_acc = _add_group(zg0, zg1, zg2, zg3, big_m, r_acc, a_acc, G, PLAIN_EXP2, FINITE)

    end = walk + G * BLOCK
    if ((end % SAMPLE_BLOCK) == 0) | (end >= n_walk):
        # The sampling block [b0, b0 + SAMPLE_BLOCK) (columns) is complete.
        b_walk = walk - walk % SAMPLE_BLOCK  # G * BLOCK divides SAMPLE_BLOCK
        b0 = b_walk - lead
        r_b = tl.sum(r_acc, 0) + rest
        a_b = tl.sum(a_acc, 0) + a_rest
        if (r_b != r_b) | (a_b != a_b):
            # NaN or +inf somewhere in the block: read it again on the clean path.
            big_m, holds, arg_b, rest, a_rest, r_acc, a_acc = _sampling_block_start(m, BLOCK)
            nan_acc = tl.zeros([BLOCK], tl.float32)
            for s2 in range(b0, end - lead, BLOCK):
                x2 = tl.load(row_ptr + s2 + offs, mask=(offs >= -s2) & (offs < n_cols - s2),
                             other=NEG_INF)
                x2 = x2.to(tl.float32)
                nan_acc = tl.maximum(nan_acc, x2, propagate_nan=tl.PropagateNan.ALL)
                z2 = _block_z(x2, offs, s2, vocab, inv_t, threshold, allowed_row,
                              SOFTCAP, HAS_THRESHOLD, HAS_ALLOWED, True)
                big_m, holds, arg_b, rest, a_rest, r_acc, a_acc = _accumulate(
                    z2, offs, s2, big_m, holds, arg_b, rest, a_rest, r_acc, a_acc, PLAIN_EXP2)
            has_nan = has_nan | tl.max((nan_acc != nan_acc).to(tl.int32), 0)
            r_b = tl.sum(r_acc, 0) + rest
            a_b = tl.sum(a_acc, 0) + a_rest
        # Merge into the row. A block that raised the maximum (strictly: an equal later
        # maximum keeps the lower id) holds the new arg-max; else its sums are already
        # relative to the row's maximum.
        if holds > 0:
            had_max = m > NEG_INF
            d = tl.where(had_max, tl.maximum((m - big_m) * LOG2E, U_FLOOR), 0.0)
            alpha = tl.exp2(d)
            a_row = tl.where(had_max, (a_row + d * (r_row + 1.0)) * alpha, 0.0) + a_b
            r_row = tl.where(had_max, (r_row + 1.0) * alpha, 0.0) + r_b
            m = big_m
            arg = arg_b
        else:
            a_row += a_b
            r_row += r_b
        if sampling:
            # Stage a: the block's key lse_b + G_b. Its sums wait in the key buffer (logs and
            # noise off the walk's critical path), flushed when it is full or the row ends.
            slot = b_walk // SAMPLE_BLOCK
            buffered = slot % KEY_BUFFER
            here = tl.arange(0, KEY_BUFFER) == buffered
            key_m = tl.where(here, big_m, key_m)
            key_r = tl.where(here, r_b, key_r)
            key_h = tl.where(here, holds, key_h)
            if (buffered == KEY_BUFFER - 1) | (end >= n_walk):
                best, best_start = _flush_keys(key_m, key_r, key_h, slot - buffered, first_block,
                                               lead, block_key, best, best_start, SAMPLE_BLOCK,
                                               KEY_BUFFER)
                key_m, key_r, key_h = _empty_keys(KEY_BUFFER)
        big_m, holds, arg_b, rest, a_rest, r_acc, a_acc = _sampling_block_start(m, BLOCK)

    return (m, arg, r_row, a_row, has_nan, best, best_start, key_m, key_r, key_h,
            big_m, holds, arg_b, rest, a_rest, r_acc, a_acc)


# int32 words per part in the scratch of a split walk: m, arg, R, A2, has_nan, best key,
# best column, and one of padding (32-byte slots).
PARTIAL_WORDS = tl.constexpr(8)


@triton.jit
def _file_partial(slot_ptr, m, arg, r_row, a_row, has_nan, best, best_start):
    """Write one part's row state to its slot with plain stores: the count of the part's
    arrival that follows (a barrier, then a release) publishes them."""
    tl.store(slot_ptr + 0, m.to(tl.int32, bitcast=True))
    tl.store(slot_ptr + 1, arg)
    tl.store(slot_ptr + 2, r_row.to(tl.int32, bitcast=True))
    tl.store(slot_ptr + 3, a_row.to(tl.int32, bitcast=True))
    tl.store(slot_ptr + 4, has_nan)
    tl.store(slot_ptr + 5, best.to(tl.int32, bitcast=True))
    tl.store(slot_ptr + 6, best_start)


@triton.jit
def _read_word(ptr):
    # Read after the merger's acquire of the count, from L2 (.cg), where the parts wrote.
    return tl.load(ptr, cache_modifier=".cg")


@triton.jit
def _merge_partials(row_slots_ptr, PARTS: tl.constexpr):
    """The row state of a split walk from its parts' states, merged in vocabulary order.

    Each part's sums are relative to its own maximum ``m_q`` and leave out its arg-max
    entry's 1 (``R_q``, ``A2_q`` in log2 units, as in ``_accumulate``). Merging part q into
    the row so far (max ``M``), with ``d = (min - max) log2 e``, ``alpha = 2^d``:

        m_q > M:   A2 = alpha (A2 + d (R + 1)) + A2_q,  R = alpha (R + 1) + R_q,  M = m_q
        m_q <= M:  A2 += alpha (A2_q + d (R_q + 1)),    R += alpha (R_q + 1)

    the same step that merges a sampling block into the row. Strict comparisons keep the
    lowest id for a tied maximum and the lowest sampling block for a tied key.
    """
    m = tl.full((), NEG_INF, tl.float32)
    arg = tl.full((), 0, tl.int32)
    r_row = tl.full((), 0.0, tl.float32)
    a_row = tl.full((), 0.0, tl.float32)
    has_nan = tl.full((), 0, tl.int32)
    best = tl.full((), NEG_INF, tl.float32)
    best_start = tl.full((), 0, tl.int32)
    for q in range(PARTS):
        slot = row_slots_ptr + q * PARTIAL_WORDS
        m_q = _read_word(slot + 0).to(tl.float32, bitcast=True)
        r_q = _read_word(slot + 2).to(tl.float32, bitcast=True)
        a_q = _read_word(slot + 3).to(tl.float32, bitcast=True)
        if m_q > m:
            had_max = m > NEG_INF
            d = tl.where(had_max, tl.maximum((m - m_q) * LOG2E, U_FLOOR), 0.0)
            alpha = tl.exp2(d)
            a_row = tl.where(had_max, (a_row + d * (r_row + 1.0)) * alpha, 0.0) + a_q
            r_row = tl.where(had_max, (r_row + 1.0) * alpha, 0.0) + r_q
            m = m_q
            arg = _read_word(slot + 1)
        elif m_q > NEG_INF:
            d = tl.maximum((m_q - m) * LOG2E, U_FLOOR)
            alpha = tl.exp2(d)
            a_row += (a_q + d * (r_q + 1.0)) * alpha
            r_row += (r_q + 1.0) * alpha
        has_nan = has_nan | _read_word(slot + 4)
        best_q = _read_word(slot + 5).to(tl.float32, bitcast=True)
        if best_q > best:
            best = best_q
            best_start = _read_word(slot + 6)
    return m, arg, r_row, a_row, has_nan, best, best_start


@triton.jit
def _finish_row(m, arg, r_row, a_row, has_nan, best, best_start, row, row_ptr, n_cols, todo,
                sampling, seed, draw, position, vocab, vocab_offset, inv_t, threshold,
                allowed_row, column_tokens_ptr, argmax_ptr, sample_ptr, entropy_ptr, lse_ptr,
                has_nan_ptr, sample_key_ptr, SOFTCAP: tl.constexpr, HAS_THRESHOLD: tl.constexpr,
                HAS_ALLOWED: tl.constexpr, HAS_COLUMN_TOKENS: tl.constexpr,
                HAS_SAMPLE_KEY: tl.constexpr, NOISE_FILTER: tl.constexpr,
                SAMPLE_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """A row's outputs from its walked state: lse and entropy, and stage b of the draw (the
    per-token Gumbel-max over the winning sampling block, read again)."""
    offs = tl.arange(0, BLOCK)
    entropy, lse = finish_stats(m, r_row, a_row)
    chosen = arg
    if sampling & (best > NEG_INF):
        # Stage b: Gumbel-max over the tokens of the winning sampling block.
        token_key = kn.row_key(seed, draw, position, GUMBEL_STREAM)
        tb = tl.full((), NEG_INF, tl.float32)
        tb_idx = best_start
        t_max = tl.full((), NEG_INF, tl.float32)
        b_end = tl.minimum(best_start + SAMPLE_BLOCK, n_cols)
        for s3 in range(best_start, b_end, BLOCK):
            in_block = (offs >= -s3) & (offs < b_end - s3)
            x3 = tl.load(row_ptr + s3 + offs, mask=in_block, other=NEG_INF).to(tl.float32)
            z3 = _block_z(x3, offs, s3, vocab, inv_t, threshold, allowed_row,
                          SOFTCAP, HAS_THRESHOLD, HAS_ALLOWED, True)
            z3 = tl.where(in_block, z3, NEG_INF)
            bm3 = tl.max(z3, 0)
            t_max = tl.maximum(t_max, bm3)
            if bm3 + GUMBEL_MAX >= tb:
                if HAS_COLUMN_TOKENS:
                    token = tl.load(column_tokens_ptr + s3 + offs, mask=in_block, other=0)
                else:
                    token = s3 + offs + vocab_offset
                bits = kn.token_bits(token_key, token)
                hit = tl.full((), 1, tl.int32)
                if NOISE_FILTER:
                    # Can w <= exp(z - tb + slack) hold anywhere?
                    gap = _filter_gap(t_max, tb)
                    if gap <= FILTER_MAX_GAP:
                        e3 = tl.exp2(tl.maximum((z3 - t_max) * LOG2E, U_FLOOR))
                        scale = tl.exp2(gap * LOG2E) * TWO_POW_32
                        hit = (tl.max(e3 * scale - bits.to(tl.float32), 0) >= 0).to(tl.int32)
                if hit != 0:
                    # Masked entries have z = -inf, so their keys are -inf too.
                    noisy = z3 + kn.gumbel(bits)
                    block_best = tl.max(noisy, 0)
                    if block_best > tb:
                        tb_idx = s3 + tl.min(tl.where(noisy == block_best, offs, NO_INDEX), 0)
                        tb = block_best
        chosen = tb_idx

    if HAS_COLUMN_TOKENS:
        first_token = tl.load(column_tokens_ptr)
        argmax_token = tl.load(column_tokens_ptr + arg)
        sample_token = tl.load(column_tokens_ptr + chosen)
    else:
        first_token = vocab_offset.to(tl.int64)
        argmax_token = arg.to(tl.int64) + vocab_offset
        sample_token = chosen.to(tl.int64) + vocab_offset
    kept = m > NEG_INF
    tl.store(argmax_ptr + row, tl.where(kept, argmax_token, first_token), mask=todo)
    tl.store(sample_ptr + row, tl.where(kept, sample_token, first_token), mask=todo)
    tl.store(entropy_ptr + row, entropy, mask=todo)
    tl.store(lse_ptr + row, lse, mask=todo)
    tl.store(has_nan_ptr + row, has_nan != 0, mask=todo)
    if HAS_SAMPLE_KEY:
        tl.store(sample_key_ptr + row, tl.where(sampling & kept, best, NEG_INF), mask=todo)


@triton.jit
def _walk_part(logits_desc, row_ptr, row, w_begin, n_walk, offs, lead, n_cols, allowed_row,
               block_key, first_block, vocab, inv_t, threshold, sampling, ELEMENT: tl.constexpr,
               SOFTCAP: tl.constexpr, HAS_THRESHOLD: tl.constexpr, HAS_ALLOWED: tl.constexpr,
               SAMPLE_BLOCK: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
               KEY_BUFFER: tl.constexpr, PREFETCH: tl.constexpr, NUM_STAGES: tl.constexpr,
               ALIGNED: tl.constexpr, PLAIN_EXP2: tl.constexpr, TMA_WALK: tl.constexpr,
               TMA_STAGES: tl.constexpr):
    """The row state (max, arg-max, sums, NaN flag, best sampling-block key and its column)
    of walk positions ``[w_begin, n_walk)``: a whole row, or one part of a split walk, whose
    running maximum starts afresh. ``ELEMENT``: the logits' element type."""
    # The row so far: max m, its lowest index, R without that entry's 1, A2.
    m = tl.full((), NEG_INF, tl.float32)
    arg = tl.full((), 0, tl.int32)
    r_row = tl.full((), 0.0, tl.float32)
    a_row = tl.full((), 0.0, tl.float32)
    has_nan = tl.full((), 0, tl.int32)
    best = tl.full((), NEG_INF, tl.float32)    # best sampling-block key so far
    best_start = tl.full((), 0, tl.int32)      # its first column
    key_m, key_r, key_h = _empty_keys(KEY_BUFFER)  # sampling blocks awaiting their noise
    # The current sampling block: sums relative to big_m (see _accumulate), per lane.
    big_m, holds, arg_b, rest, a_rest, r_acc, a_acc = _sampling_block_start(m, BLOCK)

    RAW_MAX: tl.constexpr = ((ELEMENT != tl.float32) & (SOFTCAP == 0)
                             & (not HAS_THRESHOLD) & (not HAS_ALLOWED) & (not PLAIN_EXP2))
    # The walk goes by groups of GROUP blocks (one max check each, see _walk_group). Register
    # prefetch: PREFETCH blocks (0, one group or two) are loaded ahead. With two groups the
    # walk is unrolled twice and each group owns its buffers, reloaded right after it is
    # consumed, so no register copy waits on a load in flight and one warp keeps between
    # one and two groups of loads in flight: the pass is bound by that latency.
    SPAN: tl.constexpr = GROUP * BLOCK
    STEP: tl.constexpr = SPAN * (1 + (PREFETCH > GROUP))  # walk positions per iteration
    walk0 = w_begin  # where the register-prefetch walk starts
    if TMA_WALK:
        # Whole groups through the descriptor; the ragged last one (if any) is left to the
        # walk below, whose masked pointer loads give -inf past the end (TMA pads zeros).
        walk0 = w_begin + (n_walk - w_begin) // SPAN * SPAN
        for walk in tl.range(w_begin, walk0, SPAN, num_stages=TMA_STAGES):
            a0, a1, a2, a3 = _desc_group(logits_desc, row, walk, GROUP, BLOCK)
            (m, arg, r_row, a_row, has_nan, best, best_start, key_m, key_r, key_h,
             big_m, holds, arg_b, rest, a_rest, r_acc, a_acc) = _walk_group(
                a0, a1, a2, a3, walk, offs, lead, n_walk, n_cols, row_ptr, allowed_row,
                block_key, first_block, vocab, inv_t, threshold, sampling,
                m, arg, r_row, a_row, has_nan, best, best_start, key_m, key_r, key_h,
                big_m, holds, arg_b, rest, a_rest, r_acc, a_acc,
                SOFTCAP, HAS_THRESHOLD, HAS_ALLOWED, SAMPLE_BLOCK, BLOCK, GROUP, KEY_BUFFER,
                RAW_MAX, PLAIN_EXP2, True)
    if PREFETCH > 0:
        a0, a1, a2, a3 = _load_group(row_ptr, walk0, offs, lead, n_walk, GROUP, BLOCK, ALIGNED)
    if PREFETCH > GROUP:
        b0, b1, b2, b3 = _load_group(row_ptr, walk0 + SPAN, offs, lead, n_walk, GROUP, BLOCK,
                                     ALIGNED)
    for walk in tl.range(walk0, n_walk, STEP, num_stages=NUM_STAGES):
        if PREFETCH == 0:
            a0, a1, a2, a3 = _load_group(row_ptr, walk, offs, lead, n_walk, GROUP, BLOCK, ALIGNED)
        (m, arg, r_row, a_row, has_nan, best, best_start, key_m, key_r, key_h,
         big_m, holds, arg_b, rest, a_rest, r_acc, a_acc) = _walk_group(
            a0, a1, a2, a3, walk, offs, lead, n_walk, n_cols, row_ptr, allowed_row, block_key,
            first_block, vocab, inv_t, threshold, sampling,
            m, arg, r_row, a_row, has_nan, best, best_start, key_m, key_r, key_h,
            big_m, holds, arg_b, rest, a_rest, r_acc, a_acc,
            SOFTCAP, HAS_THRESHOLD, HAS_ALLOWED, SAMPLE_BLOCK, BLOCK, GROUP, KEY_BUFFER, RAW_MAX, PLAIN_EXP2)
        if PREFETCH > 0:
            a0, a1, a2, a3 = _load_group(row_ptr, walk + STEP, offs, lead, n_walk, GROUP, BLOCK,
                                         ALIGNED)
        if PREFETCH > GROUP:
            if walk + SPAN < n_walk:
                (m, arg, r_row, a_row, has_nan, best, best_start, key_m, key_r, key_h,
                 big_m, holds, arg_b, rest, a_rest, r_acc, a_acc) = _walk_group(
                    b0, b1, b2, b3, walk + SPAN, offs, lead, n_walk, n_cols, row_ptr,
                    allowed_row, block_key, first_block, vocab, inv_t, threshold, sampling,
                    m, arg, r_row, a_row, has_nan, best, best_start, key_m, key_r, key_h,
                    big_m, holds, arg_b, rest, a_rest, r_acc, a_acc,
                    SOFTCAP, HAS_THRESHOLD, HAS_ALLOWED, SAMPLE_BLOCK, BLOCK, GROUP, KEY_BUFFER,
                    RAW_MAX, PLAIN_EXP2)
            b0, b1, b2, b3 = _load_group(row_ptr, walk + STEP + SPAN, offs, lead, n_walk, GROUP,
                                         BLOCK, ALIGNED)

    return m, arg, r_row, a_row, has_nan, best, best_start


@triton.jit(do_not_specialize=["vocab_offset"])
def _row_stats_kernel(
    logits_ptr, row_stride,                      # [N, V] rows, last dim contiguous
    logits_desc,                                 # TMA descriptor of logits, block [1, BLOCK]
    row_request_ptr, row_position_ptr,           # [N] int: request of the row, canvas position
    temperature_ptr, inv_t_ptr,                  # [R] fp32: T (0 = greedy), 1 / max(T, 1e-10)
    seeds_ptr, draws_ptr,                        # [R] int64
    threshold_ptr, done_ptr,                     # [N] fp32 keep x >= t (-inf written here when
                                                 # no threshold); [N] int8 row finished
    allowed_ptr, allowed_stride,                 # [R, V] bool
    column_tokens_ptr,                           # [V] int64 token id of each column
    argmax_ptr, sample_ptr, entropy_ptr, lse_ptr, has_nan_ptr,  # [N] outputs
    sample_key_ptr,                              # [N] fp32 output (HAS_SAMPLE_KEY)
    partials_ptr, arrivals_ptr,                  # [N, PARTS, 8] int32 scratch; [N] int32 zeros
    vocab, vocab_offset,
    SOFTCAP: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,
    HAS_ALLOWED: tl.constexpr,
    HAS_COLUMN_TOKENS: tl.constexpr,
    HAS_SAMPLE_KEY: tl.constexpr,
    NOISE_FILTER: tl.constexpr,  # the hash filter of stage b (False only to measure it)
    SAMPLE_BLOCK: tl.constexpr,  # positions per sampling block (a multiple of BLOCK)
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,         # blocks per max check (1, 2 or 4)
    KEY_BUFFER: tl.constexpr,    # sampling-block keys drawn together (a power of two)
    PREFETCH: tl.constexpr,      # blocks loaded ahead into registers: 0, GROUP or 2 GROUP
    NUM_STAGES: tl.constexpr,    # Triton's own load pipelining (cp.async) when > 1
    ALIGNED: tl.constexpr,       # vocab_offset % SAMPLE_BLOCK == 0 (no lead)
    PLAIN_EXP2: tl.constexpr,    # tl.exp2 in the hot loop, not ex2.approx.ftz (interpreter)
    TMA_WALK: tl.constexpr,      # whole groups through logits_desc (needs ALIGNED)
    TMA_STAGES: tl.constexpr,    # groups in flight in shared memory on the descriptor walk
    PARTS: tl.constexpr,         # parts per row, each walking PART_LEN positions (1: no split)
    PART_LEN: tl.constexpr,      # walk positions per part (a multiple of SAMPLE_BLOCK)
    PART_GROUP: tl.constexpr,    # consecutive parts walked by one program (changes no bit)
    PROGRAMS: tl.constexpr,      # programs per row: cdiv(PARTS, PART_GROUP)
):
    pid = tl.program_id(0)
    row = pid // PROGRAMS
    program = pid % PROGRAMS
    request = tl.load(row_request_ptr + row).to(tl.int64)
    position = tl.load(row_position_ptr + row)
    inv_t = tl.load(inv_t_ptr + request)
    sampling = tl.load(temperature_ptr + request) != 0.0
    seed = tl.load(seeds_ptr + request)
    draw = tl.load(draws_ptr + request)
    block_key = kn.row_key(seed, draw, position, BLOCK_STREAM)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    allowed_row = allowed_ptr + request * allowed_stride

    threshold = tl.full((), NEG_INF, tl.float32)
    todo = tl.full((), 1, tl.int1)
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + row)
        todo = tl.load(done_ptr + row) == 0
    elif program == 0:
        tl.store(threshold_ptr + row, threshold)  # the row's output: nothing cut (-inf)
    n_cols = tl.where(todo, vocab, 0)
    # The walk starts on the sampling-block boundary at or before the slice: column
    # `start` runs from -lead (masked) so that vocabulary blocks never straddle two
    # sampling blocks. lead = 0 when vocab_offset is a multiple of SAMPLE_BLOCK.
    if ALIGNED:
        lead = 0
    else:
        lead = (vocab_offset % SAMPLE_BLOCK).to(tl.int32)
    first_block = vocab_offset // SAMPLE_BLOCK

    offs = tl.arange(0, BLOCK)
    # Positions walked, from the boundary: the row's [0, lead + vocab), cut into parts of
    # PART_LEN. Parts end on sampling-block boundaries, so a part's blocks and keys are
    # those of the unsplit walk; only its running maximum starts afresh.
    row_walk = tl.where(todo, lead + vocab, 0)
    if PARTS == 1:
        m, arg, r_row, a_row, has_nan, best, best_start = _walk_part(
            logits_desc, row_ptr, row, 0, row_walk, offs, lead, n_cols, allowed_row, block_key,
            first_block, vocab, inv_t, threshold, sampling, logits_ptr.dtype.element_ty,
            SOFTCAP, HAS_THRESHOLD, HAS_ALLOWED, SAMPLE_BLOCK, BLOCK, GROUP, KEY_BUFFER,
            PREFETCH, NUM_STAGES, ALIGNED, PLAIN_EXP2, TMA_WALK, TMA_STAGES)
        _finish_row(m, arg, r_row, a_row, has_nan, best, best_start, row, row_ptr, n_cols, todo,
                    sampling, seed, draw, position, vocab, vocab_offset, inv_t, threshold,
                    allowed_row, column_tokens_ptr, argmax_ptr, sample_ptr, entropy_ptr, lse_ptr,
                    has_nan_ptr, sample_key_ptr, SOFTCAP, HAS_THRESHOLD, HAS_ALLOWED,
                    HAS_COLUMN_TOKENS, HAS_SAMPLE_KEY, NOISE_FILTER, SAMPLE_BLOCK, BLOCK)
    else:
        # This program's parts, one after the other; each files its row state in its own
        # slot, so the bits are those of one program per part.
        row_slots = partials_ptr + row.to(tl.int64) * (PARTS * PARTIAL_WORDS)
        for part in range(program * PART_GROUP, tl.minimum(program * PART_GROUP + PART_GROUP, PARTS)):
            w_begin = part * PART_LEN
            n_walk = tl.maximum(tl.minimum(row_walk, w_begin + PART_LEN), w_begin)
            m, arg, r_row, a_row, has_nan, best, best_start = _walk_part(
                logits_desc, row_ptr, row, w_begin, n_walk, offs, lead, n_cols, allowed_row,
                block_key, first_block, vocab, inv_t, threshold, sampling,
                logits_ptr.dtype.element_ty, SOFTCAP, HAS_THRESHOLD, HAS_ALLOWED, SAMPLE_BLOCK,
                BLOCK, GROUP, KEY_BUFFER, PREFETCH, NUM_STAGES, ALIGNED, PLAIN_EXP2, TMA_WALK,
                TMA_STAGES)
            _file_partial(row_slots + part * PARTIAL_WORDS, m, arg, r_row, a_row, has_nan, best,
                          best_start)
        # Every thread's slot stores before thread 0's count (release: they are published
        # with it; acquire: the merger reads the other programs' slots after it).
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel")
        if arrived == PROGRAMS - 1:
            # Every program has counted in: nothing else touches the counter in this launch.
            tl.store(arrivals_ptr + row, 0)  # ready for the next launch (graph replays)
            m, arg, r_row, a_row, has_nan, best, best_start = _merge_partials(row_slots, PARTS)
            _finish_row(m, arg, r_row, a_row, has_nan, best, best_start, row, row_ptr, n_cols,
                        todo, sampling, seed, draw, position, vocab, vocab_offset, inv_t,
                        threshold, allowed_row, column_tokens_ptr, argmax_ptr, sample_ptr,
                        entropy_ptr, lse_ptr, has_nan_ptr, sample_key_ptr, SOFTCAP,
                        HAS_THRESHOLD, HAS_ALLOWED, HAS_COLUMN_TOKENS, HAS_SAMPLE_KEY,
                        NOISE_FILTER, SAMPLE_BLOCK, BLOCK)


def _check_rows(logits, row_request, row_position, temperature, seeds, draws, top_k, top_p,
                allowed, vocab_offset, column_tokens):
    assert logits.dim() == 2, f"logits must be [N, V], got {tuple(logits.shape)}"
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16), logits.dtype
    n_rows, vocab = logits.shape
    assert vocab > 0 and (n_rows == 0 or logits.stride(1) == 1), "logits rows must be contiguous"
    n_req = temperature.shape[0]
    for name, t, dtypes, shape in (
        ("row_request", row_request, (torch.int32, torch.int64), (n_rows,)),
        ("row_position", row_position, (torch.int32, torch.int64), (n_rows,)),
        ("seeds", seeds, (torch.int64,), (n_req,)),
        ("draws", draws, (torch.int64,), (n_req,)),
        ("top_k", top_k, (torch.int32, torch.int64), (n_req,)),
        ("top_p", top_p, (torch.float32, torch.bfloat16, torch.float16), (n_req,)),
        ("allowed", allowed, (torch.bool,), (n_req, vocab)),
        ("column_tokens", column_tokens, (torch.int64,), (vocab,)),
    ):
        if t is None:
            continue
        assert t.dtype in dtypes, f"{name} must have dtype in {dtypes}, got {t.dtype}"
        assert tuple(t.shape) == shape, f"{name} must have shape {shape}, got {tuple(t.shape)}"
        assert t.device == logits.device, f"{name} must be on {logits.device}, got {t.device}"
    assert allowed is None or allowed.stride(1) == 1, "allowed rows must be contiguous"
    assert 0 <= vocab_offset and vocab_offset + vocab < 2**31 - 1, "token ids must fit in int32"


def _empty_stats(n_rows: int, device: torch.device) -> RowStats:
    """Uninitialized outputs (a separate function so tests can poison them)."""
    return RowStats.empty(n_rows, device)


def default_config(logits: torch.Tensor, softcap: float | None = None) -> dict:
    """Launch configuration of the stats pass (the alternatives timed against it are in
    ``docs/performance-history.md``).

    A ``"threshold"`` entry (a dict of ``topk_topp.threshold_rows`` keywords) tunes the top-k /
    top-p search; the CPU tests use it to shrink the candidate buffer.
    """
    # Small programs: one warp per row, 256-entry blocks, the new-maximum test once per
    # group of 4 blocks, loads one group ahead (two groups cost registers, hence programs per
    # SM), at most 128 registers: 16 programs per SM (16-bit logits with a softcap would take
    # more for the softcap's two paths, and spill nothing at 128). Every dtype takes the
    # descriptor walk where it applies (``_tma_walk``), 3 stages for fp32 and 4 for 16-bit
    # logits. fp32 logits split the walk into parts of 32 sampling
    # blocks (``vocabulary_parts``): it fills the GPU at few requests for a few percent at
    # many. 16-bit logits without a softcap stream at 2 bytes an entry, lose more at many
    # requests than they gain at few, and stay whole; with a softcap (the hidden-state path)
    # the tanh makes each entry cost ~25 instructions (~20 on the softcap's polynomial alone)
    # and parts of 32 blocks pay at one request for a few percent at many (smaller parts cost
    # more at many requests than they gain at one); at many rows a program walks both parts
    # of its row (``part_group``). The softcap is the model's, never the batch's.
    # Nothing here may depend on the number of rows: the block size, the walk (register or
    # descriptor: their per-lane sums run in another order) and the split set the rounding
    # of lse and entropy, and a request's bits may not depend on how the dispatcher tiled the
    # batch. Group, prefetch depth, key buffer and stage count change no bit
    # (tests/test_row_stats_kernel.py::test_walk_shape_changes_no_bit).
    fp32 = logits.element_size() == 4
    return dict(block=256, num_warps=1, group=4, prefetch=1, num_stages=1, maxnreg=128,
                fast_exp2=True, key_buffer=64, tma=True,
                part_blocks=32 if fp32 or softcap else None,
                tma_stages=3 if fp32 else 4)


def _tma_walk(logits: torch.Tensor, cfg: dict, block: int, aligned: bool) -> bool:
    """Whether the walk can load whole groups through a TMA descriptor: asked for by the
    config, a Hopper-or-later GPU (not the interpreter), no lead before the first sampling
    block, and rows TMA can address (16-byte aligned base and row stride, unit column stride,
    a block of at most 256 entries and at least 16 bytes)."""
    if not cfg.get("tma") or logits.device.type != "cuda" or interpreting() or not aligned:
        return False
    if cuda_capability(logits.device)[0] < 9:
        return False
    size = logits.element_size()
    return (logits.stride(1) == 1 and (logits.stride(0) * size) % 16 == 0
            and logits.data_ptr() % 16 == 0 and block <= 256 and block * size >= 16)


def walk_shape(cfg: dict, block: int, sample_block: int) -> tuple[int, int]:
    """(GROUP, PREFETCH in blocks) of a launch config: ``group`` blocks per max check (1, 2
    or 4; halved until a group fits a sampling block) and ``prefetch`` groups loaded ahead
    (0, 1 or 2; True means 2)."""
    group = cfg.get("group", 1)
    if group not in (1, 2, 4):
        raise ValueError(f"row_stats config: group must be 1, 2 or 4 blocks, got {group!r}")
    while group > 1 and sample_block % (group * block):
        group //= 2
    ahead = cfg.get("prefetch", 0)
    ahead = 2 if ahead is True else int(ahead)
    if ahead not in (0, 1, 2):
        raise ValueError(f"row_stats config: prefetch must be 0, 1 or 2 groups, got {cfg['prefetch']!r}")
    return group, ahead * group


def vocabulary_parts(cfg: dict, n_walk: int, sample_block: int) -> tuple[int, int]:
    """(parts per row, walk positions per part; 0 for one part) of a launch config: ``part_blocks`` sampling
    blocks per part (None or 0: one part, the unsplit walk), for a row walk of ``n_walk``
    positions (the lead before an unaligned slice included).

    The split depends on the config and the row length only, never on the number of rows:
    a part's sums start from its own maximum, so the split sets the rounding of lse and
    entropy, and a request's bits may not depend on the batch it came in.
    """
    blocks = cfg.get("part_blocks") or 0
    if isinstance(blocks, bool) or not (isinstance(blocks, int) and blocks >= 0):
        raise ValueError(f"row_stats config: part_blocks must be an int >= 0, got {blocks!r}")
    if blocks == 0:
        return 1, 0
    part_len = blocks * sample_block
    parts = triton.cdiv(n_walk, part_len)
    if parts > 4096:
        raise ValueError(f"row_stats config: {parts} parts per row (part_blocks={blocks}) is "
                         "more than 4096")
    return (parts, part_len) if parts > 1 else (1, 0)


# Programs of the split walk an SM runs at once (one warp of ~128 registers each): fewer per
# SM leave the ALUs idle, more are a second wave.
PROGRAMS_PER_SM = 16


def part_group(cfg: dict, n_rows: int, parts: int, num_sms: int) -> int:
    """Consecutive parts of a row walked by one program: ``cfg["part_group"]`` where given,
    else the largest power of two that still leaves ``PROGRAMS_PER_SM`` programs per SM (1
    where programs of 2 parts would not). Each part files its own state,
    so unlike the split itself this choice changes no bit and may follow the batch."""
    group = cfg.get("part_group")
    if group is not None:
        if isinstance(group, bool) or not (isinstance(group, int) and group >= 1):
            raise ValueError(f"row_stats config: part_group must be an int >= 1, got {group!r}")
        return min(group, parts)
    group = 1
    while group * 2 <= parts and n_rows * triton.cdiv(parts, group * 2) >= PROGRAMS_PER_SM * num_sms:
        group *= 2
    return group


def row_stats_rows(
    logits: torch.Tensor,
    row_request: torch.Tensor,
    row_position: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    draws: torch.Tensor,
    *,
    softcap: float | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    vocab_offset: int = 0,
    column_tokens: torch.Tensor | None = None,
    sample_block: int = contract.SAMPLE_BLOCK,
    sample_key: torch.Tensor | None = None,
    config: dict | None = None,
    noise_filter: bool = True,
    inv_t: torch.Tensor | None = None,
) -> RowStats:
    """Triton twin of ``reference.row_stats_rows`` (same arguments, same result; inputs are
    validated by the caller, ``dgemma_sampler.ops``, and only asserted here). The kernel keeps
    no per-row temporaries, so unlike the oracle it takes no ``chunk_rows``.

    ``config``: keys of ``default_config`` to override (the benchmark's sweeps, the tests'
    small blocks). ``noise_filter=False`` computes stage b's exact noise for every entry
    instead of behind the hash filter: the same result, slower (a test checks that).
    """
    _check_rows(logits, row_request, row_position, temperature, seeds, draws, top_k, top_p,
                allowed, vocab_offset, column_tokens)
    assert sample_block >= 16 and sample_block & (sample_block - 1) == 0, \
        f"sample_block must be a power of two >= 16, got {sample_block}"
    if sample_key is not None:
        assert sample_key.shape == (logits.shape[0],) and sample_key.dtype == torch.float32 \
            and sample_key.device == logits.device and sample_key.is_contiguous(), \
            "sample_key must be a contiguous [N] float32 tensor on the logits' device"
    n_rows, vocab = logits.shape
    out = _empty_stats(n_rows, logits.device)
    if n_rows == 0:
        return out
    # Per-request and per-row vectors may be strided views; the kernels index them densely.
    row_request, row_position = row_request.contiguous(), row_position.contiguous()
    seeds, draws = seeds.contiguous(), draws.contiguous()
    top_k = top_k.contiguous() if top_k is not None else None
    top_p = top_p.contiguous() if top_p is not None else None
    column_tokens = column_tokens.contiguous() if column_tokens is not None else None
    if inv_t is None:
        inv_t = contract.inverse_temperature(temperature)
    else:
        contract.check_inverse_temperature(inv_t, temperature)
    inv_t = inv_t.contiguous()
    temp32 = temperature.to(torch.float32).contiguous()
    softcap_c = 0.0 if softcap is None else float(softcap)
    done = None
    if top_k is not None or top_p is not None:
        from .topk_topp import threshold_rows

        done = threshold_rows(
            logits, row_request, row_position, temp32, inv_t, seeds, draws, out,
            softcap=softcap_c, top_k=top_k, top_p=top_p, allowed=allowed,
            vocab_offset=vocab_offset, column_tokens=column_tokens,
            sample_block=sample_block, sample_key=sample_key,
            **(config or {}).get("threshold", {}),
        )
    cfg = {**default_config(logits, softcap), **{k: v for k, v in (config or {}).items() if k != "threshold"}}
    block = min(cfg["block"], sample_block, max(16, triton.next_power_of_2(vocab)))
    group, prefetch = walk_shape(cfg, block, sample_block)
    aligned = vocab_offset % sample_block == 0
    parts, part_len = vocabulary_parts(cfg, vocab_offset % sample_block + vocab, sample_block)
    # Per part its row state (PARTIAL_WORDS int32), per row the count of parts arrived.
    scratch = torch.zeros(n_rows * (1 + parts * 8) if parts > 1 else 1, dtype=torch.int32,
                          device=logits.device)
    logits_desc = None
    if _tma_walk(logits, cfg, block, aligned):
        from triton.tools.tensor_descriptor import TensorDescriptor

        logits_desc = TensorDescriptor(logits, [n_rows, vocab], [logits.stride(0), 1], [1, block])
    parts_each = part_group(cfg, n_rows, parts, contract.sm_count(logits.device))
    programs = triton.cdiv(parts, parts_each)
    assert n_rows * programs < 2**31, f"{n_rows} rows x {programs} programs: too many programs"
    _row_stats_kernel[(n_rows * programs,)](
        logits, logits.stride(0), logits_desc,
        row_request, row_position,
        temp32, inv_t, seeds, draws,
        out.threshold, done if done is not None else out.threshold,
        allowed if allowed is not None else logits, allowed.stride(0) if allowed is not None else 0,
        column_tokens if column_tokens is not None else seeds,
        out.argmax, out.sample, out.entropy, out.lse, out.has_nan,
        sample_key if sample_key is not None else out.lse,
        scratch[n_rows:] if parts > 1 else scratch, scratch,
        vocab, vocab_offset,
        SOFTCAP=softcap_c,
        HAS_THRESHOLD=done is not None,
        HAS_ALLOWED=allowed is not None,
        HAS_COLUMN_TOKENS=column_tokens is not None,
        HAS_SAMPLE_KEY=sample_key is not None,
        NOISE_FILTER=noise_filter,
        SAMPLE_BLOCK=sample_block,
        BLOCK=block,
        GROUP=group,
        KEY_BUFFER=min(int(cfg["key_buffer"]), triton.next_power_of_2(
            triton.cdiv(part_len or vocab_offset % sample_block + vocab, sample_block))),
        PREFETCH=prefetch,
        NUM_STAGES=cfg["num_stages"],
        ALIGNED=aligned,
        PLAIN_EXP2=not cfg["fast_exp2"] or interpreting(),
        TMA_WALK=logits_desc is not None,
        TMA_STAGES=int(cfg["tma_stages"]),
        PARTS=parts,
        PART_LEN=part_len,
        PART_GROUP=parts_each,
        PROGRAMS=programs,
        num_warps=cfg["num_warps"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )
    return out
