#!/usr/bin/env bash
# One command on a GPU machine that has the source tree but not the installed package, its
# output kept as a log headed with the card, versions, date, commit and command:
#
#   bash tools/on_device.sh NAME command args...     ->  $OUT/NAME.log (and stdout)
#
# e.g. `bash tools/on_device.sh step python bench_step.py`, or
# `bash tools/on_device.sh gpu-tests python -m pytest -q -m gpu -p no:cacheprovider ../tests`.
# The first call links kernels/ to where it installs (dgemma_sampler.kernels, pyproject.toml's
# package-dir) and puts the repository root on PYTHONPATH. The command runs in bench/, where the
# benchmark scripts are (tools: ../tools/NAME.py; tests: ../tests/...); benchmarks write their
# own results of record under bench/results/ as well. The log goes to $OUT (default /tmp).
# Its exit status is the command's. LIMIT=seconds stops the command after that long (124
# then), so that a kernel that hangs costs that much device time and not the whole call.
set -uo pipefail
name=$1
shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ -e "$root/dgemma_sampler/kernels" ] || ln -s ../kernels "$root/dgemma_sampler/kernels"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
log="${OUT:-/tmp}/$name.log"
card=$(python -c "import torch, triton
v = lambda s: '.'.join(s.split('+')[0].split('.')[:2])
name = torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU (no CUDA device)'
print(f'{name} (torch {v(torch.__version__)}, triton {v(triton.__version__)})')")
# A copy of the tree without .git: DGEMMA_BENCH_COMMIT=<sha> names the commit (the benchmarks'
# results of record read it too).
commit=${DGEMMA_BENCH_COMMIT:-$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "# $card, $(date +%F), commit $commit. Command: cd bench && $*" > "$log"
cd "$root/bench" && timeout -k 10 "${LIMIT:-0}" "$@" 2>&1 | tee -a "$log"
