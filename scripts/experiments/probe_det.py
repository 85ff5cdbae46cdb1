"""Probe (GPU): which head_dim 64 fp16 backward configurations give wrong gradients; prints one
line per (shape, options) instead of stopping at the first failure. Found, 2026-11-27, that the
pipelined wgmma loop without atomic dQ (deterministic mode) gave wrong dK on every multi-tile
shape (docs/backward.md, "Next steps" 1); kept to check a fix of that loop:

    python scripts/experiments/probe_det.py
"""
import sys
sys.path.insert(0, "tests")
import numpy as np
import test_cuda_backward as t

cases = [dict(causal=True), dict(causal=True, deterministic=True), dict(deterministic=True),
         dict(causal=True, deterministic=True, softcap=5.0), dict(causal=True, softcap=5.0)]
for shape in ((2, 257, 300, 4, 2), (2, 257, 300, 2, 2), (1, 256, 256, 2, 2), (1, 64, 128, 1, 1)):
    for kw in cases:
        rng = np.random.default_rng(64)
        try:
            t.run_case(rng, "float16", *shape, 64, **kw)
            print(shape, kw, "ok", flush=True)
        except AssertionError as e:
            print(shape, kw, "FAIL", str(e).splitlines()[0][:120], flush=True)
