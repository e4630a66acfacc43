"""``tools/profile_step.py``'s count mode runs on the CPU from logits and from hidden states, and
counts the host work of a step (so that the tool keeps up with the runner it measures)."""

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def profile_step():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        yield importlib.import_module("profile_step")
    finally:
        sys.path.remove(str(ROOT / "tools"))


@pytest.mark.parametrize("hidden_states", [False, True])
def test_count_mode_from_logits_and_hidden_states(profile_step, hidden_states):
    res = profile_step.count_step(2, 4, 301, 16, 1, "cpu", "torch", 5, hidden_states=hidden_states)
    assert res["input"] == ("hidden states" if hidden_states else "logits")
    assert res["aten_launching_ops"] > 0 and res["new_shape_aten_launching_ops"] > 0
    assert res["triton_launches"] == 0  # the torch backend launches no Triton kernel
    assert res["host_reads"] == 0  # a step reads nothing back to the host


def test_kernel_parts_by_name(profile_step):
    """Kernel times of profiled steps grouped into the step's parts, per step."""
    kernels = [("head_gemm_kernel", 1200.0), ("_row_stats_kernel", 300.0),
               ("operand_in_place_kernel", 180.0), ("soft_embedding_wgmma_kernel", 1000.0),
               ("split_sum_kernel", 20.0), ("support_kernel", 40.0),
               ("_canvas_update_kernel", 30.0),
               ("void at::native::vectorized_elementwise_kernel<...>", 40.0),
               ("void at::native::_scatter_gather_elementwise_kernel<...>", 20.0)]
    parts = profile_step.kernel_parts(kernels, steps=2)
    assert parts == pytest.approx({"head": 0.6, "statistics": 0.15, "operand": 0.09,
                                   "support": 0.02, "soft embedding": 0.51, "canvas update": 0.015,
                                   "rest": 0.03})


def test_profiled_kernels_reads_profiler_averages(profile_step):
    """Device kernels out of ``key_averages()`` entries (``FunctionEventAvg``: named by ``key``)."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEventAvg

    def average(key, device_type, device_us):
        a = FunctionEventAvg()
        a.key, a.device_type, a.device_time_total = key, device_type, device_us
        return a

    averages = [average("head_gemm_kernel", DeviceType.CUDA, 1200.0),
                average("aten::mm", DeviceType.CPU, 0.0),
                average("cudaLaunchKernel", DeviceType.CPU, 0.0),
                average("idle_kernel", DeviceType.CUDA, 0.0)]
    assert profile_step._profiled_kernels(averages) == [("head_gemm_kernel", 1200.0)]
