"""Programmatic dependent launch (sm_90+): ``grid_dependency_wait`` waits until the grids this
one depends on have finished and their memory is visible (it returns at once for a grid
launched without the attribute); ``grid_launch_dependents`` lets the next grid on the stream be
scheduled early. Both are no-ops in the simulator, which runs one grid at a time.
"""
from __future__ import annotations

from .base import SIMULATOR, bare_asm_intrinsic

__all__ = ["grid_dependency_wait", "grid_launch_dependents"]

if not SIMULATOR:
    grid_dependency_wait = bare_asm_intrinsic("griddepcontrol.wait;")
    grid_launch_dependents = bare_asm_intrinsic("griddepcontrol.launch_dependents;")
else:
    def grid_dependency_wait():
        """No-op in the simulator (one grid at a time)."""

    def grid_launch_dependents():
        """No-op in the simulator."""
