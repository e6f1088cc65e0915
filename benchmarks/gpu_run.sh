#!/usr/bin/env bash
# Device calls for the H200, one phase per call (each fits the 10-minute limit); logs and
# results land in $OUT. Usage on the H200:
#   source .device/activate && bash benchmarks/gpu_run.sh tests        # pytest -m gpu (about 6 min)
#   source .device/activate && bash benchmarks/gpu_run.sh bench        # bench_kernels.py --sweep (about 4 min)
#   source .device/activate && bash benchmarks/gpu_run.sh tune NAMES   # tune_sweep.py --budget quick --only NAMES
set -uo pipefail
export DUOTILE_CACHE=${DUOTILE_CACHE:-/tmp/duotile-cache}
OUT=${OUT:-/tmp/duotile-out}; mkdir -p "$OUT"
phase=${1:-tests}; shift || true
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, tilelang; print('torch', torch.__version__, 'tilelang', tilelang.__version__)" | tee -a "$OUT/gpu.txt"
case "$phase" in
  tests) python3 -m pytest -m gpu tests -q --timeout 300 -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -n 30 ;;
  bench) python3 benchmarks/bench_kernels.py --sweep "$@" 2>&1 | grep -v "TileLang:" | tee "$OUT/bench.log" | tail -n 45 ;;
  tune)  python3 benchmarks/tune_sweep.py --budget quick --cache-dir "$DUOTILE_CACHE" --out "$OUT" --only "${1:-gemm_fp8}" 2>&1 \
           | grep -v "TileLang:" | tee "$OUT/tune.log" | tail -n 40 ;;
  *) echo "unknown phase $phase (tests | bench | tune NAMES)"; exit 2 ;;
esac
