"""Shared fixtures: deterministic seeds, GPU/vLLM skips, small random inputs."""

import os

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


def poisoned_row_stats(n, device):
    """RowStats of ``n`` rows filled with garbage, so a row a kernel forgets to write cannot pass."""
    from dgemma_sampler import reference

    return reference.RowStats(
        argmax=torch.full((n,), -7, dtype=torch.int64, device=device),
        sample=torch.full((n,), -7, dtype=torch.int64, device=device),
        entropy=torch.full((n,), 1234.5, device=device),
        lse=torch.full((n,), 1234.5, device=device),
        threshold=torch.full((n,), 1234.5, device=device),
        has_nan=torch.ones(n, dtype=torch.bool, device=device),
    )


def capture_step(run, warm_up):
    """A CUDA graph of ``run()`` and the output it captured. ``warm_up()`` runs first on a side
    stream, so that kernels compile and the sampler's own graphs are built outside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        warm_up()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    return graph, captured


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture
def interpret():
    """Kernels on CPU tensors run through the Triton interpreter (set before launch)."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")
    return "cuda" if torch.cuda.is_available() else "cpu"
