#!/usr/bin/env bash
# One GPU call for the masked forward kernel (issue 4), from the repository root with .whl carried:
#   (a) GPU tests of the kernel files (pytest-xdist when present), alongside
#   (b) compute-sanitizer memcheck + racecheck on scripts/sanitize_masks.py (masked and unmasked),
#   (c) the headline forward benchmark (fp16 (4,16,4096,128), full and causal; no-regression check),
#   (d) scripts/gpu_studies.sh, (e) scripts/bench_masks.py while time is left.
# Every step has its own time limit; logs go to $OUT and are packed into logs.tar.gz at the end
# (the device tool returns at most 8 files).
#   BUDGET=400 bash scripts/gpu_masks_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-400}
t0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - t0))); }
. scripts/gpu_prelude.sh > "$OUT/prelude.log" 2>&1 || { cat "$OUT/prelude.log"; exit 1; }
cat "$OUT/prelude.log"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; } | tee "$OUT/device.txt"

echo "=== (a) tests + (b) sanitizer $(date +%T)"
xdist="-n 8"
python3 -c "import xdist" 2>/dev/null || xdist=""
( timeout 210 python3 -m pytest -q $xdist -p no:cacheprovider --durations=8 \
    tests/test_cuda_masks.py tests/test_cuda_forward.py tests/test_varlen.py > "$OUT/tests.log" 2>&1
  echo "tests rc=$?" >> "$OUT/tests.log" ) &
for tool in memcheck racecheck; do
  ( timeout 210 compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 3 \
      python3 scripts/sanitize_masks.py > "$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool rc=$?" >> "$OUT/sanitizer_$tool.log" ) &
done
wait
tail -30 "$OUT/tests.log"
for tool in memcheck racecheck; do
  grep -v "Warn\|warn(" "$OUT/sanitizer_$tool.log" | grep -m 8 -A 4 "=====" | head -40
  tail -3 "$OUT/sanitizer_$tool.log"
done

echo "=== (c) bench_forward headline $(date +%T), $(left) s left"
timeout 120 python3 scripts/bench_forward.py --no-naive --dtype float16 --shape 4,16,4096,128 \
  --out "$OUT/bench_forward.json" --plot "$OUT/bench_forward.png" 2>&1 | tail -8 | tee "$OUT/bench_forward.log"

echo "=== (d) studies $(date +%T), $(left) s left"
timeout $(( $(left) > 200 ? 200 : $(left) )) bash scripts/gpu_studies.sh > "$OUT/studies.log" 2>&1
echo "studies rc=$?" | tee -a "$OUT/studies.log"; tail -5 "$OUT/studies.log"

echo "=== (e) bench_masks: sweep, then the set $(date +%T), $(left) s left"
if [ "$(left)" -gt 30 ]; then
  timeout $(( $(left) - 5 )) python3 scripts/bench_masks.py --reps 3 --no-set \
    --json "$OUT/bench_masks_sweep.json" --png "$OUT/bench_masks_sweep.png" 2>&1 | tee "$OUT/bench_masks_sweep.log" | tail -12
fi
if [ "$(left)" -gt 40 ]; then
  timeout $(( $(left) - 5 )) python3 scripts/bench_masks.py --reps 3 --dtypes float16 --no-sweep \
    --json "$OUT/bench_masks_set.json" 2>&1 | tee "$OUT/bench_masks_set.log" | tail -14
fi
echo "=== done $(date +%T)"
# The device tool returns at most 8 files: the logs travel as one archive.
(cd "$OUT" && tar czf logs.tar.gz ./*.log device.txt bench_forward.png 2>/dev/null && rm -f ./*.log device.txt bench_forward.png)
