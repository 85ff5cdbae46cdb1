# One step of a GPU verification round, sized to fit one device call (10 minutes). Run from the
# repository root on the GPU machine (the device tool: carry .whl/, see scripts/gpu_prelude.sh):
#
#   bash scripts/gpu_run.sh tests      # the whole suite with xdist, log in $OUT/gpu_tests.log
#   bash scripts/gpu_run.sh memcheck   # compute-sanitizer memcheck of the sanitizer drivers
#   bash scripts/gpu_run.sh racecheck  # the same with racecheck
#   bash scripts/gpu_run.sh bench      # launch overhead, backward, forward quick
#   bash scripts/gpu_run.sh bench2     # exact precisions with the tensor-core kernels, decode
#   bash scripts/gpu_run.sh backward   # the backward's tests, fp16 / bf16 benchmark, memcheck
#   bash scripts/gpu_run.sh first      # first call per operation in fresh processes, cold / warm
#   bash scripts/gpu_run.sh forward    # forward against the peers at head_dim 96 / 128 / 256,
#                                      # memcheck / racecheck of the wgmma forward kernels
#
# Every step writes its raw output under $OUT (default ./out) and prints a short tail.
set -uo pipefail
source scripts/gpu_prelude.sh || exit 1
OUT=${OUT:-out}
mkdir -p "$OUT"
case "${1:-}" in
  tests)
    timeout 540 python -m pytest -q -n 16 -p no:cacheprovider tests 2>&1 \
      | tee "$OUT/gpu_tests.log" | tail -25 ;;
  memcheck|racecheck)
    for driver in sanitize_decode.py sanitize_case.py sanitize_backward.py; do
      echo "== $1 $driver"
      timeout 270 compute-sanitizer --tool "$1" --report-api-errors no \
        python "scripts/$driver" > "$OUT/sanitize_${1}_${driver%.py}.log" 2>&1
      echo "exit $?"; tail -3 "$OUT/sanitize_${1}_${driver%.py}.log"
    done ;;
  bench)
    timeout 150 python scripts/bench_overhead.py --calls 100 --json "$OUT/overhead.json" | tail -20
    timeout 200 python scripts/bench_backward.py --quick --no-flex --json "$OUT/backward.json" \
      | tail -12
    timeout 120 python scripts/bench_forward.py --quick --no-naive --out "$OUT/forward.json" \
      --plot "$OUT/forward.png" | tail -6 ;;
  bench2)
    (cd scripts && timeout 150 python bench_exact.py --tensor-cores --shape 2,16,2048,64 \
      --out "$OUT/exact.json") | tail -6
    timeout 120 python scripts/bench_decode.py --quick --out "$OUT/decode.json" \
      --plot "$OUT/decode.png" | tail -8 ;;
  backward)
    timeout 300 python -m pytest -q -n 16 -p no:cacheprovider tests/test_cuda_backward.py \
      tests/test_torch_autograd.py tests/test_backward_api.py 2>&1 \
      | tee "$OUT/gpu_tests_backward.log" | tail -4
    timeout 150 python scripts/bench_backward.py --dims 64,128,256 --no-flex --no-deterministic \
      --json "$OUT/backward_fp16.json" | tail -8
    timeout 90 python scripts/bench_backward.py --dims 128 --dtype bfloat16 --no-flex \
      --no-deterministic --json "$OUT/backward_bf16.json" | tail -4
    for tool in memcheck racecheck; do   # the wgmma cases: the whole script needs > 130 s cold
      timeout -k 5 70 compute-sanitizer --tool $tool --report-api-errors no \
        python scripts/sanitize_backward.py --wgmma > "$OUT/sanitize_${tool}_backward.log" 2>&1
      echo "$tool exit $?"; tail -1 "$OUT/sanitize_${tool}_backward.log"
    done ;;
  first)
    # A user's installed packages carry their bytecode (.pyc); this image's Python may not write
    # it (PYTHONDONTWRITEBYTECODE), and the numpy wheel is installed without it: compile it once
    # so that the first-call times do not include compiling Python sources.
    python -m compileall -q -j 0 -x '/tests?/' /tmp/site numba_flash $(python -c "import os, \
      numba, numba_cuda, llvmlite, scipy, cupy, cuda.core, cuda.bindings; print(' '.join( \
      os.path.dirname(m.__file__) for m in (numba, numba_cuda, llvmlite, scipy, cupy, \
      cuda.core, cuda.bindings)))") > /dev/null 2>&1
    timeout 500 python scripts/bench_first_call.py --json "$OUT/first_call.json" \
      | tee "$OUT/first_call.log" | tail -16 ;;
  forward)
    timeout 240 python scripts/bench_forward.py --shape 4,16,4096,96 --shape 4,16,4096,128 \
      --shape 2,16,4096,256 --no-naive --out "$OUT/forward.json" --plot "$OUT/forward.png" \
      | tail -16
    for tool in memcheck racecheck; do
      timeout -k 5 100 compute-sanitizer --tool $tool --report-api-errors no \
        python scripts/sanitize_case.py --head-dims 96,128,256 > "$OUT/sanitize_${tool}_ws.log" 2>&1
      echo "$tool exit $?"; tail -1 "$OUT/sanitize_${tool}_ws.log"
    done ;;
  *)
    echo "usage: bash scripts/gpu_run.sh tests|memcheck|racecheck|bench|bench2|backward|first|forward" >&2
    exit 2 ;;
esac
