"""Triton kernels of dgemma-sampler, installed as ``dgemma_sampler.kernels``.

The bottom layer: these modules import torch, triton and each other, never ``dgemma_sampler``
(``tests/test_layering.py``). What the package shares with them (the result type, the sampling
constants, the inverse temperature) is ``contract.py``; inputs are validated by the package's
entry points, and the launch wrappers here only assert them.
"""
