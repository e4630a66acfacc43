"""vLLM integration: the plugin entry point (``plugin.register``) and ``FusedDiffusionSampler``.

``FusedDiffusionSampler`` is resolved on first access from the installed vLLM release (one
adapter module per supported release: ``v0_33``, ``v0_34``), so importing this package imports
neither vLLM's model code nor ours.
"""

from typing import Any

__all__ = ["FusedDiffusionSampler"]


def __getattr__(name: str) -> Any:
    if name == "FusedDiffusionSampler":
        from .plugin import load_adapter

        return load_adapter().FusedDiffusionSampler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
