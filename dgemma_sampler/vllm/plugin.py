"""The ``vllm.general_plugins`` entry point: install ``FusedDiffusionSampler`` for DiffusionGemma.

vLLM calls ``register()`` in every process it starts. For a supported vLLM release the
DiffusionGemma model module's ``DiffusionSampler`` name is pointed at our sampler, so
``DiffusionGemmaModelState.custom_sampler`` builds ours with the same arguments. Anything else
(another vLLM release, ``DGEMMA_SAMPLER_DISABLE=1``, a module that cannot be imported) leaves
vLLM untouched and says why in one log line.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("dgemma_sampler")

SUPPORTED = ("0.33.",)
DISABLE_ENV = "DGEMMA_SAMPLER_DISABLE"


def supported(version: str) -> bool:
    return any(version.startswith(prefix) for prefix in SUPPORTED)


def disabled() -> bool:
    """``DGEMMA_SAMPLER_DISABLE`` set to anything but an "off" value (unset, "", 0, false, no,
    off) keeps vLLM's own sampler."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def register() -> bool:
    """Install the fused sampler; returns whether it is now active."""
    if disabled():
        logger.info("dgemma-sampler: disabled by %s; vLLM's own DiffusionGemma sampler stays",
                    DISABLE_ENV)
        return False
    try:
        import vllm
    except ImportError:
        return False
    version = getattr(vllm, "__version__", "unknown")
    if not supported(version):
        logger.warning("dgemma-sampler: vLLM %s is not supported (need %s); vLLM left untouched",
                       version, " or ".join(p + "x" for p in SUPPORTED))
        return False
    try:
        from vllm.model_executor.models import diffusion_gemma

        from .sampler import FusedDiffusionSampler
    except Exception as exc:  # noqa: BLE001 - any import failure must leave vLLM as it was
        logger.warning("dgemma-sampler: cannot load (%s); vLLM left untouched", exc)
        return False
    if diffusion_gemma.DiffusionSampler is not FusedDiffusionSampler:
        diffusion_gemma.DiffusionSampler = FusedDiffusionSampler
    logger.info("dgemma-sampler: FusedDiffusionSampler active for DiffusionGemma (vLLM %s)",
                version)
    return True


def active() -> bool:
    """Whether DiffusionGemma currently builds ``FusedDiffusionSampler``."""
    try:
        from vllm.model_executor.models import diffusion_gemma

        from .sampler import FusedDiffusionSampler
    except Exception:  # noqa: BLE001
        return False
    return diffusion_gemma.DiffusionSampler is FusedDiffusionSampler
