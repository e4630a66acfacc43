#!/usr/bin/env bash
# The main job (bench/demo.py). With a CUDA device it benchmarks one DiffusionGemma decode step
# at the real shape (bench/bench_step.py; extra arguments go there) and records the result.
# Without one it says that speed is not measured on a CPU, checks the Triton kernels against the
# PyTorch reference through the interpreter, shows a seed reproducing a step whatever the batch,
# and shows the GPU results of record with a plot.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
python bench/demo.py "$@"
