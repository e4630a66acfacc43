"""The kernels the plugin's active line names for a device (no vLLM needed: plugin.py imports
vLLM only inside its functions)."""

import pytest
import torch

from dgemma_sampler.kernels.soft_embedding import _wgmma_module
from dgemma_sampler.ops import cuda_capability
from dgemma_sampler.vllm.plugin import kernels_for_device


def test_cpu_runs_the_pytorch_reference():
    assert kernels_for_device(torch.device("cpu")) == "cpu: PyTorch reference (no CUDA device)"


@pytest.mark.gpu
def test_gpu_names_the_dispatched_kernels(monkeypatch):
    device = torch.device("cuda", torch.cuda.current_device())
    major, minor = cuda_capability(device)
    line = kernels_for_device()
    assert line.startswith(f"{device} (sm_{major}{minor}): Triton row statistics + ")
    # Hopper runs the Gluon kernel where this Triton has the Gluon API (soft_embedding's rule).
    gluon = major == 9 and _wgmma_module() is not None
    assert line.endswith("Gluon wgmma soft-embedding GEMM" if gluon
                         else "Triton soft-embedding GEMM"), line
    monkeypatch.setenv("DGEMMA_SOFT_EMBEDDING_WGMMA", "0")
    assert kernels_for_device(device).endswith("Triton soft-embedding GEMM")
