set -u
source scripts/gpu_prelude.sh || exit 1
export PYTHONPATH=$PWD/scripts:$PWD/scripts/experiments:$PYTHONPATH
echo "== backward GPU tests"
timeout 330 python -m pytest -q -n 16 -p no:cacheprovider tests/test_cuda_backward.py tests/test_backward_fast.py tests/test_torch_autograd.py tests/test_backward_api.py tests/test_schedule.py > $OUT/tests.log 2>&1; echo "exit $?"; tail -4 $OUT/tests.log
echo "== memcheck sanitize_backward --wgmma"
timeout 200 compute-sanitizer --tool memcheck --report-api-errors no python scripts/sanitize_backward.py --wgmma > $OUT/memcheck.log 2>&1; echo "exit $?"; tail -4 $OUT/memcheck.log
