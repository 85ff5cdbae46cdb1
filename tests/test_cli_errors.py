"""``python -m numba_flash`` setup errors: one line on stderr saying what is missing and how to
install it, exit status 2, no traceback (issue 18)."""
import sys

import numba_flash.__main__ as cli
from numba_flash import validation


def test_study_without_matplotlib(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import matplotlib -> ImportError
    assert cli.main(["study", "seqlen", "--tiny", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert "matplotlib" in err and "numba-flash[plot]" in err


def test_study_gpu_on_without_cupy(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    assert cli.main(["study", "seqlen", "--tiny", "--gpu", "on", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--gpu on needs CuPy" in err and "CuPy is not installed" in err and "cuda12" in err
    assert not list(tmp_path.iterdir())                        # nothing ran


def test_demo_cuda_backend_without_gpu_says_what_to_run(monkeypatch, capsys):
    monkeypatch.setattr(validation, "cuda_simulator_enabled", lambda: False)
    monkeypatch.setattr(cli, "gpu_available", lambda: False)
    assert cli.main(["--backend", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--backend cpu" in err and "more than 5 minutes" in err


def test_demo_cuda_backend_in_the_simulator_warns_first(monkeypatch, capsys):
    monkeypatch.setattr(validation, "cuda_simulator_enabled", lambda: True)
    monkeypatch.setattr(cli, "gpu_available", lambda: False)
    assert cli._cuda_backend_refusal(sys.stdout) is None
    assert "more than 5 minutes" in capsys.readouterr().out
