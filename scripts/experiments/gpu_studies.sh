#!/usr/bin/env bash
# On the GPU machine (from the repository root, .whl carried): the stability studies that have a
# GPU part, full size, with the CUDA kernels measured next to the emulation. Everything lands in
# one archive, $OUT/studies.tar.gz (the device tool returns at most 8 files).
set -uo pipefail
source scripts/gpu_prelude.sh || exit 1
out=${OUT:-out}/studies
mkdir -p "$out"
for name in seqlen logit_scale split_kv sinks p_precision; do
  echo "=== study $name"
  python3 -m numba_flash study "$name" --gpu on --no-progress --out "$out/$name" 2>&1 | tail -40
done
tar -czf "${OUT:-out}/studies.tar.gz" -C "$out" . && rm -rf "$out"
