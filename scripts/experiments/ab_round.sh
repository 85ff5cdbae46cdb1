# A/B of the working tree's numba_flash against a commit's, in alternating processes
# (scripts/experiments/forward_ab.py), on a GPU in one device call (carry .whl).
#
#   bash scripts/experiments/ab_round.sh prepare [COMMIT]   # here: ab/base (COMMIT, default
#                                                          # HEAD) and ab/new (working tree)
#   bash scripts/experiments/ab_round.sh tests              # device: the forward GPU tests
#   bash scripts/experiments/ab_round.sh ab                 # device: two rounds base / new
#                                                          # (AB_ONLY=d96,d128: those rows,
#                                                          # in any mode but ab_backward)
#   bash scripts/experiments/ab_round.sh ab_backward        # device: the same, backward_ab.py
#                                                          # (fp16 backward alone, 4 cases)
#   bash scripts/experiments/ab_round.sh ab_masks           # device: forward_ab.py --masks
# Raw output under $OUT (default ./out). ab/ is untracked scratch: delete it before committing.
set -uo pipefail
OUT=${OUT:-out}
case "${1:-}" in
  prepare)
    rm -rf ab && mkdir -p ab
    git archive "${2:-HEAD}" numba_flash | tar -x -C ab && mv ab/numba_flash ab/base
    cp -r numba_flash ab/new
    find ab -name __pycache__ -prune -exec rm -rf {} +
    ls ab ;;
  tests)
    source scripts/gpu_prelude.sh >/dev/null || exit 1
    mkdir -p "$OUT"
    timeout 300 python -m pytest -q -n 16 -p no:cacheprovider tests/test_cuda_forward.py \
      tests/test_head_dim_v.py tests/test_varlen.py tests/test_cuda_masks.py 2>&1 \
      | tee "$OUT/ab_tests.log" | tail -3 ;;
  ab|ab_backward|ab_masks)
    source scripts/gpu_prelude.sh >/dev/null || exit 1
    export PYTHONPATH=$PWD/scripts:$PYTHONPATH
    mkdir -p "$OUT"
    script=forward_ab.py; args=""
    [ "$1" = ab_backward ] && script=backward_ab.py && args="--bwd-only"
    [ "$1" = ab_masks ] && args="--masks"
    [ -n "${AB_ONLY:-}" ] && args="$args --only $AB_ONLY"
    cp -r numba_flash ab/tree
    for r in 1 2; do
      for X in base new; do
        rm -rf numba_flash && cp -r "ab/$X" numba_flash
        timeout 100 python "scripts/experiments/$script" $args --tag "$X" \
          --json "$OUT/${1}_${X}_$r.json" 2>&1 | grep -v "Warn\|warn(" | head -20
      done
    done
    rm -rf numba_flash && mv ab/tree numba_flash ;;
  *) echo "usage: $0 prepare [COMMIT] | tests | ab | ab_backward | ab_masks"; exit 2 ;;
esac
