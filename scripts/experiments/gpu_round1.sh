set -uo pipefail
source scripts/gpu_prelude.sh || exit 1
mkdir -p $OUT
timeout 100 python scripts/experiments/host_steps.py 2>&1 | tee $OUT/host_steps.txt
