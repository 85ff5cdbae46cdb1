#!/usr/bin/env bash
# One call on the GPU machine: prelude, kernel report (correctness, registers, SASS), GPU tests,
# compute-sanitizer on small cases, on-disk cache timings, benchmark. Logs go to $OUT (or ./out).
#   bash scripts/gpu_check.sh [probe] [report] [host] [tests] [tests-par] [tests-all] [sanitizer]
#                             [sanitizer-mt2] [cache] [ab] [ab-mt] [bench] [bench-quick]
# ab: the kernel of the tree unpacked in ./out/old (git archive <commit> numba_flash) against
# this one, same shapes, one process each.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
. scripts/gpu_prelude.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/device.txt"
steps=${*:-report tests sanitizer cache bench}
for step in $steps; do
  echo "=== $step $(date +%T)"
  case $step in
    probe)  # what CuPy offers for bfloat16; one direct launch per dtype (falls back if it fails)
      python3 - <<'PY' 2>&1 | tee "$OUT/probe.log"
import numpy as np, ml_dtypes, cupy as cp
print("cupy", cp.__version__)
try:
    x = cp.asarray(np.arange(4, dtype=ml_dtypes.bfloat16)); print("cupy bf16 asarray:", x.dtype, x.dtype.name, x.dtype.str, cp.asnumpy(x))
    print("bf16 astype f32:", x.astype(cp.float32)); print("bf16 arithmetic:", (x * 2).dtype)
except Exception as e:
    print("cupy bf16 unsupported:", repr(e)[:300])
from numba_flash.cuda import launch
for dt in ("float16", "float32"):
    q = cp.random.standard_normal((1, 70, 2, 128), dtype=cp.float32).astype(dt)
    o = launch.attention_cuda(q, q, q, softmax_scale=0.1, causal=True); cp.cuda.runtime.deviceSynchronize()
    print("fast launch", dt, "ok:", bool(cp.isfinite(o).all()))
PY
      grep -q "fast launch float32 ok: True" "$OUT/probe.log" || { echo "FAST LAUNCH BROKEN: using the dispatcher"; export NUMBA_FLASH_SLOW_LAUNCH=1; } ;;
    host)
      python3 scripts/gpu_host_overhead.py 2>&1 | tee -a "$OUT/host.log"
      NUMBA_FLASH_SLOW_LAUNCH=1 python3 scripts/gpu_host_overhead.py 2>&1 | tee -a "$OUT/host.log" ;;
    tests-par)  # the GPU test file in 5 parallel shards (compiles dominate; 16 cores)
      i=0
      for sel in "grid and float16 and not bfloat16" "grid and bfloat16" "grid and float32" "grid and float64" "not grid"; do
        python3 -m pytest -q tests/test_cuda_forward.py -k "$sel" -p no:cacheprovider > "$OUT/tests_$i.log" 2>&1 &
        i=$((i+1))
      done
      wait
      for f in "$OUT"/tests_*.log; do echo "$f: $(tail -1 $f)"; done | tee "$OUT/tests.log"
      grep -h -B2 -A25 "^____\|Error\|assert" "$OUT"/tests_*.log | head -80 ;;
    tests-all)  # forward, masks and varlen GPU tests in parallel shards, default geometry and
                # two m-tiles per warp (NUMBA_FLASH_MMA_M_TILES=2) for the half-precision kernels
      i=0
      for sel in "grid and float16 and not bfloat16" "grid and bfloat16" "grid and float32" "grid and float64" "not grid"; do
        python3 -m pytest -q tests/test_cuda_forward.py -k "$sel" -p no:cacheprovider > "$OUT/tests_$i.log" 2>&1 &
        i=$((i+1))
      done
      python3 -m pytest -q tests/test_cuda_masks.py tests/test_varlen.py tests/test_mask_mod.py -p no:cacheprovider > "$OUT/tests_masks.log" 2>&1 &
      NUMBA_FLASH_MMA_M_TILES=2 python3 -m pytest -q tests/test_cuda_forward.py -k "float16 or bfloat16" -p no:cacheprovider > "$OUT/tests_mt2.log" 2>&1 &
      NUMBA_FLASH_MMA_M_TILES=2 python3 -m pytest -q tests/test_cuda_masks.py tests/test_varlen.py -p no:cacheprovider > "$OUT/tests_mt2_masks.log" 2>&1 &
      wait
      for f in "$OUT"/tests_*.log; do echo "$f: $(tail -1 $f)"; done | tee "$OUT/tests.log"
      grep -h -B2 -A25 "^____\|Error\|assert" "$OUT"/tests_*.log | head -80 ;;
    sanitizer-mt2)
      for tool in memcheck racecheck; do
        NUMBA_FLASH_MMA_M_TILES=2 compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 3 python3 scripts/sanitize_case.py --head-dims 32,64,96,128 > "$OUT/sanitizer_mt2_$tool.log" 2>&1
        echo "compute-sanitizer m-tiles 2 $tool rc=$?" | tee -a "$OUT/sanitizer.log"
        tail -2 "$OUT/sanitizer_mt2_$tool.log" | tee -a "$OUT/sanitizer.log"
      done ;;
    ab-mt)  # same process per variant: the tree in ./out/old, then this tree with 1 and 2 m-tiles
      for variant in old mt1 mt2; do
        pp=$PYTHONPATH; [ $variant = old ] && pp=$PWD/out/old:$PYTHONPATH
        mt=1; [ $variant = mt2 ] && mt=2
        echo "--- $variant" | tee -a "$OUT/ab.log"
        NUMBA_FLASH_MMA_M_TILES=$mt PYTHONPATH=$pp python3 scripts/bench_forward.py --no-naive --dtype float16 --shape 4,16,4096,128 --shape 16,16,1024,64 --shape 4,16,4096,64 --shape 4,16,4096,96 --shape 2,16,4096,256 --out "$OUT/ab_$variant.json" --plot /tmp/ab.png 2>&1 | tail -12 | tee -a "$OUT/ab.log"
      done ;;
    ab)
      for tree in old new; do
        pp=$PYTHONPATH; [ $tree = old ] && pp=$PWD/out/old:$PYTHONPATH
        (cd /tmp && PYTHONPATH=$pp python3 -c "import numba_flash; print('$tree tree:', numba_flash.__file__)")
        PYTHONPATH=$pp python3 scripts/bench_forward.py --no-naive --dtype float16 --shape 4,16,4096,128 --shape 2,16,4096,256 --shape 16,16,1024,64 --out "$OUT/ab_$tree.json" --plot /tmp/ab.png 2>&1 | tail -7 | tee -a "$OUT/ab.log"
      done ;;
    report)
      mkdir -p /tmp/sass
      python3 scripts/gpu_kernel_report.py --sass-dir /tmp/sass --json "$OUT/kernel_report.json" ${REPORT_ARGS:-} 2>&1 | tee "$OUT/report.log"
      tar czf "$OUT/sass.tar.gz" -C /tmp sass ;;
    tests)
      python3 -m pytest -q tests/test_cuda_forward.py --durations=5 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    sanitizer)
      for tool in memcheck racecheck; do
        compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 3 python3 scripts/sanitize_case.py ${SANITIZE_ARGS:-} > "$OUT/sanitizer_$tool.log" 2>&1
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
