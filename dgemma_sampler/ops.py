"""Public kernel-level operations: validation, backend choice, and the 3-D request layout.

``row_stats`` and ``soft_embedding`` take logits as ``[num_requests, W, V]`` and map them
onto the flat-row functions shared by the backends (``reference.py`` for ``"torch"``,
``dgemma_sampler.kernels`` for ``"triton"``). ``backend="auto"`` picks Triton for CUDA
tensors and the PyTorch oracle elsewhere. Inputs are validated here, once, with errors that
name the argument; the kernels below only assert. The environment's switches for the kernels
(``envs``) are read here too and passed down as arguments.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import envs, reference, support
from .backend import kernels
from .checks import is_real, need_int
from .kernels.contract import FLOAT_DTYPES, RowStats, check_tail_eps, cuda_capability  # noqa: F401 (re-exported)

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, device: torch.device) -> str:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, one of {BACKENDS}, got {type(backend).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not envs.triton_interpret():
        raise ValueError(
            "backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 to run the kernels "
            f"through the interpreter on the CPU; got tensors on {device}"
        )
    return backend


def same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:<current>`` are the same device."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        current = torch.cuda.current_device() if a.type == "cuda" else 0
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


def check_tensor(name: str, t: object, *, dim: int | None = None, dtypes=None, device=None,
                 shape: tuple | None = None) -> torch.Tensor:
    """Raise a TypeError/ValueError naming ``name`` when ``t`` is not what is expected; else
    return ``t`` (typed as the tensor it is)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")
    if device is not None and not same_device(t.device, device):
        raise ValueError(f"{name} must be on {device} (where the logits are), got {t.device}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    return t


def _check_logits(logits: torch.Tensor) -> None:
    check_tensor("logits", logits, dim=3, dtypes=FLOAT_DTYPES)
    if logits.shape[2] == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension")
    if logits.numel() and logits.stride(2) != 1:
        raise ValueError("logits must be contiguous in the vocabulary dimension (stride(2) == 1)")


def check_values(*checks: tuple[str, torch.Tensor]) -> None:
    """ValueError with the message of the first ``(message, ok)`` whose 0-d bool tensor ``ok``
    is False. All are read in one host synchronisation (public kernel-level calls only)."""
    if not checks:
        return
    ok = torch.stack([c for _, c in checks]).tolist()
    for (message, _), good in zip(checks, ok):
        if not good:
            raise ValueError(message)


TEMPERATURE_MESSAGE = "temperature must be finite and >= 0 (0 = greedy)"


def temperature_ok(temperature: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The value check of a (type-checked) temperature tensor, for ``check_values``."""
    return TEMPERATURE_MESSAGE, torch.isfinite(temperature).all() & (temperature >= 0).all()


def _check_request_params(logits, temperature, seeds, draws, top_k, top_p, allowed) -> None:
    r, _, vocab = logits.shape
    dev = logits.device
    check_tensor("temperature", temperature, dim=1, dtypes=FLOAT_DTYPES, device=dev, shape=(r,))
    check_tensor("seeds", seeds, dim=1, dtypes=(torch.int64,), device=dev, shape=(r,))
    check_tensor("draws", draws, dim=1, dtypes=(torch.int64,), device=dev, shape=(r,))
    values = [temperature_ok(temperature)]
    if top_k is not None:
        check_tensor("top_k", top_k, dim=1, dtypes=(torch.int32, torch.int64), device=dev, shape=(r,))
        values.append(("top_k must be >= 0 (0 or >= vocab size disables it)", (top_k >= 0).all()))
    if top_p is not None:
        check_tensor("top_p", top_p, dim=1, dtypes=FLOAT_DTYPES, device=dev, shape=(r,))
        values.append(("top_p must be in (0, 1] (1 disables it)", ((top_p > 0) & (top_p <= 1)).all()))
    if allowed is not None:
        check_tensor("allowed", allowed, dim=2, dtypes=(torch.bool,), device=dev, shape=(r, vocab))
    if r:
        check_values(*values)


def _check_softcap(softcap) -> None:
    if softcap is None:
        return
    if not is_real(softcap):
        raise TypeError(
            f"softcap must be None or a finite float > 0, got {type(softcap).__name__} {softcap!r}")
    if not 0 < softcap < float("inf"):
        raise ValueError(f"softcap must be None or a finite float > 0, got {softcap!r}")


def check_normalizer(normalizer, device: torch.device) -> tuple[str, torch.Tensor] | None:
    """Type, shape and device of the soft embedding's ``normalizer``: a finite real number, or a
    1-element floating tensor on ``device``. A number's value is checked here; a tensor's value
    check is returned for ``check_values`` (reading it is a host synchronisation, so callers
    read it once: per public kernel-level call, or once when a sampler is built)."""
    if isinstance(normalizer, torch.Tensor):
        if normalizer.numel() != 1:
            raise ValueError(f"normalizer must be a scalar, got shape {tuple(normalizer.shape)}")
        if not normalizer.dtype.is_floating_point:
            raise TypeError(
                f"normalizer must be a float or a 1-element floating tensor, got {normalizer.dtype}")
        if not same_device(normalizer.device, device):
            raise ValueError(
                f"normalizer must be on {device} (where the logits are), got {normalizer.device}")
        return "normalizer must be finite", torch.isfinite(normalizer).all()
    if not is_real(normalizer):
        raise TypeError(
            f"normalizer must be a float or a 1-element tensor, got {type(normalizer).__name__}")
    if not math.isfinite(normalizer):
        raise ValueError(f"normalizer must be finite, got {normalizer!r}")
    return None


def _contiguous_mask(allowed: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels read ``allowed`` rows as contiguous runs of the vocabulary."""
    return None if allowed is None else allowed.contiguous()


def _flat_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r, w, vocab = logits.shape
    dev = logits.device
    if logits.stride(0) == w * logits.stride(1):
        flat = logits.as_strided((r * w, vocab), (logits.stride(1), 1))
    else:
        flat = logits.reshape(r * w, vocab)
    request = torch.arange(r, device=dev, dtype=torch.int32).repeat_interleave(w)
    position = torch.arange(w, device=dev, dtype=torch.int32).repeat(r)
    return flat, request, position


def row_stats(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    draws: torch.Tensor,
    softcap: float | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    backend: str = "auto",
    sample_block: int = reference.SAMPLE_BLOCK,
) -> RowStats:
    """Per-position statistics of ``[num_requests, W, V]`` logits in one pass per row.

    Parameters
    ----------
    logits : ``[R, W, V]`` fp32 / bf16 / fp16, contiguous in V (rows may be strided).
    temperature : ``[R]`` float, >= 0; 0 is greedy (sample = argmax).
    seeds, draws : ``[R]`` int64: request seed and that request's draw counter; the noise
        of position i, token v is a pure function of (seed, draw, i, v).
    softcap : optional final-logit softcap ``c * tanh(x / c)`` applied in fp32.
    top_k : optional ``[R]`` int (0 or >= V: off). top_p : optional ``[R]`` float in (0, 1].
    allowed : optional ``[R, V]`` bool, the tokens each request may take.
    sample_block : vocabulary positions per sampling block of the two-stage draw (a power
        of two, part of what a seed draws; ``reference.py`` step 5). Keep the default.

    Returns a ``RowStats`` of ``[R, W]`` tensors: argmax / sample int64, entropy / lse /
    threshold fp32, has_nan bool. See ``reference.py`` for the exact semantics.
    """
    _check_logits(logits)
    _check_request_params(logits, temperature, seeds, draws, top_k, top_p, allowed)
    _check_softcap(softcap)
    reference.check_sample_block(sample_block)
    r, w, vocab = logits.shape
    flat, request, position = _flat_rows(logits)
    kwargs = dict(softcap=softcap, top_k=top_k, top_p=top_p, allowed=_contiguous_mask(allowed),
                  sample_block=int(sample_block))
    run = kernels(resolve_backend(backend, logits.device)).row_stats_rows
    return run(flat, request, position, temperature, seeds, draws, **kwargs).view(r, w)


def soft_embedding(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    embed_weight: torch.Tensor,
    normalizer: torch.Tensor | float,
    keep: torch.Tensor | None = None,
    vocab_start: int = 0,
    softcap: float | None = None,
    threshold: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    tail_eps: float = 0.0,
    argmax: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """``normalizer * softmax(z) @ E`` per position, probabilities never stored.

    ``logits`` ``[R, W, V]``; ``lse`` ``[R, W]`` from ``row_stats`` (same temperature and
    masks); ``embed_weight`` ``[V_local, H]`` bf16/fp16/fp32 multiplies logits columns
    ``[vocab_start, vocab_start + V_local)`` (a tensor-parallel slice: the caller
    all-reduces); ``threshold`` ``[R, W]`` is ``row_stats(...).threshold`` when top-k /
    top-p were used. Rows with ``keep`` False come out zero. Returns ``[R, W, H]`` fp32,
    written into ``out`` when given.

    ``tail_eps`` > 0: rows whose probability mass sits, up to ``tail_eps``, on at most
    ``support.MAX_SUPPORT`` tokens are computed over those tokens only (``support.py``), with
    error ``<= tail_eps * normalizer * max_v |E[v]|_inf`` per component; 0 is the dense
    result. ``argmax`` / ``entropy`` ``[R, W]`` from ``row_stats`` (same temperature and
    masks) let rows skip the support pass (optional).
    """
    _check_logits(logits)
    r, w, vocab = logits.shape
    dev = logits.device
    check_tensor("temperature", temperature, dim=1, dtypes=FLOAT_DTYPES, device=dev, shape=(r,))
    check_tensor("lse", lse, dtypes=(torch.float32,), device=dev, shape=(r, w))
    check_tensor("embed_weight", embed_weight, dim=2, dtypes=FLOAT_DTYPES, device=dev)
    if not embed_weight.is_contiguous():
        raise ValueError("embed_weight must be contiguous")
    v_local, hidden = embed_weight.shape
    vocab_start = need_int("vocab_start", vocab_start)
    if not (0 <= vocab_start and vocab_start + v_local <= vocab):
        raise ValueError(
            f"embed_weight rows [vocab_start={vocab_start}, +{v_local}) must lie inside the "
            f"logits vocabulary of {vocab}"
        )
    if keep is not None:
        check_tensor("keep", keep, dtypes=(torch.bool,), device=dev, shape=(r, w))
    if threshold is not None:
        check_tensor("threshold", threshold, dtypes=(torch.float32,), device=dev, shape=(r, w))
    if allowed is not None:
        check_tensor("allowed", allowed, dim=2, dtypes=(torch.bool,), device=dev, shape=(r, vocab))
    normalizer_ok = check_normalizer(normalizer, dev)
    _check_softcap(softcap)
    check_tail_eps(tail_eps)
    if argmax is not None:
        check_tensor("argmax", argmax, dtypes=(torch.int64,), device=dev, shape=(r, w))
    if entropy is not None:
        check_tensor("entropy", entropy, dtypes=(torch.float32,), device=dev, shape=(r, w))
    if out is not None:
        check_tensor("out", out, dtypes=(torch.float32,), device=dev, shape=(r, w, hidden))
        if out.stride(2) != 1 or out.stride(0) != w * out.stride(1):
            raise ValueError("out must be contiguous in its last dimension with rows of one stride")
    if r:  # the values, in one host synchronisation (as row_stats reads its temperature)
        check_values(temperature_ok(temperature), *([normalizer_ok] if normalizer_ok else []))
    elif normalizer_ok:
        check_values(normalizer_ok)
    flat, request, _ = _flat_rows(logits)
    out_flat = None if out is None else out.view(r * w, hidden)
    # The keyword arguments both soft embedding paths take, of several types.
    kwargs: dict[str, Any] = dict(
        keep=None if keep is None else keep.reshape(-1),
        threshold=None if threshold is None else threshold.reshape(-1),
        allowed=_contiguous_mask(allowed), vocab_start=vocab_start, softcap=softcap, out=out_flat,
    )
    chosen = kernels(resolve_backend(backend, dev))
    if tail_eps > 0:
        res, _ = support.soft_embedding_tail(
            chosen, flat, request, temperature, lse.reshape(-1), embed_weight, normalizer,
            tail_eps=tail_eps, argmax=None if argmax is None else argmax.reshape(-1),
            entropy=None if entropy is None else entropy.reshape(-1), **kwargs)
        return res.view(r, w, hidden)
    res = chosen.soft_embedding_rows(flat, request, temperature, lse.reshape(-1), embed_weight,
                                     normalizer, **kwargs)
    return res.view(r, w, hidden)
