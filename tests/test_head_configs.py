"""``tools/head_configs.py`` parses tiles, refuses bad ones by name, and compares a tile's logits
with the reference tile's bit for bit (in the interpreter on a CPU; timing needs CUDA)."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def head_configs(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    return importlib.import_module("head_configs")


def test_parse_config():
    from dgemma_sampler.kernels.head_gemm import CONFIG, HeadConfig

    assert HeadConfig.parse("128x256x64/g8/w8/s3") == CONFIG
    assert HeadConfig.parse(CONFIG.spec) == CONFIG
    assert HeadConfig.parse(" 64x128x32/g1/w4/s5 ") == HeadConfig(64, 128, 32, 1, 4, 5)
    split = HeadConfig.parse("128x256x64/g8/w8/s4/e2")
    assert split == HeadConfig(128, 256, 64, 8, 8, 4, epilogue_split=2)
    assert split.spec == "128x256x64/g8/w8/s4/e2" and HeadConfig.parse("16x32x16/g2/w4/s1/e1").spec \
        == "16x32x16/g2/w4/s1"


@pytest.mark.parametrize("spec", ["128x256", "128x256x64/g8/w8", "96x256x64/g8/w8/s3",
                                  "8x256x64/g8/w8/s3", "128x256x64/g0/w8/s3",
                                  "128x256x64/g8/w3/s3", "128x256x64/g8/w8/s0",
                                  "128x256x64/g8/w8/s4/e4", "128x16x64/g8/w8/s4/e2"])
def test_bad_tiles_are_refused(spec):
    from dgemma_sampler.kernels.head_gemm import HeadConfig

    with pytest.raises(ValueError, match="BM|GROUP_M|tile is|epilogue"):
        HeadConfig.parse(spec)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU (interpreter) half of the tool")
def test_compare_in_the_interpreter(head_configs):
    from dgemma_sampler.kernels import head_gemm

    spec = head_gemm.INTERPRETER_CONFIG.spec
    other, split = "32x16x16/g1/w4/s1", spec + "/e2"
    rows = head_configs.compare([spec, other, split], [1, 2], 9, 301, 40, 1, torch.device("cpu"))
    assert [(r["tile"], r["requests"]) for r in rows] == [
        (spec, 1), (other, 1), (split, 1), (spec, 2), (other, 2), (split, 2)]
    # the reference against itself, other M/N tiles, the epilogue stored in two slices
    assert all(r["same_bits"] for r in rows)
    assert all("ms" not in r for r in rows)  # no time on a CPU


def test_candidates_compile_for_sm90_and_fit(head_configs):
    """Every default candidate compiles for sm_90 without spills and fits its shared memory, so a
    device run spends no time on a tile that cannot launch (``tools/compile_sm90.py``, the Triton
    installed here; the device runs 3.6)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "compile_sm90.py"), "--head",
                          "--head-configs", ",".join(head_configs.CANDIDATES)],
                         env=env, capture_output=True, text=True, timeout=600)
    report = [line for line in run.stdout.splitlines() if " shared " in line]
    assert run.returncode == 0 and len(report) == len(head_configs.CANDIDATES), \
        run.stdout[-2000:] + run.stderr[-2000:]
    for line in report:
        assert "(launches)" in line and "0 bytes spill stores" in line, line
