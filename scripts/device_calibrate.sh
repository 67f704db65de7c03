#!/usr/bin/env bash
# Measure H200 profiles, each with its end-to-end check, on a lent GPU.
# From the repository root on the GPU machine (the device tool's `run`):
#     bash scripts/device_calibrate.sh [cuda|cpu] [MODEL ...]      (default: llama-3-8b)
# It needs PyTorch with CUDA, numpy, pandas and click there (kvsim calibrate imports
# nothing else), so it runs kvsim from the source tree without installing it. What it
# writes goes to $OUT: the GPU's description and, per model, the profile folder
# (profile-MODEL/) and its report; progress goes to stderr. The run of 2026-11-30 is in
# tests/data/h200-calibrate/ (README: Measured on an H200).
# `bash scripts/device_calibrate.sh cpu` rehearses it here (quick grids, widths / 8).
set -euo pipefail
device=${1:-cuda}
shift || true
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(llama-3-8b)
out=${OUT:-/tmp/kvsim-device}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
kvsim() { python3 -c 'import sys; from kvsim.cli.app import main; sys.exit(main(sys.argv[1:]))' "$@"; }
if [ "$device" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/gpu.txt"
    # a smoke test first (seconds), so a broken CUDA path fails before the long runs
    kvsim calibrate --model "${models[0]}" --device cuda --quick --out /tmp/kvsim-quick
    grid=()
else
    grid=(--quick)
fi
for model in "${models[@]}"; do
    start=$SECONDS
    kvsim calibrate --model "$model" --device "$device" ${grid[@]+"${grid[@]}"} --out "$out/profile-$model"
    kvsim calibrate --report "$out/profile-$model" | tee "$out/report-$model.txt"
    echo "$model: $((SECONDS - start)) s"
done
