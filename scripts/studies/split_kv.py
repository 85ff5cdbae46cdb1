"""Study 'split_kv' of docs/stability.md.

Usage: python scripts/studies/split_kv.py [--tiny] [--out DIR] [--gpu auto|on|off] [--no-progress]
"""
from numba_flash.studies.cli import main

if __name__ == "__main__":
    raise SystemExit(main(name="split_kv"))
