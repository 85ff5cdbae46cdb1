set -u
source scripts/gpu_prelude.sh || exit 1
export PYTHONPATH=$PWD/scripts:$PYTHONPATH
echo "== bf16 masks (Flex)"
timeout 170 python scripts/bench_backward.py --only-masks --dtype bfloat16 --no-deterministic --json $OUT/bb_masks_bf16.json 2>&1 | grep -v -i warn | tail -14
for dt in float16 bfloat16; do echo "== $dt dims 64,128,256 (no Flex)"
timeout 140 python scripts/bench_backward.py --dtype $dt --no-flex --no-deterministic --json $OUT/bb_$dt.json 2>&1 | grep -v -i warn | tail -10; done
