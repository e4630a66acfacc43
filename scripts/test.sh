#!/usr/bin/env bash
# The test suite. On a CPU-only machine the Triton kernels run through the interpreter;
# GPU tests are skipped without CUDA.
#
# With DGEMMA_TEST_VLLM=1 it then runs the vLLM tests (-m vllm) once per supported vLLM release,
# each in its own virtualenv (scripts/vllm_venv.sh builds or reuses it; vLLM pins its own torch,
# a ~9.5 GB CUDA build, ~5-6 minutes fresh): VLLM33_VENV (default .venv-vllm33) and VLLM34_VENV
# (default .venv-vllm34). DGEMMA_VLLM_RELEASES picks the releases (default "0.33 0.34").
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

# The linter first: pyproject.toml's [tool.ruff] configuration, which the code passes.
ruff check "$ROOT"
# Then the type checker ([tool.mypy]). It reads the source tree, where kernels/ is not under its
# installed name, dgemma_sampler.kernels, and it cannot see the editable install's import hook
# that maps one to the other: link it there, as tools/on_device.sh does (the link is gitignored).
[ -e "$ROOT/dgemma_sampler/kernels" ] || ln -s ../kernels "$ROOT/dgemma_sampler/kernels"
mypy "$ROOT/dgemma_sampler"

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    export TRITON_INTERPRET=1
fi
run_pytest python -m pytest -q -p no:cacheprovider "$@"

if [ "${DGEMMA_TEST_VLLM:-0}" = "1" ]; then
    for release in ${DGEMMA_VLLM_RELEASES:-0.33 0.34}; do
        case "$release" in
            0.33) venv="${VLLM33_VENV:-$ROOT/.venv-vllm33}" ;;
            0.34) venv="${VLLM34_VENV:-$ROOT/.venv-vllm34}" ;;
            *) echo "DGEMMA_VLLM_RELEASES: unknown vLLM release $release" >&2; exit 2 ;;
        esac
        bash "$ROOT/scripts/vllm_venv.sh" "$release" "$venv"
        echo "vLLM $release tests ($venv)"
        # vLLM imports Triton at import time: the interpreter must be chosen before that.
        TRITON_INTERPRET=1 run_pytest "$venv/bin/python" -m pytest -q -p no:cacheprovider -m vllm "$@"
    done
fi
