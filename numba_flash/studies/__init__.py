"""Numerical-stability studies of the online softmax (docs/stability.md).

Each study is a module with the logic (``seqlen``, ``logit_scale``, ``exp2``, ``tiles``,
``split_kv``, ``sinks``, ``p_precision``); ``run_study`` runs one and writes a CSV table, a PNG
figure and a short text summary under ``out/studies/<name>/``. Run them as
``python -m numba_flash study NAME`` or ``python scripts/studies/NAME.py``.

The studies measure the NumPy reference's emulation of each precision (``numba_flash_reference``)
on the CPU, and numba_flash's CUDA kernels too where a GPU is present. Drawing and progress bars
need the ``plot`` extra (matplotlib, tqdm), imported only when a study runs; ``import
numba_flash`` does not import this package.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from ._gpu import GPU_CHOICES, gpu_context
from ._output import save_figure, write_csv, write_summary

__all__ = ["STUDIES", "SIZES", "StudyResult", "run_study", "default_out_dir"]

#: Study name -> one-line question. The module of the same name holds the study.
STUDIES = {
    "seqlen": "error against sequence length, online vs naive softmax, fp16 / bf16 / fp32",
    "logit_scale": "error against logit scale: where a naive softmax overflows or underflows",
    "exp2": "exp against exp2 with log2(e) folded into the scale",
    "tiles": "do the key-tile size (block_n) and tile order change the error?",
    "split_kv": "split-KV merge: error against the number of splits, tree vs sequential order",
    "sinks": "does processing attention-sink tokens first stabilise the online softmax?",
    "p_precision": "precision of P in the PV product: fp16 vs bf16 P against fp32 P",
    "tf32": "float32 attention on TF32 tensor cores: plain TF32 and 3xTF32 against IEEE fp32",
}

SIZES = ("full", "tiny")


@dataclass
class StudyResult:
    """What a study run produced.

    name: the study; size: "full" or "tiny"; rows: the CSV table (list of dicts); headline: the
    numbers the summary's answer rests on (floats, keyed by name; tests assert on them);
    summary: the summary's lines; gpu_note: whether the GPU part ran and why; files: written
    paths keyed "csv", "png", "summary"; seconds: wall time of the run.
    """
    name: str
    size: str
    rows: list
    headline: dict
    summary: list
    gpu_note: str
    files: dict = field(default_factory=dict)
    seconds: float = 0.0


def default_out_dir(name: str) -> Path:
    """``out/studies/<name>`` relative to the current directory."""
    return Path("out") / "studies" / name


def _module(name: str):
    if not isinstance(name, str) or name not in STUDIES:
        raise ValueError(f"study name must be one of {sorted(STUDIES)}, got {name!r}")
    return importlib.import_module(f"{__name__}.{name}")


def run_study(name: str, *, size: str = "full", out_dir=None, gpu="auto",
              progress: bool = True, write: bool = True) -> StudyResult:
    """Run study ``name`` and write ``<name>.csv``, ``<name>.png`` and ``summary.txt``.

    size: "full" (the documented configuration, up to a few minutes on two CPU cores) or "tiny"
    (seconds; what the tests run). out_dir: folder for the files (default
    ``out/studies/<name>``). gpu: "auto" / "on" / "off" (or a bool) for the GPU part, see
    ``_gpu.gpu_context``. progress: show a tqdm bar. write: False skips the files (and the
    figure). Returns a ``StudyResult``.
    """
    module = _module(name)
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if gpu not in GPU_CHOICES and not isinstance(gpu, bool):
        raise ValueError(f"gpu must be one of {GPU_CHOICES} (or a bool), got {gpu!r}")
    config = dict(module.CONFIGS[size])
    ctx = gpu_context(gpu)
    if not getattr(module, "GPU_PART", True):  # nothing to run on a GPU: say so, never claim it
        ctx = type(ctx)(False, "This study has no GPU part")
    start = time.perf_counter()
    rows, headline, lines = module.compute(config, gpu=ctx, progress=progress)
    seconds = time.perf_counter() - start
    command = f"python -m numba_flash study {name}" + (" --tiny" if size == "tiny" else "")
    summary = list(lines) + ["", ctx.note + ".",
                             f"Configuration ({size}): " + ", ".join(
                                 f"{k}={v}" for k, v in config.items()) + ".",
                             f"Reproduce: {command}  ({seconds:.0f} s here)."]
    result = StudyResult(name, size, rows, headline, summary, ctx.note, seconds=seconds)
    if write:
        out = Path(out_dir) if out_dir is not None else default_out_dir(name)
        result.files["csv"] = write_csv(rows, out / f"{name}.csv")
        fig = module.plot(rows, config)
        result.files["png"] = save_figure(fig, out / f"{name}.png")
        result.files["summary"] = write_summary(module.TITLE, summary, out / "summary.txt")
    return result
