"""Triton kernels of dgemma-sampler, installed as ``dgemma_sampler.kernels``."""
