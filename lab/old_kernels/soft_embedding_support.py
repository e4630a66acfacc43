"""Support pass of the tail-tolerant soft embedding: which rows may take the gather, and over which tokens.

Math (the spec is ``dgemma_sampler/support.py``; this is its Triton twin)
-------------------------------------------------------------------------
For a logits row (columns ``[vocab_start, vocab_start + v_local)``), ``z`` softcapped, masked and
scaled as every row kernel does (``logit_row``), ``p_v = exp(z_v - lse)``, and a budget ``eps``:

1. tier 1 (one gathered logit): non-greedy row whose argmax lies in the slice and
   ``1 - 2^((z_argmax - lse - d) log2 e) + 2^-20 <= eps``: S = {argmax};
2. tier 2 (no read): ``entropy > entropy_bound``, or (argmax in the slice)
   ``2^((z_argmax - lse + d) log2 e) < (1 - eps) / K``: dense;
3. otherwise one pass bins every kept entry by ``j = floor(-4 log2 p)`` against ``lse - d``
   (255 quarter-octave bins plus one for masked entries; a token in bin j has
   ``p <= 2^(-j/4)``, bound ``w_j >= 2^(56 - j/4)`` in int64). The cut may sit no lower than
   bin J (``lowest``: level ``eps / K``). Entries in bins ``>= J`` only add ``w_j`` to per-lane
   sums saturated at ``budget + 1``; the candidates (bins ``< J``) are appended, ``(column << 8)
   | bin`` in vocabulary order, to a ``[2K]`` scratch row, and the row stops being read once
   there are more than 2K of them (then it is dense: a sparse row has fewer), or once the sum
   below J alone passes the budget (no cut can then make it sparse). From the
   candidates' histogram and the sum below J (each term saturated at ``budget + 1``, which no
   cut includes, so nothing overflows) the cut is the smallest bin ``c <= J`` whose tail bound
   is ``<= eps 2^56``; S is the candidates below it, written to ``ids[row, :|S|]`` when
   ``|S| <= K``.

``d = (|lse| + 16) 2^-17`` covers the fp32 error of ``lse`` and of the bin arithmetic (0 for
greedy rows, whose probabilities are exactly 1 at the tied maxima and 0 elsewhere).

Traffic: tiers 1 and 2 read O(1) per row. A row that runs the pass reads its logits once, or
up to the block where its candidates pass 2K or its sum below J passes the budget (looked at
every ``LOW_CHECK`` blocks); S comes from the scratch row, not a second read. A row dense by the
pass reports ``min(candidates, 2K + 1)``, or ``2K + 1`` when the sum below J passes the budget,
whichever block it stopped at. Each program adds its row to the count of its path (one integer
atomic, when the caller asks for the counts).
One program per row (the next block is loaded while this one is binned); programs of rows that
need no pass exit at once. Blocks of 1024 columns x 4 warps when the launch has many rows (four
programs per SM overlap their block reductions), else 4096 x 16 (one program streams a row
faster); no result depends on the block: candidates keep vocabulary order, and a lane or group
sum saturated at ``budget + 1`` passes the budget exactly when the true sum does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import contract
from .logit_row import LOG2E, interpreting, scaled, softcapped

# Path codes and the lse margin (contract.py)
NOT_KEPT = tl.constexpr(contract.PATH_NOT_KEPT)
TOP1 = tl.constexpr(contract.PATH_TOP1)
SUPPORT = tl.constexpr(contract.PATH_SUPPORT)
STATS_DENSE = tl.constexpr(contract.PATH_STATS_DENSE)
SUPPORT_DENSE = tl.constexpr(contract.PATH_SUPPORT_DENSE)
MARGIN_OFFSET = tl.constexpr(contract.LSE_MARGIN_OFFSET)
MARGIN_SCALE = tl.constexpr(contract.LSE_MARGIN_SCALE)
LOW_CHECK = tl.constexpr(4)  # blocks between two looks at the sum below the lowest cut
MANY_ROWS_PER_SM = 16  # rows per SM from which the pass takes small blocks (support_rows)


@triton.jit
def _load_block(logits_ptr, row, cols, v_local, vocab_start, stride_logits):
    """A block of a row's logits slice in their own dtype, ``-inf`` past the slice."""
    return tl.load(logits_ptr + row * stride_logits + vocab_start + cols, mask=cols < v_local,
                   other=float("-inf"))


@triton.jit
def _bins(x, allowed_ptr, threshold, request, cols, v_local, vocab_start, stride_allowed, inv_t,
          lse_lo, HAS_THRESHOLD: tl.constexpr, HAS_ALLOWED: tl.constexpr, SOFTCAP: tl.constexpr,
          NUM_BINS: tl.constexpr):
    """Bin of each column of a block: ``clamp(floor(-(z - lse_lo) 4 log2 e), 0, NUM_BINS - 2)``,
    ``NUM_BINS - 1`` for masked entries and columns past the slice."""
    in_slice = cols < v_local
    x = softcapped(x.to(tl.float32), SOFTCAP)
    masked = (x != x) | (x == float("-inf")) | ~in_slice  # noqa: PLR0124 (NaN)
    if HAS_THRESHOLD:
        masked = masked | (x < threshold)
    if HAS_ALLOWED:
        ok = tl.load(allowed_ptr + request * stride_allowed + vocab_start + cols, mask=in_slice,
                     other=0)
        masked = masked | (ok == 0)
    z = scaled(x, inv_t)
    u4 = (z - lse_lo) * (4.0 * LOG2E)
    b = tl.minimum(tl.maximum(tl.floor(-u4), 0.0), NUM_BINS - 2.0)
    return tl.where(masked, NUM_BINS - 1, b.to(tl.int32))


@triton.jit
def _lane_sum(low, budget, BLOCK_V: tl.constexpr):
    """T(J) from the per-lane sums (each saturated at ``budget + 1``): groups of 32 lanes
    saturated again, so that the sum fits in int64; exact when it is <= budget, above budget
    otherwise."""
    groups = tl.minimum(tl.sum(tl.reshape(low, (BLOCK_V // 32, 32)), axis=1), budget + 1)
    return tl.sum(groups, axis=0)


@triton.jit
def support_kernel(
    logits_ptr, row_request_ptr, temperature_ptr, inv_t_ptr, lse_ptr, threshold_ptr, allowed_ptr,
    keep_ptr, argmax_ptr, entropy_ptr, weights_ptr, path_ptr, count_ptr, ids_ptr, cand_ptr,
    path_rows_ptr, v_local, vocab_start, stride_logits, stride_allowed,
    tail_eps, budget, entropy_bound, min_top, lowest,
    HAS_KEEP: tl.constexpr, HAS_THRESHOLD: tl.constexpr, HAS_ALLOWED: tl.constexpr,
    HAS_ARGMAX: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_PATH_ROWS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    K: tl.constexpr, CAP: tl.constexpr, NUM_BINS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    request = tl.load(row_request_ptr + row).to(tl.int64)
    inv_t = tl.load(inv_t_ptr + request)
    greedy = tl.load(temperature_ptr + request).to(tl.float32) == 0.0
    lse = tl.load(lse_ptr + row)
    finite = tl.abs(lse) < float("inf")
    d = tl.where(greedy | ~finite, 0.0, (tl.abs(lse) + MARGIN_OFFSET) * MARGIN_SCALE)
    kept = finite | ~finite  # a true scalar
    if HAS_KEEP:
        kept = tl.load(keep_ptr + row) != 0
    threshold = float("-inf")
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + row)

    top1 = ~kept  # a false scalar where kept
    small_top = top1 & ~top1
    a_loc = tl.zeros((), tl.int64)
    if HAS_ARGMAX:
        a = tl.load(argmax_ptr + row).to(tl.int64)
        here = (a >= vocab_start) & (a < vocab_start + v_local)
        a_loc = tl.minimum(tl.maximum(a - vocab_start, 0), tl.maximum(v_local - 1, 0))
        x_a = tl.load(logits_ptr + row * stride_logits + vocab_start + a_loc,
                      mask=here, other=0.0).to(tl.float32)
        z_a = scaled(softcapped(x_a, SOFTCAP), inv_t)
        tail1 = 1.0 - tl.exp2((z_a - (lse + d)) * LOG2E) + 0.00000095367431640625  # + 2^-20
        top1 = here & ~greedy & finite & (tail1 <= tail_eps)
        p_hi = tl.exp2((z_a - (lse - d)) * LOG2E)
        small_top = here & finite & (p_hi < min_top)
    top1 = top1 & kept
    filtered = small_top
    if HAS_ENTROPY:
        filtered = filtered | (tl.load(entropy_ptr + row) > entropy_bound)

    path = tl.full((), SUPPORT, tl.int32)
    count = tl.full((), -1, tl.int32)
    budget = budget.to(tl.int64)  # an int argument below 2^31 arrives as int32: budget + 1 must not wrap
    if kept & finite & ~top1 & ~filtered:
        lse_lo = lse - d
        # Below the lowest cut: per-lane sums of the bin weights, saturated at budget + 1.
        low = tl.zeros((BLOCK_V,), tl.int64)
        # Above it: the candidates, (column << 8) | bin in vocabulary order, until there are
        # more than CAP of them (then the row is dense: stop reading it).
        n_cand = tl.zeros((), tl.int32)
        start = tl.zeros((), tl.int32)
        # The sum below the lowest cut only grows: once it passes the budget no cut can make
        # the row sparse, so it stops being read (checked every LOW_CHECK blocks).
        low_over = n_cand < 0  # a false scalar
        # The next block is loaded before this one is binned: one block of one program in
        # flight is too little to stream the row.
        x_next = _load_block(logits_ptr, row, tl.arange(0, BLOCK_V), v_local, vocab_start,
                             stride_logits)
        while (start < v_local) & (n_cand <= CAP) & ~low_over:
            cols = start + tl.arange(0, BLOCK_V)
            x = x_next
            x_next = _load_block(logits_ptr, row, cols + BLOCK_V, v_local, vocab_start,
                                 stride_logits)
            b = _bins(x, allowed_ptr, threshold, request, cols, v_local, vocab_start,
                      stride_allowed, inv_t, lse_lo, HAS_THRESHOLD, HAS_ALLOWED, SOFTCAP, NUM_BINS)
            cand = b < lowest
            w = tl.load(weights_ptr + b)
            low = tl.minimum(low + tl.where(cand, 0, w), budget + 1)
            c = cand.to(tl.int32)
            nc = tl.sum(c, axis=0)
            if nc > 0:  # most blocks of a peaked row have no candidate
                pos = n_cand + tl.cumsum(c, axis=0) - 1
                tl.store(cand_ptr + row * CAP + pos, (cols << 8) | b, mask=cand & (pos < CAP))
            n_cand += nc
            start += BLOCK_V
            if start % (LOW_CHECK * BLOCK_V) == 0:
                # A sufficient test in one sum: lanes <= 2^54 (saturated at budget + 1), so
                # shifted by 12 bits no sum of fewer than 2^21 lanes overflows, and passing
                # budget >> 12 there means passing budget.
                low_over = tl.sum(low >> 12, axis=0) > (budget >> 12)
        tail_low = _lane_sum(low, budget, BLOCK_V)
        path = tl.full((), SUPPORT_DENSE, tl.int32)
        # (2K + 1 whichever way the pass stopped early: the count does not depend on the blocks)
        count = tl.where(tail_low > budget, CAP + 1, tl.minimum(n_cand, CAP + 1))
        if (n_cand <= CAP) & (tail_low <= budget):
            slots = tl.arange(0, CAP)
            packed = tl.load(cand_ptr + row * CAP + slots, mask=slots < n_cand, other=NUM_BINS - 1)
            cb = packed & (NUM_BINS - 1)
            counts = tl.histogram(cb, NUM_BINS)
            js = tl.arange(0, NUM_BINS)
            wj = tl.load(weights_ptr + js)
            # Saturated tail terms (the cut is unchanged, int64 cannot overflow: the oracle's note)
            cap = budget // tl.maximum(wj, 1) + 1
            t = tl.where(js < lowest, tl.minimum(tl.minimum(counts.to(tl.int64), cap) * wj, budget + 1), 0)
            suffix = tail_low + tl.sum(t, axis=0) - tl.cumsum(t, axis=0) + t  # exact integers
            cut = tl.min(tl.where((suffix <= budget) & (js <= lowest), js, NUM_BINS), axis=0)
            size = tl.sum(tl.where(js < cut, counts, 0), axis=0)
            if size <= K:
                sel = (cb < cut).to(tl.int32)
                pos = tl.cumsum(sel, axis=0) - 1
                tl.store(ids_ptr + row * K + pos, packed >> 8, mask=sel != 0)
                path = tl.full((), SUPPORT, tl.int32)
                count = size.to(tl.int32)
    path = tl.where(filtered, STATS_DENSE, path)
    count = tl.where(filtered, -1, count)
    path = tl.where(top1, TOP1, path)
    count = tl.where(top1, 1, count)
    path = tl.where(finite, path, TOP1)  # nothing kept in the row: an empty S, zero as on the dense path
    count = tl.where(finite, count, 0)
    path = tl.where(kept, path, NOT_KEPT)
    count = tl.where(kept, count, -1)
    tl.store(path_ptr + row, path.to(tl.int8))
    tl.store(count_ptr + row, count)
    if HAS_PATH_ROWS:
        # Integer adds: the counts do not depend on the order rows arrive in. Relaxed: they
        # are read by later launches only, so no fence is needed (acq_rel costs one per row).
        tl.atomic_add(path_rows_ptr + path, 1, sem="relaxed")
    tl.store(ids_ptr + row * K, a_loc.to(tl.int32), mask=top1)


def support_rows(
    logits: torch.Tensor,
    row_request: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    *,
    tail_eps: float,
    bin_weights: torch.Tensor,
    budget: int,
    lowest: int,
    v_local: int | None = None,
    vocab_start: int = 0,
    max_support: int = contract.MAX_SUPPORT,
    keep: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    softcap: float | None = None,
    argmax: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    entropy_bound: float = float("inf"),
    block_v: int | None = None,
    inv_t: torch.Tensor | None = None,
    path_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of ``dgemma_sampler.support.support_rows``: returns (path [N] int8,
    count [N] int32, ids [N, K] int32 -1 padded), and adds the rows of each path to
    ``path_rows`` ([NUM_PATHS] int64) when given. ``inv_t``: the inverse temperature
    (``contract.inverse_temperature(temperature)``) where the caller has it. ``bin_weights``
    [NUM_BINS] int64, ``budget`` (eps in 2^-56 units) and ``lowest`` (the lowest cut's bin)
    come from ``dgemma_sampler.support``. Scratch: ``[N, 2K]`` int32 of candidates."""
    n_rows, vocab = logits.shape
    dev = logits.device
    v_local = vocab - vocab_start if v_local is None else v_local
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [N, V], contiguous in V"
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16), logits.dtype
    assert 0 <= vocab_start and vocab_start + v_local <= vocab, "slice outside the logits"
    assert lse.shape == (n_rows,) and lse.dtype == torch.float32, "lse must be [N] fp32"
    assert row_request.shape == (n_rows,), "row_request must be [N]"
    assert bin_weights.dim() == 1 and bin_weights.dtype == torch.int64, "bin_weights: [B] int64"
    num_bins = bin_weights.numel()
    assert num_bins & (num_bins - 1) == 0, "the number of bins must be a power of two"
    assert 0 < budget < 2**54, f"budget must be in (0, 2^54) (eps <= 2^-2), got {budget}"
    assert 0 <= lowest <= num_bins - 2, f"lowest cut {lowest} outside the bins"
    assert v_local < 2**23, "candidate columns are packed with their bin in an int32"
    assert max_support & (max_support - 1) == 0, "max_support must be a power of two"
    for name, t, dt in (("keep", keep, torch.bool), ("threshold", threshold, torch.float32),
                        ("argmax", argmax, torch.int64), ("entropy", entropy, torch.float32)):
        if t is not None:
            assert t.shape == (n_rows,) and t.dtype == dt, f"{name} must be [N] {dt}"
    if allowed is not None:
        assert allowed.dim() == 2 and allowed.dtype == torch.bool and allowed.shape[1] == vocab
    if path_rows is not None:
        assert path_rows.shape == (contract.NUM_PATHS,) and path_rows.dtype == torch.int64, \
            "path_rows must be [NUM_PATHS] int64"
    k = max_support
    path = torch.empty(n_rows, dtype=torch.int8, device=dev)
    count = torch.empty(n_rows, dtype=torch.int32, device=dev)
    ids = torch.full((n_rows, k), -1, dtype=torch.int32, device=dev)
    if n_rows == 0:
        return path, count, ids
    candidates = torch.empty(n_rows, 2 * k, dtype=torch.int32, device=dev)
    if inv_t is None:
        inv_t = contract.inverse_temperature(temperature)
    contract.check_inverse_temperature(inv_t, temperature)
    interpret = interpreting()
    if block_v is None:
        # With many rows launched (not all reach the pass), 4 warps x 1024 columns: four
        # programs per SM (114 registers on sm_90) whose block reductions and stalls overlap (one
        # program of 16 warps x 4096 waits on its own barriers). With few, one program of 16 warps
        # x 4096 per row streams it faster. The result does not depend on the block.
        block_v = 256 if interpret else 1024 if n_rows >= MANY_ROWS_PER_SM * contract.sm_count(dev) else 4096
    assert block_v >= 32 and block_v & (block_v - 1) == 0, "block_v: a power of two >= 32"
    num_warps = 4 if block_v < 4096 else 16
    placeholder = lse
    support_kernel[(n_rows,)](
        logits, row_request, temperature, inv_t, lse,
        placeholder if threshold is None else threshold,
        placeholder if allowed is None else allowed.view(torch.uint8),
        placeholder if keep is None else keep.view(torch.uint8),
        placeholder if argmax is None else argmax,
        placeholder if entropy is None else entropy,
        bin_weights, path, count, ids, candidates,
        placeholder if path_rows is None else path_rows,
        v_local, vocab_start, logits.stride(0), 0 if allowed is None else allowed.stride(0),
        float(tail_eps), int(budget), float(entropy_bound), (1.0 - tail_eps) / k, int(lowest),
        HAS_KEEP=keep is not None, HAS_THRESHOLD=threshold is not None,
        HAS_ALLOWED=allowed is not None, HAS_ARGMAX=argmax is not None,
        HAS_ENTROPY=entropy is not None, HAS_PATH_ROWS=path_rows is not None,
        SOFTCAP=0.0 if softcap is None else float(softcap),
        K=k, CAP=2 * k, NUM_BINS=num_bins, BLOCK_V=block_v, num_warps=num_warps,
    )
    return path, count, ids
