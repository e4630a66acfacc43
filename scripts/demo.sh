#!/usr/bin/env bash
# The main job: benchmark one DiffusionGemma decode step on a workload sized for this device
# (the real shape on a GPU, a scaled one on a CPU), printing time, transient memory and
# agreement with the PyTorch reference. Extra arguments go to bench/bench_step.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
python bench/bench_step.py "$@"
