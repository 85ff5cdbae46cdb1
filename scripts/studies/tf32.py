"""Study 'tf32' of docs/stability.md.

Usage: python scripts/studies/tf32.py [--tiny] [--out DIR] [--gpu auto|on|off] [--no-progress]
"""
from numba_flash.studies.cli import main

if __name__ == "__main__":
    raise SystemExit(main(name="tf32"))
