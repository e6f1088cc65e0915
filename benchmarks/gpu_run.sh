#!/usr/bin/env bash
# One device call: the GPU tests, then the benchmarks; logs and results land in $OUT.
# Usage on the H200:  source .device/activate && bash benchmarks/gpu_run.sh [--sweep]
set -uo pipefail
export DUOTILE_CACHE=${DUOTILE_CACHE:-/tmp/duotile-cache}
OUT=${OUT:-/tmp/duotile-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, tilelang; print('torch', torch.__version__, 'tilelang', tilelang.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -m gpu tests -q --timeout 300 -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -n 30
python3 benchmarks/bench_kernels.py "$@" 2>&1 | tee "$OUT/bench.log" | tail -n 40
