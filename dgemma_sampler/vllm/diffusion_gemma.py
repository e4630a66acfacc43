"""What vLLM imports for DiffusionGemma while the plugin is on: its own model, our sampler.

``plugin.register()`` points the ``DiffusionGemmaForBlockDiffusion`` architecture at this module's
``DiffusionGemmaForConditionalGeneration`` by name, so vLLM imports it only in a process that
loads DiffusionGemma (or inspects it). Importing it installs the adapter for the installed vLLM
release in vLLM's DiffusionGemma module, whose model state builds its sampler through the module
global ``DiffusionSampler``, and re-exports vLLM's model class unchanged.
"""

from vllm.model_executor.models import diffusion_gemma as _vllm_diffusion_gemma

from .plugin import install_sampler

install_sampler(_vllm_diffusion_gemma)

DiffusionGemmaForConditionalGeneration = _vllm_diffusion_gemma.DiffusionGemmaForConditionalGeneration
