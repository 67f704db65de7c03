#!/usr/bin/env bash
# Measure an H200 profile for Llama-3-8B, with its end-to-end check, on a lent GPU.
# From the repository root on the GPU machine (the device tool's `run`):
#     bash scripts/device_calibrate.sh
# It needs PyTorch with CUDA, numpy, pandas and click there (kvsim calibrate imports
# nothing else), so it runs kvsim from the source tree without installing it. What it
# writes goes to $OUT: the profile folder, the logs and the report. Ship the profile as
# kvsim/data/profiles/h200-llama-3-8b/ and add it to the README's accuracy table.
# `bash scripts/device_calibrate.sh cpu` rehearses it here (quick grids, widths / 8).
set -euo pipefail
device=${1:-cuda}
out=${OUT:-/tmp/kvsim-device}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
kvsim() { python3 -c 'import sys; from kvsim.cli.app import main; sys.exit(main(sys.argv[1:]))' "$@"; }
if [ "$device" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/gpu.txt"
    # a smoke test first (seconds), so a broken CUDA path fails before the long run
    kvsim calibrate --model llama-3-8b --device cuda --quick --out /tmp/kvsim-quick 2>&1 | tee "$out/quick.log"
    grid=()
else
    grid=(--quick)
fi
kvsim calibrate --model llama-3-8b --device "$device" ${grid[@]+"${grid[@]}"} --out "$out/profile" 2>&1 | tee "$out/full.log"
kvsim calibrate --report "$out/profile" | tee "$out/report.txt"
