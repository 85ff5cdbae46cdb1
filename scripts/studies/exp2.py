"""Study 'exp2' of docs/stability.md.

Usage: python scripts/studies/exp2.py [--tiny] [--out DIR] [--gpu auto|on|off] [--no-progress]
"""
from numba_flash.studies.cli import main

if __name__ == "__main__":
    raise SystemExit(main(name="exp2"))
