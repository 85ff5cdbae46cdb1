"""``python -m numba_flash``: the main job runs, reports, and fails loudly when the check fails."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import numba_flash
from numba_flash import __main__ as cli
from numba_flash import validation
from numba_flash_reference.attention import attention as reference_attention

ROOT = Path(__file__).resolve().parents[1]


def run_module(*args):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")  # as in CI: no GPU, never touch a driver
    return subprocess.run([sys.executable, "-m", "numba_flash", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def field(text, label):
    match = re.search(rf"^{label}\s*: (.*)$", text, re.MULTILINE)
    assert match, f"no {label!r} line in:\n{text}"
    return match.group(1)


def test_module_runs_the_main_job_in_cpu_mode():
    proc = run_module()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert field(out, "backend") == "cpu"
    assert field(out, "dtype") == "float32"
    assert field(out, "shapes").startswith("q (2, 256, 8, 64), k and v (2, 256, 2, 64)")
    assert "causal_document" in field(out, "mask")
    error = float(field(out, "max error").split()[0])
    assert 0 < error <= 1e-5  # float32 output: one rounding of the float64 answer, not zero
    assert float(field(out, "tolerance").split()[0]) == 1e-5
    assert field(out, "check") == "PASS"
    assert re.match(r"[\d.]+ ms first call", field(out, "time"))


def test_module_exits_nonzero_when_the_check_fails():
    proc = run_module("demo", "--perturb", "0.5")
    assert proc.returncode == 1
    assert field(proc.stdout, "check") == "FAIL"
    assert float(field(proc.stdout, "max error").split()[0]) >= 0.5 - 1e-3


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_narrow_dtypes_use_the_two_times_naive_rule(dtype, capsys):
    assert cli.main(["demo", "--dtype", dtype, "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert field(out, "dtype") == dtype
    tolerance = field(out, "tolerance")
    naive = float(re.search(r"naive \w+ error ([\d.e+-]+)", tolerance).group(1))
    error = float(field(out, "max error").split()[0])
    assert 0 < error < naive  # CPU mode rounds once; the naive computation rounds at every step


def test_failure_hook_in_process(capsys):
    assert cli.main(["--dtype", "float64", "--perturb", "1e-9"]) == 1
    out = capsys.readouterr().out
    assert field(out, "check") == "FAIL" and field(out, "tolerance").startswith("1.000e-12")


def test_cuda_backend_without_gpu_or_simulator_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr(validation, "cuda_simulator_enabled", lambda: False)
    monkeypatch.setattr(cli, "gpu_available", lambda: False)
    assert cli.main(["--backend", "cuda"]) == 2
    assert "backend='cuda' needs GPU arrays" in capsys.readouterr().err


def test_auto_falls_back_to_cpu_mode_when_the_gpu_backend_lacks_a_feature(monkeypatch, capsys):
    real = numba_flash.attention

    def gpu_without_masks(*args, backend="auto", **kwargs):
        if backend == "auto":
            raise NotImplementedError("mask objects are not supported on the GPU yet")
        return real(*args, backend=backend, **kwargs)

    monkeypatch.setattr(numba_flash, "attention", gpu_without_masks)
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "note: the GPU backend cannot run this job yet (mask objects" in out
    assert field(out, "backend") == "cpu" and field(out, "check") == "PASS"


def test_parser_options_before_or_after_the_subcommand():
    parser = cli.build_parser()
    args = parser.parse_args([])
    assert (args.command, args.backend, args.dtype, args.seed, args.perturb) == (
        None, "auto", None, 0, 0.0)
    args = parser.parse_args(["--seed", "4", "--dtype", "float64", "demo"])
    assert (args.command, args.seed, args.dtype) == ("demo", 4, "float64")
    args = parser.parse_args(["demo", "--seed", "9", "--backend", "cpu"])
    assert (args.seed, args.backend) == (9, "cpu")
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--dtype", "int8"])
    assert exit_info.value.code == 2


def test_tolerance_rule():
    assert cli.tolerance("float32", 0.3, 5.0) == 1e-5
    assert cli.tolerance("float64", 0.3, 5.0) == 1e-12
    assert cli.tolerance("float16", 1e-3, 4.0) == pytest.approx(2e-3 + 4.0 * 2.0**-11)
    assert cli.tolerance("bfloat16", 1e-2, 2.0) == pytest.approx(2e-2 + 2.0 * 2.0**-8)


def test_naive_attention_against_the_reference():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 9, 4, 16))
    k = rng.standard_normal((1, 11, 2, 16))
    v = rng.standard_normal((1, 11, 2, 16))
    visible = np.tril(np.ones((9, 11), bool), k=2)
    visible[3] = False  # an empty row
    from numba_flash_reference.masks import Mask

    class Dense(Mask):
        def _visible(self, qpos, kpos, seqlen_k):
            return visible[qpos - (seqlen_k - 9), kpos]

    ref = reference_attention(q, k, v, softmax_scale=0.25, mask=Dense())
    f32 = cli.naive_attention(q, k, v, visible, 0.25, np.float32)
    assert np.max(np.abs(f32 - ref)) < 1e-5
    q16, k16, v16 = (x.astype(np.float16).astype(np.float64) for x in (q, k, v))
    ref16 = reference_attention(q16, k16, v16, softmax_scale=0.25, mask=Dense())
    f16 = cli.naive_attention(q16, k16, v16, visible, 0.25, np.float16)
    err16 = np.max(np.abs(f16 - ref16))
    assert 1e-4 < err16 < 2e-2
    assert np.all(f16[0, 3] == 0) and np.all(f32[0, 3] == 0)
