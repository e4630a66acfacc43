"""The kernels the plugin's active line names for a device (no vLLM needed: plugin.py imports
vLLM only inside its functions)."""

import pytest
import torch

from dgemma_sampler.kernels.soft_embedding_dispatch import _wgmma_module
from dgemma_sampler.ops import cuda_capability
from dgemma_sampler.vllm.plugin import _kernels_line, kernels_for_device


def test_cpu_runs_the_pytorch_reference():
    assert kernels_for_device(torch.device("cpu")) == "cpu: PyTorch reference (no CUDA device)"


def test_line_by_capability(monkeypatch):
    """What the line says for a GPU, from its capability alone (as vLLM's platform reports it
    before CUDA is initialised)."""
    cuda = torch.device("cuda", 0)
    triton_gemm = "cuda:0 (sm_80): Triton row statistics + Triton soft-embedding GEMM"
    assert _kernels_line(cuda, (8, 0)) == triton_gemm
    hopper = _kernels_line(cuda, (9, 0))
    gemm = "Gluon wgmma" if _wgmma_module() is not None else "Triton"
    assert hopper == f"cuda:0 (sm_90): Triton row statistics + {gemm} soft-embedding GEMM"
    assert _kernels_line(torch.device("cuda"), None).endswith("Triton soft-embedding GEMM")
    monkeypatch.setenv("DGEMMA_SOFT_EMBEDDING_WGMMA", "0")
    assert _kernels_line(cuda, (9, 0)).endswith("+ Triton soft-embedding GEMM")


@pytest.mark.gpu
def test_gpu_names_the_dispatched_kernels(monkeypatch):
    device = torch.device("cuda", torch.cuda.current_device())
    major, minor = cuda_capability(device)
    line = kernels_for_device(device)
    assert line.startswith(f"{device} (sm_{major}{minor}): Triton row statistics + ")
    # Hopper runs the Gluon kernel where this Triton has the Gluon API (soft_embedding's rule).
    gluon = major == 9 and _wgmma_module() is not None
    assert line.endswith("Gluon wgmma soft-embedding GEMM" if gluon
                         else "Triton soft-embedding GEMM"), line
    monkeypatch.setenv("DGEMMA_SOFT_EMBEDDING_WGMMA", "0")
    assert kernels_for_device(device).endswith("Triton soft-embedding GEMM")
