"""Command line of the studies: ``python -m numba_flash study NAME`` and scripts/studies/*.py."""
from __future__ import annotations

import argparse
import sys

from . import STUDIES, run_study
from ._gpu import GPU_CHOICES

__all__ = ["add_arguments", "run_from_args", "main", "study_help"]


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


def run_from_args(args: argparse.Namespace, name: str | None = None) -> int:
    """Run the study the parsed ``args`` ask for, print its summary and files; returns 0."""
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
