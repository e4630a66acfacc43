"""The ``vllm.general_plugins`` entry point: route DiffusionGemma to ``FusedDiffusionSampler``.

vLLM calls ``register()`` in every process it starts, whatever model it serves, so registering
must cost nothing: it imports no model code. For a supported release it

* points the DiffusionGemma architecture at ``dgemma_sampler.vllm.diffusion_gemma`` by a
  ``"module:Class"`` string (``ModelRegistry.register_model``, vLLM's lazy registration). vLLM
  imports that module only where it loads DiffusionGemma; importing it installs the adapter for
  the installed release (``install_sampler``) and hands back vLLM's own model class;
* lets ``SamplingParams.seed`` through vLLM's diffusion validation (``seeds.py``): the seed
  reaches the keyed noise, so it reproduces a generation.

Any other vLLM release, or ``DGEMMA_SAMPLER_DISABLE=1``, leaves vLLM untouched and says so in one
line through vLLM's own logger (a stdlib logger outside the ``vllm`` tree is not shown).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from .. import __version__, envs

# vLLM release series -> the adapter module that defines FusedDiffusionSampler for it.
ADAPTERS = {"0.33": "v0_33", "0.34": "v0_34"}
ARCHITECTURE = "DiffusionGemmaForBlockDiffusion"
MODEL_CLASS = "dgemma_sampler.vllm.diffusion_gemma:DiffusionGemmaForConditionalGeneration"
DISABLE_ENV = "DGEMMA_SAMPLER_DISABLE"
SUPPORTED_TEXT = " and ".join(series + ".x" for series in ADAPTERS)


def _logger():
    # vLLM's handler hangs on the "vllm" logger: ours must be a child of it to be shown.
    from vllm.logger import init_logger

    return init_logger("vllm.dgemma_sampler")


def adapter_name(version: str) -> str | None:
    """The adapter module (``dgemma_sampler.vllm.<name>``) for a vLLM version, or None."""
    parts = version.split(".")
    if len(parts) < 3 or not parts[2][:1].isdigit():
        return None
    return ADAPTERS.get(".".join(parts[:2]))


def supported(version: str) -> bool:
    return adapter_name(version) is not None


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def load_adapter(version: str | None = None) -> Any:
    """The adapter module for the installed (or given) vLLM version; ImportError if none."""
    version = vllm_version() if version is None else version
    name = adapter_name(version)
    if name is None:
        raise ImportError(
            f"dgemma-sampler supports vLLM {SUPPORTED_TEXT}; vLLM {version} is installed"
        )
    return importlib.import_module(f"{__package__}.{name}")


def register() -> bool:
    """Register the lazy model entry and the seed rule; returns whether the plugin is on."""
    if envs.sampler_disabled():
        _logger().info_once(
            "dgemma-sampler: disabled by %s; vLLM's own DiffusionGemma sampler stays",
            DISABLE_ENV, scope="process",
        )
        return False
    version = vllm_version()
    if not supported(version):
        _logger().warning_once(
            "dgemma-sampler %s: vLLM %s is not supported (supported: vLLM %s); vLLM left "
            "untouched. To silence this, set %s=1 or leave dgemma_sampler out of VLLM_PLUGINS.",
            __version__, version, SUPPORTED_TEXT, DISABLE_ENV, scope="process",
        )
        return False
    from vllm import ModelRegistry

    from . import seeds

    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    seeds.accept_seed(ARCHITECTURE)
    return True


def install_sampler(model_module: Any) -> bool:
    """Point ``model_module.DiffusionSampler`` (vLLM's DiffusionGemma module, whose model state
    builds its sampler through that global) at our adapter, and log the active line. Any import
    failure leaves vLLM's sampler in place and says why."""
    version = vllm_version()
    try:
        fused = load_adapter(version).FusedDiffusionSampler
    except Exception as exc:  # noqa: BLE001 - any failure must leave vLLM as it was
        _logger().warning_once(
            "dgemma-sampler: cannot load the fused sampler (%s); vLLM's own DiffusionGemma "
            "sampler stays and ignores SamplingParams.seed", str(exc), scope="process",
        )
        return False
    model_module.DiffusionSampler = fused
    _logger().info_once(
        "dgemma-sampler %s active for DiffusionGemma on vLLM %s: %s; %s=1 turns it off",
        __version__, version, kernels_for_device(), DISABLE_ENV,
    )
    return True


def active() -> bool:
    """Whether vLLM's DiffusionGemma module, if loaded, builds our sampler."""
    model_module = sys.modules.get("vllm.model_executor.models.diffusion_gemma")
    sampler = getattr(model_module, "DiffusionSampler", None)
    return sampler is not None and sampler.__module__.startswith(__package__ + ".")


def kernels_for_device(device: Any = None) -> str:
    """The kernels a decode step runs on ``device`` (default: this process's), as
    ``ops.resolve_backend`` and the soft-embedding dispatch choose them."""
    import torch

    from ..ops import cuda_capability

    if device is None:
        return _kernels_line(*_process_device())
    device = torch.device(device)
    return _kernels_line(device, cuda_capability(device) if device.type == "cuda" else None)


def _process_device() -> tuple[Any, tuple[int, int] | None]:
    """This process's device and compute capability, without initialising CUDA where vLLM has
    not: a process that imports the model before it starts its workers (the API server builds
    the multimodal processor from the model class) must stay safe to fork. vLLM's platform
    reads the capability through NVML."""
    import torch

    from ..ops import cuda_capability

    if torch.cuda.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device())
        return device, cuda_capability(device)
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():
        return torch.device("cpu"), None
    capability = current_platform.get_device_capability()
    return torch.device("cuda"), None if capability is None else (capability.major,
                                                                 capability.minor)


def _kernels_line(device: Any, capability: tuple[int, int] | None) -> str:
    from ..ops import resolve_backend

    if resolve_backend("auto", device) != "triton":
        return f"{device}: PyTorch reference (no CUDA device)"
    from ..kernels.soft_embedding_dispatch import gemm_name

    if capability is None:
        return f"{device}: Triton row statistics + {gemm_name(None)}"
    major, minor = capability
    # (calls the Gluon kernel cannot take, e.g. an fp32 E, stay on the Triton kernel)
    gemm = gemm_name(capability if envs.soft_embedding_wgmma() else None)
    return f"{device} (sm_{major}{minor}): Triton row statistics + {gemm}"
