#!/usr/bin/env bash
# One GPU call for a kernel change: GPU tests (forward, masks, varlen; pytest-xdist) alongside
# compute-sanitizer on small cases, then the same bench_forward shapes for each tree / setting
# in VARIANTS ("name:tree:env", tree "." = this checkout; env e.g. NUMBA_FLASH_MMA_M_TILES=1).
#   VARIANTS="cur:out/cur: new:.: mt1:.:NUMBA_FLASH_MMA_M_TILES=1" bash scripts/gpu_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
. scripts/gpu_prelude.sh > "$OUT/prelude.log" 2>&1 || { cat "$OUT/prelude.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
xdist="-n 10"; python3 -c "import xdist" 2>/dev/null || xdist=""
( timeout "${TEST_LIMIT:-150}" python3 -m pytest -q $xdist -p no:cacheprovider \
    tests/test_cuda_forward.py tests/test_cuda_masks.py tests/test_varlen.py > "$OUT/tests.log" 2>&1
  echo "tests rc=$?" >> "$OUT/tests.log" ) &
for tool in memcheck racecheck; do
  ( timeout "${TEST_LIMIT:-150}" compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 3 \
      python3 scripts/sanitize_case.py --head-dims ${SANITIZE_DIMS:-64,128} > "$OUT/san_$tool.log" 2>&1
    echo "compute-sanitizer $tool rc=$?" >> "$OUT/san_$tool.log" ) &
done
wait
grep -E "passed|failed|rc=" "$OUT/tests.log" | tail -3; grep -B2 -A20 "^_____" "$OUT/tests.log" | head -40
for tool in memcheck racecheck; do grep -h "ERROR SUMMARY\|RACECHECK SUMMARY\|rc=" "$OUT/san_$tool.log"; done
for v in ${VARIANTS:-new:.:}; do
  name=${v%%:*}; rest=${v#*:}; tree=${rest%%:*}; env=${rest#*:}
  pp=$PYTHONPATH; [ "$tree" != "." ] && pp=$PWD/$tree:$PYTHONPATH
  args=${BENCH_ARGS:---no-naive --dtype float16 --shape 4,16,4096,128 --shape 16,16,1024,64 --shape 1,16,16384,128}
  [ "$name" = new ] && args=${args/--no-naive/}     # the naive CuPy column once, for this tree
  echo "--- $name ($tree $env)" | tee -a "$OUT/ab.log"
  env $env PYTHONPATH=$pp timeout 90 python3 scripts/bench_forward.py $args \
    --out "$OUT/ab_$name.json" --plot "$OUT/ab_$name.png" 2>&1 | grep -v "Warn\|main()" | tail -8 | tee -a "$OUT/ab.log"
done
