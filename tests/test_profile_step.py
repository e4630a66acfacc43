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
