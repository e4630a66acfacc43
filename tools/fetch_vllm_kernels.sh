#!/usr/bin/env bash
# vLLM's DiffusionGemma row-statistics kernel module, made runnable without vLLM, for the
# benchmarks that time vLLM's own sampler paths in the same run as ours
# (bench/vllm_paths.py; `bench/bench_step.py --vllm-kernels FILE`).
#
#   bash tools/fetch_vllm_kernels.sh [VERSION] [OUT]          # pip download --no-deps vllm==VERSION
#   bash tools/fetch_vllm_kernels.sh --from-venv DIR [OUT]    # a vLLM installed in the virtualenv DIR
#   bash tools/fetch_vllm_kernels.sh --wheel FILE [OUT]       # a vLLM wheel already downloaded
#
# VERSION defaults to 0.34.0, OUT to .vllm_kernels/diffusion_gemma_sampler.py (git ignores
# .vllm_kernels/). It takes vllm/model_executor/models/diffusion_gemma_sampler.py out of the
# release (the same file from 0.31 to 0.34), replaces its one vLLM import
# (`from vllm.triton_utils import tl, triton`) by plain `import triton` /
# `import triton.language as tl`, heads it with a comment naming its origin, and prints where it
# went. With --from-venv, a VERSION given as well must be the installed one.
#
# The file is vLLM's code (Apache-2.0): it is used at run time only and never committed. The GPU
# machines reach no package index, so fetch it on a machine that does and copy .vllm_kernels/
# there with the source tree.
set -euo pipefail

usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
member=vllm/model_executor/models/diffusion_gemma_sampler.py
venv="" wheel="" positional=()
while [ $# -gt 0 ]; do
    case $1 in
        --from-venv) [ $# -ge 2 ] || usage; venv=$2; shift 2 ;;
        --wheel) [ $# -ge 2 ] || usage; wheel=$2; shift 2 ;;
        -h|--help) usage ;;
        -*) echo "unknown option $1" >&2; usage ;;
        *) positional+=("$1"); shift ;;
    esac
done
version="" out=""
if [ -n "$venv" ] || [ -n "$wheel" ]; then
    # One positional argument is OUT; two are VERSION (checked against the source) and OUT.
    case ${#positional[@]} in
        0) ;;
        1) out=${positional[0]} ;;
        2) version=${positional[0]}; out=${positional[1]} ;;
        *) usage ;;
    esac
else
    [ ${#positional[@]} -le 2 ] || usage
    version=${positional[0]:-0.34.0}
    out=${positional[1]:-}
fi
out=${out:-$root/.vllm_kernels/diffusion_gemma_sampler.py}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [ -z "$venv" ] && [ -z "$wheel" ]; then
    echo "downloading vllm==$version (no dependencies; ~240 MB) ..." >&2
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" "vllm==$version"
    wheel=$(ls "$tmp"/vllm-*.whl)
fi

# Extract (from the venv's site-packages or the wheel), rewrite the import, check, write.
"$python" - "$member" "$out" "${venv:-}" "${wheel:-}" "$version" <<'EOF'
import glob
import os
import re
import sys
import zipfile

member, out, venv, wheel, want = sys.argv[1:6]
if venv:
    hits = glob.glob(os.path.join(venv, "lib", "python*", "site-packages", member))
    if not hits:
        sys.exit(f"no {member} under {venv}/lib/python*/site-packages: is vLLM installed there?")
    metas = glob.glob(os.path.join(os.path.dirname(hits[0]), "..", "..", "..", "vllm-*.dist-info"))
    have = re.sub(r"^vllm-|\.dist-info$", "", os.path.basename(metas[0])) if metas else "unknown"
    with open(hits[0]) as f:
        source = f.read()
    origin = f"vllm=={have} (installed in {os.path.abspath(venv)})"
else:
    have = os.path.basename(wheel).split("-")[1]
    with zipfile.ZipFile(wheel) as z:
        try:
            source = z.read(member).decode()
        except KeyError:
            sys.exit(f"{wheel} has no {member}: DiffusionGemma's sampler came with vLLM 0.31")
    origin = f"vllm=={have} (wheel {os.path.basename(wheel)})"
if want and have != want:
    sys.exit(f"asked for vllm=={want} but the source holds vllm=={have}")

vllm_import = "from vllm.triton_utils import tl, triton\n"
if source.count(vllm_import) != 1:
    sys.exit(f"{member} of {origin} no longer imports exactly {vllm_import.strip()!r}: "
             "read it and update tools/fetch_vllm_kernels.sh")
source = source.replace(vllm_import, "import triton\nimport triton.language as tl\n")
left = [line for line in source.splitlines() if re.match(r"\s*(from|import)\s+vllm\b", line)]
if left:
    sys.exit(f"vLLM imports left after the rewrite: {left}")
if "def sample_row_stats(" not in source:
    sys.exit(f"{member} of {origin} has no sample_row_stats")
compile(source, out, "exec")
head = (f"# Taken from {origin} by tools/fetch_vllm_kernels.sh.\n"
        "# dgemma-sampler replaced `from vllm.triton_utils import tl, triton` by plain triton imports.\n"
        "# vLLM's code (Apache-2.0), for run-time baselines only: never commit it.\n")
os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
with open(out, "w") as f:
    f.write(head + source)
EOF
echo "$out"
