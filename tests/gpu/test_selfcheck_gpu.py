"""`convfuse selfcheck` on a real GPU: every case passes, and the cases can fail.

Never run on the machines this was written on (no GPU); written against the real API.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def report():
    """The whole selfcheck, run once. Under the acceptance run ($OUT set), each case's start
    and outcome is appended to $OUT/log.txt as it happens: pytest holds the fixture's output
    until it ends, and a chunk cut or hung inside it would otherwise leave no trace of which
    case it reached."""
    import convfuse.selfcheck as selfcheck
    from convfuse.selfcheck import gpu_suite, runner

    log = os.environ.get("OUT") and os.path.join(os.environ["OUT"], "log.txt")
    if not log or not os.path.isfile(log):
        return selfcheck.run()

    def logged(group, name, fn, dtype=None):
        with open(log, "a") as f:
            f.write(f"selfcheck: {group} {name} {dtype or ''} ...\n")
        result = runner.run_check(group, name, fn, dtype)
        with open(log, "a") as f:
            f.write(f"selfcheck: {group} {name} {dtype or ''}: {result.status} "
                    f"({result.seconds:.1f} s) {result.detail[:200]}\n")
        return result

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(selfcheck, "run_check", logged)
        mp.setattr(gpu_suite, "run_check", logged)
        return selfcheck.run()


def test_every_gpu_case_passes(report):
    failed = [(c.name, c.dtype, c.detail) for c in report.checks if c.status != "pass"]
    assert failed == []
    assert report.gpu_ran and report.not_checked == [] and report.exit_code == 0


def test_every_case_ran_for_every_supported_dtype(report):
    import cupy

    from convfuse.selfcheck.gpu_arrays import supported_dtypes
    from convfuse.selfcheck.gpu_checks import OP_CASES

    dtypes = supported_dtypes(cupy)
    assert {"float64", "float32"} <= set(dtypes)
    # the informational row (gpu_suite.forward_path_report) measures nothing: no error
    [paths] = [c for c in report.checks if c.name == "fused forward paths"]
    assert paths.status == "pass" and "plan(s) fused" in paths.detail
    gpu = [c for c in report.checks if c.group == "gpu" and c is not paths]
    for name, _ in OP_CASES:
        assert sorted(c.dtype for c in gpu if c.name == name) == sorted(dtypes), name
    for name in ("plan autotune", "captured training step", "tiny ResNet training step"):
        assert [c.dtype for c in gpu if c.name == name] == ["float32"]
    for name in ("conv layers", "Linear layer", "pooling layers", "fused SGD", "fused Adam",
                 "fused AdamW", "batchnorm train/eval, fused/plain"):
        assert len([c for c in gpu if c.name == name]) == len(dtypes)
    assert all(c.error is not None and c.error <= c.tolerance for c in gpu)


def test_report_names_the_gpu_and_prints_the_table(report):
    from convfuse.selfcheck.report import write_text

    assert "compute capability" in report.environment["GPU"]
    assert report.environment["CUDA driver"] != "none found"
    out = io.StringIO()
    write_text(report, out)
    text = out.getvalue()
    assert "GPU checks against the float64 reference" in text
    assert "No GPU" not in text and "Result: PASS" in text and "CPU and GPU checks" in text


def test_command_line_exits_zero_and_writes_json(tmp_path):
    path = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "convfuse", "selfcheck", "--json", str(path)],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(path.read_text())
    assert data["gpu_checks_ran"] is True and data["ok"] is True


def _only(case_name):
    from convfuse.selfcheck.gpu_checks import OP_CASES

    return tuple((n, fn) for n, fn in OP_CASES if n == case_name)


def test_a_wrong_gpu_result_fails_with_its_error(monkeypatch):
    """Scale the cuDNN data gradient by 1.001: every dtype's case must fail, with the error
    measured (about 1e-3), except float16/bfloat16 whose tolerance is 1e-2."""
    import convfuse.ops as ops
    from convfuse.backend import is_cupy
    from convfuse.selfcheck.gpu_suite import run_gpu_checks

    real = ops.conv_backward_data

    def off(dz, w, geom, out=None, beta=0.0):
        result = real(dz, w, geom, out, beta)
        if is_cupy(result):
            result *= 1.001
        return result

    monkeypatch.setattr(ops, "conv_backward_data", off)
    results = run_gpu_checks(_only("conv_backward_data"))
    assert results
    for r in results:
        if r.dtype in ("float64", "float32"):
            assert r.status == "fail" and r.error == pytest.approx(1e-3, rel=0.1), r
        else:
            assert r.status == "pass", r


def test_an_unwritten_output_is_caught(monkeypatch):
    """An op that leaves its NaN-poisoned output untouched fails with an infinite error."""
    import convfuse.ops as ops
    from convfuse.backend import is_cupy
    from convfuse.selfcheck.gpu_suite import run_gpu_checks

    real = ops.conv_backward_filter

    def lazy(x, dz, geom, out=None, beta=0.0):
        if is_cupy(x) and out is not None:
            return out
        return real(x, dz, geom, out, beta)

    monkeypatch.setattr(ops, "conv_backward_filter", lazy)
    results = run_gpu_checks(_only("conv_backward_filter"))
    assert results and all(r.status == "fail" and r.error == math.inf for r in results)


def test_a_failing_case_does_not_stop_the_others(monkeypatch):
    from convfuse.selfcheck import gpu_suite

    def boom(dtype):
        raise RuntimeError(f"boom {dtype}")

    cases = (("boom", boom), *_only("pooling"))
    results = gpu_suite.run_gpu_checks(cases)
    booms = [r for r in results if r.name == "boom"]
    assert booms and all(r.status == "fail" and r.detail.startswith("RuntimeError") for r in booms)
    assert all(r.status == "pass" for r in results if r.name == "pooling")


def test_each_case_runs_alone_without_tf32():
    """The cases set allow_tf32=False themselves; check the flag is restored afterwards."""
    from convfuse import config
    from convfuse.selfcheck.gpu_checks import activation_case
    from convfuse.selfcheck.gpu_suite import run_gpu_checks

    before = config.get()
    results = run_gpu_checks((("activation kernels", activation_case),))
    assert all(r.status == "pass" for r in results)
    assert config.get() == before
