#!/usr/bin/env bash
# Build the sdist and the wheel as a release would, and check what a user gets (minutes, so not
# part of the test suite; tests/test_packaging.py checks the rules behind it in a second):
#   - the sdist carries the package, README, LICENSE, CHANGELOG and pyproject, and none of the
#     repository-only folders (tests, bench, tools, scripts, docs, .ci);
#   - the wheel, installed with --no-deps into a fresh virtualenv beside torch and numpy,
#     imports (kernels/ as dgemma_sampler.kernels) and declares the vLLM plugin entry point;
#   - pip builds the same wheel from the sdist alone.
#   bash tools/check_dist.sh        PYTHON: the interpreter that builds (default .venv's);
#                                   TORCH_VERSION: torch for the fresh virtualenv (2.13.0)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

"$PY" -m build --version >/dev/null 2>&1 || "$PY" -m pip install -q build
# The sdist first, then the wheel built from it.
"$PY" -m build -o "$WORK/dist" "$ROOT" >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
sdist="$(ls "$WORK"/dist/*.tar.gz)"
wheel="$(ls "$WORK"/dist/*.whl)"
echo "built $(basename "$sdist") and $(basename "$wheel")"

tar tzf "$sdist" | sed 's|^[^/]*/||' | grep -v '/$' | sort >"$WORK/sdist.txt"
bad="$(grep -E '^(tests|bench|tools|scripts|docs|\.ci)/' "$WORK/sdist.txt" || true)"
if [ -n "$bad" ]; then
    echo "the sdist carries repository-only files:"; echo "$bad"; exit 1
fi
for f in README.md LICENSE CHANGELOG.md pyproject.toml dgemma_sampler/__init__.py \
         dgemma_sampler/py.typed kernels/contract.py; do
    grep -qx "$f" "$WORK/sdist.txt" || { echo "the sdist lacks $f"; exit 1; }
done
echo "sdist: $(wc -l <"$WORK/sdist.txt") files, no repository-only folder"

python3 -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}" numpy
"$VPY" -m pip install -q --no-deps "$wheel"
# Outside the checkout, so that the installed package is the one imported.
(cd "$WORK" && "$VPY" - <<'EOF'
import importlib.metadata as metadata

import dgemma_sampler
import dgemma_sampler.kernels.contract  # noqa: F401

assert "site-packages" in dgemma_sampler.__file__, dgemma_sampler.__file__
assert metadata.version("dgemma-sampler") == dgemma_sampler.__version__
plugins = {e.name: e.value for e in metadata.entry_points(group="vllm.general_plugins")}
assert plugins == {"dgemma_sampler": "dgemma_sampler.vllm.plugin:register"}, plugins
meta = metadata.metadata("dgemma-sampler")
assert meta.get_all("Project-URL") and meta.get_all("Classifier"), "urls or classifiers missing"
print(f"wheel: dgemma_sampler {dgemma_sampler.__version__} imports; vllm.general_plugins entry point")
EOF
)

"$VPY" -m pip wheel -q --no-deps "$sdist" -w "$WORK/from-sdist"
if ! cmp -s <(unzip -Z1 "$wheel" | sort) <(unzip -Z1 "$WORK"/from-sdist/*.whl | sort); then
    echo "pip's wheel from the sdist holds other files than the built wheel"; exit 1
fi
echo "pip wheel from the sdist: the same files"
