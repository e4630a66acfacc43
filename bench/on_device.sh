#!/usr/bin/env bash
# One command on the lent GPU machine, its output kept as a log with the header that
# bench/results/ uses ("# <card> (torch X.Y, triton X.Y), <date>. Command: ..."):
#
#   bash bench/on_device.sh NAME command args...     ->  $OUT/NAME.log (and stdout)
#
# Run from the repository root of the device's copy of the tree, where the package is not
# installed: the first call links kernels/ to where it installs (dgemma_sampler.kernels,
# pyproject.toml's package-dir) and puts the root on PYTHONPATH. The command runs in bench/,
# where the benchmark scripts import each other. Its exit status is this script's.
# LIMIT=seconds stops the command after that long (124 then), so that a kernel that hangs (a
# new pipeline's barriers, say) costs that much device time and not the whole call.
set -uo pipefail
name=$1
shift
root=$(cd "$(dirname "$0")/.." && pwd)
[ -e "$root/dgemma_sampler/kernels" ] || ln -s ../kernels "$root/dgemma_sampler/kernels"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
log="${OUT:-$root/bench/results}/$name.log"
card=$(python -c "import torch, triton
v = lambda s: '.'.join(s.split('+')[0].split('.')[:2])
name = torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU (no CUDA device)'
print(f'{name} (torch {v(torch.__version__)}, triton {v(triton.__version__)})')")
echo "# $card, $(date +%F). Command: cd bench && $*" > "$log"
cd "$root/bench" && timeout -k 10 "${LIMIT:-0}" "$@" 2>&1 | tee -a "$log"
