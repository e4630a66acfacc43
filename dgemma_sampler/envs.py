"""Every environment variable dgemma-sampler reads, in one place.

=============================== ==========================================================
``DGEMMA_SAMPLER_DISABLE``      Any value but an "off" one (unset, "", 0, false, no, off)
                                keeps vLLM's own DiffusionGemma sampler: the plugin does
                                nothing.
``DGEMMA_GRAPH_UPDATE``         ``0`` turns off the CUDA-graph replay of a step's
                                logits-free parts (``update_graph.py``); default on CUDA.
``DGEMMA_SOFT_EMBEDDING_WGMMA`` ``0`` keeps the soft-embedding GEMM on the portable Triton
                                kernel where the Hopper (Gluon, wgmma) kernel would run.
``DGEMMA_SOFT_EMBEDDING_TUNE``  ``0`` skips the one-time check of the soft-embedding tile
                                configurations for register spills (the first that fits
                                runs).
``TRITON_INTERPRET``            Triton's own: ``1`` runs the kernels through the interpreter
                                on CPU tensors (tests and the demo on a machine without a
                                GPU).
=============================== ==========================================================

Values are read when asked for, not at import, so a test or a launcher may set them late.
The kernels read none of them (except Triton's own ``TRITON_INTERPRET``): the callers in this
package (``ops``, ``sampler``) turn them into explicit arguments.
"""

from __future__ import annotations

import os

_OFF = ("", "0", "false", "no", "off")


def _on(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in _OFF


def sampler_disabled() -> bool:
    return _on("DGEMMA_SAMPLER_DISABLE", False)


def graph_update() -> bool:
    return _on("DGEMMA_GRAPH_UPDATE", True)


def soft_embedding_wgmma() -> bool:
    return _on("DGEMMA_SOFT_EMBEDDING_WGMMA", True)


def soft_embedding_tune() -> bool:
    return _on("DGEMMA_SOFT_EMBEDDING_TUNE", True)


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
