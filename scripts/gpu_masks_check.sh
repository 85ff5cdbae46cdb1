#!/usr/bin/env bash
# One GPU call for the masked forward kernel (issue 4), from the repository root with .whl carried:
#   (a) GPU tests of the mask / varlen / forward kernel files (pytest-xdist when present),
#       alongside (b) compute-sanitizer memcheck + racecheck on scripts/sanitize_masks.py,
#   (c) the headline unmasked forward benchmark (fp16 (4,16,4096,128), full and causal),
#   (d) scripts/bench_masks.py: the N = 32768 sparsity sweep with its fit, then the mask set (fp16,
#       with FlexAttention; BENCH_SET_ARGS adds flags) and the machinery-cost rows.
# Every step has its own time limit; logs go to $OUT and are packed into logs.tar.gz at the end
# (the device tool returns at most 8 files).
#   BUDGET=280 bash scripts/gpu_masks_check.sh            (SKIP_PRELUDE=1: environment ready)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-280}
TEST_LIMIT=${TEST_LIMIT:-180}
BENCH_SET_ARGS=${BENCH_SET_ARGS-"--no-naive --no-sdpa"}   # "" runs SDPA and naive too
t0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - t0))); }
if [ "${SKIP_PRELUDE:-0}" != 1 ]; then
  . scripts/gpu_prelude.sh > "$OUT/prelude.log" 2>&1 || { cat "$OUT/prelude.log"; exit 1; }
  cat "$OUT/prelude.log"
fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; } | tee "$OUT/device.txt"

echo "=== (a) tests + (b) sanitizer $(date +%T)"
xdist="-n 8"
python3 -c "import xdist" 2>/dev/null || xdist=""
( timeout "$TEST_LIMIT" python3 -m pytest -q $xdist -p no:cacheprovider --durations=8 \
    tests/test_cuda_masks.py tests/test_varlen.py tests/test_mask_mod.py tests/test_cuda_forward.py \
    > "$OUT/tests.log" 2>&1
  echo "tests rc=$?" >> "$OUT/tests.log" ) &
for tool in memcheck racecheck; do
  ( timeout "$TEST_LIMIT" compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 3 \
      python3 scripts/sanitize_masks.py > "$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool rc=$?" >> "$OUT/sanitizer_$tool.log" ) &
done
wait
grep -E "passed|failed|error|rc=" "$OUT/tests.log" | tail -12
grep -B2 -A25 "^_____" "$OUT/tests.log" | head -80
for tool in memcheck racecheck; do
  grep -v "Warn\|warn(" "$OUT/sanitizer_$tool.log" | grep -m 8 -A 4 "=====" | head -40
  tail -3 "$OUT/sanitizer_$tool.log"
done

echo "=== (c) bench_forward headline $(date +%T), $(left) s left"
timeout 60 python3 scripts/bench_forward.py --no-naive --dtype float16 --shape 4,16,4096,128 \
  --out "$OUT/bench_forward.json" --plot "$OUT/bench_forward.png" 2>&1 | tail -8 | tee "$OUT/bench_forward.log"

echo "=== (d) bench_masks: the sweep, then the set $(date +%T), $(left) s left"
if [ "$(left)" -gt 60 ]; then
  timeout 70 python3 scripts/bench_masks.py --reps 3 --no-set \
    --json "$OUT/bench_masks_sweep.json" --png "$OUT/bench_masks_sweep.png" 2>&1 \
    | tee "$OUT/bench_masks_sweep.log" | tail -4
fi
if [ "$(left)" -gt 30 ]; then
  timeout $(( $(left) - 5 )) python3 scripts/bench_masks.py --reps 3 --dtypes float16 --no-sweep \
    $BENCH_SET_ARGS --json "$OUT/bench_masks_set.json" 2>&1 | tee "$OUT/bench_masks_set.log" \
    | python3 -c "
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        print(line.rstrip()); continue
    keys = ('mask', 'overhead_case', 'block_sparsity', 'ours_ms', 'ours_tflops', 'flex_tflops', 'sdpa_tflops', 'speedup_vs_flex', 'max_abs_diff_vs_flex')
    print({k: (round(r[k], 3) if isinstance(r[k], float) else r[k]) for k in keys if k in r})"
fi
echo "=== done $(date +%T)"
# The device tool returns at most 8 files: the logs travel as one archive.
(cd "$OUT" && tar czf logs.tar.gz ./*.log device.txt bench_forward.png 2>/dev/null && rm -f ./*.log device.txt bench_forward.png)
