"""What the vLLM plugin's ``register()`` costs a vLLM process that serves another model.

vLLM calls every ``vllm.general_plugins`` entry point in each process it starts. This imports
what ``vllm serve`` has loaded by then (``vllm.engine.arg_utils``), runs ``register()`` and
prints the modules it added, the seconds it took and whether DiffusionGemma's model code came
with it (it must not: the model module loads only where vLLM loads that model).

    VLLM_TARGET_DEVICE=cpu python tools/plugin_import_cost.py    # in a venv with vLLM
"""

import sys
import time

import vllm.engine.arg_utils  # noqa: F401 (what `vllm serve` has imported when plugins run)

before = set(sys.modules)
start = time.perf_counter()
from dgemma_sampler.vllm import plugin  # noqa: E402

plugin.register()
seconds = time.perf_counter() - start
added = set(sys.modules) - before
model_code = any(m.startswith("vllm.model_executor.models.diffusion_gemma") for m in added)
print(f"register(): {len(added)} new modules, {seconds:.2f} s; "
      f"DiffusionGemma model code imported: {model_code}")
