"""numba.cuda kernels and their launcher.

Importing this package compiles nothing and needs no GPU; ``launch.attention_cuda`` is the entry
point that ``numba_flash.api`` calls for device arrays (or NumPy arrays under the simulator).
"""
