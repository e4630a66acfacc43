#!/usr/bin/env bash
# The test suite. On a CPU-only machine the Triton kernels run through the interpreter;
# GPU tests are skipped without CUDA.
#
# With DGEMMA_TEST_VLLM=1 it then builds a second virtualenv (.venv-vllm: vLLM 0.33 pins its
# own torch, a ~9.5 GB CUDA build, ~6 minutes) and runs the vLLM parity tests (-m vllm) there.
# Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/setup_env.sh"
cd "$ROOT"

run_pytest() {
    # pytest exits 5 when it collected no test (e.g. a filter matched nothing): not a failure.
    set +e
    "$@"
    local rc=$?
    set -e
    if [ "$rc" -eq 5 ]; then
        echo "pytest collected no tests"
        return 0
    fi
    return "$rc"
}

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    export TRITON_INTERPRET=1
fi
run_pytest python -m pytest -q -p no:cacheprovider "$@"

if [ "${DGEMMA_TEST_VLLM:-0}" = "1" ]; then
    VLLM_VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
    if [ ! -x "$VLLM_VENV/bin/python" ]; then
        python3 -m venv "$VLLM_VENV"
        "$VLLM_VENV/bin/python" -m pip install -q -U pip
    fi
    "$VLLM_VENV/bin/python" -m pip install -q -e "$ROOT[vllm,test]"
    # vLLM imports Triton at import time: the interpreter must be chosen before that.
    TRITON_INTERPRET=1 run_pytest "$VLLM_VENV/bin/python" -m pytest -q -p no:cacheprovider -m vllm "$@"
fi
