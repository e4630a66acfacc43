#!/usr/bin/env bash
# Build (or reuse) the virtualenv in which the vLLM tests of one release run:
#   bash scripts/vllm_venv.sh RELEASE DIR        RELEASE: 0.33 or 0.34
# A DIR whose vllm is already that release is reused as it is; the project is then installed
# into it (editable, with the test extra) so that vLLM finds the plugin's entry point.
# vLLM pins its own torch (a CUDA build, ~9.5 GB): a fresh build takes minutes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RELEASE="$1"
VENV="$2"
case "$RELEASE" in
    0.33) WANT=0.33.0 ;;
    0.34) WANT=0.34.0 ;;
    *) echo "vllm_venv.sh: unknown vLLM release $RELEASE (0.33 or 0.34)" >&2; exit 2 ;;
esac

installed() {
    "$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('vllm'))" 2>/dev/null || true
}

if [ "$(installed)" != "$WANT" ]; then
    echo "building $VENV for vLLM $WANT"
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    pip_install() { "$VENV/bin/python" -m pip install -q "$@"; }
    pip_install -U pip
    pip_install -r "$ROOT/requirements/vllm-0.33.txt"
    if [ "$RELEASE" = "0.34" ]; then
        # 0.34.0's own pins cannot all be met here (requirements/vllm-0.34.txt says why).
        pip_install --no-deps "vllm==$WANT"
        pip_install -r "$ROOT/requirements/vllm-0.34.txt"
    fi
    [ "$(installed)" = "$WANT" ] || { echo "vllm_venv.sh: $VENV has vllm $(installed), not $WANT" >&2; exit 1; }
fi
"$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
