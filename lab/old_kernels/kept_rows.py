"""Kept rows first: the row order the soft-embedding GEMMs compact their rows by.

Math
----
For a keep mask ``k[0..N)``: ``order`` is a permutation of ``0..N-1`` with the kept rows first,
each group in increasing row order (a stable partition), and ``count = sum(k)``. Row r goes to
``cumsum(k)[r] - 1`` when kept, to ``count + cumsum(1 - k)[r] - 1`` otherwise. The same result
as ``torch.argsort(~k, stable=True)`` (the twin in the tests), which costs the host a sort's
several launches: this is one launch of one program.

Traffic: N bytes read twice (the count, then the scatter), 8N bytes written; a step's N is
at most a few tens of thousands of rows. One program walks the rows in blocks, carrying the
two running counts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .logit_row import interpreting


@triton.jit
def kept_first_kernel(keep_ptr, order_ptr, count_ptr, n_rows, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    total = tl.zeros((), tl.int32)
    for start in range(0, n_rows, BLOCK):
        k = tl.load(keep_ptr + start + offs, mask=start + offs < n_rows, other=0)
        total += tl.sum((k != 0).to(tl.int32), axis=0)
    kept_before = tl.zeros((), tl.int32)
    dropped_before = tl.zeros((), tl.int32)
    for start in range(0, n_rows, BLOCK):
        rows = start + offs
        inside = rows < n_rows
        kept = (tl.load(keep_ptr + rows, mask=inside, other=0) != 0).to(tl.int32)
        dropped = tl.where(inside, 1 - kept, 0)
        pos = tl.where(kept != 0, kept_before + tl.cumsum(kept, axis=0) - 1,
                       total + dropped_before + tl.cumsum(dropped, axis=0) - 1)
        tl.store(order_ptr + pos, rows.to(tl.int64), mask=inside)
        kept_before += tl.sum(kept, axis=0)
        dropped_before += tl.sum(dropped, axis=0)
    tl.store(count_ptr, total)


def kept_first(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order ``[N]`` int64, count ``[1]`` int32) of a ``[N]`` bool keep mask, both on its
    device (no host synchronisation)."""
    assert keep.dim() == 1 and keep.dtype == torch.bool, "keep must be [N] bool"
    n_rows = keep.shape[0]
    assert n_rows <= 2**30, "rows and positions are int32"
    order = torch.empty(n_rows, dtype=torch.int64, device=keep.device)
    if n_rows == 0:
        return order, torch.zeros(1, dtype=torch.int32, device=keep.device)
    count = torch.empty(1, dtype=torch.int32, device=keep.device)
    block = 256 if interpreting() else 2048
    kept_first_kernel[(1,)](keep.contiguous().view(torch.uint8), order, count, n_rows,
                            BLOCK=block, num_warps=8)
    return order, count
