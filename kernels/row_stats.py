"""Row statistics in one streaming pass: lse, entropy, arg-max and a keyed Gumbel-max sample.

One program per logits row (a canvas position of a request) walks the vocabulary in
blocks of ``BLOCK`` entries and keeps every per-token quantity in registers; it writes six
numbers per row. Semantics: ``dgemma_sampler.reference.row_stats_rows`` (masking, NaN, +inf,
all-masked rows, greedy rows, lowest id on ties).

Per block, with ``z = min(x * inv_t, FLT_MAX)`` (``inv_t`` computed once per request on the
host side by ``reference.inverse_temperature``, so ``z`` is bit-identical to the oracle's)::

    bm = max z over the block
    if bm > m:  rescale the running sums by 2^((m - bm) log2 e); m = bm; arg = lowest such id
    u = (z - m) log2 e;  R += 2^u (all but the arg-max entry);  A2 += u 2^u

(see ``logit_row.py`` for why the arg-max entry's 1 is kept out of ``R``).

Sampling is Gumbel-max with the keyed noise of ``keyed_noise.py``: the sample is the lowest
id of the largest ``z + G(seed, draw, position, token)``. Computing ``G`` costs about 85
instructions per entry (the murmur hash, two accurate logarithms), several times the rest of
the pass, so the kernel computes it only where it can change the answer:

1. Block skip. ``G <= GUMBEL_MAX`` (22.9: the noise of 32-bit uniforms tops out at 33 ln 2),
   so a block with ``bm + GUMBEL_MAX < best`` (best key so far) cannot hold the winner.
2. Hash filter. Otherwise only the hash (about 14 instructions) is computed. Since
   ``E >= w`` (the exponential of a uniform ``w`` is at least ``w``), ``G = -log E <= -log w``,
   and an entry can reach ``best`` only if ``w <= exp(z - best)`` = ``e * exp(m - best)``
   with ``e = 2^u`` already computed for the sums. One compare per entry, with a relative
   slack far above every rounding error, says whether any entry of the block can win.
3. Only a block that passes both computes the exact noise (the same operation sequence as
   the oracle) and updates ``best``.

Instruction counts (sm_90 SASS, per entry): about 18 for the sums, arg-max and masks, 20 more
for hash and filter, 70 more in a block that computes the exact noise. On a row of comparable
logits the filter should let through about ln(number of blocks) blocks per row (the running
best is rarely beaten); on a peaked row the block skip removes the tail blocks outright
(estimates: ``bench/bench_row_stats.py`` measures the result, and ``noise_filter=False``
what the filter saves). The result is exactly the full Gumbel-max
(both tests are conservative), so the sample matches the oracle bit for bit up to the last
ulp of ``log`` (keys closer than that can resolve differently; tests check such near-ties).

Why Gumbel-max and not an exponential race or inverse CDF: the oracle and the tensor-parallel
path need a per-token key that composes as a max across vocabulary slices (a rank holding
``[vocab_offset, vocab_offset + V)`` draws the same noise for a token as a single GPU), and
the keyed 32-bit noise reaches the Gumbel tail to 22.9 nats. The race ``e / E`` would save one
log per entry, but the filter above already removes the logs from almost every entry, and
the race's keys are not the oracle's keys.

Rows with top-k / top-p: ``topk_topp.py`` finds the threshold first and, when the kept set
is small, computes the whole row's statistics from its candidates and marks the row done;
this kernel then skips the row. Other thresholded rows come here with ``x < threshold``
masked.
"""

import torch
import triton
import triton.language as tl

from dgemma_sampler import reference
from dgemma_sampler.reference import RowStats

from . import keyed_noise as kn
from .logit_row import LOG2E, NEG_INF, NO_INDEX, U_FLOOR, finish_stats, scaled, softcapped

# Largest Gumbel value of keyed_noise: bits = 0 gives E = 2^-33, G = 33 ln 2 = 22.87.
GUMBEL_MAX = tl.constexpr(22.9)
TWO_POW_32 = tl.constexpr(4294967296.0)
# Use the hash filter only while exp(m - best + slack) * 2^32 stays finite and the weights
# e = 2^u of every possible winner (z > best - 23) stay above fp32's underflow.
FILTER_MAX_GAP = tl.constexpr(60.0)
GUMBEL_STREAM = tl.constexpr(1)  # keyed_noise.Stream.GUMBEL
# Below this |m| the exp2 argument is formed with one FMA, z * log2(e) - m * log2(e). The FMA
# subtracts the rounded m * log2(e), off by up to half its ulp: 2^-13 at |m| < 2048, but ~1e4
# for a greedy row (z = x * 1e10), where an entry tied with the max would get 2^16384 = inf
# (seen on the H200 with bf16 logits, whose ties are common). Larger |m| takes z - m exactly.
EXP_FAST_LIMIT = tl.constexpr(2048.0)


@triton.jit(do_not_specialize=["vocab_offset"])
def _row_stats_kernel(
    logits_ptr, row_stride,                      # [N, V] rows, last dim contiguous
    row_request_ptr, row_position_ptr,           # [N] int: request of the row, canvas position
    temperature_ptr, inv_t_ptr,                  # [R] fp32: T (0 = greedy), 1 / max(T, 1e-10)
    seeds_ptr, draws_ptr,                        # [R] int64
    threshold_ptr, done_ptr,                     # [N] fp32 keep x >= t; [N] int8 row finished
    allowed_ptr, allowed_stride,                 # [R, V] bool
    column_tokens_ptr,                           # [V] int64 token id of each column
    argmax_ptr, sample_ptr, entropy_ptr, lse_ptr, has_nan_ptr,  # [N] outputs
    vocab, vocab_offset,
    SOFTCAP: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,
    HAS_ALLOWED: tl.constexpr,
    HAS_COLUMN_TOKENS: tl.constexpr,
    NOISE_FILTER: tl.constexpr,  # the hash filter (False only to measure what it saves)
    BLOCK: tl.constexpr,
    PREFETCH: tl.constexpr,      # register prefetch of the next block
    NUM_STAGES: tl.constexpr,    # Triton's own load pipelining (cp.async) when > 1
):
    row = tl.program_id(0)
    request = tl.load(row_request_ptr + row).to(tl.int64)
    position = tl.load(row_position_ptr + row)
    inv_t = tl.load(inv_t_ptr + request)
    sampling = tl.load(temperature_ptr + request) != 0.0
    key = kn.row_key(tl.load(seeds_ptr + request), tl.load(draws_ptr + request), position,
                     GUMBEL_STREAM)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    allowed_row = allowed_ptr + request * allowed_stride

    threshold = tl.full((), NEG_INF, tl.float32)
    todo = tl.full((), 1, tl.int1)
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + row)
        todo = tl.load(done_ptr + row) == 0
    n_cols = tl.where(todo, vocab, 0)

    offs = tl.arange(0, BLOCK)
    offs_c1 = offs.to(tl.uint32) * kn.C1       # loop-invariant part of token * C1
    m = tl.full((), NEG_INF, tl.float32)       # running max of z
    arg = tl.full((), 0, tl.int32)             # lowest index of m
    rest = tl.full((), 0.0, tl.float32)        # former arg-max entries, rescaled (part of R)
    a_rest = tl.full((), 0.0, tl.float32)      # their part of A2
    r_acc = tl.zeros([BLOCK], tl.float32)      # R: sum of 2^u except the arg-max entry
    a_acc = tl.zeros([BLOCK], tl.float32)      # A2: sum of u 2^u
    nan_acc = tl.zeros([BLOCK], tl.float32)    # becomes NaN where a NaN logit passed
    best = tl.full((), NEG_INF, tl.float32)    # best key z + G so far
    best_idx = tl.full((), 0, tl.int32)

    if PREFETCH:
        # Register prefetch: the load of the next block is in flight while this one computes.
        x_next = tl.load(row_ptr + offs, mask=offs < n_cols, other=NEG_INF)
    for start in tl.range(0, n_cols, BLOCK, num_stages=NUM_STAGES):
        if PREFETCH:
            x_raw = x_next
            x_next = tl.load(row_ptr + (start + BLOCK) + offs, mask=offs < n_cols - (start + BLOCK),
                             other=NEG_INF)
        else:
            x_raw = tl.load(row_ptr + start + offs, mask=offs < n_cols - start, other=NEG_INF)
        x = x_raw.to(tl.float32)
        nan_acc = tl.maximum(nan_acc, x, propagate_nan=tl.PropagateNan.ALL)
        x = softcapped(x, SOFTCAP)
        keep = x >= threshold  # False for NaN
        if SOFTCAP > 0:
            # the padding past the row end is -inf, which the softcap turns into -c
            keep = keep & (offs < vocab - start)
        if HAS_ALLOWED:
            keep = keep & (tl.load(allowed_row + start + offs, mask=offs < vocab - start, other=0) != 0)
        z = tl.where(keep, scaled(x, inv_t), NEG_INF)
        bm = tl.max(z, 0)

        if bm > m:
            # A new row maximum (rare after the first blocks): rescale, move the arg-max.
            had_max = m > NEG_INF
            # clamped: 2^-160 is already 0, and -inf * 0 would poison the sums with NaN
            d = tl.where(had_max, tl.maximum((m - bm) * LOG2E, U_FLOOR), 0.0)
            alpha = tl.exp2(d)
            # A' = alpha (A + d Z) with Z = r_acc + rest + 1 (the old arg-max entry's 1)
            a_acc = (a_acc + d * r_acc) * alpha
            a_rest = tl.where(had_max, (a_rest + d * (rest + 1.0)) * alpha, 0.0)
            r_acc = r_acc * alpha
            rest = tl.where(had_max, (rest + 1.0) * alpha, 0.0)
            at = tl.min(tl.where(z == bm, offs, NO_INDEX), 0)
            arg = start + at
            m = bm
            u = tl.maximum((z - m) * LOG2E, U_FLOOR)
            e = tl.exp2(u)
            r_acc += tl.where(offs == at, 0.0, e)
            a_acc += u * e
        else:
            if (tl.abs(m) < EXP_FAST_LIMIT) | (m == NEG_INF):
                # One FMA per entry; exact enough for sums (not used for any comparison).
                u = tl.maximum(z * LOG2E - tl.where(m > NEG_INF, m * LOG2E, 0.0), U_FLOOR)
            else:
                # z * log2(e) would overflow near FLT_MAX (+inf logits).
                u = tl.maximum((z - m) * LOG2E, U_FLOOR)
            e = tl.exp2(u)
            r_acc += e
            a_acc += u * e

        if sampling:
            if bm + GUMBEL_MAX >= best:
                if HAS_COLUMN_TOKENS:
                    token = tl.load(column_tokens_ptr + start + offs, mask=offs < vocab - start,
                                    other=0)
                    bits = kn.token_bits(key, token)
                else:
                    # token * C1 = offs * C1 + (start + vocab_offset) * C1 (mod 2^32)
                    first = (start + vocab_offset).to(tl.uint32) * kn.C1
                    bits = kn.token_bits_of_product(key, offs_c1 + first)
                hit = tl.full((), 1, tl.int32)
                if NOISE_FILTER:
                    # Can w <= e * exp(m - best + slack) hold anywhere? The slack covers the
                    # rounding of z - m, exp2, the product and the two logs of the exact noise.
                    gap = (m - best) + (1e-3 + 1e-6 * (tl.abs(m) + tl.abs(best)))
                    if gap <= FILTER_MAX_GAP:
                        scale = tl.exp2(gap * LOG2E) * TWO_POW_32
                        hit = (tl.max(e * scale - bits.to(tl.float32), 0) >= 0).to(tl.int32)
                if hit != 0:
                    # Masked entries have z = -inf, so their keys are -inf too.
                    noisy = z + kn.gumbel(bits)
                    block_best = tl.max(noisy, 0)
                    if block_best > best:
                        best_idx = start + tl.min(tl.where(noisy == block_best, offs, NO_INDEX), 0)
                        best = block_best

    entropy, lse = finish_stats(m, tl.sum(r_acc, 0) + rest, tl.sum(a_acc, 0) + a_rest)
    has_nan = tl.max((nan_acc != nan_acc).to(tl.int32), 0) != 0
    chosen = tl.where(sampling, best_idx, arg)
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
    tl.store(has_nan_ptr + row, has_nan, mask=todo)


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
    return RowStats(
        argmax=torch.empty(n_rows, dtype=torch.int64, device=device),
        sample=torch.empty(n_rows, dtype=torch.int64, device=device),
        entropy=torch.empty(n_rows, dtype=torch.float32, device=device),
        lse=torch.empty(n_rows, dtype=torch.float32, device=device),
        threshold=torch.empty(n_rows, dtype=torch.float32, device=device),
        has_nan=torch.empty(n_rows, dtype=torch.bool, device=device),
    )


def default_config(logits: torch.Tensor) -> dict:
    """Launch configuration of the stats pass (``bench/bench_row_stats.py --sweep`` measures it).

    A ``"threshold"`` entry (a dict of ``topk_topp.threshold_rows`` keywords) tunes the top-k /
    top-p search; the CPU tests use it to shrink the candidate buffer.
    """
    # Measured on an H200 (bench/results/row_stats-h200-v1.log): small programs win. Two warps
    # per row keep the per-block reductions to one barrier between two warps; 512-entry
    # blocks keep ~110 registers, so about 18 warps fit per SM; the register prefetch keeps
    # the next block's load in flight.
    return dict(block=512, num_warps=2, prefetch=True, num_stages=1, maxnreg=None)


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
    chunk_rows: int | None = None,
    config: dict | None = None,
    noise_filter: bool = True,
) -> RowStats:
    """Triton twin of ``reference.row_stats_rows`` (same arguments, same result).

    ``chunk_rows`` is accepted for signature parity and ignored: the kernel keeps no per-row
    temporaries, so it never needs to tile rows. ``config`` (keys of ``default_config``) and
    ``noise_filter`` are knobs for the benchmark.
    """
    _check_rows(logits, row_request, row_position, temperature, seeds, draws, top_k, top_p,
                allowed, vocab_offset, column_tokens)
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
    inv_t = reference.inverse_temperature(temperature).contiguous()
    temp32 = temperature.to(torch.float32).contiguous()
    softcap_c = 0.0 if softcap is None else float(softcap)
    done = None
    if top_k is None and top_p is None:
        out.threshold.fill_(float("-inf"))
    else:
        from .topk_topp import threshold_rows

        done = threshold_rows(
            logits, row_request, row_position, temp32, inv_t, seeds, draws, out,
            softcap=softcap_c, top_k=top_k, top_p=top_p, allowed=allowed,
            vocab_offset=vocab_offset, column_tokens=column_tokens,
            **(config or {}).get("threshold", {}),
        )
    cfg = {**default_config(logits), **{k: v for k, v in (config or {}).items() if k != "threshold"}}
    block = min(cfg["block"], max(16, triton.next_power_of_2(vocab)))
    _row_stats_kernel[(n_rows,)](
        logits, logits.stride(0),
        row_request, row_position,
        temp32, inv_t, seeds, draws,
        out.threshold, done if done is not None else out.threshold,
        allowed if allowed is not None else logits, allowed.stride(0) if allowed is not None else 0,
        column_tokens if column_tokens is not None else seeds,
        out.argmax, out.sample, out.entropy, out.lse, out.has_nan,
        vocab, vocab_offset,
        SOFTCAP=softcap_c,
        HAS_THRESHOLD=done is not None,
        HAS_ALLOWED=allowed is not None,
        HAS_COLUMN_TOKENS=column_tokens is not None,
        NOISE_FILTER=noise_filter,
        BLOCK=block,
        PREFETCH=cfg["prefetch"],
        NUM_STAGES=cfg["num_stages"],
        num_warps=cfg["num_warps"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )
    return out
