"""Argument checks of the public entry points: one rule and one message style everywhere.

A public call checks its arguments before it does any work and never converts one: a wrong type
is a ``TypeError``, a wrong value (range, shape, device, NaN, an out-of-order call) a
``ValueError``, and both name the argument ("top_k must be an int >= 0, got -2").

What counts as what:

* an *int* is a ``numbers.Integral``: a Python ``int`` or a numpy integer scalar, never a
  ``bool`` (``True`` is not a slot, a seed or a width); it is used as ``int(value)``;
* a *real* is a ``numbers.Real``: a Python ``int`` or ``float`` or a numpy scalar, never a
  ``bool``;
* a *flag* is a ``bool`` or ``numpy.bool_``, never an int or a string;
* a *list of ids* is a list, tuple, 1-D numpy integer array or 1-D integer tensor whose
  entries are ints (by the rule above); a string is not one.

Tensors are checked by ``ops.check_tensor``. Checks that read a device tensor's values cost a
host synchronisation: they run only at the kernel-level public functions (``ops.row_stats``,
``ops.soft_embedding``, the tensor-parallel ones) and at construction, never inside a step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeGuard

import numpy as np
import torch

if TYPE_CHECKING:
    from typing import TypeAlias

    # What ``is_int`` / ``is_real`` let through, as a type checker sees it: Python and numpy
    # scalars (another ``numbers.Integral`` / ``numbers.Real`` passes too, and behaves as they do).
    IntScalar: TypeAlias = int | np.integer
    RealScalar: TypeAlias = int | float | np.integer | np.floating


def is_int(value: object) -> TypeGuard[IntScalar]:
    """An integer that is not a bool (Python int or numpy integer scalar)."""
    return type(value) is int or (isinstance(value, numbers.Integral)
                                  and not isinstance(value, (bool, np.bool_)))


def is_real(value: object) -> TypeGuard[RealScalar]:
    """A real number that is not a bool (Python int / float, numpy scalar)."""
    return type(value) in (int, float) or (isinstance(value, numbers.Real)
                                           and not isinstance(value, (bool, np.bool_)))


def need_int(name: str, value: object) -> int:
    """``value`` as a Python int; TypeError naming ``name`` unless it is an int (not a bool)."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def need_real(name: str, value: object) -> float:
    """``value`` as a Python float; TypeError naming ``name`` unless it is a real (not a bool),
    ValueError when it is NaN or infinite."""
    if not is_real(value):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def need_flag(name: str, value: object) -> bool:
    """``value`` as a bool; TypeError naming ``name`` unless it is a bool (or ``numpy.bool_``)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def int_range(name: str, value: object, low: int | None = None, high: int | None = None) -> int:
    """``need_int`` and ``low <= value < high`` (either bound may be None), else ValueError."""
    v = need_int(name, value)
    if (low is not None and v < low) or (high is not None and v >= high):
        if high is None:
            want = f"an int >= {low}"
        elif low is None:
            want = f"an int < {high}"
        else:
            want = f"an int in [{low}, {high})"
        raise ValueError(f"{name} must be {want}, got {value!r}")
    return v


def id_list(name: str, value: object) -> list[int]:
    """A list of ids (see the module docstring) as Python ints; TypeError naming ``name`` or
    the first entry that is not an int. Reading a device tensor's values costs a host
    synchronisation (only request setup takes tensors here)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype.is_complex \
                or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a 1-D integer tensor, got {value.dtype} "
                            f"of shape {tuple(value.shape)}")
        return [int(v) for v in value.tolist()]
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise TypeError(f"{name} must be a 1-D integer array, got {value.dtype} "
                            f"of shape {value.shape}")
        return [int(v) for v in value.tolist()]
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(value).__name__}")
    out = []
    for i, v in enumerate(value):
        if not is_int(v):
            raise TypeError(f"{name}[{i}] must be an int, got {type(v).__name__} {v!r}")
        out.append(int(v))
    return out
