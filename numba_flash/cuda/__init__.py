"""The GPU backend (docs/architecture.md): ``primitives`` (one instruction family per module,
each with a simulator stand-in), ``kernels`` (one module per kernel family, built from tile
helpers by factories with compile-time closures) and ``launch`` (the runtime: array interop,
streams, plans, driver-API launches; the only code that knows CuPy / PyTorch / Numba arrays).
Importing it compiles nothing."""
