"""Kernel images on disk (numba_flash/cuda/launch/images.py), without a GPU.

The key of an image must separate every configuration that Numba's own cache separates (a
closure constant that is not in the kernel's qualified name included) and every device
generation; a file that is not a whole image must never load. Real Numba dispatchers are built
in a process of their own with the simulator off (building one compiles nothing); the file
round trip runs here with a stand-in for cuda.core's loader.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from numba_flash.cuda.launch import images

ROOT = os.path.join(os.path.dirname(__file__), "..")

_KEYS = r"""
import json
from numba.cuda import types
from numba_flash.cuda.kernels import decode_mma
from numba_flash.cuda.launch.images import image_path
args = (128, False, False, False, False, False, False, False, False, True, 32, 2, 1)
sig = types.void(types.int64)
plain, again = (decode_mma.make_mma_decode_kernel(*args, fold=True) for _ in range(2))
hint = decode_mma.make_mma_decode_kernel(*args, fold=True, stream_hint=True)
print(json.dumps({"plain": image_path(plain, sig, (9, 0)), "again": image_path(again, sig, (9, 0)),
                  "hint": image_path(hint, sig, (9, 0)), "sm80": image_path(plain, sig, (8, 0)),
                  "sig": image_path(plain, types.void(types.int32), (9, 0))}))
"""


def test_image_keys_separate_configurations_devices_and_signatures(tmp_path):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", NUMBA_CACHE_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", _KEYS], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    paths = json.loads(res.stdout.splitlines()[-1])
    assert paths["plain"] == paths["again"]            # the same configuration: one image
    assert all(p.startswith(str(tmp_path)) and p.endswith(".nfimg") for p in paths.values())
    # stream_hint lives only in the kernel's closure, not in its qualified name
    others = [paths[k] for k in ("hint", "sm80", "sig")]
    assert len({paths["plain"], *others}) == 4, paths


class _Linked:
    """numba-cuda 0.30's linker returns a cuda.core ObjectCode; its ``code`` is the cubin."""
    code = b"\x7fELF stand-in machine code \n with a newline"


class _Library:
    _entry_name = "_Z6kernelv"

    def get_cubin(self):
        return _Linked()


class _Compiled:
    _codelibrary = _Library()


class _Kernel:
    handle = 1234


class _ObjectCode:
    loaded = []

    @classmethod
    def from_cubin(cls, cubin, name):
        cls.loaded.append((cubin, name))
        return cls()

    def get_kernel(self, name):
        assert name == _Library._entry_name
        return _Kernel()


# Stand-ins for dispatchers (counted by identity): alive for the whole session, so that no
# other object of a later test can take their id.
_OWNERS = (object(), object())


def test_image_round_trip_and_damaged_files(tmp_path, monkeypatch):
    monkeypatch.setattr(images, "_object_code", lambda: _ObjectCode)
    owner = _OWNERS[0]
    path = str(tmp_path / "sub" / "kernel.abc.nfimg")
    assert images.load_image(owner, path) is None                  # nothing there yet
    images.store_image(owner, path, _Compiled())
    assert images.image_stats(owner) == (0, 1)
    assert not [n for n in os.listdir(tmp_path / "sub") if n.startswith(".nfimg-")]
    loaded = images.load_image(owner, path)
    assert loaded.handle == 1234 and loaded.name == "_Z6kernelv"
    assert _ObjectCode.loaded[-1] == (_Linked.code, "_Z6kernelv")
    assert images.image_stats(owner) == (1, 1)
    whole = open(path, "rb").read()
    for damaged in (whole[:-1], whole[:10], b"", b"not an image\n" + whole, whole + b"x"):
        with open(path, "wb") as f:
            f.write(damaged)
        assert images.load_image(owner, path) is None, damaged[:40]
    assert images.image_stats(owner) == (1, 1)


def test_unwritable_cache_directory_is_skipped(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder should be")
    owner = _OWNERS[1]
    images.store_image(owner, str(blocker / "kernel.nfimg"), _Compiled())
    assert images.image_stats(owner) == (0, 0)
