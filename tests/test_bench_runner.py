"""``bench/bench_runner.py`` on the CPU at a small shape: the primary rows are timed in turns
(``bench_step.interleaved_timer``) and each row carries every figure and ratio of the table,
with a stand-in for vLLM's row-statistics module in place of the real one."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return importlib.import_module("bench_step"), importlib.import_module("bench_runner")


def test_interleaved_timer_takes_turns(bench):
    bench_step, _ = bench
    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in "abc"}
    ms = bench_step.interleaved_timer(fns, warmup=1, reps=6, cuda=False)
    assert set(ms) == set("abc") and all(t >= 0 for t in ms.values())
    # warm-up once each, then six rounds, each timing every function once
    assert order[:3] == list("abc")
    rounds = [order[3 + 3 * r: 6 + 3 * r] for r in range(6)]
    assert all(sorted(r) == list("abc") for r in rounds)
    # in shuffled orders (seeded: the same every run), so no function keeps its predecessor
    assert len({tuple(r) for r in rounds}) > 1
    again = []
    bench_step.interleaved_timer({n: (lambda n=n: again.append(n)) for n in "abc"}, 1, 6, False)
    assert again == order


def test_lead_is_gpu_only(bench):
    """The host's head start is GPU cycles queued before the start event: none on a CPU."""
    bench_step, _ = bench
    assert bench_step.lead_cycles(2.0, cuda=False) == 0
    assert bench_step.lead_cycles(0.0, cuda=True) == 0
    calls = []
    ms = bench_step.interleaved_timer({"a": lambda: calls.append(1)}, 0, 2, False, lead_ms=2.0,
                                      no_lead=frozenset({"a"}))
    assert calls == [1, 1] and ms["a"] >= 0


@pytest.mark.parametrize("n", [1, 2])
def test_measure_row(bench, n):
    _, runner = bench
    from test_vllm_paths import stand_in_kernels

    args = SimpleNamespace(canvas=8, vocab=301, hidden=16, reps=2, no_secondary=True)
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) / 4).to(torch.bfloat16)
    kernels = stand_in_kernels()
    row = runner.measure(n, args, weight, kernels, "cpu", gen, warmup=1)
    for key in ("floor_head_ms", "floor_soft_ms", "our_head_ms", "adapter_ms", "adapter_idle_ms",
                "native_ms", "vllm_ms"):
        assert row[key] > 0, key
    assert row["our_head_vs_floor_head"] == row["our_head_ms"] / row["floor_head_ms"]
    assert row["floor_ms"] == row["floor_head_ms"] + row["floor_soft_ms"]
    assert row["adapter_vs_floor"] == row["adapter_ms"] / row["floor_ms"]
    assert row["adapter_vs_vllm"] == row["adapter_ms"] / row["vllm_ms"]
    assert row["native_vs_adapter"] == row["native_ms"] / row["adapter_ms"]
    assert row["adapter_tile_requests"] == n and row["vllm_tiles"]
    assert len(kernels.calls) >= 3  # vLLM's path ran: warm-up and both rounds
