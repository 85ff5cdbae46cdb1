"""Command line of the studies: ``python -m numba_flash study NAME`` and scripts/studies/*.py."""
from __future__ import annotations

import argparse
import sys

from . import STUDIES, run_study
from ._gpu import GPU_CHOICES

__all__ = ["add_arguments", "run_from_args", "main", "study_help", "missing_requirement"]


def study_help() -> str:
    """One line per study: its name and question."""
    return "\n".join(f"  {name:<12} {question}" for name, question in STUDIES.items())


def add_arguments(parser: argparse.ArgumentParser, *, with_name: bool = True) -> None:
    """Add the study options (NAME unless ``with_name`` is False, --tiny, --out, --gpu,
    --no-progress) to ``parser``."""
    if with_name:
        parser.add_argument("name", choices=sorted(STUDIES), metavar="NAME",
                            help="which study: " + ", ".join(STUDIES))
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny configuration (seconds; what the tests run)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="output folder (default out/studies/NAME)")
    parser.add_argument("--gpu", default="auto", choices=GPU_CHOICES,
                        help="GPU part: auto (when CuPy and a GPU are present), on, off")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def missing_requirement(gpu: str) -> str | None:
    """None when a study can run with this ``gpu`` choice, else one line saying what is
    missing and how to install it: matplotlib (the plot extra) draws every study's figure;
    ``gpu="on"`` needs CuPy, a CUDA GPU and the CUDA backend."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("the studies draw their figures with matplotlib, which is not installed: "
                "pip install 'numba-flash[plot]' (or pip install -e \".[plot]\" in a clone)")
    if gpu == "on":
        from ._gpu import _why_no_gpu

        why = _why_no_gpu()
        if why is not None:
            return (f"--gpu on needs CuPy and a CUDA GPU, but {why}: install the cuda12 or "
                    f"cuda13 extra on a GPU machine (pip install 'numba-flash[cuda12]'), or "
                    f"use --gpu auto (GPU part when present) or --gpu off")
    return None


def run_from_args(args: argparse.Namespace, name: str | None = None) -> int:
    """Run the study the parsed ``args`` ask for, print its summary and files; returns 0, or
    2 with one line on stderr when a requirement is missing (``missing_requirement``)."""
    missing = missing_requirement(args.gpu)
    if missing is not None:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    result = run_study(name or args.name, size="tiny" if args.tiny else "full", out_dir=args.out,
                       gpu=args.gpu, progress=not args.no_progress)
    print("\n".join(result.summary))
    for kind, path in result.files.items():
        print(f"{kind:>8}: {path}")
    return 0


def main(argv=None, name: str | None = None) -> int:
    """Entry point: ``main(["seqlen", "--tiny"])``, or ``main(argv, name="seqlen")`` for a
    script bound to one study."""
    parser = argparse.ArgumentParser(
        prog=f"scripts/studies/{name}.py" if name else "numba_flash study",
        description=STUDIES[name] if name else "numerical-stability studies:\n" + study_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, with_name=name is None)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return run_from_args(args, name)


if __name__ == "__main__":
    raise SystemExit(main())
