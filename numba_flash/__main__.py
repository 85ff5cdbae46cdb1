"""``python -m numba_flash``: run the main job (a checked attention call) and report.

Subcommands:

- (none) or ``demo``: random q, k, v (batch 2, seqlen 256, heads_q 8, heads_kv 2, head_dim 64)
  under a causal-document mask, on the GPU when CuPy sees one (float16) or else in CPU mode
  (float32), checked against the float64 reference. Exit status 0 when the check passes, 1 when
  it fails, 2 for a usage or setup error.
- ``study NAME``: a numerical-stability study (numba_flash.studies, docs/stability.md).
- ``warmup``: compile (or load) the kernels of a set of configurations into Numba's disk cache
  (``numba_flash.warmup``); exit status 0, or 2 without a GPU.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time

import numpy as np

DEMO = dict(batch=2, seqlen=256, heads_q=8, heads_kv=2, head_dim=64, doc_lengths=(100, 60, 96))
DTYPES = ("float16", "bfloat16", "float32", "float64")
# Fixed tolerances for the wide dtypes; float16/bfloat16 use the 2x-naive rule (tolerance()).
_WIDE_TOLERANCE = {"float32": 1e-5, "float64": 1e-12}
# Significand bits (with the implicit one) of the narrow dtypes: unit roundoff 2**-bits.
_NARROW_BITS = {"float16": 11, "bfloat16": 8}


def numpy_dtype(name: str) -> np.dtype:
    """NumPy dtype for a dtype name among float16, bfloat16 (ml_dtypes), float32, float64."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def naive_attention(q, k, v, visible, softmax_scale, dtype) -> np.ndarray:
    """Textbook attention computed "in" ``dtype``, the way a framework's unfused ops would.

    q: (B, Sq, Hq, D), k, v: (B, Sk, Hkv, D) float64 arrays (values already representable in
    ``dtype``); visible: bool (Sq, Sk). Every op accumulates in float32 and rounds its result to
    ``dtype`` (scores, probabilities, output), as fp16/bf16 matmul and softmax kernels do.
    Returns float64 (B, Sq, Hq, D); rows with no visible key are 0.
    """
    dtype = np.dtype(dtype)

    def rnd(x):
        return x.astype(dtype).astype(np.float32)

    group = q.shape[2] // k.shape[2]
    qf = q.astype(np.float32)
    kf = np.repeat(k.astype(np.float32), group, axis=2)
    vf = np.repeat(v.astype(np.float32), group, axis=2)
    scores = rnd(np.einsum("bqhd,bkhd->bhqk", qf, kf) * np.float32(softmax_scale))
    scores = np.where(visible, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0)
    weights = np.exp(scores - row_max)
    total = weights.sum(axis=-1, keepdims=True)
    probs = rnd(weights / np.where(total > 0, total, 1))
    return rnd(np.einsum("bhqk,bkhd->bqhd", probs, vf)).astype(np.float64)


def tolerance(dtype_name: str, naive_error: float, ref_max: float) -> float:
    """Largest acceptable max |out - ref64| for an output of dtype ``dtype_name``.

    float16/bfloat16: twice the naive same-dtype error plus one rounding of the largest output
    (DESIGN.md's rule); float32: 1e-5; float64: 1e-12.
    """
    if dtype_name in _WIDE_TOLERANCE:
        return _WIDE_TOLERANCE[dtype_name]
    return 2.0 * naive_error + 2.0 ** -_NARROW_BITS[dtype_name] * ref_max


def gpu_available() -> bool:
    """True when CuPy imports and sees a CUDA device (and Numba's CUDA simulator is off)."""
    from .validation import cuda_simulator_enabled

    if cuda_simulator_enabled():
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "no GPU"
        return False


def _gpu_name() -> str:
    import cupy

    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    name = props["name"]
    return f"{name.decode() if isinstance(name, bytes) else name} (device {device.id})"


def _cpu_name() -> str:
    return f"CPU ({platform.processor() or platform.machine() or 'unknown'})"


def _timed(call, sync, repeats):
    """(seconds of the first call, best seconds of ``repeats`` later calls, last result)."""
    sync()
    start = time.perf_counter()
    result = call()
    sync()
    first = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        sync()
        best = min(best, time.perf_counter() - start)
    return first, best, result


SIMULATOR_NOTE = ("Numba's CUDA simulator runs the kernels on the CPU one thread at a time: "
                  "at the demo's shape that takes more than 5 minutes")


def _cuda_backend_refusal(file) -> str | None:
    """For ``--backend cuda``: None when a GPU is visible; a note on ``file`` and None under
    Numba's CUDA simulator; else the one-line error to print (exit status 2)."""
    from . import validation

    if gpu_available():
        return None
    if validation.cuda_simulator_enabled():
        print(f"note: {SIMULATOR_NOTE}; --backend cpu gives the same check in well under a "
              f"second", file=file)
        return None
    return ("error: backend='cuda' needs GPU arrays, and no CUDA GPU is visible to CuPy (install "
            "the cuda12 or cuda13 extra on a machine with an NVIDIA GPU). Without a GPU, run "
            "`python -m numba_flash --backend cpu` (CPU mode, under a second); "
            "NUMBA_ENABLE_CUDASIM=1 would run the kernels in Numba's CUDA simulator, but at the "
            "demo's shape that takes more than 5 minutes")


def run_demo(backend="auto", dtype=None, seed=0, perturb=0.0, file=None) -> int:
    """Run the main job and print a report to ``file`` (default stdout); return the exit status.

    backend: "auto", "cpu" or "cuda"; dtype: a name in DTYPES or None (float16 on a GPU, float32
    in CPU mode); seed: int for the random inputs; perturb: added to one output element before
    the check (a hook to exercise the failure path).
    """
    import numba_flash
    from numba_flash_reference.attention import attention as reference_attention
    from numba_flash_reference.masks import visible_matrix

    file = file or sys.stdout
    if backend == "cuda":
        refusal = _cuda_backend_refusal(file)
        if refusal is not None:
            print(refusal, file=sys.stderr)
            return 2

    def say(label, text):
        print(f"{label:<10}: {text}", file=file)

    # backend="cuda" without a GPU keeps NumPy inputs: the kernels then run in Numba's CUDA
    # simulator when it is on, and attention() explains the problem otherwise.
    on_gpu = backend != "cpu" and gpu_available()
    used = "cuda" if on_gpu or backend == "cuda" else "cpu"
    dtype_name = dtype or ("float16" if on_gpu else "float32")
    np_dtype = numpy_dtype(dtype_name)

    d = DEMO
    rng = np.random.default_rng(seed)
    q64 = rng.standard_normal((d["batch"], d["seqlen"], d["heads_q"], d["head_dim"]))
    k64 = rng.standard_normal((d["batch"], d["seqlen"], d["heads_kv"], d["head_dim"]))
    v64 = rng.standard_normal((d["batch"], d["seqlen"], d["heads_kv"], d["head_dim"]))
    q, k, v = (x.astype(np_dtype) for x in (q64, k64, v64))
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))  # what the kernel actually sees
    mask = numba_flash.masks.causal_document(list(d["doc_lengths"]))
    scale = 1.0 / np.sqrt(d["head_dim"])

    if on_gpu:
        import cupy

        try:
            q, k, v = (cupy.asarray(x) for x in (q, k, v))
        except Exception as exc:  # noqa: BLE001 - CuPy lacks some dtypes (bfloat16)
            print(f"error: cannot place {dtype_name} arrays on the GPU with CuPy ({exc}); "
                  f"try --dtype float16", file=sys.stderr)
            return 2
        device, sync = _gpu_name(), cupy.cuda.get_current_stream().synchronize

        def to_host(x):
            return cupy.asnumpy(x)
    else:
        device = _cpu_name() if used == "cpu" else "Numba CUDA simulator on the CPU"

        def sync():
            pass

        def to_host(x):
            return np.asarray(x)

    try:
        first, best, out = _timed(
            lambda: numba_flash.attention(q, k, v, mask=mask, backend=backend), sync,
            repeats=3)
    except NotImplementedError as exc:
        if backend != "auto":
            print(f"error: {exc}", file=sys.stderr)
            return 2
        # The GPU backend lacks something this job needs: say so, then run CPU mode instead.
        print(f"note: the GPU backend cannot run this job yet ({exc}); running CPU mode",
              file=file)
        return run_demo("cpu", dtype, seed, perturb, file)
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = to_host(out).astype(np.float64)
    if perturb:
        out.flat[0] += perturb

    ref = reference_attention(q64, k64, v64, softmax_scale=scale, mask=mask)
    error = float(np.max(np.abs(out - ref)))
    ref_max = float(np.max(np.abs(ref)))
    naive_error = None
    if dtype_name in _NARROW_BITS:
        visible = visible_matrix(d["seqlen"], d["seqlen"], mask=mask)
        naive = naive_attention(q64, k64, v64, visible, scale, np_dtype)
        naive_error = float(np.max(np.abs(naive - ref)))
    tol = tolerance(dtype_name, naive_error or 0.0, ref_max)
    passed = bool(np.isfinite(error) and error <= tol)

    print(f"numba-flash {numba_flash.__version__}: exact attention under a causal-document mask, "
          f"checked against the float64 reference", file=file)
    say("backend", used)
    say("device", device)
    say("dtype", dtype_name)
    say("shapes", f"q {tuple(q.shape)}, k and v {tuple(k.shape)} "
                  f"(GQA: {d['heads_q'] // d['heads_kv']} query heads per kv head)")
    say("mask", repr(mask))
    say("time", f"{first * 1e3:.2f} ms first call"
                f"{' (includes compilation)' if used == 'cuda' else ''}, "
                f"{best * 1e3:.2f} ms best of 3 later calls")
    say("max error", f"{error:.3e} (max |out - reference float64|)")
    rule = (f"2 x naive {dtype_name} error {naive_error:.3e} + one rounding"
            if naive_error is not None else f"fixed for {dtype_name}")
    say("tolerance", f"{tol:.3e} ({rule})")
    say("check", "PASS" if passed else "FAIL")
    return 0 if passed else 1


def _add_demo_options(parser, suppress_defaults):
    def default(value):
        return argparse.SUPPRESS if suppress_defaults else value

    parser.add_argument("--backend", choices=("auto", "cpu", "cuda"), default=default("auto"),
                        help="where to run: auto (GPU if present, else CPU mode), cpu, cuda")
    parser.add_argument("--dtype", choices=DTYPES, default=default(None),
                        help="input dtype (default: float16 on a GPU, float32 in CPU mode)")
    parser.add_argument("--seed", type=int, default=default(0), help="seed of the random inputs")
    # Hidden hook for tests: perturb one output element so that the check must fail.
    parser.add_argument("--perturb", type=float, default=default(0.0), help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser: ``python -m numba_flash [demo] [--backend] [--dtype] [--seed]``."""
    parser = argparse.ArgumentParser(
        prog="python -m numba_flash",
        description="numba-flash: exact FlashAttention with numba.cuda kernels and a NumPy CPU "
                    "mode. Without a subcommand, runs the demo.")
    _add_demo_options(parser, suppress_defaults=False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="checked attention call under a causal-document mask (the default)")
    # Subcommand defaults are suppressed so options given before the subcommand survive.
    _add_demo_options(demo, suppress_defaults=True)
    from .studies import STUDIES
    from .studies.cli import add_arguments as _add_study_arguments, study_help

    study = commands.add_parser(
        "study", help="numerical-stability study NAME (docs/stability.md): " + ", ".join(STUDIES),
        description="Numerical-stability studies; each writes a CSV, a PNG and a summary under "
                    "out/studies/NAME (needs the plot extra).\n\nstudies:\n" + study_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_study_arguments(study)
    warm = commands.add_parser(
        "warmup", help="compile the kernels of a set of configurations into Numba's disk cache "
                       "(for deployments: the first real call then loads them)")
    warm.add_argument("--dtype", action="append", choices=DTYPES, help="repeatable "
                      "(default: float16 and bfloat16)")
    warm.add_argument("--head-dim", action="append", type=int, help="repeatable (default: 64, 128)")
    warm.add_argument("--no-decode", action="store_true", help="attention kernels only")
    warm.add_argument("--library", choices=("cupy", "torch"), default="cupy",
                      help="array library of the warm-up calls")
    return parser


def run_warmup(args) -> int:
    """``python -m numba_flash warmup``: the stats of the kernel cache after the calls."""
    from .warmup import warmup

    try:
        stats = warmup(dtypes=tuple(args.dtype or ("float16", "bfloat16")),
                       head_dims=tuple(args.head_dim or (64, 128)),
                       decode=not args.no_decode, library=args.library)
    except RuntimeError as exc:
        print(f"python -m numba_flash warmup: {exc}", file=sys.stderr)
        return 2
    for family, counts in sorted(stats.items()):
        print(f"{family:10s} loaded from the cache {counts['hits']:4d}   compiled "
              f"{counts['misses']:4d}")
    return 0


def main(argv=None) -> int:
    """Entry point of ``python -m numba_flash``; returns the process exit status."""
    args = build_parser().parse_args(argv)
    if args.command in (None, "demo"):
        return run_demo(backend=args.backend, dtype=args.dtype, seed=args.seed,
                        perturb=args.perturb)
    if args.command == "study":
        from .studies.cli import run_from_args

        return run_from_args(args)
    if args.command == "warmup":
        return run_warmup(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
