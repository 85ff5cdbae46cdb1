#!/usr/bin/env bash
# One GPU call that verifies every forward-kernel change and records its figures:
#   (a) the GPU tests of the forward, mask, varlen and mask_mod files (pytest-xdist when present),
#       alongside (b) compute-sanitizer memcheck + racecheck on scripts/sanitize_case.py (every
#       dtype's kernel) and scripts/sanitize_masks.py;
#   (c) scripts/bench_forward.py (the issue's shapes, fp16 and bf16, SDPA and naive CuPy peers);
#   (d) scripts/bench_exact.py (fp32 / fp64 kernels against SDPA and naive CuPy; OLD_TREE=dir
#       also times the kernels of an older checkout's numba_flash in a second process);
#   (e) scripts/bench_masks.py: the mask set, fp16, with FlexAttention and SDPA (MASK_REPS
#       single calls each, median; MASK_ARGS="" adds naive CuPy and the sparsity sweep to the
#       same process: the issue's "one run");
#   (g) with MASK_SWEEP=1: the mask sparsity sweep at N=32768 (time against block sparsity, R^2);
#   (h) with PROBE=1: scripts/decode_short_probe.py back to back and under ncu (kernel durations);
#   (f) with DECODE=1: scripts/bench_decode.py's table (every shape, fp16 / bf16, contiguous and
#       paged caches, SDPA flash / cuDNN peers); DECODE_ARGS adds options.
#   (i) with PROFILE=1: host time per call: scripts/mask_profile.py --profile (single-call,
#       device and host time of masked calls, ours and FlexAttention, then cProfile of ours)
#       and scripts/decode_host_profile.py.
#   (j) with SCORE_MOD=1: scripts/bench_score_mod.py (score_mod cases against FlexAttention and
#       SDPA, fp16 and bf16).
# Each step has its own time limit; logs in $OUT, packed into logs.tar.gz at the end.
#   bash scripts/gpu_final.sh            (SKIP_PRELUDE=1: environment ready; TESTS_ONLY=1: (a), (b);
#                                         SKIP_TESTS=1: no (a), (b); FORWARD=0: no (c), (d), (e))
# One call must end within 10 minutes: (a)-(e) take about 7; run (g)-(j) in a second call, e.g.
#   SKIP_TESTS=1 FORWARD=0 PROFILE=1 SCORE_MOD=1 bash scripts/gpu_final.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
if [ "${SKIP_PRELUDE:-0}" != 1 ]; then
  . scripts/gpu_prelude.sh > "$OUT/prelude.log" 2>&1 || { cat "$OUT/prelude.log"; exit 1; }
  tail -1 "$OUT/prelude.log"
fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; } | tee "$OUT/device.txt"

if [ "${SKIP_TESTS:-0}" != 1 ]; then
echo "=== (a) tests + (b) sanitizers $(date +%T)"
xdist="-n ${WORKERS:-8}"
python3 -c "import xdist" 2>/dev/null || xdist=""
( timeout "${TEST_LIMIT:-360}" python3 -m pytest -q $xdist -p no:cacheprovider --durations=5 \
    ${TEST_FILES:-tests/test_cuda_forward.py tests/test_cuda_masks.py tests/test_varlen.py tests/test_mask_mod.py tests/test_score_mod.py tests/test_decode.py tests/test_merge_api.py tests/test_jitcache.py} \
    > "$OUT/tests.log" 2>&1
  echo "tests rc=$?" >> "$OUT/tests.log" ) &
for case in ${SANITIZE_CASES-sanitize_case sanitize_masks sanitize_decode}; do
  for tool in memcheck racecheck; do
    ( timeout "${TEST_LIMIT:-360}" compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 3 \
        python3 scripts/$case.py > "$OUT/${case}_$tool.log" 2>&1
      echo "compute-sanitizer $case $tool rc=$?" >> "$OUT/${case}_$tool.log" ) &
  done
done
wait
grep -E "passed|failed|error|rc=" "$OUT/tests.log" | tail -6
grep -B2 -A30 "^_____" "$OUT/tests.log" | head -60
for f in "$OUT"/sanitize_*.log; do
  grep -v "Warn\|warn(" "$f" | grep -m 4 -A 4 "=====" | head -12
  tail -2 "$f"
done
fi

summary() {   # the end of the output is what comes back: the verdicts last
  echo "=== summary $(date +%T)"
  grep -E "passed|failed|rc=" "$OUT/tests.log" 2>/dev/null | tail -3
  grep -h "^FAILED\|^ERROR" "$OUT/tests.log" 2>/dev/null | head -20
  for f in "$OUT"/sanitize_*.log; do
    [ -f "$f" ] || continue
    echo "$(basename $f): $(grep -c '^========= [A-Z]' $f) reports; $(tail -1 $f)"
  done
  # at most 8 files come back from $OUT: everything in one archive, the JSONs beside it
  cd "$OUT" && tar czf logs.tar.gz --exclude=logs.tar.gz * && find . -maxdepth 1 -type f \
    ! -name logs.tar.gz ! -name 'bench_*.json' ! -name 'bench_*.png' -delete
  ls "$OUT"
}
if [ "${TESTS_ONLY:-0}" = 1 ]; then summary; exit 0; fi
if [ "${FORWARD:-1}" = 1 ]; then

if [ "${FORWARD_BENCH:-1}" = 1 ]; then   # FORWARD_BENCH=0: (e) alone
echo "=== (c) bench_forward $(date +%T)"
timeout "${BENCH_LIMIT:-130}" python3 scripts/bench_forward.py --out "$OUT/bench_forward.json" \
  --plot "$OUT/bench_forward.png" 2>&1 | tee "$OUT/bench_forward.log"

echo "=== (d) bench_exact $(date +%T)"
(cd scripts && timeout 45 python3 bench_exact.py --out "$OUT/bench_exact.json" 2>&1) | tee "$OUT/bench_exact.log"
if [ -n "${OLD_TREE:-}" ]; then
  echo "--- old tree ($OLD_TREE)" | tee -a "$OUT/bench_exact.log"
  (cd scripts && PYTHONPATH=$OLD_TREE:$PYTHONPATH timeout 45 python3 bench_exact.py \
     --out "$OUT/bench_exact_old.json" 2>&1) | tee -a "$OUT/bench_exact.log"
fi

fi
echo "=== (e) bench_masks set $(date +%T)"
timeout "${MASKS_LIMIT:-100}" python3 scripts/bench_masks.py --reps "${MASK_REPS:-15}" --dtypes "${MASK_DTYPES:-float16}" \
  ${MASK_ARGS---no-sweep --no-naive} --json "$OUT/bench_masks_set.json" --png "$OUT/bench_masks_sweep.png" 2>&1 \
  | tee "$OUT/bench_masks_set.log" | grep -v "Warn\|warn(" | tail -40

fi
if [ "${MASK_SWEEP:-0}" = 1 ]; then
  echo "=== (g) bench_masks sparsity sweep $(date +%T)"
  timeout "${SWEEP_LIMIT:-150}" python3 scripts/bench_masks.py --reps 3 --dtypes float16 --no-set --no-naive \
    --no-sdpa --json "$OUT/bench_masks_sweep.json" --png "$OUT/bench_masks_sweep.png" 2>&1 \
    | tee "$OUT/bench_masks_sweep.log" | grep -v Warn | tail -12
fi
if [ "${PROBE:-0}" = 1 ]; then
  echo "=== (h) short decode call: back to back, then each kernel's own duration (ncu) $(date +%T)"
  (cd scripts && timeout 60 python3 decode_short_probe.py 2>&1 | grep -v "Warn\|warn(" | tee "$OUT/probe.log")
  (cd scripts && timeout 120 ncu --clock-control none --metrics ${NCU_METRICS:-gpu__time_duration.sum} --csv \
     python3 decode_short_probe.py --calls 3 > "$OUT/probe_ncu.csv" 2> "$OUT/probe_ncu.err")
  timeout 60 python3 scripts/decode_host_profile.py > "$OUT/host_profile.log" 2>&1
  head -1 "$OUT/host_profile.log"
  python3 - "$OUT/probe_ncu.csv" <<'PY' | tee -a "$OUT/probe.log"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, body = rows[0], rows[1:]
ki, ui, vi = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value")
ni = head.index("Metric Name")
for r in body:
    print(f"{r[ki][:44]:44s} {r[ni][:40]:40s} {r[vi]:>10s} {r[ui]}")
PY
fi
if [ "${DECODE:-0}" = 1 ]; then
  echo "=== (f) bench_decode $(date +%T)"
  timeout "${DECODE_LIMIT:-240}" python3 scripts/bench_decode.py ${DECODE_ARGS:-} --out "$OUT/bench_decode.json" \
    --plot "$OUT/bench_decode.png" 2>&1 | tee "$OUT/bench_decode.log" | tail -45
fi

if [ "${PROFILE:-0}" = 1 ]; then
  echo "=== (i) host time per call $(date +%T)"
  timeout 150 python3 scripts/mask_profile.py --profile > "$OUT/mask_profile.log" 2>&1
  grep -v "Warn\|warn(" "$OUT/mask_profile.log" | head -45
  timeout 60 python3 scripts/decode_host_profile.py > "$OUT/decode_host_profile.log" 2>&1
  head -25 "$OUT/decode_host_profile.log"
fi

if [ "${SCORE_MOD:-0}" = 1 ]; then
  echo "=== (j) bench_score_mod $(date +%T)"
  (cd scripts && timeout "${SCORE_MOD_LIMIT:-150}" python3 bench_score_mod.py \
     --json "$OUT/bench_score_mod.json" 2>&1) | grep -v "Warn\|warn(" | tee "$OUT/bench_score_mod.log" | tail -12
fi

echo "=== done $(date +%T)"
summary
