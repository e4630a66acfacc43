"""Per-row top-k / top-p threshold without a sort of the row and without an fp32 copy.

The threshold ``t`` of ``reference.top_k_top_p_threshold`` (keep ``x >= t``; top-k, then
top-p at temperature 1 over what top-k kept, ties kept) is, in value space::

    t_k = the largest value v of the row with  count(x >= v) >= k
    t_p = the largest value v in K            with  mass(x >= v) >= p * mass(K)
    t   = max(t_k, t_p)          mass(S) = sum over S of exp(x - max x)

Both are "the largest v with F(>= v) >= target" for a non-increasing F (a count or a mass),
so one search serves both. The search keeps a bracket ``[lo, hi)`` with ``F(>= lo) >=
target > F(>= hi)`` (``t`` lies in it) and the count and mass above ``hi``:

1. Scan (``_scan_kernel``, one program per row, one read at memory speed): the maximum of
   every 256-entry sub-block (a table in scratch, [N, V / 256]), for top-p-only rows also
   each sub-block's mass, and the NaN flag. The table bounds the answer from below without
   touching the row again: the k-th largest sub-block maximum is at most the k-th largest
   value, and the sub-block maxima >= v carry at least their own mass. For k of a few
   dozen that ``lo`` usually leaves a few dozen entries above it (about k sub-blocks reach
   it). (Steps 2-3 run in ``_search_kernel``, persistent programs with a candidate buffer
   each.)
2. Collect: one pass over the sub-blocks whose maximum reaches ``lo`` (the loads of the
   others are masked off) writes the entries in
   ``[lo, hi)`` (value and id packed in an int64) to scratch. If they are at most ``CAP``,
   they are sorted in registers and ``t`` is read off exactly: the position where the
   cumulative count (or fp64 mass) from ``hi`` down first reaches the target.
3. Otherwise (a large kept set: top-p alone on a flat row, or k above about 100) pivot
   passes narrow the bracket: ``PIVOTS`` values spaced evenly in value (or in the fp32 bit
   order once the bracket is a few ulps wide) get their counts and masses in one pass.
   Each pass shrinks the bracket by about ``PIVOTS + 1``; then step 2 runs. A bracket that
   is one float wide but still holds more than ``CAP`` tied entries gives ``t = lo``. The
   fallback first reads the row once more for its count, minimum, largest finite value and
   mass (the scan does not spend per-entry work on them).

When the final candidates cover every kept entry (the usual case), the search also finishes
the row's statistics from them (max, R, A, arg-max, the two-stage keyed sample: the same
formulas as ``row_stats``, on at most ``CAP`` entries) and marks the row done; ``row_stats`` then skips it.
So a row with top-k costs about one read of its logits, no more than a row without.

Exactness: counts are exact. Masses are fp32 exponentials summed in fp64 against the
oracle's fp64 softmax, so ``t_p`` can differ only where the cumulative mass at a value lies
within about 1e-6 relative of ``p`` (tests check that such a miss is such a near-tie).
"""

import torch
import triton
import triton.language as tl

from . import contract
from . import keyed_noise as kn
from .logit_row import (
    FLT_MAX,
    LOG2E,
    NEG_INF,
    NO_INDEX,
    U_FLOOR,
    finish_stats,
    from_ordered_key,
    interpreting,
    ordered_key,
    pack_value_id,
    scaled,
    scatter_store,
    softcapped,
    unpack_value_id,
)

POS_INF = tl.constexpr(float("inf"))
GUMBEL_STREAM = tl.constexpr(1)  # keyed_noise.Stream.GUMBEL
BLOCK_STREAM = tl.constexpr(4)   # keyed_noise.Stream.BLOCK
INT64_MIN = tl.constexpr(-(2**63))
# Value-spaced pivots while the bracket is wider than this fraction of its magnitude,
# then pivots spaced in the fp32 bit order (which always separate distinct floats).
VALUE_PIVOT_MIN_WIDTH = tl.constexpr(2.0**-10)


@triton.jit
def _load_valid(row_ptr, allowed_row, idx, wanted, vocab, SOFTCAP: tl.constexpr,
                HAS_ALLOWED: tl.constexpr):
    """(x, valid) for the entries ``idx`` of a row where ``wanted``: softcapped fp32; valid =
    not masked. Entries not wanted are not read (-inf, invalid)."""
    in_row = (idx < vocab) & wanted
    x = tl.load(row_ptr + idx, mask=in_row, other=NEG_INF).to(tl.float32)
    x = softcapped(x, SOFTCAP)
    # False for NaN, -inf and the padding (which the softcap would turn into -c)
    valid = (x > NEG_INF) & in_row
    if HAS_ALLOWED:
        valid = valid & (tl.load(allowed_row + idx, mask=in_row, other=0) != 0)
    return x, valid


@triton.jit
def _sub_block_tile(subs_ptr, j0, q, SUB: tl.constexpr, GROUP: tl.constexpr):
    """Entry ids (and which are wanted) of the qualifying sub-blocks j0 .. j0 + GROUP - 1, a
    [GROUP, SUB] tile.

    ``subs_ptr`` holds the ``q`` sub-blocks whose maximum reaches the current bound (listed by
    ``_reaching``): the passes read those and nothing else. The tile stays 2-D so that each
    row of it is known to be SUB contiguous entries: the loads are vectorized (a 1-D
    reshape hides that and gives one scalar load per entry).
    """
    j = j0 + tl.arange(0, GROUP)
    sub_id = tl.load(subs_ptr + j, mask=j < q, other=0)
    idx = sub_id[:, None] * SUB + tl.arange(0, SUB)[None, :]
    wanted = tl.broadcast_to((j < q)[:, None], [GROUP, SUB])
    return idx, wanted


@triton.jit
def _in_bracket(x, valid, lo, hi):
    """valid & lo <= x < hi, where hi = +inf means no upper bound (+inf logits included)."""
    return valid & (x >= lo) & (tl.minimum(x, FLT_MAX) < hi)


@triton.jit
def _collect(row_ptr, allowed_row, subs_ptr, q, cand_ptr, vocab, lo, hi,
             SOFTCAP: tl.constexpr, HAS_ALLOWED: tl.constexpr,
             SUB: tl.constexpr, GROUP: tl.constexpr, CAP: tl.constexpr, INTERPRET: tl.constexpr):
    """Write the entries in [lo, hi) (packed value/id) to scratch; return how many there are.

    Only the ``q`` sub-blocks whose maximum reaches ``lo`` are read.
    """
    count = tl.full((), 0, tl.int32)
    tl.debug_barrier()  # the candidate buffer may still be read by other threads
    # The next tile is loaded before this one is processed: the sub-blocks are scattered over
    # the row and usually come from HBM, and one program per SM-quarter cannot hide that
    # latency by itself.
    idx, wanted = _sub_block_tile(subs_ptr, 0, q, SUB, GROUP)
    x, valid = _load_valid(row_ptr, allowed_row, idx, wanted, vocab, SOFTCAP, HAS_ALLOWED)
    for j0 in range(0, q, GROUP):
        idx_next, wanted_next = _sub_block_tile(subs_ptr, j0 + GROUP, q, SUB, GROUP)
        x_next, valid_next = _load_valid(row_ptr, allowed_row, idx_next, wanted_next, vocab,
                                         SOFTCAP, HAS_ALLOWED)
        flag = _in_bracket(x, valid, lo, hi).to(tl.int32)
        # slot of each entry: the ones before it in its sub-block, plus those in the
        # sub-blocks before (the order is irrelevant: the candidates get sorted)
        per_sub = tl.sum(flag, 1)
        pos = count + (tl.cumsum(per_sub, 0) - per_sub)[:, None] + tl.cumsum(flag, 1) - flag
        scatter_store(cand_ptr + pos, pack_value_id(x, idx), (flag != 0) & (pos < CAP), INTERPRET)
        count += tl.sum(per_sub, 0)
        idx, x, valid = idx_next, x_next, valid_next
    return count


@triton.jit
def _pivots(lo, hi_eff, closed, PIVOTS: tl.constexpr):
    """PIVOTS ascending values in (lo, hi_eff) (``closed``: the last one is hi_eff itself)."""
    step = tl.arange(0, PIVOTS) + 1
    denom = tl.where(closed, PIVOTS, PIVOTS + 1)
    f = step.to(tl.float32) / denom.to(tl.float32)
    by_value = lo * (1.0 - f) + hi_eff * f
    k_lo = ordered_key(lo).to(tl.int64)
    k_hi = ordered_key(hi_eff).to(tl.int64)
    by_key = from_ordered_key((k_lo + ((k_hi - k_lo) * step) // denom).to(tl.int32))
    narrow = (hi_eff - lo) <= VALUE_PIVOT_MIN_WIDTH * (tl.abs(lo) + tl.abs(hi_eff))
    piv = tl.where(narrow, by_key, by_value)
    return tl.minimum(tl.maximum(piv, lo), hi_eff)


@triton.jit
def _pivot_pass(row_ptr, allowed_row, subs_ptr, q, vocab, lo, hi, piv, m1,
                SOFTCAP: tl.constexpr, HAS_ALLOWED: tl.constexpr,
                SUB: tl.constexpr, PIVOTS: tl.constexpr):
    """Count and mass (fp32, relative to m1) of the entries in [piv_j, hi), per pivot.

    Reads the ``q`` sub-blocks whose maximum reaches ``lo``, one at a time (the compare
    against every pivot is a [SUB, PIVOTS] tile).
    """
    cnt = tl.zeros([PIVOTS], tl.int32)
    mass = tl.zeros([PIVOTS], tl.float32)
    for j0 in range(0, q):
        idx, wanted = _sub_block_tile(subs_ptr, j0, q, SUB, 1)
        x, valid = _load_valid(row_ptr, allowed_row, idx, wanted, vocab, SOFTCAP, HAS_ALLOWED)
        x = tl.reshape(tl.where(_in_bracket(x, valid, lo, hi), x, NEG_INF), [SUB])
        w = tl.exp2(tl.maximum((x - m1) * LOG2E, U_FLOOR))
        above = x[:, None] >= piv[None, :]
        cnt += tl.sum(above.to(tl.int32), 0)
        mass += tl.sum(tl.where(above, w[:, None], 0.0), 0)
    return cnt, mass


@triton.jit
def _bracket_search(row_ptr, allowed_row, subs_ptr, maxima, cand_ptr, vocab,
                    lo, n, target, m1, top, is_mass,
                    SOFTCAP: tl.constexpr, HAS_ALLOWED: tl.constexpr,
                    SUB: tl.constexpr, GROUP: tl.constexpr,
                    CAP: tl.constexpr, PIVOTS: tl.constexpr, MAX_ROUNDS: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """Narrow [lo, +inf) until at most CAP entries are left in the bracket; collect them.

    F is the count (or, with ``is_mass``, the mass) of the entries >= v. ``lo`` must be valid
    (F(>= lo) >= target) and ``n`` the number of entries >= lo; ``top`` is the largest
    finite value (pivots above it only separate it from +inf logits).
    Returns (lo, hi, c_hi, w_hi, n): the bracket, the count and mass of entries >= hi, and
    the number n of entries in [lo, hi), which sit in scratch when n <= CAP.
    """
    hi = tl.full((), POS_INF, tl.float32)
    c_hi = tl.full((), 0, tl.int32)
    w_hi = tl.full((), 0.0, tl.float64)
    rounds = tl.full((), 0, tl.int32)
    while (n > CAP) & (rounds < MAX_ROUNDS) & (lo < top):
        hi_eff = tl.minimum(hi, top)
        piv = _pivots(lo, hi_eff, hi == POS_INF, PIVOTS)
        q = _reaching(maxima, lo, subs_ptr, INTERPRET)
        cnt, mass = _pivot_pass(row_ptr, allowed_row, subs_ptr, q, vocab, lo, hi, piv, m1, SOFTCAP,
                                HAS_ALLOWED, SUB, PIVOTS)
        reached = tl.where(is_mass, w_hi + mass.to(tl.float64), (c_hi + cnt).to(tl.float64))
        ok = reached >= target
        # Pivots ascend and F falls, so ok is True up to some pivot: the new bracket.
        new_lo = tl.max(tl.where(ok, piv, lo), 0)
        cnt_at_lo = tl.max(tl.where(ok & (piv == new_lo), cnt, -1), 0)
        cnt_lo = tl.where(cnt_at_lo >= 0, cnt_at_lo, n)
        new_hi = tl.min(tl.where(ok, POS_INF, piv), 0)
        has_hi = new_hi < POS_INF
        cnt_hi = tl.max(tl.where(piv == new_hi, cnt, 0), 0)
        mass_hi = tl.max(tl.where(piv == new_hi, mass, 0.0), 0)
        if has_hi:
            hi = new_hi
            c_hi += cnt_hi
            w_hi += mass_hi.to(tl.float64)
            n = cnt_lo - cnt_hi
        else:
            n = cnt_lo
        lo = new_lo
        rounds += 1
        # one float left in [lo, hi): only ties at lo remain
        single_value = ordered_key(tl.minimum(hi, FLT_MAX)) - ordered_key(lo) <= 1
        if n <= CAP:
            q = _reaching(maxima, lo, subs_ptr, INTERPRET)
            n = _collect(row_ptr, allowed_row, subs_ptr, q, cand_ptr, vocab, lo, hi, SOFTCAP,
                         HAS_ALLOWED, SUB, GROUP, CAP, INTERPRET)
        elif single_value:
            rounds = MAX_ROUNDS  # only ties at lo are left: t = lo
    return lo, hi, c_hi, w_hi, n


@triton.jit
def _range_pass(row_ptr, allowed_row, vocab, m1, SOFTCAP: tl.constexpr,
                HAS_ALLOWED: tl.constexpr, TILE: tl.constexpr):
    """(count, minimum, largest finite value, mass rel. m1) of the valid entries of a row.

    Only the fallback needs these (a table without a usable bound, a candidate overflow,
    +inf logits), so the scan kernel does not spend a per-entry instruction on them.
    """
    offs = tl.arange(0, TILE)
    n_acc = tl.zeros([TILE], tl.int32)
    min_acc = tl.full([TILE], POS_INF, tl.float32)
    top_acc = tl.full([TILE], NEG_INF, tl.float32)
    s_acc = tl.zeros([TILE], tl.float32)
    for start in range(0, vocab, TILE):
        x, valid = _load_valid(row_ptr, allowed_row, start + offs, offs >= 0, vocab, SOFTCAP,
                               HAS_ALLOWED)
        xv = tl.where(valid, x, NEG_INF)
        n_acc += valid.to(tl.int32)
        min_acc = tl.minimum(min_acc, tl.where(valid, x, POS_INF))
        top_acc = tl.maximum(top_acc, tl.where(x < POS_INF, xv, NEG_INF))
        s_acc += tl.exp2(tl.maximum((xv - m1) * LOG2E, U_FLOOR))
    return tl.sum(n_acc, 0), tl.min(min_acc, 0), tl.max(top_acc, 0), tl.sum(s_acc, 0)


@triton.jit
def _sorted_candidates(cand_ptr, n, CAP: tl.constexpr):
    """The collected entries sorted by value descending (ties: lowest id first)."""
    slot = tl.arange(0, CAP)
    packed = tl.load(cand_ptr + slot, mask=slot < n, other=INT64_MIN)
    values, ids = unpack_value_id(tl.sort(packed, descending=True))
    present = slot < n
    return tl.where(present, values, NEG_INF), ids, present


@triton.jit
def _first_reaching(cum, target, present, CAP: tl.constexpr):
    """Lowest slot whose cumulative value reaches target (the last present slot if none)."""
    slot = tl.arange(0, CAP)
    first = tl.min(tl.where(present & (cum >= target), slot, CAP), 0)
    last = tl.max(tl.where(present, slot, 0), 0)
    return tl.minimum(first, last)


@triton.jit
def _at(values, slot_wanted, CAP: tl.constexpr):
    return tl.max(tl.where(tl.arange(0, CAP) == slot_wanted, values, NEG_INF), 0)


@triton.jit
def _reaching(maxima, lo, subs_ptr, INTERPRET: tl.constexpr):
    """List the sub-blocks whose maximum (``maxima``, one per sub-block, -inf padded) is
    >= lo in scratch, in index order (a prefix sum, no sort); return how many there are."""
    slot = tl.arange(0, maxima.shape[0])
    flag = (maxima >= lo).to(tl.int32)
    pos = tl.cumsum(flag, 0) - flag
    tl.debug_barrier()  # the previous list may still be read
    scatter_store(subs_ptr + pos, slot, flag != 0, INTERPRET)
    tl.debug_barrier()
    return tl.sum(flag, 0)


@triton.jit
def _largest_reaching(maxima, weight, target, WAYS: tl.constexpr):
    """The largest sub-block maximum v with ``sum(weight where maxima >= v) >= target`` (-inf if
    none): the k-th largest maximum for a weight of 1 and target k.

    A search on the order-preserving int keys instead of a sort of the table: each round
    weighs WAYS pivots spread over the remaining key range at once (one [n, WAYS]
    compare-and-sum, one reduction) and keeps the part between the last pivot that reaches
    the target and the first that does not, so 32 bits of key take about 32 / log2(WAYS + 1)
    rounds, where a bisection takes 32 dependent reductions. The answer is the value a sort
    would give (F only changes at table values). Counts come as int32 weights: their sums
    are integer reductions, not the fp64 ones a mass needs.
    """
    keys = ordered_key(maxima)
    lo = tl.min(keys, 0).to(tl.int64)  # the range arithmetic needs 33 bits
    hi = tl.max(keys, 0).to(tl.int64)
    found = tl.sum(weight, 0) >= target
    step = (tl.arange(0, WAYS) + 1).to(tl.int64)
    zero = tl.zeros([WAYS], weight.dtype)
    while lo < hi:  # invariant: F(lo) >= target (when found), the answer lies in [lo, hi]
        # ascending pivots in (lo, hi], the last one hi itself; int32 keys again, so the
        # [n, WAYS] compare holds one register per element, not two
        piv = (lo + ((hi - lo) * step + (WAYS - 1)) // WAYS).to(tl.int32)
        reach = tl.sum(tl.where(keys[:, None] >= piv[None, :], weight[:, None], zero[None, :]), 0)
        ok = reach >= target  # F falls as the pivots rise: ok holds up to some pivot
        new_lo = tl.max(tl.where(ok, piv.to(tl.int64), lo), 0)
        hi = tl.min(tl.where(ok, hi, piv.to(tl.int64) - 1), 0)
        lo = new_lo
    return tl.where(found, from_ordered_key(lo.to(tl.int32)), NEG_INF)


@triton.jit
def _request_top_k_top_p(top_k_ptr, top_p_ptr, request, vocab, HAS_TOP_K: tl.constexpr,
                         HAS_TOP_P: tl.constexpr):
    """(k, p, top-k on, top-p on) of a request, with the oracle's rules (0 < k < V, p < 1)."""
    k = tl.full((), 0, tl.int64)
    p = tl.full((), 1.0, tl.float32)
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + request)
    if HAS_TOP_P:
        p = tl.load(top_p_ptr + request)
    return k, p, (k > 0) & (k < vocab), p < 1.0


@triton.jit
def _scan_kernel(
    logits_ptr, row_stride, row_request_ptr,
    top_k_ptr, top_p_ptr,                     # [R] int64 (0 or >= V: off), fp32 (1: off)
    allowed_ptr, allowed_stride,
    max_table_ptr, mass_table_ptr, table_stride,   # [N, >= n_sub] fp32 scratch
    has_nan_ptr, vocab,
    SOFTCAP: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
    HAS_ALLOWED: tl.constexpr, SUB: tl.constexpr, TILE: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Pass 1, one program per row: the maximum of every sub-block of SUB entries (and, for
    rows with top-p but no top-k, the mass of every sub-block relative to its maximum) and
    the NaN flag. A few instructions per entry: this pass runs at memory speed."""
    row = tl.program_id(0)
    request = tl.load(row_request_ptr + row).to(tl.int64)
    _, _, k_on, p_on = _request_top_k_top_p(top_k_ptr, top_p_ptr, request, vocab, HAS_TOP_K,
                                            HAS_TOP_P)
    if k_on | p_on:
        need_mass = p_on & ~k_on
        row_ptr = logits_ptr + row.to(tl.int64) * row_stride
        allowed_row = allowed_ptr + request * allowed_stride
        table_row = row.to(tl.int64) * table_stride
        n_sub = tl.cdiv(vocab, SUB)
        subs = tl.arange(0, TILE // SUB)
        idx2 = subs[:, None] * SUB + tl.arange(0, SUB)[None, :]
        nan_acc = tl.zeros([TILE // SUB, SUB], tl.float32)
        for start in tl.range(0, vocab, TILE, num_stages=NUM_STAGES):
            x, valid = _load_valid(row_ptr, allowed_row, start + idx2, idx2 >= 0, vocab, SOFTCAP,
                                   HAS_ALLOWED)
            nan_acc = tl.maximum(nan_acc, x, propagate_nan=tl.PropagateNan.ALL)
            xv = tl.where(valid, x, NEG_INF)
            sub_max = tl.max(xv, 1)
            slot = start // SUB + subs
            tl.store(max_table_ptr + table_row + slot, sub_max, mask=slot < n_sub)
            if need_mass:
                ref = tl.where(sub_max > NEG_INF, sub_max, 0.0)
                w = tl.exp2(tl.maximum((xv - ref[:, None]) * LOG2E, U_FLOOR))
                tl.store(mass_table_ptr + table_row + slot, tl.sum(w, 1), mask=slot < n_sub)
        has_nan = tl.max(tl.max((nan_acc != nan_acc).to(tl.int32), 1), 0) != 0
        tl.store(has_nan_ptr + row, has_nan)


@triton.jit
def _search_kernel(
    logits_ptr, row_stride,
    row_request_ptr, row_position_ptr,
    temperature_ptr, inv_t_ptr, seeds_ptr, draws_ptr,
    top_k_ptr, top_p_ptr,
    allowed_ptr, allowed_stride, column_tokens_ptr,
    max_table_ptr, mass_table_ptr, table_stride,   # from the scan kernel
    cand_ptr, subs_ptr,                       # scratch per program: [CAP] int64, [NSUB_PAD] int32
    threshold_ptr, done_ptr,                  # [N] fp32, [N] int8
    argmax_ptr, sample_ptr, entropy_ptr, lse_ptr, sample_key_ptr,
    n_rows, vocab, vocab_offset,
    SOFTCAP: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
    HAS_ALLOWED: tl.constexpr, HAS_COLUMN_TOKENS: tl.constexpr,
    HAS_SAMPLE_KEY: tl.constexpr, SAMPLE_BLOCK: tl.constexpr,
    SUB: tl.constexpr, TILE: tl.constexpr, GROUP: tl.constexpr, NSUB_PAD: tl.constexpr,
    CAP: tl.constexpr, PIVOTS: tl.constexpr, MAX_ROUNDS: tl.constexpr,
    TABLE_WAYS: tl.constexpr, STATS_BC: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Steps 2 and 3 per row (persistent programs: the candidate scratch is per program).

    Two phases share one copy of the code: phase 0 finds t_k (F = count, target k), phase 1
    t_p (F = mass over K, target p * mass(K)).
    """
    pid = tl.program_id(0)
    cand_ptr += pid.to(tl.int64) * CAP
    subs_ptr += pid.to(tl.int64) * NSUB_PAD
    n_sub = tl.cdiv(vocab, SUB)
    slot_t = tl.arange(0, NSUB_PAD)
    slot_c = tl.arange(0, CAP)
    for row in range(pid, n_rows, tl.num_programs(0)):
        request = tl.load(row_request_ptr + row).to(tl.int64)
        k, p, k_on, p_on = _request_top_k_top_p(top_k_ptr, top_p_ptr, request, vocab, HAS_TOP_K,
                                                HAS_TOP_P)
        # int64 row offset; (0 + row) instead of tl.to_tensor, which triton 3.6 lacks.
        row64 = tl.zeros((), tl.int64) + row
        row_ptr = logits_ptr + row64 * row_stride
        allowed_row = allowed_ptr + request * allowed_stride
        table_ptr = max_table_ptr + row64 * table_stride
        thr = tl.full((), NEG_INF, tl.float32)
        done = tl.full((), 0, tl.int32)
        if k_on | p_on:
            maxima = tl.load(table_ptr + slot_t, mask=slot_t < n_sub, other=NEG_INF)
            m1 = tl.max(maxima, 0)
            z1 = tl.full((), 0.0, tl.float64)  # mass of the row (relative to m1)
            if p_on & ~k_on & (m1 > NEG_INF) & (m1 < POS_INF):
                masses = tl.load(mass_table_ptr + row64 * table_stride + slot_t,
                                 mask=slot_t < n_sub, other=0.0)
                scale = tl.exp2(tl.maximum((maxima - m1) * LOG2E, U_FLOOR))
                z1 = tl.sum((masses * scale).to(tl.float64), 0)
            # The row's count, minimum and largest finite value: only after a range pass.
            ranged = tl.full((), 0, tl.int32)
            n_valid = tl.full((), 0, tl.int32)
            x_min = tl.full((), POS_INF, tl.float32)
            top = m1
            if m1 == POS_INF:
                n_valid, x_min, top, _ = _range_pass(row_ptr, allowed_row, vocab, m1, SOFTCAP,
                                                     HAS_ALLOWED, TILE)
                ranged = tl.full((), 1, tl.int32)

            t_k = tl.full((), NEG_INF, tl.float32)
            t_p = tl.full((), NEG_INF, tl.float32)
            w_k = z1                           # mass of K (what top-k kept)
            n_k = tl.full((), 0, tl.int32)     # entries in K, when k_found
            k_found = tl.full((), 0, tl.int32)
            k_full = tl.full((), 0, tl.int32)  # all of K sits sorted in the candidate buffer
            last_hi = tl.full((), POS_INF, tl.float32)
            last_n = tl.full((), CAP + 1, tl.int32)
            values = tl.full([CAP], NEG_INF, tl.float32)
            ids = tl.zeros([CAP], tl.int32)
            present = tl.zeros([CAP], tl.int1)
            w_cand = tl.zeros([CAP], tl.float64)
            for phase in range(2):
                is_mass = phase == 1
                if tl.where(is_mass, p_on & (m1 > NEG_INF), k_on):
                    if is_mass & (m1 == POS_INF):
                        # +inf logits: the oracle's fp64 softmax is NaN -> 0 everywhere, so
                        # top-p keeps everything; its threshold is the smallest kept value
                        # (-inf when anything is masked).
                        size_k = tl.where(k_found != 0, n_k, n_valid)
                        t_p = tl.where(size_k < vocab, NEG_INF, tl.where(k_found != 0, t_k, x_min))
                    elif is_mass & (k_full != 0):
                        # all of K is sorted in registers already
                        kept_k = present & (values >= t_k)
                        cum = tl.cumsum(tl.where(kept_k, w_cand, 0.0), 0)
                        t_p = _at(values, _first_reaching(cum, p.to(tl.float64) * w_k, kept_k, CAP), CAP)
                    else:
                        target = tl.where(is_mass, p.to(tl.float64) * w_k, k.to(tl.float64))
                        # lower bounds from the table: the k-th largest sub-block maximum is at
                        # most the k-th largest value; the sub-block maxima >= v carry at
                        # least their own mass
                        if is_mass:
                            tw = tl.where(maxima >= t_k,
                                          tl.exp2(tl.maximum((maxima - m1) * LOG2E, U_FLOOR)), 0.0)
                            lo = _largest_reaching(maxima, tw.to(tl.float64), target, TABLE_WAYS)
                            lo = tl.maximum(lo, t_k)
                        else:
                            lo = _largest_reaching(maxima, tl.full(maxima.shape, 1, tl.int32), k,
                                                   TABLE_WAYS)
                        if (lo == NEG_INF) & (ranged == 0):
                            n_valid, x_min, top, z1_row = _range_pass(row_ptr, allowed_row, vocab, m1,
                                                                      SOFTCAP, HAS_ALLOWED, TILE)
                            z1 = z1_row.to(tl.float64)
                            ranged = tl.full((), 1, tl.int32)
                        if lo == NEG_INF:
                            lo = x_min  # no bound from the table: start from the whole row
                        n = tl.full((), 0, tl.int32)
                        if lo > NEG_INF:
                            q = _reaching(maxima, lo, subs_ptr, INTERPRET)
                            n = _collect(row_ptr, allowed_row, subs_ptr, q, cand_ptr, vocab, lo,
                                         POS_INF, SOFTCAP, HAS_ALLOWED, SUB, GROUP, CAP, INTERPRET)
                        if (n > CAP) & (ranged == 0):
                            n_valid, x_min, top, z1_row = _range_pass(row_ptr, allowed_row, vocab, m1,
                                                                      SOFTCAP, HAS_ALLOWED, TILE)
                            z1 = z1_row.to(tl.float64)
                            ranged = tl.full((), 1, tl.int32)
                        if (lo > NEG_INF) & (is_mass | (n >= k)):
                            hi = tl.full((), POS_INF, tl.float32)
                            c_hi = tl.full((), 0, tl.int32)
                            w_hi = tl.full((), 0.0, tl.float64)
                            if n > CAP:
                                lo, hi, c_hi, w_hi, n = _bracket_search(
                                    row_ptr, allowed_row, subs_ptr, maxima, cand_ptr, vocab, lo, n,
                                    target, m1, top, is_mass, SOFTCAP, HAS_ALLOWED, SUB, GROUP,
                                    CAP, PIVOTS, MAX_ROUNDS, INTERPRET)
                            t = lo  # more than CAP entries tie at lo
                            if n <= CAP:
                                tl.debug_barrier()
                                values, ids, present = _sorted_candidates(cand_ptr, n, CAP)
                                w_cand = tl.where(present,
                                                  tl.exp2(tl.maximum((values - m1) * LOG2E, U_FLOOR)),
                                                  0.0).to(tl.float64)
                                cum = tl.where(is_mass, w_hi + tl.cumsum(w_cand, 0),
                                               (c_hi + slot_c + 1).to(tl.float64))
                                t = _at(values, _first_reaching(cum, target, present, CAP), CAP)
                            last_hi = hi
                            last_n = n
                            if is_mass:
                                t_p = t
                            else:
                                t_k = t
                                k_found = tl.full((), 1, tl.int32)
                                if n <= CAP:
                                    w_k = w_hi + tl.sum(tl.where(values >= t_k, w_cand, 0.0), 0)
                                    n_k = c_hi + tl.sum((present & (values >= t_k)).to(tl.int32), 0)
                                    k_full = (hi == POS_INF).to(tl.int32)
                                else:
                                    # ties beyond CAP: one pass for the size and mass of K
                                    cnt_k, mass_k = _pivot_pass(
                                        row_ptr, allowed_row, subs_ptr,
                                        _reaching(maxima, t_k, subs_ptr, INTERPRET), vocab,
                                        t_k, POS_INF, tl.zeros([PIVOTS], tl.float32) + t_k, m1,
                                        SOFTCAP, HAS_ALLOWED, SUB, PIVOTS)
                                    w_k = tl.max(mass_k, 0).to(tl.float64)
                                    n_k = tl.max(cnt_k, 0)
                        elif ~is_mass:
                            w_k = z1  # fewer than k entries: t_k = -inf, K is the whole row
            thr = tl.maximum(t_k, t_p)
            # The candidates hold every kept entry when the last collection was unbounded
            # above and reached down to the threshold.
            covered = (last_hi == POS_INF) & (last_n <= CAP) & (thr > NEG_INF)
            if covered:
                done = tl.full((), 1, tl.int32)
                _candidate_stats(values, ids, present, thr, row, request, row_position_ptr,
                                 temperature_ptr, inv_t_ptr, seeds_ptr, draws_ptr, column_tokens_ptr,
                                 argmax_ptr, sample_ptr, entropy_ptr, lse_ptr, sample_key_ptr,
                                 vocab, vocab_offset, HAS_COLUMN_TOKENS, HAS_SAMPLE_KEY,
                                 SAMPLE_BLOCK, CAP, STATS_BC)
        tl.store(threshold_ptr + row, thr)
        tl.store(done_ptr + row, done.to(tl.int8))


@triton.jit
def _candidate_stats(values, ids, present, thr, row, request, row_position_ptr,
                     temperature_ptr, inv_t_ptr, seeds_ptr, draws_ptr, column_tokens_ptr,
                     argmax_ptr, sample_ptr, entropy_ptr, lse_ptr, sample_key_ptr,
                     vocab, vocab_offset, HAS_COLUMN_TOKENS: tl.constexpr,
                     HAS_SAMPLE_KEY: tl.constexpr, SAMPLE_BLOCK: tl.constexpr, CAP: tl.constexpr,
                     BC: tl.constexpr):
    """Row statistics of a row whose kept entries are all among the sorted candidates.

    The sample follows the reference's two stages. Stage a needs the mass of every sampling
    block among the candidates: ``BC`` blocks at a time, a [BC, CAP] compare-and-sum (no
    loop over candidates, a fixed summation order, so the result is deterministic); the
    masses are relative to the row maximum (a block that underflows there is ~87 nats down
    and can never win). Stage b is the Gumbel-max over the winning block's candidates.
    """
    kept = present & (values >= thr)
    z = tl.where(kept, scaled(values, tl.load(inv_t_ptr + request)), NEG_INF)
    m = tl.max(z, 0)
    arg = tl.min(tl.where(z == m, ids, NO_INDEX), 0)
    u = tl.maximum((z - m) * LOG2E, U_FLOOR)
    e = tl.exp2(u)
    rest = tl.sum(tl.where(ids == arg, 0.0, e), 0)
    entropy, lse = finish_stats(m, rest, tl.sum(u * e, 0))
    chosen = arg
    best = tl.full((), NEG_INF, tl.float32)
    sampling = tl.load(temperature_ptr + request) != 0.0
    if sampling & (m > NEG_INF):
        seed = tl.load(seeds_ptr + request)
        draw = tl.load(draws_ptr + request)
        position = tl.load(row_position_ptr + row)
        lead = (vocab_offset % SAMPLE_BLOCK).to(tl.int32)
        first_block = vocab_offset // SAMPLE_BLOCK
        block = (ids + lead) // SAMPLE_BLOCK  # sampling block, counted from the slice's first
        e_kept = tl.where(kept, e, 0.0)
        n_blocks = (lead + vocab + SAMPLE_BLOCK - 1) // SAMPLE_BLOCK
        block_key = kn.row_key(seed, draw, position, BLOCK_STREAM)
        best_block = tl.full((), 0, tl.int32)
        for c in range(0, n_blocks, BC):
            bids = c + tl.arange(0, BC)
            mass = tl.sum(tl.where(block[None, :] == bids[:, None], e_kept[None, :], 0.0), 1)
            keys = m + tl.log(mass) + kn.gumbel(kn.token_bits(block_key, bids + first_block))
            keys = tl.where((mass > 0) & (bids < n_blocks), keys, NEG_INF)
            top_key = tl.max(keys, 0)
            if top_key > best:  # chunks come in increasing order: ties keep the lowest
                best = top_key
                best_block = tl.min(tl.where(keys == top_key, bids, NO_INDEX), 0)
        key = kn.row_key(seed, draw, position, GUMBEL_STREAM)
        if HAS_COLUMN_TOKENS:
            token = tl.load(column_tokens_ptr + ids, mask=kept, other=0)
        else:
            token = ids + vocab_offset
        noisy = tl.where(block == best_block, z + kn.gumbel(kn.token_bits(key, token)), NEG_INF)
        top = tl.max(noisy, 0)
        chosen = tl.min(tl.where(noisy == top, ids, NO_INDEX), 0)
    if HAS_COLUMN_TOKENS:
        argmax_token = tl.load(column_tokens_ptr + arg)
        sample_token = tl.load(column_tokens_ptr + chosen)
    else:
        argmax_token = arg.to(tl.int64) + vocab_offset
        sample_token = chosen.to(tl.int64) + vocab_offset
    tl.store(argmax_ptr + row, argmax_token)
    tl.store(sample_ptr + row, sample_token)
    tl.store(entropy_ptr + row, entropy)
    tl.store(lse_ptr + row, lse)
    if HAS_SAMPLE_KEY:
        tl.store(sample_key_ptr + row, best)


def _programs(n_rows: int, device: torch.device, per_sm: int) -> int:
    """Persistent grid: a few programs per SM, each walking rows (scratch is per program)."""
    if device.type != "cuda":
        return max(1, min(n_rows, 4))
    return max(1, min(n_rows, per_sm * contract.sm_count(device)))


def threshold_rows(logits, row_request, row_position, temperature, inv_t, seeds, draws, out, *,
                   softcap: float, top_k, top_p, allowed, vocab_offset: int, column_tokens,
                   sample_block: int, sample_key=None,
                   sub: int = 256, scan_tile: int = 2048, scan_warps: int = 4, scan_stages: int = 4,
                   tile: int = 2048, group: int = 4, cap: int = 128, pivots: int = 16,
                   num_warps: int = 2, programs_per_sm: int = 10, maxnreg="auto",
                   table_ways: int = 4, stats_blocks: int = 64):
    """Fill ``out.threshold``; finish the statistics of rows whose kept set is small.

    Returns the int8 ``done`` flags ([N]) that tell ``row_stats`` which rows are finished.
    ``temperature`` / ``inv_t`` are fp32 per request (already prepared by ``row_stats_rows``).
    Scratch: the sub-block tables ([N, V / sub] fp32, twice with top-p: 4 MiB per 1024 rows
    at V = 262144) and a candidate buffer per search program.

    Search defaults (timed with top-k 50 and top-p 0.9; ``docs/performance-history.md``). The
    search is bound by its latency per row, so the defaults put more rows in flight and shorten
    each row's chain of dependent steps:

    * 2 warps per row and 10 programs per SM. With more rows than fit uncapped (4 programs per
      SM), ``maxnreg="auto"`` caps the registers at 96: it spills, but more programs hide more
      latency. With fewer rows each program's latency is all there is, and they run uncapped
      (at the cost of some latency per row against 4 warps per row).
    * a 128-entry candidate buffer: its sort is half the size of a 256-entry one; rows with
      more candidates (k above about 100) take the pivot passes.
    * the sampling-block masses of the candidates weighed 64 blocks at a time, in one
      [64, CAP] reduction instead of 8 dependent ones of 8 blocks.
    * the table search with 4 pivots per round (16 spill badly; 2 and 8 are slower).

    The register cap, the pivots per round, the collection tile and the programs per SM change
    no bit; the sampling blocks per reduction and the warps per row change only the rounding
    of sums (``test_gpu_search_config_changes_no_bit``). The warps per row are fixed, not
    chosen by the number of rows: a request's bits may not depend on how the batch is tiled.
    """
    n_rows, vocab = logits.shape
    dev = logits.device
    n_sub = triton.cdiv(vocab, sub)
    # keep the per-row table (registers of the search) small for huge vocabularies
    while triton.next_power_of_2(n_sub) > 4096:
        sub *= 2
        n_sub = triton.cdiv(vocab, sub)
    scan_tile, tile = max(scan_tile, sub), max(tile, sub)
    nsub_pad = max(triton.next_power_of_2(n_sub), 2)
    if table_ways < 2 or table_ways & (table_ways - 1):
        raise ValueError(f"table_ways must be a power of two >= 2, got {table_ways}")
    if stats_blocks < 1 or stats_blocks & (stats_blocks - 1):
        raise ValueError(f"stats_blocks must be a power of two, got {stats_blocks}")
    max_table = torch.empty(n_rows, n_sub, dtype=torch.float32, device=dev)
    mass_table = torch.empty_like(max_table) if top_p is not None else max_table
    done = torch.empty(n_rows, dtype=torch.int8, device=dev)
    top_k64 = top_k.to(torch.int64) if top_k is not None else seeds
    top_p32 = top_p.to(torch.float32) if top_p is not None else temperature
    allowed_arg = allowed if allowed is not None else logits
    allowed_stride = allowed.stride(0) if allowed is not None else 0
    flags = dict(SOFTCAP=softcap, HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None,
                 HAS_ALLOWED=allowed is not None)
    _scan_kernel[(n_rows,)](
        logits, logits.stride(0), row_request, top_k64, top_p32, allowed_arg, allowed_stride,
        max_table, mass_table, n_sub, out.has_nan, vocab,
        SUB=sub, TILE=scan_tile, NUM_STAGES=scan_stages, num_warps=scan_warps, **flags,
    )
    if maxnreg == "auto":
        # uncapped (up to 255 registers) only while one program per row, at that size, all
        # fit on the chip at once
        uncapped_per_sm = max(1, 65536 // (256 * 32 * num_warps))
        many_rows = dev.type == "cuda" and n_rows > uncapped_per_sm * contract.sm_count(dev)
        maxnreg = 96 if many_rows else None
    programs = _programs(n_rows, dev, programs_per_sm)
    cand = torch.empty(programs, cap, dtype=torch.int64, device=dev)
    subs = torch.empty(programs, nsub_pad, dtype=torch.int32, device=dev)
    _search_kernel[(programs,)](
        logits, logits.stride(0),
        row_request, row_position,
        temperature, inv_t, seeds, draws,
        top_k64, top_p32,
        allowed_arg, allowed_stride,
        column_tokens if column_tokens is not None else seeds,
        max_table, mass_table, n_sub,
        cand, subs,
        out.threshold, done,
        out.argmax, out.sample, out.entropy, out.lse,
        sample_key if sample_key is not None else out.lse,
        n_rows, vocab, vocab_offset,
        HAS_COLUMN_TOKENS=column_tokens is not None,
        HAS_SAMPLE_KEY=sample_key is not None, SAMPLE_BLOCK=sample_block,
        SUB=sub, TILE=tile, GROUP=group, NSUB_PAD=nsub_pad, CAP=cap, PIVOTS=pivots,
        MAX_ROUNDS=40, TABLE_WAYS=table_ways, STATS_BC=stats_blocks, INTERPRET=interpreting(),
        num_warps=num_warps, **flags,
        **({"maxnreg": maxnreg} if maxnreg and dev.type == "cuda" else {}),
    )
    return done
