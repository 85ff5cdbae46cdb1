"""Every ```python block of README.md and docs/api.md runs, in CPU mode, so the docs cannot
drift from the code.

The blocks of one file run in order in one namespace (a later block may use an earlier one's
arrays). A block right after a ``<!-- gpu -->`` line needs a GPU: it is skipped when no CUDA
device is visible (later blocks must not depend on it). Signatures and shell commands use other
fences (```text, ```bash) and are not run.
"""
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = ["README.md", "docs/api.md"]
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_GPU_MARK = re.compile(r"<!--\s*gpu\s*-->\s*$")


def extract_blocks(text: str):
    """(line number, needs_gpu, code) for every ```python block of a Markdown ``text``."""
    blocks = []
    for match in _FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").splitlines()
        needs_gpu = bool(before) and bool(_GPU_MARK.search(before[-1]))
        blocks.append((text.count("\n", 0, match.start()) + 1, needs_gpu, match.group(1)))
    return blocks


def gpu_present() -> bool:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver: no GPU
        return False


def test_extract_blocks_sees_the_gpu_mark():
    text = "a\n```python\nx = 1\n```\n<!-- gpu -->\n```python\ny = 2\n```\n```text\nz\n```\n"
    assert extract_blocks(text) == [(2, False, "x = 1\n"), (6, True, "y = 2\n")]


@pytest.mark.parametrize("name", FILES)
def test_code_blocks_run(name, tmp_path, monkeypatch):
    blocks = extract_blocks((ROOT / name).read_text())
    assert blocks, f"{name} has no python block"
    monkeypatch.chdir(tmp_path)            # blocks that write files write them here
    has_gpu = gpu_present()
    namespace = {"__name__": f"docs_{Path(name).stem}"}
    for line, needs_gpu, code in blocks:
        if needs_gpu and not has_gpu:
            continue
        try:
            exec(compile(code, f"{name}:{line}", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"the python block at {name} line {line} fails: "
                                 f"{type(exc).__name__}: {exc}") from exc
    gpu_blocks = [line for line, needs_gpu, _ in blocks if needs_gpu]
    assert len(gpu_blocks) <= 2, f"{name}: keep GPU-only blocks few, got lines {gpu_blocks}"
