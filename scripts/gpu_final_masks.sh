#!/usr/bin/env bash
# Last GPU call of the 2026-11-23 session: the mask, varlen and mask_mod tests and the decode
# bit-reproducibility test on the final kernels beside compute-sanitizer on the mask cases, then scripts/mask_profile.py (host,
# device and single-call times, ours and FlexAttention) and bench_masks.py's mask set.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
. scripts/gpu_prelude.sh > "$OUT/prelude.log" 2>&1 || { cat "$OUT/prelude.log"; exit 1; }
date -u | tee "$OUT/device.txt"
( timeout "${TEST_LIMIT:-170}" python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_cuda_masks.py \
    tests/test_varlen.py tests/test_mask_mod.py tests/test_decode.py::test_gpu_pdl_same_bits \
    > "$OUT/tests.log" 2>&1; echo "tests rc=$?" >> "$OUT/tests.log" ) &
for tool in memcheck racecheck; do
  ( timeout "${TEST_LIMIT:-170}" compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 3 \
      python3 scripts/sanitize_masks.py > "$OUT/sanitize_masks_$tool.log" 2>&1
    echo "compute-sanitizer sanitize_masks $tool rc=$?" >> "$OUT/sanitize_masks_$tool.log" ) &
done
wait
timeout 100 python3 scripts/mask_profile.py > "$OUT/mask_profile.log" 2>&1
timeout "${SET_LIMIT:-110}" python3 scripts/bench_masks.py --reps 5 --no-sweep --no-naive \
  --json "$OUT/bench_masks_set.json" > "$OUT/bench_masks_set.log" 2>&1
echo "=== summary $(date +%T)"
grep -E "passed|failed|rc=" "$OUT/tests.log" | tail -3; grep -h "^FAILED\|^ERROR" "$OUT/tests.log" | head -20
for f in "$OUT"/sanitize_*.log; do echo "$(basename $f): $(grep -c '^========= [A-Z]' $f) reports; $(tail -1 $f)"; done
grep -v "Warn\|warn(" "$OUT/mask_profile.log" | tail -11
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
cd "$OUT" && tar czf logs.tar.gz --exclude=logs.tar.gz *.log device.txt && rm -f *.log
