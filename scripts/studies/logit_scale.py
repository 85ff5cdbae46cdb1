"""Study 'logit_scale' of docs/stability.md.

Usage: python scripts/studies/logit_scale.py [--tiny] [--out DIR] [--gpu auto|on|off]
       [--no-progress]
"""
from numba_flash.studies.cli import main

if __name__ == "__main__":
    raise SystemExit(main(name="logit_scale"))
