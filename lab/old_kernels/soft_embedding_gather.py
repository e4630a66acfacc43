"""Gather soft embedding of the sparse rows: ``out[row] = normalizer * sum_{v in S} p_v E[v]``.

Math
----
S is a row's support from ``soft_embedding_support`` (at most K columns, vocabulary order) and
``p_v = 2^((z_v - lse) log2 e)``, ``z_v`` the softcapped, scaled logit recomputed from the one
logit at v (S holds no masked entry, so no mask is needed here). Accumulated in fp32 one member
at a time in vocabulary order (a reduction over a [members, H] tile would sum in an order that
follows the tile's layout, hence its width): the result of a row depends on its own S only, not
on the batch or on the H tiling. Not renormalised: the mass left out is at most the support
pass's budget, and the error per component at most that budget times
``normalizer * max_v |E[v]|_inf``.

Traffic: per sparse row, |S| rows of E (2|S|H bytes in bf16), read once each (the H blocks of
a row read disjoint parts of them), and |S| logits per H block; E rows are never copied. Dense
and not-kept rows exit at once and leave ``out`` alone (the dense GEMM writes them).
Grid: (rows, H blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import contract
from .logit_row import LOG2E, interpreting, scaled, softcapped

TOP1 = tl.constexpr(contract.PATH_TOP1)
SUPPORT = tl.constexpr(contract.PATH_SUPPORT)


@triton.jit
def gather_kernel(
    logits_ptr, row_request_ptr, inv_t_ptr, lse_ptr, path_ptr, count_ptr, ids_ptr, embed_ptr,
    norm_ptr, out_ptr, out_index_ptr,
    hidden, vocab_start, stride_logits, stride_embed, stride_out, norm_value,
    HAS_OUT_INDEX: tl.constexpr, NORM_IS_TENSOR: tl.constexpr, SOFTCAP: tl.constexpr,
    K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    path = tl.load(path_ptr + row).to(tl.int32)
    if (path == TOP1) | (path == SUPPORT):  # the sparse paths
        count = tl.load(count_ptr + row)
        request = tl.load(row_request_ptr + row).to(tl.int64)
        inv_t = tl.load(inv_t_ptr + request)
        lse = tl.load(lse_ptr + row)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = offs_h < hidden
        acc = tl.zeros((BLOCK_H,), tl.float32)
        for i in range(count):
            col = tl.load(ids_ptr + row * K + i).to(tl.int64)
            x = tl.load(logits_ptr + row * stride_logits + vocab_start + col).to(tl.float32)
            p = tl.exp2((scaled(softcapped(x, SOFTCAP), inv_t) - lse) * LOG2E)
            e = tl.load(embed_ptr + col * stride_embed + offs_h, mask=h_ok, other=0.0)
            acc += p * e.to(tl.float32)
        if NORM_IS_TENSOR:
            norm = tl.load(norm_ptr).to(tl.float32)
        else:
            norm = norm_value
        out_row = row
        if HAS_OUT_INDEX:
            out_row = tl.load(out_index_ptr + row)
        tl.store(out_ptr + out_row * stride_out + offs_h, acc * norm, mask=h_ok)


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
    block_h: int | None = None,
    inv_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of ``dgemma_sampler.support.gather_rows``: writes the sparse rows of ``out``
    (``[M, H]`` fp32; row n goes to ``out[out_index[n]]`` when given) and leaves the others.
    ``inv_t``: ``contract.inverse_temperature(temperature)`` where the caller has it."""
    n_rows = logits.shape[0]
    hidden = embed_weight.shape[1]
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [N, V], contiguous in V"
    assert embed_weight.is_contiguous(), "embed_weight must be contiguous"
    assert path.shape == (n_rows,) and path.dtype == torch.int8, "path must be [N] int8"
    assert count.shape == (n_rows,) and count.dtype == torch.int32, "count must be [N] int32"
    assert ids.dim() == 2 and ids.shape[0] == n_rows and ids.dtype == torch.int32, "ids: [N, K] int32"
    assert lse.shape == (n_rows,) and lse.dtype == torch.float32, "lse must be [N] fp32"
    assert out.dim() == 2 and out.shape[1] == hidden and out.dtype == torch.float32
    assert out.numel() == 0 or out.stride(1) == 1, "out must be contiguous in its last dimension"
    if out_index is not None:
        assert out_index.shape == (n_rows,) and out_index.dtype == torch.int64
    if n_rows == 0 or hidden == 0:
        return out
    if inv_t is None:
        inv_t = contract.inverse_temperature(temperature)
    contract.check_inverse_temperature(inv_t, temperature)
    norm_tensor, norm_value = contract.split_normalizer(normalizer, logits.device)
    if block_h is None:
        block_h = 64 if interpreting() else 512
    grid = (n_rows, triton.cdiv(hidden, block_h))
    gather_kernel[grid](
        logits, row_request, inv_t, lse, path, count, ids, embed_weight,
        lse if norm_tensor is None else norm_tensor, out,
        lse if out_index is None else out_index,
        hidden, vocab_start, logits.stride(0), embed_weight.stride(0), out.stride(0),
        norm_value, HAS_OUT_INDEX=out_index is not None, NORM_IS_TENSOR=norm_tensor is not None,
        SOFTCAP=0.0 if softcap is None else float(softcap), K=ids.shape[1],
        BLOCK_H=block_h, num_warps=4,
    )
    return out
