"""One on-disk cache index per kernel configuration (numba_flash/cuda/kernels/jitcache.py)."""
from __future__ import annotations

import subprocess
import sys

from numba_flash.cuda.kernels import (decode_fma, decode_mma, forward_fma, forward_geometry,
                                      forward_mma, jitcache, merge)


def test_config_qualname_is_deterministic_and_distinct():
    a = jitcache.config_qualname("make.<locals>.kernel", ("mma", 128, False, True, 64))
    b = jitcache.config_qualname("make.<locals>.kernel", ("mma", 128, False, True, 32))
    assert a.startswith("make.<locals>.kernel_") and len(a) == len("make.<locals>.kernel_") + 12
    assert a != b
    # The same name in another process (the cache must find it again).
    code = ("from numba_flash.cuda.kernels import jitcache; "
            "print(jitcache.config_qualname('make.<locals>.kernel', ('mma', 128, False, True, 64)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == a


def test_qualname_follows_the_kernel_sources(monkeypatch):
    """An edit anywhere in the kernel house (a device helper in another module than the kernel,
    which Numba's own cache check would miss) gives every configuration a new name."""
    assert len(jitcache.source_digest()) == 40
    before = jitcache.config_qualname("make.<locals>.kernel", ("mma", 128))
    monkeypatch.setattr(jitcache, "source_digest", lambda: "an edited primitives/ module")
    assert jitcache.config_qualname("make.<locals>.kernel", ("mma", 128)) != before


def test_cache_files_differ_per_configuration():
    """Numba names a function's cache index after its qualified name: renamed closures of one
    factory get separate index files."""
    from numba.cuda.core.caching import CacheImpl

    class CUDACacheImpl(CacheImpl):    # numba-cuda's file naming; the payload does not matter
        def reduce(self, kernel):
            return kernel

        def rebuild(self, target_context, payload):
            return payload

        def check_cachable(self, cres):
            return True

    def factory(width):
        def kernel(x):
            x[0] = width
        kernel.__qualname__ = jitcache.config_qualname(kernel.__qualname__, ("k", width))
        return kernel

    bases = {CUDACacheImpl(factory(w)).filename_base for w in (1, 2, 3)}
    assert len(bases) == 3


def _captured_configs(monkeypatch, module):
    seen = []

    def fake(fn, config, cache=True):
        seen.append(tuple(config))
        return fn

    monkeypatch.setattr(module, "jit_kernel", fake)
    return seen


def test_factories_pass_every_compile_time_argument(monkeypatch):
    seen = _captured_configs(monkeypatch, forward_mma)
    forward_mma.make_mma_kernel(64, False, False, True, False, False, True, 64, m_tiles=2)
    forward_mma.make_mma_kernel(64, True, False, True, False, False, True, 64, m_tiles=2)
    forward_mma.make_mma_kernel(64, False, False, True, False, False, True, 64, m_tiles=1)
    forward_mma.make_mma_kernel(64, False, False, True, False, False, True, 32, m_tiles=1)
    assert len(set(seen)) == 4, seen
    seen = _captured_configs(monkeypatch, forward_fma)
    forward_fma.make_fma_kernel(64, False, True, True, False, False, True,
                                forward_geometry.fma_block_n(64, 4))
    forward_fma.make_fma_kernel(64, True, True, True, False, False, True,
                                forward_geometry.fma_block_n(64, 8))
    assert len(set(seen)) == 2, seen
    seen = _captured_configs(monkeypatch, decode_fma)
    decode_fma.make_decode_kernel(128, False, 4, False, False, True, False, False, False, True,
                                  False)
    decode_fma.make_decode_kernel(128, False, 4, True, False, True, False, False, False, True,
                                  False)
    assert len(set(seen)) == 2, seen
    seen = _captured_configs(monkeypatch, decode_mma)
    args = (128, False, False, False, True, False, False, False, True, False, 32, 2, 1)
    decode_mma.make_mma_decode_kernel(*args)
    decode_mma.make_mma_decode_kernel(*args, fold=True)
    assert len(set(seen)) == 2, seen
    seen = _captured_configs(monkeypatch, merge)
    merge.make_merge_kernel(0, False)
    merge.make_merge_kernel(0, True)
    assert len(set(seen)) == 2, seen


_CLOSURE_HASHES = r"""
import hashlib, json, os
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"      # real cuda.jit dispatchers (no compile needed)
from numba.cuda.core.caching import dumps
from numba_flash.cuda.kernels import (backward, decode_fma, decode_mma, forward_fma,
                                      forward_mma, merge)
def digest(kernel):
    cells = kernel.py_func.__closure__ or ()
    return hashlib.sha256(dumps(tuple(c.cell_contents for c in cells))).hexdigest()
kernels = {
    "forward_mma": forward_mma.make_mma_kernel(64, False, False, True, False, False, True, 64,
                                               m_tiles=2),
    "forward_wgmma": forward_mma.make_mma_kernel(128, True, False, True, False, False, True, 128,
                                                 m_tiles=1, wgmma=True),
    "forward_fma": forward_fma.make_fma_kernel(64, True, False, True, False, False, True, 16),
    "decode_mma_hint": decode_mma.make_mma_decode_kernel(
        128, False, False, False, True, False, False, False, False, True, 32, 2, 1, fold=True,
        stream_hint=True),
    "decode_mma_paged": decode_mma.make_mma_decode_kernel(
        128, True, True, False, True, False, False, False, False, False, 32, 2, 1, fold=True,
        page_pow2=16),
    "decode_fma": decode_fma.make_decode_kernel(256, True, 4, False, False, True, False, False,
                                                False, True, False),
    "merge": merge.make_merge_kernel(2, True),
    "backward_pre": backward.make_preprocess_kernel(True, True, False),
    "backward_mma": backward.make_mma_dkdv_kernel(64, False, False, True, False, False, True, 0),
    "backward_fma": backward.make_fma_dkdv_kernel(64, False, False, True, False, False, True),
    "backward_reduce": backward.make_reduce_kernel(True, False),
}
print(json.dumps({name: digest(k) for name, k in kernels.items()}))
"""


def test_kernel_closures_hash_the_same_in_every_process():
    """Numba's disk cache keys an entry on a hash of the kernel's closure contents; a closure
    holding an intrinsic or a dispatcher made by the factory pickles differently in every
    process, so every process would compile again (the decode kernels did: ~16 s per script).
    Every kernel family's closure must give the same bytes in two fresh processes."""
    import json
    import os

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    runs = [json.loads(subprocess.run([sys.executable, "-c", _CLOSURE_HASHES], env=env,
                                      capture_output=True, text=True, check=True).stdout)
            for _ in range(2)]
    assert runs[0] == runs[1], {k: (runs[0][k][:8], runs[1][k][:8]) for k in runs[0]
                                if runs[0][k] != runs[1][k]}
