"""`convfuse selfcheck` on this machine (no GPU): its report, the environment it names,
the JSON report and the command line.

Failing checks, broken installs and the checks' pieces are tested in
test_selfcheck_failures.py, test_selfcheck_install.py and test_selfcheck_pieces.py.
"""

from __future__ import annotations

import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from convfuse import _binding, cli
from convfuse.backend import gpu_unavailable_reason
from convfuse.selfcheck import GPU_ONLY, NO_KERNELS, run
from convfuse.selfcheck.report import FAIL, PASS, SKIP, CheckResult, Report

NO_GPU = gpu_unavailable_reason() is not None


@pytest.fixture(scope="module")
def report() -> Report:
    return run(kernels=False)


def test_every_cpu_check_passes_here(report):
    failed = [(c.name, c.detail) for c in report.checks if c.status != PASS]
    assert failed == []
    assert report.problems == []
    assert report.ok and report.exit_code == 0


def test_checks_cover_the_issue(report):
    names = {c.name for c in report.checks}
    for expected in ("libcudnn and convfuse._cudnn load", "descriptors round-trip",
                     "cuDNN output dims = convfuse rule", "BAD_PARAM -> CudnnError",
                     "plans build and cache", "no descriptor leak", "reference forward = loops",
                     "reference gradients (adjoints)", "activation gradients (FD)",
                     "reference bfloat16 vs float64"):
        assert expected in names
    numeric = [c for c in report.checks if c.error is not None]
    assert numeric and all(c.error <= c.tolerance for c in numeric)


@pytest.mark.skipif(not NO_GPU, reason="describes a machine without a GPU")
def test_without_a_gpu_it_says_what_it_could_not_check(report):
    assert report.gpu_reason == gpu_unavailable_reason()
    assert report.not_checked == [*GPU_ONLY, NO_KERNELS]  # the fixture's run(kernels=False)
    assert not any(c.group.startswith("gpu") for c in report.checks)
    out = io.StringIO()
    from convfuse.selfcheck.report import write_text

    write_text(report, out)
    text = out.getvalue()
    assert f"GPU checks not run: {gpu_unavailable_reason()}" in text
    assert "Not checked here" in text and GPU_ONLY[0] in text
    assert "Result: PASS" in text and "CPU-side checks only" in text


def test_environment_names_every_version(report):
    env = report.environment
    for key in ("convfuse", "Python", "NumPy", "CuPy", "CUDA runtime", "CUDA driver", "cuDNN",
                "cuDNN binding", "cuDNN wheels", "cuda-pathfinder", "GPU"):
        assert key in env
    lib = _binding.cudnn()
    v = lib.getVersion()
    assert env["cuDNN"].startswith(f"{v // 10000}.{v % 10000 // 100}.{v % 100} (")
    assert _binding.load_library() in env["cuDNN"]
    assert env["NumPy"] == np.__version__
    assert env["Python"].startswith(".".join(map(str, sys.version_info[:3])))
    if NO_GPU:
        assert env["GPU"].startswith("none (")


def test_json_report_holds_everything(report, tmp_path):
    path = tmp_path / "r.json"
    report.write_json(path)
    data = json.loads(path.read_text())
    assert data["ok"] is True and data["exit_code"] == 0
    assert data["gpu_checks_ran"] is (not NO_GPU)
    assert data["environment"] == report.environment
    assert data["counts"] == {PASS: len(report.checks), FAIL: 0, SKIP: 0}
    assert len(data["checks"]) == len(report.checks)
    first = data["checks"][0]
    assert set(first) >= {"group", "name", "status", "detail", "error", "tolerance", "seconds"}


def test_json_writes_non_finite_errors_as_text():
    rep = Report(checks=[CheckResult("gpu", "x", FAIL, "NaN left", math.inf, 1e-5, "float32")])
    data = json.loads(json.dumps(rep.to_dict()))
    assert data["checks"][0]["error"] == "inf"
    assert data["ok"] is False and data["exit_code"] == 1


def test_cli_main_prints_and_writes_json(tmp_path, capsys):
    path = tmp_path / "report.json"
    assert cli.main(["selfcheck", "--no-kernels", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("convfuse selfcheck\n") and "Result: PASS" in out
    assert f"Full report written to {path}" in out
    assert json.loads(path.read_text())["ok"] is True


def test_cli_usage_errors(tmp_path, capsys):
    assert cli.main([]) == cli.EXIT_USAGE
    assert "selfcheck" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["selfcheck", "--no-such-flag"])
    assert info.value.code == 2



@pytest.mark.parametrize("where, says", [
    ("missing-folder/r.json", "the folder of '.*missing-folder/r.json' does not exist"),
    ("", "needs a file name"),
    (".", "'.*' is a directory"),
])
def test_a_json_path_that_cannot_be_written_is_refused_before_any_check(
        monkeypatch, tmp_path, capsys, where, says):
    import convfuse.selfcheck as sc

    def no_checks(*args, **kwargs):
        raise AssertionError("the checks ran before --json was refused")

    monkeypatch.setattr(sc, "run", no_checks)
    path = "" if not where else str(tmp_path / where)
    with pytest.raises(SystemExit) as info:
        cli.main(["selfcheck", "--no-kernels", "--json", path])
    assert info.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert re.search(f"^convfuse selfcheck: error: argument --json: {says}", err), err
    assert "Traceback" not in err


def test_the_json_report_is_written_before_the_text(monkeypatch, tmp_path):
    """A broken stdout (`| true`, a closed pipe) must not cost the file."""
    class Broken:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    path = tmp_path / "report.json"
    monkeypatch.setattr(sys, "stdout", Broken())
    # the reader left: the checks' verdict is the exit code still (not a usage error)
    assert cli.main(["selfcheck", "--no-kernels", "--json", str(path)]) == cli.EXIT_OK
    assert json.loads(path.read_text())["ok"] is True


def test_a_failed_json_write_keeps_the_text_report(monkeypatch, capsys):
    """A disk that fills after the path was checked: the report is still printed."""
    import convfuse.selfcheck as sc

    def full(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sc.Report, "write_json", full)
    assert cli.main(["selfcheck", "--no-kernels", "--json", "r.json"]) == cli.EXIT_USAGE
    captured = capsys.readouterr()
    assert "Result: PASS" in captured.out and "Full report written" not in captured.out
    assert "could not write the JSON report to 'r.json': No space left" in captured.err


def test_cli_reports_a_selfcheck_bug_without_a_traceback(monkeypatch, capsys):
    import convfuse.selfcheck as sc

    def broken(*args, **kwargs):
        raise KeyError("oops")

    monkeypatch.setattr(sc, "selfcheck", broken)
    assert cli.main(["selfcheck"]) == cli.EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "internal error (KeyError" in err and "Traceback" not in err


def test_python_dash_m_runs_the_whole_selfcheck(tmp_path):
    """The real command, NVRTC kernel compile included, in a fresh interpreter."""
    path = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "convfuse", "selfcheck", "--json", str(path)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    data = json.loads(path.read_text())
    kernels = [c for c in data["checks"] if c["group"] == "kernels"]
    assert kernels and kernels[0]["status"] == PASS
    assert "compiled to PTX" in kernels[0]["detail"]


def test_console_script_is_installed():
    exe = shutil.which("convfuse", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the convfuse console script is not installed in this environment "
                    "(reinstall the package to create it)")
    proc = subprocess.run([exe, "selfcheck", "--no-kernels"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Result: PASS" in proc.stdout
