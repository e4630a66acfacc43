"""The one seam between a decode step and its kernels: the Triton kernels or the PyTorch oracle,
chosen once, behind the same interface.

``Kernels`` names every flat-row operation a step runs (``step.decode_step``), the support path
(``support.soft_embedding_tail``), the public operations (``ops``) and the tensor-parallel
partials (``tensor_parallel``) call: row statistics, the dense soft embedding, the support
decision and its gather, logprobs, and how the keyed random canvases are made. ``kernels(name)``
returns the set of a resolved backend name ("triton" or "torch", ``ops.resolve_backend``); a
caller that must change one operation (a chunked oracle, statistics merged across ranks, the
oracle for a constrained read's K columns) derives a set with ``Kernels.with_row_stats``.

The Triton set imports its kernels only when asked for (the PyTorch backend never imports
Triton), and its soft embedding reads the environment's switches (``envs``: the Hopper GEMM, the
tile-config check) on every call.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import envs, reference, support
from .reference import RowStats


@dataclass(frozen=True)
class Kernels:
    """The flat-row operations of one backend (``reference.py`` documents each signature)."""

    name: str  # "triton" or "torch"
    row_stats_rows: Callable[..., RowStats]
    soft_embedding_rows: Callable[..., Any]
    token_logprobs_rows: Callable[..., Any]
    support_rows: Callable[..., Any]  # support.support_rows' twin
    gather_rows: Callable[..., Any]  # support.gather_rows' twin
    triton_noise: bool  # keyed random canvases from the Triton kernel (step.noise_canvases)

    def with_row_stats(self, row_stats_rows: Callable[..., RowStats], **fixed: Any) -> Kernels:
        """This set with another statistics function (keyword arguments ``fixed`` bound)."""
        if fixed:
            inner = row_stats_rows

            def row_stats_rows(*args: Any, **kwargs: Any) -> RowStats:
                return inner(*args, **{**kwargs, **fixed})

        return dataclasses.replace(self, row_stats_rows=row_stats_rows)


def _triton_soft_embedding_rows(*args: Any, **kwargs: Any) -> Any:
    """``kernels.soft_embedding_dispatch.soft_embedding_rows`` with the switches of the environment
    (``envs``: the Hopper kernel, the tile-config check), read on every call."""
    from .kernels.soft_embedding_dispatch import soft_embedding_rows

    kwargs.setdefault("wgmma", None if envs.soft_embedding_wgmma() else False)
    kwargs.setdefault("tune", envs.soft_embedding_tune())
    return soft_embedding_rows(*args, **kwargs)


@functools.cache
def kernels(name: str) -> Kernels:
    """The ``Kernels`` of a resolved backend name."""
    if name == "triton":
        from .kernels.logprobs import token_logprobs_rows
        from .kernels.row_stats import row_stats_rows
        from .kernels.soft_embedding_gather import gather_rows
        from .kernels.soft_embedding_support import support_rows

        return Kernels("triton", row_stats_rows, _triton_soft_embedding_rows, token_logprobs_rows,
                       support_rows, gather_rows, triton_noise=True)
    if name == "torch":
        return Kernels("torch", reference.row_stats_rows, reference.soft_embedding_rows,
                       reference.token_logprobs_rows, support.support_rows, support.gather_rows,
                       triton_noise=False)
    raise ValueError(f"backend must be resolved to 'triton' or 'torch', got {name!r}")
