"""The soft-embedding GEMM's A operand written over the logits it comes from.

Math
----
For every row the dense soft-embedding GEMM multiplies (the kept rows of a row order, up to its
count on the device; every row without one), and its columns ``[vocab_start, vocab_start +
V_local)``::

    p[v] = exp(z[v] - lse),   z[v] = softcap(x[v]) * inv_t        (0 where masked)

rounded to E's dtype, NaN -> 0: exactly the operand the fused GEMM's prologue makes in registers
(``soft_embedding_probabilities``), written in place of ``x``. The
GEMM then reads it as a plain operand (``soft_embedding_wgmma``'s ``P_GIVEN``) and the result is
the fused GEMM's bit for bit.

Why
---
The fused GEMM makes ``p`` on the warps that issue the wgmma; its exponentials hold it at 75-80%
of cuBLAS (``docs/performance-history.md``), and a softcap adds a tanh per entry (two more MUFU
operations and a dozen FMAs), which would make the prologue, not the tensor cores, set the pace
of the whole GEMM. Where the step owns its logits (hidden-state input: it projects them itself, in
the model dtype) the rows the GEMM multiplies are read by nothing after the statistics, the
support decision and the gather: their bytes can hold ``p`` instead. The operand then costs one
streaming pass, and the GEMM runs as a plain one.

Traffic: each entry read and written once in the model dtype, 4 bytes per entry for bf16 (8.6 GB
at 32 requests x 256 rows x 2^18 vocabulary, ~3 ms at copy bandwidth); the arithmetic per entry
(softcap, one FMA, ``exp2``) stays under the memory time. Rows not multiplied are not touched, so
the logprobs of converging requests (never kept) and the support gather (sparse rows) read their
logits unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import soft_embedding_probabilities as prologue
from .logit_row import interpreting

# Columns per program and per step of its loop. A program owns a contiguous chunk of one row.
CHUNK = 16384
BLOCK = 2048


@triton.jit
def operand_in_place_kernel(
    logits_ptr, row_request_ptr, inv_t_ptr, lse_ptr, threshold_ptr, allowed_ptr,
    row_order_ptr, kept_count_ptr,
    n_rows, v_local, vocab_start, stride_logits, stride_allowed,
    HAS_ORDER: tl.constexpr, HAS_THRESHOLD: tl.constexpr, HAS_ALLOWED: tl.constexpr,
    SOFTCAP: tl.constexpr, INTERPRET: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    pos = tl.program_id(0)
    if HAS_ORDER:
        if pos >= tl.load(kept_count_ptr):
            return
        row = tl.load(row_order_ptr + pos).to(tl.int64)
    else:
        row = pos.to(tl.int64)
    request = tl.load(row_request_ptr + row).to(tl.int64)
    inv_t = tl.load(inv_t_ptr + request + tl.zeros([1], tl.int64))
    lse = tl.load(lse_ptr + row + tl.zeros([1], tl.int64))
    # rows whose lse is not finite (nothing kept) get p = 0, as in the fused prologue
    neg_lse2 = tl.where(tl.abs(lse) < float("inf"), prologue.neg_lse2(lse), float("-inf"))
    threshold = None
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + row + tl.zeros([1], tl.int64))
    row_ptr = logits_ptr + row * stride_logits + vocab_start
    start = tl.program_id(1) * CHUNK
    for c in range(start, tl.minimum(start + CHUNK, v_local), BLOCK):
        cols = c + tl.arange(0, BLOCK)
        inside = cols < v_local
        x = tl.load(row_ptr + cols, mask=inside, other=0.0)[None, :]
        allowed = None
        if HAS_ALLOWED:
            allowed = tl.load(allowed_ptr + request * stride_allowed + vocab_start + cols,
                              mask=inside, other=0)[None, :] != 0
        p = prologue.probabilities(x, inv_t, neg_lse2, threshold, allowed, SOFTCAP, HAS_THRESHOLD,
                           HAS_ALLOWED, INTERPRET)
        dtype = logits_ptr.dtype.element_ty
        if INTERPRET:  # round as the GPU does (the interpreter's cast truncates); NaN is -inf here
            p = prologue.rounded_as_fp32(p, dtype).to(dtype)
        else:
            p = prologue.nan_to_zero(p.to(dtype))
        tl.store(row_ptr + cols[None, :], p, mask=inside[None, :])


def operand_in_place(logits: torch.Tensor, row_request: torch.Tensor, inv_t: torch.Tensor,
                     lse: torch.Tensor, *, row_order: torch.Tensor | None,
                     kept_count: torch.Tensor | None, threshold: torch.Tensor | None,
                     allowed: torch.Tensor | None, vocab_start: int, v_local: int,
                     softcap: float | None) -> None:
    """Overwrite columns ``[vocab_start, vocab_start + v_local)`` of the rows the GEMM multiplies
    with ``p`` in the logits' own dtype (which must be the GEMM's operand dtype, E's).

    ``row_order`` / ``kept_count``: the kept rows first and their count (``kept_rows.kept_first``,
    on the device), or both None for every row. Inputs are checked by the dispatcher
    (``soft_embedding.soft_embedding_rows``) and only asserted here.
    """
    assert logits.dim() == 2 and logits.dtype in (torch.bfloat16, torch.float16), logits.dtype
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    assert (row_order is None) == (kept_count is None), "row_order and kept_count go together"
    n_rows = logits.shape[0]
    assert 0 <= vocab_start and vocab_start + v_local <= logits.shape[1], (vocab_start, v_local)
    if n_rows == 0 or v_local == 0:
        return
    placeholder = inv_t
    grid = (n_rows, triton.cdiv(v_local, CHUNK))
    operand_in_place_kernel[grid](
        logits, row_request, inv_t, lse,
        placeholder if threshold is None else threshold,
        placeholder if allowed is None else allowed,
        placeholder if row_order is None else row_order,
        placeholder if kept_count is None else kept_count,
        n_rows, v_local, vocab_start, logits.stride(0),
        0 if allowed is None else allowed.stride(0),
        HAS_ORDER=row_order is not None, HAS_THRESHOLD=threshold is not None,
        HAS_ALLOWED=allowed is not None, SOFTCAP=0.0 if softcap is None else float(softcap),
        INTERPRET=interpreting(), CHUNK=CHUNK, BLOCK=BLOCK, num_warps=8,
    )
