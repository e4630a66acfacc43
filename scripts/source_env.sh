#!/usr/bin/env bash
# Use the source tree without installing it (e.g. on a machine whose Python may not be
# changed): lay the package out as it installs, kernels/ as dgemma_sampler/kernels, under a
# temporary folder and put that on PYTHONPATH. Source it: `. scripts/source_env.sh`.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PKG="${DGEMMA_PKG_DIR:-/tmp/dgemma_sampler_src}"
rm -rf "$PKG" && mkdir -p "$PKG"
cp -r "$ROOT/dgemma_sampler" "$PKG/dgemma_sampler"
cp -r "$ROOT/kernels" "$PKG/dgemma_sampler/kernels"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
