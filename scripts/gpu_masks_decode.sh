#!/usr/bin/env bash
# One GPU call after a change to the mask pass and the decode merge tail (session of 2026-11-23):
#   (a) GPU tests of the mask, varlen, mask_mod, decode and merge files, beside (b)
#       compute-sanitizer memcheck + racecheck on scripts/sanitize_masks.py and sanitize_decode.py;
#   (c) bench_masks.py's mask set (float16 and bfloat16, FlexAttention / SDPA / naive peers);
#   (d) the N=32768 sparsity sweep (float16);
#   (e) the decode merge tail A/B on (1, 32, 32, 8192) fp16, contiguous, at 12 / 14 / 16 splits.
# Logs and JSON under $OUT; the summary comes last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
. scripts/gpu_prelude.sh > "$OUT/prelude.log" 2>&1 || { cat "$OUT/prelude.log"; exit 1; }
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$OUT/device.txt"
echo "=== (a) tests + (b) sanitizers $(date +%T)"
( timeout "${TEST_LIMIT:-240}" python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_cuda_masks.py \
    tests/test_varlen.py tests/test_mask_mod.py tests/test_decode.py tests/test_merge_api.py \
    > "$OUT/tests.log" 2>&1; echo "tests rc=$?" >> "$OUT/tests.log" ) &
for case in sanitize_masks sanitize_decode; do
  for tool in memcheck racecheck; do
    ( timeout "${TEST_LIMIT:-240}" compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 3 \
        python3 scripts/$case.py > "$OUT/${case}_$tool.log" 2>&1
      echo "compute-sanitizer $case $tool rc=$?" >> "$OUT/${case}_$tool.log" ) &
  done
done
wait
echo "=== (c) mask set $(date +%T)"
timeout "${SET_LIMIT:-150}" python3 scripts/bench_masks.py --reps 5 --no-sweep --json "$OUT/bench_masks_set.json" \
  > "$OUT/bench_masks_set.log" 2>&1
echo "=== (d) sweep $(date +%T)"
timeout "${SWEEP_LIMIT:-100}" python3 scripts/bench_masks.py --reps 3 --dtypes float16 --no-set --no-naive --no-sdpa \
  --json "$OUT/bench_masks_sweep.json" --png "$OUT/bench_masks_sweep.png" > "$OUT/bench_masks_sweep.log" 2>&1
echo "=== (e) decode tail A/B $(date +%T)"
timeout "${DECODE_LIMIT:-100}" python3 scripts/bench_decode.py --tiles '32,2,1,1,0,old;32,2,1,1,0,new;32,2,1,1,0,old;32,2,1,1,0,new' \
  --tile-shapes 3 --tile-splits 12,14,16 --tile-pages none --no-table --out "$OUT/bench_decode_tail.json" \
  > "$OUT/bench_decode_tail.log" 2>&1
echo "=== summary $(date +%T)"
grep -E "passed|failed|rc=" "$OUT/tests.log" | tail -3; grep -h "^FAILED\|^ERROR" "$OUT/tests.log" | head -20
for f in "$OUT"/sanitize_*.log; do echo "$(basename $f): $(grep -c '^========= [A-Z]' $f) reports; $(tail -1 $f)"; done
python3 - "$OUT/bench_masks_set.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("overhead", []):
    print(f"{r['dtype']:8} overhead {r['overhead_case']:22} {r['ours_ms']:.3f} ms")
for r in d.get("set", []):
    print(f"{r['dtype']:8} {r['mask']:22} ours {r['ours_ms']:.3f} ms {r['ours_tflops']:6.1f} TF/s  "
          f"flex {r.get('flex_ms', float('nan')):.3f} ms  x flex {r.get('speedup_vs_flex', float('nan')):.2f}  "
          f"x sdpa {r.get('speedup_vs_sdpa', float('nan')):.2f}")
PY
grep -i "r\^2\|slope\|R2" "$OUT/bench_masks_sweep.log" | tail -4
grep -v "Warn\|warn(" "$OUT/bench_decode_tail.log" | tail -16
cd "$OUT" && tar czf logs.tar.gz --exclude=logs.tar.gz *.log device.txt && rm -f *.log
