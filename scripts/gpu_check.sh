#!/usr/bin/env bash
# One call on the GPU machine: prelude, kernel report (correctness, registers, SASS), GPU tests,
# compute-sanitizer on small cases, on-disk cache timings, benchmark. Logs go to $OUT (or ./out).
#   bash scripts/gpu_check.sh [report] [tests] [sanitizer] [cache] [bench] [bench-quick]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
. scripts/gpu_prelude.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/device.txt"
steps=${*:-report tests sanitizer cache bench}
for step in $steps; do
  echo "=== $step $(date +%T)"
  case $step in
    report)
      mkdir -p /tmp/sass
      python3 scripts/gpu_kernel_report.py --sass-dir /tmp/sass --json "$OUT/kernel_report.json" 2>&1 | tee "$OUT/report.log"
      tar czf "$OUT/sass.tar.gz" -C /tmp sass ;;
    tests)
      python3 -m pytest -q tests/test_cuda_forward.py --durations=5 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    sanitizer)
      for tool in memcheck racecheck; do
        compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 3 python3 scripts/sanitize_case.py > "$OUT/sanitizer_$tool.log" 2>&1
        echo "compute-sanitizer $tool rc=$?" | tee -a "$OUT/sanitizer.log"
        grep -v "Warn\|warn(" "$OUT/sanitizer_$tool.log" | grep -m 12 -A 3 "=====" | head -40
        tail -2 "$OUT/sanitizer_$tool.log" | tee -a "$OUT/sanitizer.log"
      done ;;
    cache)
      # first call in a process: cold (compiles, writes the on-disk cache), then warm (loads it)
      find numba_flash -name '*.nbi' -delete; find numba_flash -name '*.nbc' -delete
      for run in cold warm; do
        python3 - <<'PY' 2>&1 | sed "s/^/$run: /" | tee -a "$OUT/cache.log"
import time, cupy as cp
from numba import cuda
t0 = time.perf_counter()
from numba_flash.cuda.launch import attention_cuda, compiled_kernel_count
q = cp.random.standard_normal((1, 512, 4, 128), dtype=cp.float32).astype(cp.float16)
cuda.current_context(); cp.cuda.runtime.deviceSynchronize()
t1 = time.perf_counter()
attention_cuda(q, q, q, softmax_scale=0.1, causal=True); cp.cuda.runtime.deviceSynchronize()
t2 = time.perf_counter()
attention_cuda(q, q, q, softmax_scale=0.1, causal=True); cp.cuda.runtime.deviceSynchronize()
t3 = time.perf_counter()
t4 = time.perf_counter()
for _ in range(100):
    attention_cuda(q, q, q, softmax_scale=0.1, causal=True)
t5 = time.perf_counter(); cp.cuda.runtime.deviceSynchronize()
print(f"host time per call (100 calls, no sync): {1e6*(t5-t4)/100:.0f} us")
from numba_flash.cuda.launch import kernel_for
st = kernel_for("float16", 128, False, True, False, False, False)[0].stats
print(f"import+context {t1-t0:.2f}s first call {t2-t1:.2f}s second call {1e3*(t3-t2):.2f}ms specialisations {compiled_kernel_count()} disk-cache hits {dict(st.cache_hits)} misses {dict(st.cache_misses)}")
PY
      done
      find numba_flash -name '*.nb[ic]' | head -5 | tee -a "$OUT/cache.log" ;;
    bench)
      python3 scripts/bench_forward.py --out "$OUT/bench_forward.json" --plot "$OUT/bench_forward.png" 2>&1 | tee "$OUT/bench.log" ;;
    bench-bn32)   # tuning experiment: 32-key tiles for every head_dim
      NUMBA_FLASH_MMA_BLOCK_N=32 python3 scripts/bench_forward.py --quick --no-naive --out "$OUT/bench_bn32.json" --plot /tmp/q.png 2>&1 | tail -6 | tee "$OUT/bench_bn32.log" ;;
    bench-quick)
      python3 scripts/bench_forward.py --quick --no-naive --out "$OUT/bench_quick.json" --plot /tmp/q.png 2>&1 | tee "$OUT/bench.log" ;;
  esac
done
echo "=== done $(date +%T)"
