"""Token logprobs from the logits and the row's lse: no fp32 copy, no log_softmax tensor.

Twin of ``reference.token_logprobs_rows`` (vLLM's layout: column 0 the selected token, then
the top-n tokens or the requested ids; ``logprob = z - lse``; rank = number of entries whose
scaled logit is >= the selected one's). One program per row streams the vocabulary once with
``z = min(x * inv_t, FLT_MAX)`` (softcapped, masked as in ``row_stats``) and keeps:

* the rank count ``#{z >= z_selected}``: compared in z, as vLLM's rank kernel compares the
  scaled logits (in logprobs, distinct z can round to one value and count alike);
* for top-n, a list of the n best (z, id) in registers. A block is merged only while its
  maximum beats the list's worst entry, one entry at a time, so a row costs about
  ``n log(V / n)`` merges beyond the stream itself. Ties keep the lowest ids (torch.topk
  leaves the order of ties unspecified; the values agree either way).

``lse`` comes from ``row_stats`` (same temperature and masks); without it the kernel first
streams the row once more for its own lse. Top-n does not use ``torch.topk`` on the logits:
that would see NaN as the largest value and ignore the allowed-set and threshold masks.
"""

import torch
import triton
import triton.language as tl

from .logit_row import LOG2E, NEG_INF, NO_INDEX, U_FLOOR, pack_value_id, scaled, softcapped, unpack_value_id

POS_INF = tl.constexpr(float("inf"))
INT64_MIN = tl.constexpr(-(2**63))


@triton.jit
def _z_block(row_ptr, allowed_row, idx, vocab, inv_t, threshold,
             SOFTCAP: tl.constexpr, HAS_ALLOWED: tl.constexpr):
    """z of the entries ``idx`` (-inf where masked: NaN, x < threshold, not allowed)."""
    in_row = idx < vocab
    x = tl.load(row_ptr + idx, mask=in_row, other=NEG_INF).to(tl.float32)
    x = softcapped(x, SOFTCAP)
    keep = (x >= threshold) & in_row  # the softcap turns the -inf padding into -c
    if HAS_ALLOWED:
        keep = keep & (tl.load(allowed_row + idx, mask=in_row, other=0) != 0)
    return tl.where(keep, scaled(x, inv_t), NEG_INF)


@triton.jit
def _logprobs_kernel(
    logits_ptr, row_stride,
    inv_t_ptr, threshold_ptr, lse_ptr,          # [n] fp32
    allowed_ptr, allowed_stride,                 # [n, V] bool
    selected_ptr,                                # [n] int64
    token_ids_ptr, token_ids_stride,             # [n, K] int64, -1 padded
    ids_ptr, vals_ptr, out_stride,               # [n, 1 + cols]
    ranks_ptr,                                   # [n] int64
    vocab, n_cols,
    SOFTCAP: tl.constexpr, HAS_ALLOWED: tl.constexpr, HAS_LSE: tl.constexpr,
    TOKEN_IDS: tl.constexpr, NPAD: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    allowed_row = allowed_ptr + row.to(tl.int64) * allowed_stride
    inv_t = tl.load(inv_t_ptr + row)
    threshold = tl.load(threshold_ptr + row)
    offs = tl.arange(0, BLOCK)

    if HAS_LSE:
        lse = tl.load(lse_ptr + row)
    else:
        m = tl.full((), NEG_INF, tl.float32)
        s_acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            z = _z_block(row_ptr, allowed_row, start + offs, vocab, inv_t, threshold,
                         SOFTCAP, HAS_ALLOWED)
            bm = tl.max(z, 0)
            if bm > m:
                if m > NEG_INF:
                    s_acc = s_acc * tl.exp2((m - bm) * LOG2E)
                m = bm
            s_acc += tl.exp2(tl.maximum((z - tl.where(m > NEG_INF, m, 0.0)) * LOG2E, U_FLOOR))
        lse = tl.where(m > NEG_INF, m + tl.log(tl.sum(s_acc, 0)), NEG_INF)

    selected = tl.load(selected_ptr + row)
    z_sel = tl.max(_z_block(row_ptr, allowed_row, selected + tl.arange(0, 1), vocab, inv_t,
                            threshold, SOFTCAP, HAS_ALLOWED), 0)

    lp_sel = z_sel - lse
    slot = tl.arange(0, NPAD)
    # top-n list: slots >= n_cols hold +inf so they are never the worst entry
    best_z = tl.where(slot < n_cols, NEG_INF, POS_INF)
    best_id = tl.zeros([NPAD], tl.int32)
    rank = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        z = _z_block(row_ptr, allowed_row, start + offs, vocab, inv_t, threshold,
                     SOFTCAP, HAS_ALLOWED)
        rank += ((z >= z_sel) & (offs < vocab - start)).to(tl.int32)
        if not TOKEN_IDS:
            worst = tl.min(best_z, 0)
            bm = tl.max(z, 0)
            while bm > worst:
                at = tl.min(tl.where(z == bm, offs, NO_INDEX), 0)
                # replace the worst entry (of equal worst values, the highest id)
                victim = tl.max(tl.where(best_z == worst, best_id.to(tl.int64) * NPAD + slot, -1), 0) % NPAD
                best_z = tl.where(slot == victim, bm, best_z)
                best_id = tl.where(slot == victim, start + at, best_id)
                z = tl.where(offs == at, NEG_INF, z)
                bm = tl.max(z, 0)
                worst = tl.min(best_z, 0)

    out_row = row.to(tl.int64) * out_stride
    tl.store(ids_ptr + out_row, selected)
    tl.store(vals_ptr + out_row, lp_sel)
    tl.store(ranks_ptr + row, tl.sum(rank, 0).to(tl.int64))
    col = slot < n_cols
    if TOKEN_IDS:
        req = tl.load(token_ids_ptr + row.to(tl.int64) * token_ids_stride + slot, mask=col, other=-1)
        valid = req >= 0
        safe = tl.where(valid, req, 0)
        x = tl.load(row_ptr + safe, mask=col & valid, other=NEG_INF).to(tl.float32)
        x = softcapped(x, SOFTCAP)
        keep = x >= threshold
        if HAS_ALLOWED:
            keep = keep & (tl.load(allowed_row + safe, mask=col & valid, other=0) != 0)
        z = tl.where(keep, scaled(x, inv_t), NEG_INF)
        tl.store(ids_ptr + out_row + 1 + slot, safe, mask=col)
        tl.store(vals_ptr + out_row + 1 + slot, tl.where(valid, z - lse, NEG_INF), mask=col)
    else:
        # sort the list: value descending, lowest id first on ties
        packed = tl.where(col, pack_value_id(best_z, best_id), INT64_MIN)
        values, ids = unpack_value_id(tl.sort(packed, descending=True))
        tl.store(ids_ptr + out_row + 1 + slot, ids.to(tl.int64), mask=col)
        tl.store(vals_ptr + out_row + 1 + slot, values - lse, mask=col)


def token_logprobs_rows(
    logits: torch.Tensor,
    inv_t: torch.Tensor,
    threshold: torch.Tensor,
    allowed: torch.Tensor | None,
    selected: torch.Tensor,
    num_logprobs: int,
    token_ids: torch.Tensor | None = None,
    softcap: float | None = None,
    *,
    lse: torch.Tensor | None = None,
    block: int = 1024,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.token_logprobs_rows``; ``lse`` ([n] fp32, from ``row_stats``)
    saves one pass over the logits. Returns (ids, logprobs, ranks) in the oracle's layout."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [n, V], rows contiguous"
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16), logits.dtype
    n, vocab = logits.shape
    dev = logits.device
    for name, t, dt in (("inv_t", inv_t, torch.float32), ("threshold", threshold, torch.float32),
                        ("selected", selected, torch.int64), ("lse", lse, torch.float32)):
        if t is not None:
            assert t.shape == (n,) and t.dtype == dt and t.device == dev, f"{name}: [n] {dt} on {dev}"
    if allowed is not None:
        assert allowed.shape == (n, vocab) and allowed.dtype == torch.bool and allowed.stride(1) == 1
    if token_ids is not None:
        assert token_ids.dim() == 2 and token_ids.shape[0] == n and token_ids.dtype == torch.int64
        n_cols = token_ids.shape[1]
    else:
        assert num_logprobs >= 0
        n_cols = num_logprobs
    # per-row vectors may be strided views; the kernel indexes them densely
    inv_t, threshold, selected = inv_t.contiguous(), threshold.contiguous(), selected.contiguous()
    lse = lse.contiguous() if lse is not None else None
    ids = torch.empty(n, 1 + n_cols, dtype=torch.int64, device=dev)
    vals = torch.empty(n, 1 + n_cols, dtype=torch.float32, device=dev)
    ranks = torch.empty(n, dtype=torch.int64, device=dev)
    if n == 0:
        return ids, vals, ranks
    token_ids_arg = token_ids.contiguous() if token_ids is not None else selected
    block = min(block, max(16, triton.next_power_of_2(vocab)))
    _logprobs_kernel[(n,)](
        logits, logits.stride(0),
        inv_t, threshold, lse if lse is not None else inv_t,
        allowed if allowed is not None else logits, allowed.stride(0) if allowed is not None else 0,
        selected,
        token_ids_arg, token_ids_arg.stride(0) if token_ids is not None else 0,
        ids, vals, ids.stride(0),
        ranks,
        vocab, n_cols,
        SOFTCAP=0.0 if softcap is None else float(softcap),
        HAS_ALLOWED=allowed is not None, HAS_LSE=lse is not None,
        TOKEN_IDS=token_ids is not None, NPAD=max(2, triton.next_power_of_2(max(n_cols, 1))),
        BLOCK=block, num_warps=num_warps,
    )
    return ids, vals, ranks
