"""Sampler configuration: DiffusionGemma's generation defaults, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .checks import is_int, is_real
from .kernels.contract import check_tail_eps


@dataclass(frozen=True)
class SamplerConfig:
    """Hyper-parameters of the entropy-bound denoising sampler.

    Defaults are DiffusionGemma's ``generation_config.json`` (t 0.8 -> 0.4 over 48 steps,
    entropy bound 0.1, confidence 0.005, stability 1) and its 256-token canvas.

    ``stability_threshold`` follows Transformers: 1 means the current argmax canvas must
    equal the previous one, so the ring of argmax canvases holds ``stability_threshold + 1``
    entries (``ring_size``), as vLLM stores it.

    ``tail_eps`` is the probability mass the self-conditioning soft embedding may leave out
    of a row (``support.py``): a row whose mass sits on at most ``support.MAX_SUPPORT``
    tokens but a tail of at most ``tail_eps`` takes a gather over those tokens instead of
    the dense GEMM, with error ``<= tail_eps * normalizer * max_v |E[v]|_inf`` per component.
    ``0`` gives the dense result everywhere. Default ``2^-10``: vLLM's own soft embedding
    rounds every probability to bf16 (relative ``2^-9`` each), so its error is up to
    ``2^-9 * normalizer * sum_v p_v |E[v]| <= 2^-9 * normalizer * max_v |E[v]|_inf`` before
    its bf16 output rounding; ``2^-10`` keeps our bound at half of that (a deliberate
    difference from vLLM, which always multiplies the whole vocabulary).
    """

    t_min: float = 0.4
    t_max: float = 0.8
    entropy_bound: float = 0.1
    confidence_threshold: float = 0.005
    stability_threshold: int = 1
    max_denoising_steps: int = 48
    canvas_length: int = 256
    softcap: float | None = None
    tail_eps: float = 2.0**-10

    def __post_init__(self) -> None:
        """Check every field (``checks.py``: a wrong type is a TypeError, a wrong value a
        ValueError, both naming the field). numpy scalars are accepted and stored as the
        Python int / float of the same value, so that equal configurations compare equal."""

        def need(ok: bool, field: str, expected: str) -> None:
            if not ok:
                value = getattr(self, field)
                raise ValueError(f"SamplerConfig.{field} must be {expected}, got {value!r}")

        def typed(field: str, ok, kind: type) -> None:
            value = getattr(self, field)
            if not ok(value):
                what = "an int" if kind is int else "a real number"
                raise TypeError(f"SamplerConfig.{field} must be {what}, got {type(value).__name__} {value!r}")
            if type(value) not in (int, float):  # numpy scalars: the same value, as Python's
                object.__setattr__(self, field, kind(value))

        for field in ("t_min", "t_max", "entropy_bound", "confidence_threshold", "tail_eps"):
            typed(field, is_real, float)
        for field in ("stability_threshold", "max_denoising_steps", "canvas_length"):
            typed(field, is_int, int)
        if self.softcap is not None:
            typed("softcap", is_real, float)

        def finite(v: float) -> bool:
            return math.isfinite(v)

        need(finite(self.t_min) and self.t_min >= 0, "t_min", "a finite float >= 0")
        need(finite(self.t_max) and self.t_max >= 0, "t_max", "a finite float >= 0")
        if self.t_min > self.t_max:
            raise ValueError(
                f"SamplerConfig.t_min must be <= t_max, got t_min={self.t_min!r} > t_max={self.t_max!r}"
            )
        need(finite(self.entropy_bound) and self.entropy_bound > 0, "entropy_bound", "a finite float > 0")
        need(
            finite(self.confidence_threshold) and self.confidence_threshold >= 0,
            "confidence_threshold",
            "a finite float >= 0",
        )
        need(self.stability_threshold >= 0, "stability_threshold", "an int >= 0")
        need(self.max_denoising_steps >= 1, "max_denoising_steps", "an int >= 1")
        need(self.canvas_length >= 1, "canvas_length", "an int >= 1")
        need(self.softcap is None or (finite(self.softcap) and self.softcap > 0),
             "softcap", "None or a finite float > 0")
        try:
            check_tail_eps(self.tail_eps)
        except ValueError:
            need(False, "tail_eps", "0 or a finite float in [2^-30, 2^-4]")

    @property
    def ring_size(self) -> int:
        """Argmax canvases compared for stability (vLLM's ``ST``)."""
        return self.stability_threshold + 1

    def temperature(self, steps_done):
        """Schedule temperature after ``steps_done`` denoise steps (tensor or number).

        ``t_min + (t_max - t_min) * max(N - n, 1) / N`` with N the global step count. A number
        must be a finite real >= 0 (not a bool); a tensor's values are not read (the step
        calls this on the device).
        """
        n = float(self.max_denoising_steps)
        if is_real(steps_done):
            if not (math.isfinite(steps_done) and steps_done >= 0):
                raise ValueError(f"steps_done must be a finite number >= 0, got {steps_done!r}")
            remaining = max(n - steps_done, 1.0)
        elif not hasattr(steps_done, "float") or isinstance(steps_done, (bool, str)):
            raise TypeError(f"steps_done must be a number or a tensor, got {type(steps_done).__name__}")
        else:
            remaining = (n - steps_done.float()).clamp(min=1.0)
        return self.t_min + (self.t_max - self.t_min) * (remaining / n)
