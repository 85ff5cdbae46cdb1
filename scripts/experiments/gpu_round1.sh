set -uo pipefail
source scripts/gpu_prelude.sh || exit 1
mkdir -p $OUT
timeout 60 python scripts/experiments/host_steps.py 2>&1 | tee $OUT/host_steps.txt
timeout 200 python -m pytest -q -n 16 -p no:cacheprovider tests/test_cuda_backward.py tests/test_torch_autograd.py tests/test_backward_api.py tests/test_warmup.py 2>&1 | tee $OUT/tests1.log | tail -4
PYTHONPATH=scripts:$PYTHONPATH timeout 150 python scripts/experiments/gpu_bound_shapes.py --json $OUT/gpu_bound.json
