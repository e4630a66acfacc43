"""Hidden states to logits for a decode step: the LM head, one tile of requests at a time.

Where the sampler receives hidden states (vLLM 0.34, ``DiffusionSampler.step(hidden_states=)``)
the logits are the step's own to make: ``z = softcap(h @ W^T)`` with ``W`` the LM head (tied to
the token embedding in DiffusionGemma). ``LmHead`` makes them the way the fewest bytes allow:

* in the model dtype, as ``lm_head`` writes them before vLLM's ``compute_logits`` upcasts them: 2
  bytes per logit, no fp32 copy. The softcap is not applied here but in registers by every kernel
  that reads the logits (``Projection.softcap``);
* batch-invariant: a request's logits do not depend on the batch or tile it comes in. On the
  Triton backend ``kernels/head_gemm.py`` computes every output tile in one program over the
  whole hidden dimension in a fixed order; the PyTorch backend multiplies each request's rows on
  their own (a BLAS picks its kernel, and with it the rounding, by the problem size);
* under tensor parallelism a rank holds a vocabulary slice of the head and projects only that
  slice (``Projection.vocab_start``): the statistics merge O(1) numbers per row across ranks and
  the soft embedding all-reduces ``[rows, H]``, instead of gathering ``[rows, V]`` logits.

A ``Projection`` is what the step runner needs to know about any projection, ours or a caller's
(vLLM's ``compute_logits``, which holds its bf16 output and an fp32 softcapped copy at its peak).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Projection:
    """How a step turns a tile's hidden states into its logits.

    ``project(hidden_rows, valid_lengths)`` returns ``[rows, C]`` logits that the step owns (it may
    overwrite them once read). ``itemsize``: bytes per logit the projection holds at its peak (the
    tile budget). ``softcap``: applied by the kernels that read the logits (None: already applied).
    ``vocab_start``: the logits hold this rank's vocabulary slice ``[vocab_start, vocab_start + C)``
    only (tensor parallelism); None: every column of the row. ``key``: what the projection reads
    besides its input (the head's storage, the softcap, the slice), equal for two projections
    that make the same logits: a step replayed from a CUDA graph (``step_graph.py``) replays only
    a projection of the key it captured; None: a caller's projection, never captured.
    """

    project: Callable[[torch.Tensor, np.ndarray], torch.Tensor]
    itemsize: int
    softcap: float | None = None
    vocab_start: int | None = None
    key: tuple | None = None


KERNEL_DTYPES = (torch.bfloat16, torch.float16)


class LmHead:
    """The LM head ``weight`` ``[V_local, H]``: vocabulary ids ``[vocab_start, vocab_start +
    V_local)`` of ``vocab_size``, and the final-logit ``softcap`` the kernels apply.

    ``backend`` "triton" projects 16-bit hidden states through ``kernels/head_gemm.py``; "torch"
    (and other dtypes) one request at a time with ``torch.matmul``. Inputs are validated by the
    front ends (``DiffusionSampler.step``, the vLLM adapter).
    """

    def __init__(self, weight: torch.Tensor, *, softcap: float | None = None, vocab_start: int = 0,
                 vocab_size: int | None = None, backend: str = "torch") -> None:
        if weight.dim() != 2:
            raise ValueError(f"the LM head must be [V_local, H], got shape {tuple(weight.shape)}")
        if backend not in ("triton", "torch"):
            raise ValueError(f"backend must be resolved to 'triton' or 'torch', got {backend!r}")
        self.weight = weight if weight.stride(1) == 1 else weight.contiguous()
        self.softcap = softcap
        self.vocab_start = vocab_start
        self.vocab_size = weight.shape[0] if vocab_size is None else vocab_size
        if not (0 <= vocab_start and vocab_start + weight.shape[0] <= self.vocab_size):
            raise ValueError(f"head rows [{vocab_start}, {vocab_start + weight.shape[0]}) must lie "
                             f"inside the vocabulary of {self.vocab_size}")
        self.backend = backend

    @property
    def is_slice(self) -> bool:
        """Whether the head holds part of the vocabulary only (a tensor-parallel rank's)."""
        return self.vocab_start != 0 or self.weight.shape[0] != self.vocab_size

    def uses_kernel(self, hidden: torch.Tensor) -> bool:
        return (self.backend == "triton" and hidden.dtype == self.weight.dtype
                and hidden.dtype in KERNEL_DTYPES)

    def project(self, hidden: torch.Tensor, lengths: np.ndarray | None = None) -> torch.Tensor:
        """``hidden [rows, H] @ weight^T`` in the model dtype; ``lengths``: rows per request (the
        PyTorch path multiplies each request alone; None: one request)."""
        if self.uses_kernel(hidden):
            from .kernels.head_gemm import project

            return project(hidden if hidden.stride(1) == 1 else hidden.contiguous(), self.weight)
        out = torch.empty(hidden.shape[0], self.weight.shape[0],
                          dtype=torch.result_type(hidden, self.weight), device=hidden.device)
        r = 0
        for k in ([hidden.shape[0]] if lengths is None else lengths):
            k = int(k)
            torch.matmul(hidden[r:r + k], self.weight.t(), out=out[r:r + k])
            r += k
        return out

    def projection(self) -> Projection:
        w = self.weight
        return Projection(project=self.project, itemsize=w.element_size(), softcap=self.softcap,
                          vocab_start=self.vocab_start if self.is_slice else None,
                          key=(w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype,
                               self.softcap, self.vocab_start, self.backend))
