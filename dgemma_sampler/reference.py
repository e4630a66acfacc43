"""PyTorch reference oracle: the exact math of the fused kernels, tiled over rows.

Everything here works on *flat rows*: ``logits`` is ``[N, V]`` (any float dtype, last dim
contiguous, any row stride) and each row ``n`` belongs to request ``row_request[n]`` at
canvas position ``row_position[n]``. Per-request parameters are indexed by request. The
public 3-D API in ``ops.py`` and the ragged rows of a decode step both map onto this.

Semantics of one row (``x`` the logits row), shared by every backend:

1. ``x = float32(x)``; with a softcap ``c``: ``x = c * tanh(x / c)``.
2. Masked entries: NaN, ``-inf``, tokens outside the request's allowed set, and tokens
   removed by top-k / top-p. A masked entry has probability exactly 0, contributes
   exactly 0 to the entropy and is never the argmax or the sample. Rows holding a NaN
   are flagged in ``has_nan`` (vLLM's ``num_nans``); the NaN never reaches other entries.
3. top-k keeps ``x >= t_k`` where ``t_k`` is the k-th largest unmasked value (ties at
   ``t_k`` are kept); then top-p keeps ``x >= t_p`` where ``t_p`` is the smallest value
   whose strictly-greater mass, under softmax(x) at temperature 1 over what top-k kept,
   is ``< p`` (ties kept together). Both act on temperature-1 logits, as in vLLM's
   DiffusionGemma sampler, which filters before it divides by the temperature. The
   resulting per-row ``threshold`` (``-inf`` when neither is active) is returned so the
   self-conditioning GEMM applies the same mask without redoing the search.
4. ``z = min(x * inv_temperature, FLT_MAX)`` where ``inv_temperature = 1 / max(T, 1e-10)``
   is computed once per request in fp32. ``+inf`` logits therefore become the largest
   finite value: they tie at the top and share the probability.
5. ``argmax`` = lowest index of the largest unmasked ``z``. ``sample`` is the argmax when
   ``T == 0``; otherwise it is drawn in two keyed Gumbel-max stages:

   a. The vocabulary axis is cut into *sampling blocks* of ``sample_block`` (default
      ``SAMPLE_BLOCK`` = 4096) consecutive positions ``p = vocab_offset + column``; block
      ``b`` holds ``[b * S, (b + 1) * S)``. Its key is ``lse_b + G_b``: ``lse_b`` the
      logsumexp of the block's unmasked ``z`` (``-inf`` when none) and ``G_b`` the keyed
      Gumbel noise of (seed, draw, position, BLOCK stream, b). The largest key wins, the
      lowest ``b`` on ties.
   b. Inside the winning block, the sample is the lowest index of the largest unmasked
      ``z + G`` with ``G`` the keyed Gumbel noise of (seed, draw, position, GUMBEL stream,
      token id).

   Stage a picks block ``b`` with probability ``Z_b / Z`` and stage b token ``i`` of it with
   ``exp(z_i) / Z_b``, so token ``i`` is drawn with probability exactly ``softmax(z)_i``.
   Why two stages: a single Gumbel-max over the row needs a hashed random number per
   vocabulary entry, which made the streaming kernel compute-bound (a 32-bit hash costs
   more than everything else an entry needs). Here the stream needs one random number per
   4096 entries, and only the winning block is read again for its per-token noise. The
   keys still compose as a maximum over disjoint vocabulary slices that start on a block
   boundary, which is what tensor parallelism needs.
6. ``m = max z``, ``Z = sum exp(z - m)``, ``A = sum (z - m) exp(z - m)`` over unmasked
   entries; ``lse = m + log Z``; ``entropy = log Z - A / Z``.
7. A row with no unmasked entry: argmax = sample = 0, entropy = 0, lse = -inf.

``vocab_offset`` shifts the token id used for the noise and for the returned indices, so
a tensor-parallel rank holding the slice ``[vocab_offset, vocab_offset + V)`` draws the
same noise for a token as a single GPU holding the whole vocabulary (and, when the slice
starts on a sampling-block boundary, computes the same block keys).
"""

from __future__ import annotations

import math

import torch

from . import keyed_noise
from .checks import is_int
from .kernels.contract import (  # noqa: F401 (re-exported)
    SAMPLE_BLOCK,
    RowStats,
    check_inverse_temperature,
    inverse_temperature,
)
from .keyed_noise import Stream

# The result type, the sampling-block size (step 5a) and the inverse temperature (step 4) are
# the contract with the kernels: defined beside them (kernels/contract.py), re-exported here.

FLT_MAX = torch.finfo(torch.float32).max


def softcapped(x: torch.Tensor, softcap: float | None) -> torch.Tensor:
    x = x.to(torch.float32)
    if softcap is None:
        return x
    return torch.tanh(x / softcap) * softcap


def top_k_top_p_threshold(
    x: torch.Tensor, masked: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Per-row threshold ``t`` (keep ``x >= t``) of top-k then top-p; ``-inf`` when inactive.

    ``x`` [n, V] fp32 softcapped logits, ``masked`` [n, V] bool, ``top_k`` [n] int64
    (0 or >= V: off), ``top_p`` [n] fp32 (1: off).
    """
    n, vocab = x.shape
    neg_inf = torch.tensor(float("-inf"), device=x.device)
    thr = torch.full((n,), float("-inf"), dtype=torch.float32, device=x.device)
    if top_k is None and top_p is None:
        return thr
    vals = torch.where(masked, neg_inf, x)
    sorted_vals, _ = torch.sort(vals, dim=-1, descending=True)
    if top_k is not None:
        k = top_k.to(torch.int64)
        active = (k > 0) & (k < vocab)
        kth = sorted_vals.gather(1, (k.clamp(1, vocab) - 1).unsqueeze(1)).squeeze(1)
        thr = torch.where(active, kth, thr)
        sorted_vals = torch.where(sorted_vals >= thr.unsqueeze(1), sorted_vals, neg_inf)
    if top_p is not None:
        p = top_p.to(torch.float32)
        probs = torch.softmax(sorted_vals.double(), dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0)
        exclusive = torch.cumsum(probs, dim=-1) - probs
        keep = exclusive < p.double().unsqueeze(1)
        keep[:, 0] = True
        last = keep.sum(dim=-1) - 1
        pth = sorted_vals.gather(1, last.unsqueeze(1)).squeeze(1)
        thr = torch.where(p < 1.0, torch.maximum(thr, pth), thr)
    return thr


def _rows_masked(
    x: torch.Tensor, rows_request: torch.Tensor, allowed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    nan = torch.isnan(x)
    masked = nan | (x == float("-inf"))
    if allowed is not None:
        masked |= ~allowed[rows_request]
    return masked, nan.any(dim=-1)


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
    chunk_rows: int = 64,
    sample_block: int = SAMPLE_BLOCK,
    sample_key: torch.Tensor | None = None,
    inv_t: torch.Tensor | None = None,
) -> RowStats:
    """Reference row statistics over flat rows (see the module docstring).

    ``column_tokens`` ([V] int64, optional) names the token id of each logits column when
    the logits hold only an allowed subset of the vocabulary (vLLM's constrained reads):
    the per-token noise is keyed by that id and argmax / sample are returned as ids (the
    sampling blocks still cut the columns). ``sample_key`` ([N] fp32, optional) receives
    the key ``lse_b + G_b`` of each row's winning sampling block (``-inf`` for greedy rows
    and rows with nothing unmasked): the number a tensor-parallel merge compares. ``inv_t``:
    ``inverse_temperature(temperature)`` where the caller has it already (a step computes it
    once for every kernel).
    """
    n_rows, vocab = logits.shape
    device = logits.device
    check_sample_block(sample_block)
    if sample_key is not None:
        assert sample_key.shape == (n_rows,) and sample_key.dtype == torch.float32, \
            "sample_key must be an [N] float32 tensor"
    if inv_t is None:
        inv_t = inverse_temperature(temperature)
    else:
        check_inverse_temperature(inv_t, temperature)
    greedy = temperature.to(torch.float32) == 0
    out = RowStats(
        argmax=torch.zeros(n_rows, dtype=torch.int64, device=device),
        sample=torch.zeros(n_rows, dtype=torch.int64, device=device),
        entropy=torch.zeros(n_rows, dtype=torch.float32, device=device),
        lse=torch.full((n_rows,), float("-inf"), dtype=torch.float32, device=device),
        threshold=torch.full((n_rows,), float("-inf"), dtype=torch.float32, device=device),
        has_nan=torch.zeros(n_rows, dtype=torch.bool, device=device),
    )
    if column_tokens is not None:
        tokens = column_tokens.to(device=device, dtype=torch.int64)
    else:
        tokens = torch.arange(vocab, device=device, dtype=torch.int64) + vocab_offset
    for r0 in range(0, n_rows, chunk_rows):
        r1 = min(r0 + chunk_rows, n_rows)
        req = row_request[r0:r1].to(torch.int64)
        x = softcapped(logits[r0:r1], softcap)
        masked, has_nan = _rows_masked(x, req, allowed)
        thr = top_k_top_p_threshold(
            x,
            masked,
            None if top_k is None else top_k[req],
            None if top_p is None else top_p[req],
        )
        masked |= x < thr.unsqueeze(1)
        z = torch.clamp(x * inv_t[req].unsqueeze(1), max=FLT_MAX)
        z = torch.where(masked, float("-inf"), z)
        any_kept = ~masked.all(dim=-1)
        m = z.max(dim=-1).values
        safe_m = torch.where(any_kept, m, 0.0).unsqueeze(1)
        shifted = z - safe_m
        e = torch.exp(shifted)
        big_z = e.sum(dim=-1)
        a = torch.where(masked, 0.0, shifted * e).sum(dim=-1)
        argmax = torch.argmax(z, dim=-1)  # first index of the max: lowest id on ties
        block_key, block_of_column = sampling_block_keys(
            z, seeds[req], draws[req], row_position[r0:r1], vocab_offset, sample_block)
        best_key, best_block = block_key.max(dim=-1)  # first max: lowest block on ties
        key = keyed_noise.row_key(seeds[req].unsqueeze(1), draws[req].unsqueeze(1),
                                  row_position[r0:r1].unsqueeze(1), Stream.GUMBEL)
        g = keyed_noise.gumbel(keyed_noise.token_bits(key, tokens.unsqueeze(0)))
        outside = block_of_column.unsqueeze(0) != best_block.unsqueeze(1)
        noisy = torch.where(masked | outside, float("-inf"), z + g)
        sample = torch.where(greedy[req], argmax, torch.argmax(noisy, dim=-1))
        if sample_key is not None:
            sample_key[r0:r1] = torch.where(greedy[req] | ~any_kept, float("-inf"), best_key)
        safe_z = torch.where(any_kept, big_z, 1.0)
        out.argmax[r0:r1] = torch.where(any_kept, tokens[argmax], tokens[0])
        out.sample[r0:r1] = torch.where(any_kept, tokens[sample], tokens[0])
        out.entropy[r0:r1] = torch.where(any_kept, torch.log(safe_z) - a / safe_z, 0.0)
        out.lse[r0:r1] = torch.where(any_kept, m + torch.log(safe_z), float("-inf"))
        out.threshold[r0:r1] = thr
        out.has_nan[r0:r1] = has_nan
    return out


def check_sample_block(sample_block: int) -> None:
    if not is_int(sample_block):
        raise TypeError(f"sample_block must be an int, a power of two >= 16, got "
                        f"{type(sample_block).__name__} {sample_block!r}")
    if not (sample_block >= 16 and sample_block & (sample_block - 1) == 0):
        raise ValueError(f"sample_block must be a power of two >= 16, got {sample_block!r}")


def sampling_block_keys(
    z: torch.Tensor,
    seeds: torch.Tensor,
    draws: torch.Tensor,
    positions: torch.Tensor,
    vocab_offset: int,
    sample_block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``lse_b + G_b`` of the sampling blocks a row slice touches (step 5a).

    ``z`` [n, V] fp32 with masked entries ``-inf``; ``seeds``, ``draws``, ``positions`` [n]
    per row. Returns (keys [n, B] fp32 for the blocks ``vocab_offset // S ...`` in order,
    block_of_column [V] int64 indexing those B blocks).
    """
    n, vocab = z.shape
    s = sample_block
    first = vocab_offset // s
    lead = vocab_offset - first * s  # a slice may start inside a block
    n_blocks = (lead + vocab + s - 1) // s
    padded = torch.full((n, n_blocks * s), float("-inf"), dtype=torch.float32, device=z.device)
    padded[:, lead:lead + vocab] = z
    lse_b = torch.logsumexp(padded.view(n, n_blocks, s), dim=-1)  # -inf where all masked
    block_ids = torch.arange(n_blocks, device=z.device, dtype=torch.int64) + first
    key = keyed_noise.row_key(seeds.unsqueeze(1), draws.unsqueeze(1), positions.unsqueeze(1),
                              Stream.BLOCK)
    g = keyed_noise.gumbel(keyed_noise.token_bits(key, block_ids.unsqueeze(0)))
    block_of_column = (torch.arange(vocab, device=z.device) + lead) // s
    return lse_b + g, block_of_column


def probabilities(
    x_rows: torch.Tensor,
    inv_t: torch.Tensor,
    lse: torch.Tensor,
    threshold: torch.Tensor,
    masked_extra: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    """``exp(z - lse)`` per entry with masked entries exactly 0 (fp32, [n, V])."""
    x = softcapped(x_rows, softcap)
    masked = torch.isnan(x) | (x == float("-inf")) | (x < threshold.unsqueeze(1))
    if masked_extra is not None:
        masked |= masked_extra
    z = torch.clamp(x * inv_t.unsqueeze(1), max=FLT_MAX)
    p = torch.exp(z - lse.unsqueeze(1))
    return torch.where(masked | ~torch.isfinite(lse).unsqueeze(1), 0.0, p)


def soft_embedding_rows(
    logits: torch.Tensor,
    row_request: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    embed_weight: torch.Tensor,
    normalizer: torch.Tensor | float,
    *,
    keep: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    vocab_start: int = 0,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    out_index: torch.Tensor | None = None,
    chunk_rows: int = 64,
    inv_t: torch.Tensor | None = None,
    logits_scratch: bool = False,
) -> torch.Tensor:
    """Reference ``normalizer * softmax(z)[:, vocab_start:+V_local] @ E`` over flat rows.

    ``lse`` is the full-vocabulary logsumexp of ``z`` from ``row_stats``; ``embed_weight``
    is ``[V_local, H]`` and multiplies logits columns ``[vocab_start, vocab_start +
    V_local)``. Rows with ``keep`` False are zero. Accumulates in fp32.

    ``out`` is ``[M, H]`` fp32 (a view of a slot-indexed buffer is fine); with
    ``out_index`` ([N] int64) row n is written to ``out[out_index[n]]``, else to ``out[n]``.
    ``inv_t``: ``inverse_temperature(temperature)`` where the caller has it already (a step
    computes it once for its three soft-embedding calls). ``logits_scratch`` (the caller lets
    the kernels overwrite the rows they multiply) changes nothing here: the oracle only reads.
    Returns ``out``.
    """
    n_rows = logits.shape[0]
    v_local, hidden = embed_weight.shape
    if out is None:
        out = torch.empty(n_rows, hidden, dtype=torch.float32, device=logits.device)
    if inv_t is None:
        inv_t = inverse_temperature(temperature)
    # A float stays a float: a device tensor made from it would be a synchronising copy.
    norm = normalizer.to(logits.device, torch.float32) if isinstance(normalizer, torch.Tensor) \
        else float(normalizer)
    e32 = embed_weight.to(torch.float32)
    cols = slice(vocab_start, vocab_start + v_local)
    for r0 in range(0, n_rows, chunk_rows):
        r1 = min(r0 + chunk_rows, n_rows)
        req = row_request[r0:r1].to(torch.int64)
        thr = (
            threshold[r0:r1]
            if threshold is not None
            else torch.full((r1 - r0,), float("-inf"), device=logits.device)
        )
        extra = None if allowed is None else ~allowed[req][:, cols]
        p = probabilities(logits[r0:r1, cols], inv_t[req], lse[r0:r1], thr, extra, softcap)
        block = (p @ e32) * norm
        if keep is not None:
            block = torch.where(keep[r0:r1].unsqueeze(1), block, 0.0)
        if out_index is None:
            out[r0:r1] = block
        else:
            out[out_index[r0:r1]] = block
    return out


def token_logprobs_rows(
    logits: torch.Tensor,
    inv_t: torch.Tensor,
    threshold: torch.Tensor,
    allowed: torch.Tensor | None,
    selected: torch.Tensor,
    num_logprobs: int,
    token_ids: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of flat rows, vLLM's layout: column 0 the selected token, then top-n.

    ``inv_t`` [n] per row, ``threshold`` [n], ``allowed`` [n, V] bool or None, ``selected``
    [n] int64. With ``token_ids`` ([n, K] int64, -1 padded) the requested ids replace the
    top-n columns. Returns (ids [n, 1 + cols] int64, logprobs [n, 1 + cols] fp32 with
    -inf for padding, ranks [n] int64 counted as vLLM does: the number of entries whose
    scaled logit z is >= the selected one's).
    """
    x = softcapped(logits, softcap)
    masked = torch.isnan(x) | (x < threshold.unsqueeze(1))
    if allowed is not None:
        masked |= ~allowed
    z = torch.where(masked, float("-inf"), torch.clamp(x * inv_t.unsqueeze(1), max=FLT_MAX))
    lp = torch.log_softmax(z, dim=-1)
    if token_ids is not None:
        cols = token_ids.to(torch.int64)
        valid = cols >= 0
        cols = cols.clamp(min=0)
    else:
        cols = torch.topk(z, num_logprobs, dim=-1).indices if num_logprobs > 0 else \
            torch.empty(z.shape[0], 0, dtype=torch.int64, device=z.device)
        valid = torch.ones_like(cols, dtype=torch.bool)
    ids = torch.cat([selected.unsqueeze(1), cols], dim=1)
    vals = lp.gather(1, ids)
    vals[:, 1:] = torch.where(valid, vals[:, 1:], float("-inf"))
    ids[:, 1:] = torch.where(valid, ids[:, 1:], 0)
    # vLLM's rank: entries whose scaled logit is >= the selected one's (compared in z, not in
    # log-softmax, where distinct z can round to one value).
    ranks = (z >= z.gather(1, selected.unsqueeze(1))).sum(dim=-1)
    return ids, vals, ranks


def phantom_entropy(vocab_size: int) -> float:
    """Entropy of a padded (all-zero) logits row: the uniform distribution, ``log V``."""
    return math.log(vocab_size)
