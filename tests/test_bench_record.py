"""The bench of record (``bench/record.py``) and the demo's reading of it (``bench/demo.py``),
on CPU without running any benchmark."""

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench_modules(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    record = importlib.import_module("record")
    demo = importlib.import_module("demo")
    return record, demo


@pytest.mark.parametrize("name, tag", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                       ("cpu", "cpu"), ("Some Accelerator", "some-accelerator")])
def test_card_tag(bench_modules, name, tag):
    record, _ = bench_modules
    assert record.card_tag(name) == tag


def test_run_elsewhere_leaves_the_history_alone(bench_modules, tmp_path, capsys):
    record, _ = bench_modules
    history = tmp_path / "history.jsonl"
    with record.Record("step", tmp_path / "out" / "step.json", history=history) as rec:
        print("a line of the run")
        rec.save({"results": [{"requests": 1}]}, [{"requests": 1}])
    saved = json.loads((tmp_path / "out" / "step.json").read_text())
    for key in ("commit", "card", "torch", "triton", "python", "date", "command"):
        assert key in saved["meta"], key
    log = (tmp_path / "out" / "step.log").read_text().splitlines()
    assert log[0].startswith("# ") and "commit" in log[0] and "a line of the run" in log
    assert not history.exists()
    assert sys.stdout is not None and "a line of the run" in capsys.readouterr().out


def test_run_of_record_appends_one_history_row(bench_modules, tmp_path, monkeypatch):
    record, _ = bench_modules
    monkeypatch.setattr(record, "RESULTS", tmp_path)
    monkeypatch.setattr(record, "card_name", lambda device=None: "NVIDIA H200")
    history = tmp_path / "history.jsonl"
    for _ in range(2):
        with record.Record("row_stats", history=history) as rec:
            rec.save({"results": []}, [{"ms": 1.5}])
    assert (tmp_path / "row_stats-h200.json").exists() and (tmp_path / "row_stats-h200.log").exists()
    rows = record.read_history(history)
    assert len(rows) == 2 and rows[-1]["bench"] == "row_stats" and rows[-1]["figures"] == [{"ms": 1.5}]
    assert rows[-1]["commit"] and rows[-1]["card"] == "NVIDIA H200"


def test_cpu_run_stays_out_of_the_record(bench_modules, tmp_path, monkeypatch):
    record, _ = bench_modules
    monkeypatch.setattr(record, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(record, "card_name", lambda device=None: "cpu")
    monkeypatch.setattr(record.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    history = tmp_path / "results" / "history.jsonl"
    with record.Record("step", history=history) as rec:
        rec.save({"results": []}, [])
    assert (tmp_path / "tmp" / "dgemma-sampler-bench" / "step-cpu.json").exists()
    assert not (tmp_path / "results").exists()


def test_demo_shows_the_latest_recorded_step_per_card(bench_modules, tmp_path, monkeypatch, capsys):
    record, demo = bench_modules
    history = tmp_path / "history.jsonl"

    def step_row(card, commit, ms):
        figures = {"canvas": 256, "vocab": 262144, "hidden": 2816, "logits_dtype": "float32",
                   "rows": [{"requests": n, "ours_ms": ms * n, "materialized_ms": 3.0 * n,
                             "floor_ms": 0.5 * n, "ours_transient_bytes": 2**24,
                             "materialized_transient_bytes": 2**31 * n} for n in (1, 4)]}
        return dict(bench="step", card=card, commit=commit, date="2026-12-06", torch="2.11",
                    triton="3.6", command="python bench/bench_step.py", figures=figures)

    for row in (step_row("NVIDIA H200", "old", 2.0), step_row("cpu", "c", 9.0),
                dict(bench="row_stats", card="NVIDIA H200", figures=[]),
                step_row("NVIDIA H200", "new", 1.0), step_row("NVIDIA H100", "h1", 1.2)):
        record.append_history(row, history)
    monkeypatch.setattr(record, "HISTORY", history)
    runs = demo.recorded_steps(record)
    assert [(r["card"], r["commit"]) for r in runs] == [("NVIDIA H200", "new"), ("NVIDIA H100", "h1")]
    plot = tmp_path / "plot.png"
    demo.show_recorded(runs, str(plot))
    out = capsys.readouterr().out
    assert plot.stat().st_size > 0 and "commit new" in out and "16.0 MiB" in out and "8.0 GiB" in out


def test_demo_table_without_tabulate(bench_modules, monkeypatch):
    _, demo = bench_modules
    monkeypatch.setitem(sys.modules, "tabulate", None)  # import fails: the plain fallback
    text = demo.table([["a", 1.23456, "x"]], ["name", "value", "note"])
    assert text.splitlines()[0].split() == ["name", "value", "note"] and "1.23" in text


@pytest.mark.gpu
def test_gpu_bench_step_writes_its_result_with_meta(bench_modules, tmp_path):
    """On the GPU: the whole-step benchmark at a small shape writes JSON, log and plot with the
    card and versions, and ours agrees with the PyTorch reference."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    bench_step = importlib.import_module("bench_step")
    out = tmp_path / "step.json"
    assert bench_step.main(["--requests", "1,2", "--canvas", "16", "--vocab", "4099", "--hidden", "64",
                            "--no-compile", "--hidden-requests", "2", "--reps", "2",
                            "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["meta"]["card"] == torch.cuda.get_device_name() and saved["meta"]["triton"]
    assert [r["requests"] for r in saved["results"]] == [1, 2]
    for r in saved["results"]:
        assert r["ours_ms"] > 0 and r["ours_transient_bytes"] is not None
        assert r["agreement"]["argmax_equal"] == 1.0 and r["agreement"]["lse_max_rel_err"] < 1e-5
    assert out.with_suffix(".log").exists() and out.with_suffix(".png").exists()
