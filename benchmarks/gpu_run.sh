#!/usr/bin/env bash
# The GPU phases on an H200 with duotile and TileLang importable (bash scripts/install), one phase a
# run, each short enough for a 10-minute job:
#   bash benchmarks/gpu_run.sh tests [ARGS]    # pytest -m gpu [ARGS], 8 workers (about 5 min)
#   bash benchmarks/gpu_run.sh bench [ARGS]    # bench_kernels.py --sweep [ARGS], e.g. --kernels gemm_fp8 --interleave
#   bash benchmarks/gpu_run.sh tune NAMES      # tune_sweep.py --budget quick --only NAMES
#   bash benchmarks/gpu_run.sh profile SPEC:SHAPE ...  # ncu: each kernel and its peer, one launch each
#                                              # (profile_kernel.py: built first in 15 processes)
#   bash benchmarks/gpu_run.sh tune-model KERNEL MODEL [PATTERN ...]
#                                              # duotile tune KERNEL --model MODEL --shapes PATTERN
#                                              # --budget shortlist --jobs 15 --ship: the shipped table
#                                              # for those shapes (copied to $OUT/tuning.json)
#   bash benchmarks/gpu_run.sh grid SPEC ARGS  # config_grid.py SPEC ARGS: configs x model shapes, each
#                                              # checked and timed (e.g. router --shapes 'v41/*'
#                                              # --grid threads=32,64,128,256 --grid ROWS=1,2)
#   bash benchmarks/gpu_run.sh graphs [ARGS]   # graphs_variants.py [ARGS]: the sections' CUDA graphs against
#                                              # eager launches in variants (it builds the default
#                                              # workload's kernels first, in parallel)
#   bash benchmarks/gpu_run.sh prebuild FILE   # duotile build --signatures FILE, 15 processes: the
#                                              # builds a later phase meets (scripts/gpu_signatures.py
#                                              # lists them), into $DUOTILE_CACHE and TileLang's cache
#   bash benchmarks/gpu_run.sh runtime [IDS]   # tests/runtime/test_gpu.py, each test (IDS: test ids of that
#                                              # file; default all) in a pytest process of its own under
#                                              # `timeout $EACH` (default 240 s), so a phase cut short keeps
#                                              # the failures and reports of the tests that finished
#   bash benchmarks/gpu_run.sh sweep [ARGS]    # the fenced shape sweep (tests/gpu/test_shape_sweep.py ARGS,
#                                              # e.g. -k 'topk or sample'), 15 workers, seed $SWEEP_SEED
#                                              # (default: today's date), one line a case in $OUT/sweep.log;
#                                              # SWEEP_SKIP=LOGS leaves out the cases those logs matched
# Phases may be chained: `bash benchmarks/gpu_run.sh bench && bash benchmarks/gpu_run.sh tune gemm_fp8`.
# Each phase runs under `timeout $PHASE_LIMIT` (default 540 s), writes into $WORK, and then packs
# everything into $OUT/<phase>.tgz (tune: tune_<NAMES>.tgz, its tables under $WORK/tune_<NAMES>/, so
# chained sweeps do not overwrite each other); its log and summary table are also copied to $OUT
# (default /tmp/duotile-out).
set -uo pipefail
export DUOTILE_CACHE=${DUOTILE_CACHE:-/tmp/duotile-cache}
OUT=${OUT:-/tmp/duotile-out}; WORK=${WORK:-/tmp/duotile-run}
mkdir -p "$OUT" "$WORK"
limit=${PHASE_LIMIT:-540}
phase=${1:-tests}; shift || true
tag=$phase; [ "$phase" = tune ] && tag="tune_${1:-gemm_fp8}"  # chained sweeps keep their own log and tables
[ "$phase" = tune-model ] && tag="tune_${1:-gemm}_${2:-v41-flash}"
[ "$phase" = grid ] && tag="grid_${1:-spec}"
log="$WORK/$tag.log"
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, tilelang; print('torch', torch.__version__, 'tilelang', tilelang.__version__)"; } >"$log"
case "$phase" in
  tests) par=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")  # builds dominate: eight at once (16 cores)
         # -v: one line a test, so a phase cut short still says which tests finished
         timeout "$limit" python3 -m pytest -m gpu tests -v --timeout 300 -p no:cacheprovider $par "$@" 2>&1 \
           | grep -v "PytestBenchmarkWarning\|warner(" >>"$log" ;;
  bench) timeout "$limit" python3 benchmarks/bench_kernels.py --sweep "$@" 2>&1 | grep -v "TileLang:" >>"$log"
         cp benchmarks/results/kernels_sm90.* "$WORK/" 2>/dev/null ;;
  tune)  timeout "$limit" python3 benchmarks/tune_sweep.py --budget quick --cache-dir "$WORK" --out "$WORK/$tag" \
           --only "${1:-gemm_fp8}" 2>&1 | tr '\r' '\n' | grep -v "TileLang:" >>"$log" ;;  # progress kept: a stall shows where
  profile) python3 benchmarks/profile_kernel.py --build-only "${PREBUILD_JOBS:-15}" "$@" 2>&1 | grep -v "TileLang:" >>"$log"
           timeout "$limit" ncu --clock-control none --profile-from-start off --set "${NCU_SET:-detailed}" \
             --import-source no -f -o "$WORK/profile" python3 benchmarks/profile_kernel.py "$@" 2>&1 \
             | grep -v "TileLang:" >>"$log"
           ncu --import "$WORK/profile.ncu-rep" --page details >"$WORK/profile_details.txt" 2>&1
           cp "$WORK/profile_details.txt" "$OUT/" ;;
  tune-model) kernel=$1 model=$2; shift 2; pats=(); for p in "${@:-*}"; do pats+=(--shapes "$p"); done
         timeout "$limit" python3 -m duotile tune "$kernel" --model "$model" "${pats[@]}" --budget shortlist \
           --jobs "${PREBUILD_JOBS:-15}" --ship --no-progress 2>&1 | grep -v "TileLang:\|ThreadSync" >>"$log"
         cp duotile/tuned/tuning.json "$OUT/" ;;
  grid)  timeout "$limit" python3 benchmarks/config_grid.py --jobs "${PREBUILD_JOBS:-15}" "$@" 2>&1 \
           | grep -v "TileLang:" >>"$log"
         cp benchmarks/results/config_grid_*.md "$OUT/" 2>/dev/null ;;
  graphs) timeout "$limit" python3 benchmarks/graphs_variants.py "$@" 2>&1 | grep -v "TileLang:\|ThreadSync" >>"$log" ;;
  runtime) ids=("$@"); [ ${#ids[@]} -eq 0 ] && mapfile -t ids < <(python3 -m pytest -m gpu --collect-only -q \
             tests/runtime/test_gpu.py 2>/dev/null | grep '::' | sed 's/.*:://')
         end=$(( $(date +%s) + limit ))
         for id in "${ids[@]}"; do
           left=$(( end - $(date +%s) )); [ "$left" -lt 30 ] && { echo "not run (phase limit): $id" >>"$log"; continue; }
           echo "== $id" >>"$log"
           timeout "$(( left < ${EACH:-240} ? left : ${EACH:-240} ))" python3 -m pytest -m gpu -p no:cacheprovider \
             -rA --tb=short -s "tests/runtime/test_gpu.py::$id" 2>&1 | grep -v "TileLang:\|ThreadSync" >>"$log"
           echo "== $id: exit ${PIPESTATUS[0]}" >>"$log"
         done ;;
  sweep) export DUOTILE_SWEEP_SEED=${SWEEP_SEED:-$(date -u +%Y%m%d)} DUOTILE_SWEEP_LOG="$OUT/sweep.log"
         [ -n "${SWEEP_SKIP:-}" ] && export DUOTILE_SWEEP_SKIP=$SWEEP_SKIP
         timeout "$limit" python3 -m pytest -m gpu tests/gpu/test_shape_sweep.py -p no:cacheprovider -n 15 -rfE \
           --timeout 400 "$@" 2>&1 | grep -v "TileLang:\|ThreadSync" >>"$log" ;;
  prebuild) timeout "$limit" python3 -m duotile build --signatures "$1" --target sm90 --jobs "${PREBUILD_JOBS:-15}" \
             2>&1 | grep -v "TileLang:\|Warning: \[ThreadSync\]" >>"$log" ;;
  *) echo "unknown phase $phase (tests | bench | tune NAMES | tune-model KERNEL MODEL [PATTERN ...] | profile [ARGS]" \
          "| grid SPEC [ARGS] | graphs [ARGS] | prebuild FILE | runtime [IDS] | sweep [ARGS])"; exit 2 ;;
esac
status=$?
tail -n 45 "$log"
cp "$log" "$OUT/"
[ -f "$WORK/$tag/tune_sm90.md" ] && cp "$WORK/$tag/tune_sm90.md" "$OUT/$tag.md"
[ -f "$WORK/kernels_sm90.md" ] && cp "$WORK/kernels_sm90.md" "$OUT/"
tar czf "$OUT/$tag.tgz" -C "$WORK" .
exit $status
