"""Sampler configuration: DiffusionGemma's generation defaults, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

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
        def need(ok: bool, field: str, expected: str) -> None:
            if not ok:
                value = getattr(self, field)
                raise ValueError(f"SamplerConfig.{field} must be {expected}, got {value!r}")

        def finite(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        def count(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

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
        need(count(self.stability_threshold) and self.stability_threshold >= 0,
             "stability_threshold", "an int >= 0")
        need(count(self.max_denoising_steps) and self.max_denoising_steps >= 1,
             "max_denoising_steps", "an int >= 1")
        need(count(self.canvas_length) and self.canvas_length >= 1, "canvas_length", "an int >= 1")
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

        ``t_min + (t_max - t_min) * max(N - n, 1) / N`` with N the global step count.
        """
        n = float(self.max_denoising_steps)
        if isinstance(steps_done, (int, float)):
            remaining = max(n - steps_done, 1.0)
        else:
            remaining = (n - steps_done.float()).clamp(min=1.0)
        return self.t_min + (self.t_max - self.t_min) * (remaining / n)
