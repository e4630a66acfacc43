"""What the kernels and the package above them agree on: the result type, the constants of the
sampling semantics, the dtypes, and the one fp32 computation every backend must share.

``dgemma_sampler`` re-exports these (``reference``, ``ops``); the kernels import them from here,
so that nothing under ``kernels/`` depends on the package that calls it. Only torch is imported:
the package loads this module on machines where Triton never runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Final, Literal

import torch

# Logits and embedding dtypes the kernels read (the MMA operand is E's dtype).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Vocabulary positions per sampling block of the two-stage draw (``reference`` docstring, step 5a).
# A power of two; part of the sampling semantics (changing it changes which token a seed draws),
# not a tuning knob.
SAMPLE_BLOCK = 4096
# Temperatures are clamped to this before their reciprocal: T = 0 (greedy) scales by 1e10.
GREEDY_CLAMP = 1e-10
# The soft embedding's tail tolerance (``dgemma_sampler/support.py``): 0 (the dense path) or in
# [MIN, MAX]. Below MIN the support cut could reach the last bins, which lump every token under
# 2^-63.5, and the budget in 2^-56 units gets coarse; MAX keeps the saturated int64 tail sums
# (at most 256 (budget + 1)) far from overflow and the error bound meaningful.
MIN_TAIL_EPS = 2.0**-30
MAX_TAIL_EPS = 2.0**-4
# Per-row path of the tail-tolerant soft embedding: not kept, sparse by the top token, sparse by
# the support pass, dense by the statistics (entropy or a small top probability), dense by the
# support size. The support pass writes them, the gather and the step's counts read them.
# (The two dense codes come last: ``path >= PATH_STATS_DENSE`` is the dense mask.)
PATH_NOT_KEPT, PATH_TOP1, PATH_SUPPORT, PATH_STATS_DENSE, PATH_SUPPORT_DENSE = range(5)
NUM_PATHS = 5
# K, the largest support the gather takes: a sparse row reads K rows of E where the dense GEMM
# reads all V; at K = 64 the gather of a row is a small fraction of its share of the GEMM at
# production shapes (V = 262144, H = 2816), and |S| of peaked rows is far below it.
MAX_SUPPORT = 64
# The probability bins are placed against lse -/+ (|lse| + LSE_MARGIN_OFFSET) * LSE_MARGIN_SCALE,
# a margin above the fp32 error of lse and of the bin arithmetic.
LSE_MARGIN_OFFSET = 16.0
LSE_MARGIN_SCALE = 2.0**-17


@dataclass(frozen=True)
class StatField:
    """One per-row statistic, described once for everything that handles rows of them.

    ``dtype``: its tensors' dtype (``RowStats`` allocations, the kernels' outputs).
    ``phantom``: what a phantom position (past a truncated canvas's valid rows) reads, which
    the step fills in: a constant, or ``PHANTOM_TOKEN`` (the first column's token: 0, or a
    shared allowed set's first id) or ``PHANTOM_ENTROPY`` (``log V``, a uniform row).
    ``merge``: how tensor-parallel ranks' partials of one row combine into the single-GPU value
    (``tensor_parallel.merge_row_partials``): ``"any"`` (logical or), ``"max"``, ``"min"``,
    ``"lse"`` (log-sum-exp), ``"entropy"`` (the chain rule over the ranks' shares),
    ``"winner:<key>"`` (the value of the rank whose ``<key>`` is largest, lowest id on ties; keys
    are ``z_max``, the largest z of a rank's slice, and ``sample_key``, the winning block key of
    its draw), ``"none:<fill>"`` (not defined under tensor parallelism: the fill).

    A new statistic is a field here and in ``RowStats``, its math in ``reference.py``, and the
    kernels that compute it (``row_stats.py``, and ``topk_topp.py``'s candidate path, which
    finishes the rows whose top-k / top-p set is small); the step's padding, the
    tensor-parallel packing and merge, the graph replays and tiling read this table.
    """

    name: str
    dtype: torch.dtype
    phantom: float | Literal["phantom token", "phantom entropy"]  # a constant, or a PHANTOM_* name
    merge: str


PHANTOM_TOKEN: Final = "phantom token"
PHANTOM_ENTROPY: Final = "phantom entropy"
ROW_STATS = (
    StatField("argmax", torch.int64, PHANTOM_TOKEN, "winner:z_max"),
    StatField("sample", torch.int64, PHANTOM_TOKEN, "winner:sample_key"),
    StatField("entropy", torch.float32, PHANTOM_ENTROPY, "entropy"),
    StatField("lse", torch.float32, float("nan"), "lse"),
    StatField("threshold", torch.float32, float("-inf"), "none:-inf"),
    StatField("has_nan", torch.bool, False, "any"),
)


@dataclass
class RowStats:
    """Per-row statistics (``ROW_STATS`` describes each). All tensors share the leading shape
    of the logits rows."""

    argmax: torch.Tensor  # int64
    sample: torch.Tensor  # int64
    entropy: torch.Tensor  # float32
    lse: torch.Tensor  # float32, logsumexp of z (temperature-scaled, masked)
    threshold: torch.Tensor  # float32, keep x >= threshold (-inf: no top-k/top-p)
    has_nan: torch.Tensor  # bool

    def view(self, *shape: int) -> RowStats:
        return RowStats(*(t.view(*shape) for t in self.as_tuple()))

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in ROW_STATS)

    @staticmethod
    def empty(n_rows: int, device: torch.device) -> RowStats:
        """Uninitialised statistics of ``n_rows`` rows."""
        return RowStats(*(torch.empty(n_rows, dtype=f.dtype, device=device) for f in ROW_STATS))


def inverse_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """``1 / max(T, 1e-10)`` in fp32, computed once so every backend multiplies by it: the
    statistics and the soft embedding agree on ``z = x * inv_t`` only if both use these bits."""
    # reciprocal() is what ``1.0 / t`` runs (then times 1.0): the same bits, one launch fewer.
    return temperature.to(torch.float32).clamp(min=GREEDY_CLAMP).reciprocal()


def check_inverse_temperature(inv_t: torch.Tensor, temperature: torch.Tensor) -> None:
    """Assert that a caller's ``inv_t`` can stand for ``inverse_temperature(temperature)``: one
    fp32 value per request, on the same device (the kernels index it by request)."""
    assert inv_t.dtype == torch.float32 and inv_t.shape == temperature.shape \
        and inv_t.device == temperature.device, \
        f"inv_t must be fp32 {tuple(temperature.shape)} on {temperature.device}, got " \
        f"{inv_t.dtype} {tuple(inv_t.shape)} on {inv_t.device}"


def split_normalizer(normalizer: float | torch.Tensor,
                     device: torch.device) -> tuple[torch.Tensor | None, float]:
    """A soft-embedding normalizer as the kernels take it, ``(tensor, value)``: a one-element
    tensor moved to ``device`` and a placeholder 1.0, or None and the number. A tensor (a sum
    computed on the device) is read by the kernel, so a captured graph replays what it holds; a
    number is baked into the launch."""
    if isinstance(normalizer, torch.Tensor):
        assert normalizer.numel() == 1, normalizer.shape
        return normalizer.reshape(1).to(device), 1.0
    return None, float(normalizer)


def check_tail_eps(tail_eps: object) -> None:
    """ValueError unless ``tail_eps`` is 0 or a finite float in ``[MIN_TAIL_EPS, MAX_TAIL_EPS]``
    (the one rule of ``SamplerConfig``, ``ops.soft_embedding`` and ``support``)."""
    ok = (isinstance(tail_eps, (int, float)) and not isinstance(tail_eps, bool)
          and (tail_eps == 0 or MIN_TAIL_EPS <= tail_eps <= MAX_TAIL_EPS))
    if not ok:
        raise ValueError(f"tail_eps must be 0 or a finite float in [2^-30, 2^-4], got {tail_eps!r}")


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability`` of a CUDA device, cached: the launch wrappers ask
    on every call, and the uncached query costs microseconds of host time each."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# What the interpreter (CPU tensors) plans with in place of a GPU's SM count: few enough that
# small test shapes still cover several waves.
INTERPRETER_SMS = 4


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, cached like ``cuda_capability``;
    ``INTERPRETER_SMS`` for any other device."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)
