"""The soft embedding over each row's probability support: which rows may skip the dense GEMM.

The self-conditioning soft embedding of a row is ``normalizer * sum_v p_v E[v]``. Leaving out
a set of tokens of total mass ``m`` changes every component by at most
``m * normalizer * max_v |E[v]|_inf``. So for a tolerance ``eps`` a row whose mass sits, up to
``eps``, on a support S of at most ``K`` tokens (``max_support``) is computed as the gather
``normalizer * sum_{v in S} p_v E[v]`` (not renormalised), every other row by the dense GEMM.
This module is the PyTorch oracle of that decision and of the gather; the Triton twins are
``kernels/soft_embedding_support.py`` and ``kernels/soft_embedding_gather.py``.

Probabilities are those of the dense path: ``z`` softcapped, masked (NaN, ``-inf``, below the
top-k/top-p threshold, outside the allowed set) and scaled exactly as in ``reference.py``,
``p_v = exp(z_v - lse)`` with the row-statistics ``lse``. Per row, three tiers, no sort and no
host synchronisation:

1. Free (needs ``argmax``): ``p_top = exp(z_argmax - lse)``; if ``1 - p_top <= eps`` then
   S = {argmax}. Not for greedy rows (T = 0), whose fp32 ``lse`` cannot tell k tied maxima
   from one: they go to tier 3, which finds the ties.
2. Free filters: a row whose entropy exceeds ``entropy_skip(eps, K, V)`` (needs ``entropy``;
   Fano-style bound, see ``entropy_skip``) or whose top probability is below ``(1 - eps) / K``
   (needs ``argmax``: K tokens holding ``1 - eps`` hold one of at least that) cannot have such
   a support: dense, no pass.
3. Support pass: every kept entry goes to a bin ``j = floor(-4 log2 p_v)`` (4 bins per octave,
   ``NUM_BINS - 1`` of them, the last one lumping everything below ``2^-63.5``); a token in
   bin j has ``p_v <= 2^(-j/4)``. The tail bound of a cut c is ``sum_{j >= c} count_j 2^(-j/4)``,
   summed exactly in 2^-56 fixed point with every weight rounded up (each term saturated at
   ``budget + 1``, which no cut can include: int64 cannot overflow); the cut is the smallest c
   whose bound is ``<= eps`` and S the tokens of the bins below it, in vocabulary order,
   except that the cut may sit no lower than level ``eps / K`` (``lowest_cut``, bin J).
   ``|S| <= K``: sparse, else dense. A bin's bound is within a factor 2^(1/4) of its mass, so
   a sparse row's S is no larger than the minimal set of tolerance ``eps / 2^(1/4)`` up to the
   tokens of one bin (tested, not a theorem).

   The lowest cut is what makes the pass cheap: only the "candidates" above that level need
   their own bins (a peaked row has a handful), everything below adds to one sum. A row that
   would need a lower cut has a tail bound at J within about ``(eps, 2 eps]`` (its S holds at
   most K tokens of at most ``eps / K`` each below J): it goes dense. And a sparse row has
   fewer than ``2K`` candidates: each candidate left in the tail weighs more than ``eps / K``,
   so fewer than K of them fit in the budget. So a row with more than ``2K`` candidates is
   dense without finding its cut, and the kernel stops reading it there; likewise once the sum
   below J alone passes the budget (a row with a heavy tail: no cut at or above J fits).

fp32 rounding: the bins are computed against ``lse - d`` with ``d = (|lse| + 16) 2^-17``,
which exceeds the fp32 error of ``lse`` and of the bin arithmetic, so every token's bin bound
holds for its exact probability; tier 1 uses ``lse + d``. Greedy rows take ``d = 0``: their
probabilities are, by definition (and on the dense path), 1 for each tied maximum and 0 else.

Tensor parallelism: the decision is local to a vocabulary slice (``vocab_start``, ``v_local``)
and ``eps`` is that slice's budget; a caller that all-reduces slices passes ``eps / world``
to each, so the excluded mass of the sum stays ``<= eps``. Tier 1 needs the argmax's logit,
so it applies only on the slice that holds it (the others find an empty or small S in tier 3).

Path codes per row (``PATH_*``): not kept, sparse by tier 1, sparse by the pass, dense by the
tier-2 filters, dense by the support size. Rows whose ``lse`` is not finite (nothing kept)
are sparse with an empty S, i.e. zero, as on the dense path. ``count`` is |S| for sparse rows
and, for rows dense by the pass, the number of candidates capped at ``2K + 1`` (a lower
bound of |S| where the row has no cut), or ``2K + 1`` where the sum below J alone passes the
budget (so that it does not depend on where the kernel stopped reading).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from . import reference
from .kernels.contract import (  # noqa: F401 (PATH_*, NUM_PATHS, MAX_SUPPORT: re-exported)
    LSE_MARGIN_OFFSET,
    LSE_MARGIN_SCALE,
    MAX_SUPPORT,
    MIN_TAIL_EPS,
    NUM_PATHS,
    PATH_NOT_KEPT,
    PATH_STATS_DENSE,
    PATH_SUPPORT,
    PATH_SUPPORT_DENSE,
    PATH_TOP1,
    check_tail_eps,
)

NUM_BINS = 256  # 255 bins of a quarter octave, then one for masked entries (weight 0)
BINS_PER_OCTAVE = 4
FIXED_BITS = 56  # tail bounds in units of 2^-56 (each term saturated at budget + 1: no overflow)

LOG2E = 1.4426950408889634


def _ceil_root4(n: int) -> int:
    r = math.isqrt(math.isqrt(n))
    while r**4 < n:
        r += 1
    return r


def default_bin_weights(device: torch.device | str = "cpu") -> torch.Tensor:
    """``[NUM_BINS]`` int64: ``ceil(2^(56 - j/4))`` (exact integer root), 0 for the masked bin."""
    w = [_ceil_root4(2 ** (4 * FIXED_BITS - j)) if j <= 4 * FIXED_BITS else 1
         for j in range(NUM_BINS - 1)] + [0]
    return torch.tensor(w, dtype=torch.int64, device=device)


_WEIGHTS: dict[str, torch.Tensor] = {}


def weights_on(device: torch.device) -> torch.Tensor:
    """``default_bin_weights`` on ``device``, built once per device (the runner builds it at
    set-up, outside any CUDA graph capture)."""
    key = str(device)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = default_bin_weights(device)
    return _WEIGHTS[key]


def slice_tail_eps(tail_eps: float, share: float) -> float:
    """The tolerance of a vocabulary slice holding ``share`` of the budget (a tensor-parallel
    rank: ``1 / world`` or ``V_local / V``), so that the slices' excluded mass adds up to at most
    ``tail_eps``; 0 (the dense path) where that falls below ``MIN_TAIL_EPS``."""
    eps = tail_eps * share
    return eps if eps >= MIN_TAIL_EPS else 0.0


@functools.cache  # exact rational arithmetic, asked on every step
def lowest_cut(tail_eps: float, max_support: int) -> int:
    """J, the lowest bin a cut may sit at: the smallest j with ``2^(-j/4) <= eps / K``, exact
    (eps is a binary fraction), at most ``NUM_BINS - 2``. Tokens in bins below J are the
    candidates of the support pass."""
    q = (Fraction(max_support) / Fraction(tail_eps)) ** BINS_PER_OCTAVE
    j = max(0, q.numerator.bit_length() - q.denominator.bit_length() - 1)
    while (q.denominator << j) < q.numerator:
        j += 1
    return min(j, NUM_BINS - 2)


def tail_budget(tail_eps: float) -> int:
    """``eps`` in 2^-56 units, rounded down (exact: eps times a power of two)."""
    return math.floor(tail_eps * 2.0**FIXED_BITS)


def entropy_skip(tail_eps: float, max_support: int, vocab_size: int) -> float:
    """Entropy (nats) above which no distribution over ``vocab_size`` tokens puts mass
    ``>= 1 - eps`` on ``<= max_support`` tokens; ``inf`` where no such bound exists.

    For S with ``|S| <= K`` and mass ``a = P(S) >= 1 - eps``, the chain rule over the partition
    {S, not S} gives ``H = H_b(a) + a H(p | S) + (1 - a) H(p | not S)
    <= H_b(a) + a ln K + (1 - a) ln(V - K) =: f(a)``. ``f'(a) = ln((1 - a) / a) + ln(K / (V - K))``
    is negative for ``a > K / V``, so when ``1 - eps > K / V`` the maximum over
    ``a in [1 - eps, 1]`` is at ``a = 1 - eps``: ``H_b(1 - eps) + (1 - eps) ln K + eps ln(V - K)``.
    (Masked tokens only lower the bound, so V may be the whole vocabulary.)
    """
    k, n, eps = max_support, vocab_size, tail_eps
    if eps <= 0 or k < 1 or 1 - eps <= k / n:
        return math.inf
    a = 1.0 - eps
    h_b = -a * math.log(a) - eps * math.log(eps)
    return h_b + a * math.log(k) + eps * math.log(n - k)


@functools.cache  # pure in its arguments, asked on every step
def entropy_skip_f32(tail_eps: float, max_support: int, vocab_size: int) -> float:
    """``entropy_skip`` rounded up to an fp32 value (what the kernel compares against)."""
    h = entropy_skip(tail_eps, max_support, vocab_size)
    if math.isinf(h):
        return h
    t = torch.tensor(h, dtype=torch.float32)
    if float(t) < h:
        t = torch.nextafter(t, torch.tensor(math.inf))
    return float(t)


@dataclass
class Support:
    """Per-row decision: ``path`` [N] int8 (``PATH_*``), ``count`` [N] int32 (|S| of sparse
    rows; for rows dense by the pass the candidates, at most ``2K + 1``, and ``2K + 1`` where
    the mass below the lowest cut alone passes ``eps``; -1 where no pass ran:
    not kept, filtered), ``ids`` [N, K] int32 (S's columns relative to
    ``vocab_start`` in vocabulary order for sparse rows, -1 padded), ``rows`` [NUM_PATHS] int64
    the rows per path where the support pass counted them (else ``path_rows`` counts)."""

    path: torch.Tensor
    count: torch.Tensor
    ids: torch.Tensor
    rows: torch.Tensor | None = None

    def sparse(self) -> torch.Tensor:
        return (self.path == PATH_TOP1) | (self.path == PATH_SUPPORT)

    def dense(self) -> torch.Tensor:
        return self.path >= PATH_STATS_DENSE  # the two dense codes are the largest: one op

    def path_rows(self) -> torch.Tensor:
        """``[NUM_PATHS]`` int64 row counts per path, on the device (no sync)."""
        if self.rows is not None:
            return self.rows
        return add_path_rows(torch.zeros(NUM_PATHS, dtype=torch.int64, device=self.path.device),
                             self.path)


def add_path_rows(rows: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """``rows`` ([NUM_PATHS] int64) plus the rows of each path code in ``path``, in place."""
    # (torch.bincount would ask the device for the largest value: a host sync)
    return rows.index_add_(0, path.to(torch.int64), torch.ones_like(path, dtype=torch.int64))


def lse_margin(lse: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """``d = (|lse| + 16) 2^-17`` (fp32), 0 for greedy rows and rows without a finite lse."""
    d = (lse.abs() + LSE_MARGIN_OFFSET) * LSE_MARGIN_SCALE
    return torch.where(greedy | ~torch.isfinite(lse), 0.0, d)


def support_rows(
    logits: torch.Tensor,
    row_request: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    *,
    tail_eps: float,
    bin_weights: torch.Tensor | None = None,
    budget: int | None = None,
    lowest: int | None = None,
    v_local: int | None = None,
    vocab_start: int = 0,
    max_support: int = MAX_SUPPORT,
    keep: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    softcap: float | None = None,
    argmax: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    entropy_bound: float = math.inf,
    chunk_rows: int = 64,
    inv_t: torch.Tensor | None = None,
    path_rows: torch.Tensor | None = None,
) -> Support:
    """Reference support decision over flat rows (module docstring), for the logits columns
    ``[vocab_start, vocab_start + v_local)``. ``argmax`` [N] int64 (column ids) enables tier 1,
    ``entropy`` [N] fp32 with ``entropy_bound`` (``entropy_skip_f32``) tier 2. ``bin_weights``
    ``budget`` and ``lowest`` default to ``default_bin_weights()``, ``tail_budget(tail_eps)`` and
    ``lowest_cut(tail_eps, max_support)``. ``inv_t``: ``reference.inverse_temperature(temperature)``
    where the caller has it; ``path_rows`` ([NUM_PATHS] int64), when given, gets the rows of
    each path added to it."""
    n_rows, vocab = logits.shape
    v_local = vocab - vocab_start if v_local is None else v_local
    dev = logits.device
    k = max_support
    path = torch.full((n_rows,), PATH_SUPPORT, dtype=torch.int8, device=dev)
    count = torch.full((n_rows,), -1, dtype=torch.int32, device=dev)
    ids = torch.full((n_rows, k), -1, dtype=torch.int32, device=dev)
    if inv_t is None:
        inv_t = reference.inverse_temperature(temperature)
    greedy_req = temperature.to(torch.float32) == 0
    weights = bin_weights.to(dev) if bin_weights is not None else default_bin_weights(dev)
    budget = tail_budget(tail_eps) if budget is None else budget
    lowest = lowest_cut(tail_eps, k) if lowest is None else lowest
    cols = slice(vocab_start, vocab_start + v_local)
    local = torch.arange(v_local, device=dev, dtype=torch.int32)
    for r0 in range(0, n_rows, chunk_rows):
        r1 = min(r0 + chunk_rows, n_rows)
        req = row_request[r0:r1].to(torch.int64)
        row_lse = lse[r0:r1]
        greedy = greedy_req[req]
        finite = torch.isfinite(row_lse)
        d = lse_margin(row_lse, greedy)
        x = reference.softcapped(logits[r0:r1, cols], softcap)
        thr = threshold[r0:r1] if threshold is not None else torch.full_like(row_lse, -math.inf)
        masked = torch.isnan(x) | (x == -math.inf) | (x < thr.unsqueeze(1))
        if allowed is not None:
            masked |= ~allowed[req][:, cols]
        z = torch.clamp(x * inv_t[req].unsqueeze(1), max=reference.FLT_MAX)
        # tier 3: bins against lse - d
        u4 = (z - (row_lse - d).unsqueeze(1)) * (BINS_PER_OCTAVE * LOG2E)
        b = torch.clamp(torch.floor(-u4), 0, NUM_BINS - 2)
        b = torch.where(masked | torch.isnan(b), NUM_BINS - 1, b).to(torch.int64)
        counts = torch.zeros(r1 - r0, NUM_BINS, dtype=torch.int64, device=dev)
        counts.scatter_add_(1, b, torch.ones_like(b))
        # Saturated terms: a count past budget // w_j + 1 already puts its bin over the budget,
        # and a term past budget + 1 already fails every cut that includes it. So the cut is
        # unchanged and no product or sum overflows int64 (<= NUM_BINS (budget + 1) < 2^61),
        # e.g. 200 tied maxima of a greedy row in bin 0 (weight 2^56).
        t = (torch.minimum(counts, budget // weights.clamp(min=1) + 1) * weights).clamp(max=budget + 1)
        suffix = t.flip(1).cumsum(1).flip(1)  # sum_{j >= c} count_j w_j, exact
        js = torch.arange(NUM_BINS, device=dev)
        # the smallest cut at or above the lowest allowed one (NUM_BINS: none)
        cut = torch.where((suffix <= budget) & (js <= lowest), js, NUM_BINS).min(dim=1).values
        in_s = b < cut.unsqueeze(1)
        size = in_s.sum(dim=1)
        candidates = (b < lowest).sum(dim=1)
        sparse = (cut < NUM_BINS) & (size <= k) & (candidates <= 2 * k)
        rows_path = torch.where(sparse, PATH_SUPPORT, PATH_SUPPORT_DENSE)
        # a dense row: its candidates (at most 2K + 1), or 2K + 1 if the sum below the lowest
        # cut alone passes the budget (the kernel may stop reading it there)
        low_over = suffix[:, lowest] > budget
        dense_count = torch.where(low_over, 2 * k + 1, candidates.clamp(max=2 * k + 1))
        rows_count = torch.where(sparse, size, dense_count).to(torch.int32)
        # tier 2
        filt = torch.zeros_like(finite)
        if entropy is not None:
            filt = entropy[r0:r1] > torch.tensor(entropy_bound, dtype=torch.float32)
        # tier 1 (and the top-probability filter of tier 2)
        top1 = torch.zeros_like(finite)
        if argmax is not None:
            a = argmax[r0:r1].to(torch.int64)
            here = (a >= vocab_start) & (a < vocab_start + v_local)
            a_loc = (a - vocab_start).clamp(0, max(v_local - 1, 0))
            z_a = z.gather(1, a_loc.unsqueeze(1)).squeeze(1) if v_local else torch.zeros_like(row_lse)
            tail1 = 1.0 - torch.exp2((z_a - (row_lse + d)) * LOG2E) + 2.0**-20
            top1 = here & ~greedy & finite & (tail1 <= tail_eps)
            p_hi = torch.exp2((z_a - (row_lse - d)) * LOG2E)
            filt |= here & finite & (p_hi < torch.tensor((1.0 - tail_eps) / k, dtype=torch.float32))
        rows_path = torch.where(filt, PATH_STATS_DENSE, rows_path)
        rows_count = torch.where(filt, -1, rows_count)
        if argmax is not None:
            rows_path = torch.where(top1, PATH_TOP1, rows_path)
            rows_count = torch.where(top1, 1, rows_count)
        rows_path = torch.where(finite, rows_path, PATH_TOP1)
        rows_count = torch.where(finite, rows_count, 0)
        if keep is not None:
            kept = keep[r0:r1]
            rows_path = torch.where(kept, rows_path, PATH_NOT_KEPT)
            rows_count = torch.where(kept, rows_count, -1)
        path[r0:r1] = rows_path.to(torch.int8)
        count[r0:r1] = rows_count.to(torch.int32)
        # S's columns in vocabulary order: the position of each member is its rank in the row.
        # Fixed shapes (no host sync): entries not written go to a spare column K, dropped.
        write = in_s & (rows_path == PATH_SUPPORT).unsqueeze(1)
        pos = torch.where(write, in_s.cumsum(1) - 1, k)
        row_ids = torch.full((r1 - r0, k + 1), -1, dtype=torch.int32, device=dev)
        row_ids.scatter_(1, pos, local.expand(r1 - r0, -1).contiguous())
        row_ids = row_ids[:, :k]
        if argmax is not None:
            first = top1 & (rows_path == PATH_TOP1)
            row_ids[:, 0] = torch.where(first, a_loc.to(torch.int32), row_ids[:, 0])
        ids[r0:r1] = row_ids
    if path_rows is not None:
        add_path_rows(path_rows, path)
    return Support(path, count, ids)


def gather_rows(
    logits: torch.Tensor,
    row_request: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    embed_weight: torch.Tensor,
    normalizer: torch.Tensor | float,
    path: torch.Tensor,
    count: torch.Tensor,
    ids: torch.Tensor,
    *,
    vocab_start: int = 0,
    softcap: float | None = None,
    out: torch.Tensor,
    out_index: torch.Tensor | None = None,
    inv_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference gather: for the sparse rows (``path``, ``count``, ``ids`` of a ``Support``),
    ``out[row] = normalizer * sum_{v in S} p_v E[v]`` (fp32, vocabulary order); other rows of
    ``out`` are left alone. ``p_v = 2^((z_v - lse) log2 e)`` as the kernel computes it.
    Fixed shapes over all rows (p = 0 outside S), so no host sync. ``inv_t``:
    ``reference.inverse_temperature(temperature)`` where the caller has it."""
    if inv_t is None:
        inv_t = reference.inverse_temperature(temperature)
    # a float stays a float: no host-to-device copy
    norm = normalizer.to(logits.device, torch.float32) if isinstance(normalizer, torch.Tensor) \
        else float(normalizer)
    sparse = Support(path, count, ids).sparse()
    member = (torch.arange(ids.shape[1], device=ids.device) < count.unsqueeze(1)) & sparse.unsqueeze(1)
    cols = torch.where(member, ids, 0).to(torch.int64)
    x = reference.softcapped(logits.gather(1, vocab_start + cols), softcap)
    inv = inv_t[row_request.to(torch.int64)].unsqueeze(1)
    z = torch.clamp(x * inv, max=reference.FLT_MAX)
    p = torch.where(member, torch.exp2((z - lse.unsqueeze(1)) * LOG2E), 0.0)
    acc = torch.zeros(logits.shape[0], embed_weight.shape[1], dtype=torch.float32, device=logits.device)
    for i in range(ids.shape[1]):  # vocabulary order, one member at a time
        acc += p[:, i:i + 1] * embed_weight[cols[:, i]].to(torch.float32)
    sparse = sparse.unsqueeze(1)
    if out_index is None:
        out.copy_(torch.where(sparse, acc * norm, out))
    else:  # distinct rows: one write per row
        out.index_copy_(0, out_index, torch.where(sparse, acc * norm, out[out_index]))
    return out


def decide_support(support_fn, logits, row_request, temperature, lse, *, tail_eps: float,
                   max_support: int = MAX_SUPPORT, **kwargs) -> Support:
    """``support_fn`` (``support_rows`` of either backend) with the pass's constants for
    ``tail_eps`` (bin weights on the logits' device, budget, lowest cut); the result as a
    ``Support``, its rows per path counted by the pass. ``kwargs``: the other arguments of
    ``support_rows``."""
    rows = torch.zeros(NUM_PATHS, dtype=torch.int64, device=logits.device)
    res = support_fn(logits, row_request, temperature, lse, tail_eps=tail_eps,
                     bin_weights=weights_on(logits.device), budget=tail_budget(tail_eps),
                     lowest=lowest_cut(tail_eps, max_support), max_support=max_support,
                     path_rows=rows, **kwargs)
    path, count, ids = (res.path, res.count, res.ids) if isinstance(res, Support) else res
    return Support(path, count, ids, rows)


def soft_embedding_tail(
    kernels,
    logits, row_request, temperature, lse, embed_weight, normalizer, *,
    tail_eps: float, keep=None, threshold=None, allowed=None, vocab_start: int = 0,
    softcap=None, out=None, out_index=None, argmax=None, entropy=None,
    max_support: int = MAX_SUPPORT, inv_t=None, logits_scratch: bool = False,
) -> tuple[torch.Tensor, Support]:
    """Soft embedding with a tail tolerance, from a backend's three operations
    (``backend.Kernels``): the support decision (``support_rows``), the dense soft embedding
    (``soft_embedding_rows``) of the dense rows, then the gather of the sparse rows
    (``gather_rows``, after the dense pass, which zeroes the rows it does not keep).
    ``inv_t`` (``reference.inverse_temperature(temperature)``, optional) is computed once for
    the three. ``logits_scratch``: the dense pass may overwrite the rows it multiplies (the
    gather reads only the sparse ones). Returns (out, support).
    """
    if inv_t is None:
        inv_t = reference.inverse_temperature(temperature)
    vocab = logits.shape[1]
    v_local = embed_weight.shape[0]
    check_tail_eps(tail_eps)
    if tail_eps == 0:
        raise ValueError("tail_eps 0 is the dense path: call the dense soft embedding")
    h_skip = math.inf
    if entropy is not None:
        h_skip = entropy_skip_f32(tail_eps, max_support, vocab)
    support = decide_support(kernels.support_rows, logits, row_request, temperature, lse,
                             tail_eps=tail_eps, max_support=max_support, v_local=v_local,
                             vocab_start=vocab_start, keep=keep, threshold=threshold,
                             allowed=allowed, softcap=softcap, argmax=argmax,
                             entropy=entropy if h_skip < math.inf else None,
                             entropy_bound=h_skip, inv_t=inv_t)
    dense_keep = support.dense()
    out = kernels.soft_embedding_rows(
        logits, row_request, temperature, lse, embed_weight, normalizer, keep=dense_keep,
        threshold=threshold, allowed=allowed, vocab_start=vocab_start, softcap=softcap, out=out,
        out_index=out_index, inv_t=inv_t, logits_scratch=logits_scratch)
    kernels.gather_rows(logits, row_request, temperature, lse, embed_weight, normalizer,
                        support.path, support.count, support.ids, vocab_start=vocab_start,
                        softcap=softcap, out=out, out_index=out_index, inv_t=inv_t)
    return out, support
