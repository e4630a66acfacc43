#!/usr/bin/env bash
# Create (or reuse) the project virtualenv and install the package with its test and bench
# extras. Sourced by demo.sh and test.sh, so a fresh machine needs nothing beforehand.
# VENV overrides the location; EXTRAS the extras (default "test,bench").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
EXTRAS="${EXTRAS:-test,bench}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
if ! python -c "import torch" >/dev/null 2>&1; then
    # A pinned release: on CPU-only machines pip takes the local CPU wheel; an unpinned
    # torch would pull a multi-GB CUDA build.
    python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
python -m pip install -q -e "$ROOT[$EXTRAS]"
