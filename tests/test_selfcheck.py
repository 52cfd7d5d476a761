"""`convfuse selfcheck` on this machine (no GPU), its reports, and broken installs.

Broken installs are simulated by monkeypatching package metadata, the loaders in
convfuse._binding and sys.modules; each must give a named problem with a fix and a
non-zero exit, never a traceback.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from convfuse import _binding, cli
from convfuse.backend import gpu_unavailable_reason
from convfuse.errors import CudnnLoadError
from convfuse.selfcheck import GPU_ONLY, cpu_checks, install, oracle, reference_checks, run
from convfuse.selfcheck.report import FAIL, PASS, SKIP, CheckResult, Report, write_gpu_matrix
from convfuse.selfcheck.runner import CheckFailed, Outcome, Worst, relative_error, run_check
from tests import naive

NO_GPU = gpu_unavailable_reason() is not None
ROOT = Path(__file__).resolve().parents[1]


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
    assert report.not_checked == list(GPU_ONLY)
    assert not any(c.group.startswith("gpu") for c in report.checks)
    out = io.StringIO()
    from convfuse.selfcheck.report import write_text

    write_text(report, out)
    text = out.getvalue()
    assert f"No GPU: {gpu_unavailable_reason()}" in text
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
    bad = tmp_path / "missing-folder" / "r.json"
    assert cli.main(["selfcheck", "--no-kernels", "--json", str(bad)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "missing-folder" in err and "Traceback" not in err


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


# --- failures are reported, with numbers, and make the exit code non-zero ------------------


@pytest.fixture
def quick(monkeypatch):
    """Selfcheck without the reference-engine checks (for tests about other parts)."""
    monkeypatch.setattr(reference_checks, "REFERENCE_CHECKS", ())


def test_a_wrong_result_fails_with_its_error(monkeypatch):
    import convfuse.ops as ops

    real = ops.conv_backward_data

    def off(dz, w, geom, out=None, beta=0.0):
        return real(dz, w, geom, out, beta) * (1 + 1e-6)

    monkeypatch.setattr(ops, "conv_backward_data", off)
    result = run_check("reference", "grads", reference_checks.gradients_adjoint)
    assert result.status == FAIL
    assert result.error is not None and 1e-12 < result.error < 1e-5
    assert result.tolerance == reference_checks.EXACT
    assert "dX(g)" in result.detail


def test_an_exception_in_a_check_is_a_failure_not_a_crash(monkeypatch, quick):
    def boom(*args, **kwargs):
        raise RuntimeError("engine exploded")

    monkeypatch.setattr(cpu_checks, "descriptor_round_trips", boom)
    rep = run(kernels=False)
    failed = rep.failures
    assert [c.name for c in failed] == ["descriptors round-trip"]
    assert failed[0].detail == "RuntimeError: engine exploded"
    assert "Traceback" in failed[0].trace
    assert rep.exit_code == 1
    out = io.StringIO()
    from convfuse.selfcheck.report import write_text

    write_text(rep, out)
    assert "FAIL    descriptors round-trip" in out.getvalue()
    assert "Traceback" not in out.getvalue()
    assert "Result: FAIL" in out.getvalue()


def test_missing_nvrtc_is_a_skip(monkeypatch):
    from convfuse import kernels

    def no_nvrtc():
        raise ImportError("No module named 'cupy'")

    monkeypatch.setattr(kernels, "nvrtc", no_nvrtc)
    result = run_check("kernels", "compile", cpu_checks.kernels_compile)
    assert result.status == SKIP and "CuPy is not installed" in result.detail


# --- broken installs ----------------------------------------------------------------------


@pytest.fixture
def fresh_loaders():
    """Forget the cached library and binding before and after (they reload on demand)."""
    cached = (_binding.load_library, _binding.cudnn)  # tests may replace them meanwhile
    for fn in cached:
        fn.cache_clear()
    yield
    for fn in cached:
        fn.cache_clear()


def fake_dists(monkeypatch, installed: dict[str, str]) -> None:
    """Make importlib.metadata report exactly these versions for the wheels convfuse checks."""
    real = importlib.metadata.version
    watched = {"nvidia-cudnn-cu12", "nvidia-cudnn-cu13", "cupy-cuda11x", "cupy-cuda12x",
               "cupy-cuda13x", "cupy"}

    def version(name: str) -> str:
        if name in watched:
            if name in installed:
                return installed[name]
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


def problems_text(rep: Report) -> str:
    return "\n".join(f"{p.what} | {p.fix}" for p in rep.problems)


def broken_run(capsys) -> tuple[Report, str]:
    from convfuse.selfcheck import selfcheck

    code = selfcheck(kernels=False)
    out = capsys.readouterr().out
    assert code == 1
    assert "Traceback" not in out and "PROBLEM:" in out and "fix:" in out
    return run(kernels=False), out


def test_both_cudnn_wheels(monkeypatch, quick, capsys):
    fake_dists(monkeypatch, {"nvidia-cudnn-cu12": "9.28.0", "nvidia-cudnn-cu13": "9.28.0",
                             "cupy-cuda12x": "14.2.0"})
    rep, _ = broken_run(capsys)
    text = problems_text(rep)
    assert "both cuDNN wheels are installed" in text
    assert "pip uninstall -y nvidia-cudnn-cu12 nvidia-cudnn-cu13" in text
    assert "pip install nvidia-cudnn-cu12" in text  # the line matching cupy-cuda12x


def test_cupy_and_cudnn_on_different_cuda_lines(monkeypatch, quick, capsys):
    fake_dists(monkeypatch, {"nvidia-cudnn-cu13": "9.28.0", "cupy-cuda12x": "14.2.0"})
    rep, _ = broken_run(capsys)
    text = problems_text(rep)
    assert "different CUDA lines: cupy-cuda12x==14.2.0 is CUDA 12, " in text
    assert "nvidia-cudnn-cu13==9.28.0 is CUDA 13" in text
    assert "pip uninstall -y nvidia-cudnn-cu13 && pip install nvidia-cudnn-cu12" in text


def test_two_cupy_wheels(monkeypatch, quick, capsys):
    fake_dists(monkeypatch, {"nvidia-cudnn-cu12": "9.28.0", "cupy-cuda12x": "14.2.0",
                             "cupy-cuda13x": "14.2.0"})
    rep, _ = broken_run(capsys)
    assert "more than one CuPy is installed" in problems_text(rep)
    assert "pip uninstall -y cupy-cuda12x cupy-cuda13x" in problems_text(rep)


def test_driver_too_old_for_the_wheels(monkeypatch):
    fake_dists(monkeypatch, {"nvidia-cudnn-cu13": "9.28.0", "cupy-cuda13x": "14.2.0"})
    problems = install.static_problems(driver_version=12040)
    text = " ".join(p.what + " " + p.fix for p in problems)
    assert "supports CUDA up to 12.4, but cupy-cuda13x==14.2.0 needs a CUDA 13 driver" in text
    assert "convfuse[cu12]" in text
    assert install.static_problems(driver_version=13000) == []


def test_no_cudnn_wheel_and_no_library(monkeypatch, quick, fresh_loaders, capsys):
    fake_dists(monkeypatch, {"cupy-cuda12x": "14.2.0"})

    def not_found():
        raise CudnnLoadError("libcudnn.so.9 could not be found or loaded")

    monkeypatch.setattr(_binding, "load_library", not_found)
    rep, _ = broken_run(capsys)
    text = problems_text(rep)
    assert "no cuDNN wheel is installed and libcudnn.so.9 was not found" in text
    assert "pip install nvidia-cudnn-cu12" in text
    assert rep.environment["cuDNN"].startswith("not loaded")
    assert rep.environment["cuDNN wheels"] == "none"
    skipped = [c for c in rep.checks if c.status == SKIP]
    assert skipped and "need convfuse._cudnn" in skipped[0].detail


def test_wheel_present_but_library_broken(monkeypatch, quick, fresh_loaders, capsys):
    def broken():
        raise CudnnLoadError("libcudnn.so.9: invalid ELF header")

    monkeypatch.setattr(_binding, "load_library", broken)
    rep, _ = broken_run(capsys)
    assert "did not load although a wheel is installed" in problems_text(rep)
    assert "pip install --force-reinstall nvidia-cudnn-cu" in problems_text(rep)


def test_missing_cuda_pathfinder(monkeypatch, quick, fresh_loaders, capsys):
    monkeypatch.setitem(sys.modules, "cuda.pathfinder", None)  # import now raises ImportError
    rep, _ = broken_run(capsys)
    text = problems_text(rep)
    assert "cuda-pathfinder is not installed" in text
    assert "pip install 'cuda-pathfinder>=1.2'" in text
    assert len(rep.problems) == 1  # the load failure is not reported a second time
    assert rep.environment["cuda-pathfinder"]  # still names the version metadata reports


def test_extension_not_built(monkeypatch, quick, fresh_loaders, capsys):
    monkeypatch.setitem(sys.modules, "convfuse._cudnn", None)
    rep, _ = broken_run(capsys)
    text = problems_text(rep)
    assert "convfuse._cudnn is missing" in text
    assert "pip install --no-build-isolation -e ." in text
    assert "loaded from" in rep.environment["cuDNN"]  # the library itself did load


def test_a_real_copy_without_the_extension(tmp_path):
    """Not simulated: a copy of the package with no compiled binding, in a fresh process."""
    shutil.copytree(ROOT / "convfuse", tmp_path / "convfuse",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    # An editable install's import hook would fetch the real extension from the source
    # checkout for the copy; drop it, and put the copy first on the path.
    boot = ("import sys, runpy; "
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in "
            "getattr(f, '__module__', '').lower()]; "
            f"sys.path.insert(0, {str(tmp_path)!r}); "
            "sys.argv = ['convfuse', 'selfcheck', '--no-kernels']; "
            "runpy.run_module('convfuse', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", boot], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stdout + proc.stderr
    assert str(tmp_path / "convfuse") in proc.stdout  # it really ran the copy
    assert "PROBLEM: the compiled binding convfuse._cudnn is missing" in proc.stdout
    assert "pip install --no-build-isolation -e ." in proc.stdout
    assert "Result: FAIL" in proc.stdout


def test_extension_present_but_not_importable(monkeypatch, quick, fresh_loaders, capsys):
    def fails():
        raise CudnnLoadError("undefined symbol: cudnnFoo")

    monkeypatch.setattr(_binding, "cudnn", fails)
    rep, _ = broken_run(capsys)
    assert "exists but does not import: undefined symbol: cudnnFoo" in problems_text(rep)


def test_unexpected_loader_failure_is_still_named(monkeypatch, quick, capsys):
    def weird():
        raise OSError("disk on fire")

    monkeypatch.setattr(install, "load_binding", weird)
    rep, _ = broken_run(capsys)
    assert "loading cuDNN failed unexpectedly (OSError: disk on fire)" in problems_text(rep)


def test_cudnn_version_problems():
    def lib(loaded: int, header: int) -> SimpleNamespace:
        return SimpleNamespace(getVersion=lambda: loaded, CUDNN_VERSION=header)

    assert install.version_problems(lib(92800, 92800)) == []
    assert install.version_problems(lib(92800, 91000)) == []  # same major is ABI-compatible
    (old,) = install.version_problems(lib(80906, 80906))
    assert "cuDNN 8.9.6 is loaded; convfuse needs cuDNN 9" in old.what
    (mixed,) = install.version_problems(lib(92800, 100100))
    assert "built against cuDNN 10.1.0 but cuDNN 9.28.0 is loaded" in mixed.what


def test_cuda_line_parsing():
    assert install.cuda_line("cupy-cuda12x==14.2.0") == 12
    assert install.cuda_line("cupy-cuda13x") == 13
    assert install.cuda_line("nvidia-cudnn-cu13==9.28.0.42") == 13
    assert install.cuda_line("nvidia-cudnn-cu12") == 12
    assert install.cuda_line("cupy==14.0.0") is None
    assert install.format_cuda(12090) == "12.9" and install.format_cudnn(92800) == "9.28.0"


def test_environment_without_cupy(monkeypatch):
    from convfuse.selfcheck import environment

    monkeypatch.setattr(environment, "cupy_module", lambda: None)
    env = environment.collect(None, None, "no library")
    assert env["CuPy"].startswith("not installed")
    assert env["CUDA runtime"].startswith("unknown") and env["CUDA driver"] == "none found"
    assert env["cuDNN"] == "not loaded (no library)"


# --- the pieces: error measure, GPU table, oracle -----------------------------------------


def test_relative_error():
    ref = np.array([1.0, -4.0, 2.0])
    assert relative_error(ref, ref) == 0.0
    assert relative_error(ref + np.array([0, 0, 0.04]), ref) == pytest.approx(0.01)
    assert relative_error(np.array([1.0, np.nan, 2.0]), ref) == math.inf  # never written
    assert relative_error(ref[:2], ref) == math.inf
    assert relative_error(np.zeros(3), np.zeros(3)) == 0.0
    worst = Worst(1e-3)
    worst.compare(ref, ref, "same")
    with pytest.raises(CheckFailed) as info:
        worst.compare(ref * 1.01, ref, "scaled")
    assert info.value.error == pytest.approx(0.01) and "scaled" in info.value.detail
    with pytest.raises(CheckFailed):
        worst.record(math.nan, "nan")
    assert isinstance(worst.outcome("x"), Outcome)


def test_gpu_table_has_a_row_per_case_and_a_column_per_dtype():
    checks = [
        CheckResult("gpu", "conv_bias_act relu", PASS, "", 2e-16, 1e-10, "float64"),
        CheckResult("gpu", "conv_bias_act relu", PASS, "", 3e-7, 1e-5, "float32"),
        CheckResult("gpu", "conv_bias_act relu", FAIL, "y: 2e-2 > 1e-2", 2e-2, 1e-2, "float16"),
        CheckResult("gpu", "captured training step", PASS, "", 1e-6, 1e-4, "float32"),
        CheckResult("binding", "descriptors round-trip", PASS, ""),
    ]
    out = io.StringIO()
    write_gpu_matrix(checks, out)
    lines = out.getvalue().splitlines()[2:]  # after a blank line and the title
    assert lines[0].split() == ["case", "float64", "float32", "float16"]
    assert lines[1].split() == ["conv_bias_act", "relu", "ok", "2.0e-16", "ok", "3.0e-07",
                                "FAIL", "2.0e-02"]
    assert lines[2].split() == ["captured", "training", "step", "n/a", "ok", "1.0e-06", "n/a"]
    assert "FAIL conv_bias_act relu [float16]: y: 2e-2 > 1e-2" in out.getvalue()


def test_selfcheck_oracle_agrees_with_the_test_suites_oracle(rng):
    """The two independent loop oracles (selfcheck ships one, tests/ has the other)."""
    for x_shape, w_shape, stride, pad, dil, groups in (
            ((2, 4, 7), (6, 2, 3), (2,), (1,), (1,), 2),
            ((1, 3, 5, 4), (3, 1, 3, 2), (1, 2), (1, 0), (2, 1), 3),
            ((1, 2, 3, 4, 3), (2, 2, 2, 2, 2), (1, 1, 1), (1, 0, 1), (1, 1, 1), 1)):
        x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
        np.testing.assert_allclose(oracle.conv(x, w, stride, pad, dil, groups),
                                   naive.conv_forward(x, w, stride, pad, dil, groups),
                                   rtol=1e-13, atol=1e-13)
    z = np.linspace(-4, 7, 23)
    for act in reference_checks.activations.ACTIVATIONS:
        np.testing.assert_allclose(oracle.activation(act, z), naive.act_array(act, z),
                                   rtol=1e-14, atol=1e-15)


def test_output_dims_grid_has_both_outcomes():
    cases = cpu_checks.output_dims_grid()
    ranks = {len(c[0]) - 2 for c in cases}
    assert ranks == {1, 2, 3} and {c[6] for c in cases} == {False, True}
    assert {c[5] for c in cases} == {1, 2, 4}  # groups, depthwise (4 of 4 channels)


# --- every check can fail -----------------------------------------------------------------


class LyingLib:
    """The real binding, except for what a test overrides."""

    def __init__(self, **overrides):
        self._lib = _binding.cudnn()
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._lib, name)


def test_descriptor_round_trip_catches_a_wrong_readback():
    real = _binding.cudnn()

    class Tensor:
        def __init__(self):
            self._d = real.TensorDescriptor()

        def setNd(self, dt, dims, strides):
            self._d.setNd(dt, dims, strides)

        def getNd(self):
            dt, dims, strides = self._d.getNd()
            return dt, dims, [*strides[:-1], strides[-1] + 1]

    with pytest.raises(CheckFailed, match="tensor float32"):
        cpu_checks.descriptor_round_trips(LyingLib(TensorDescriptor=Tensor))


def test_output_dims_check_catches_a_disagreement(monkeypatch):
    real = cpu_checks.output_dims

    def off_by_one(lib, x, w, s, p, d, g, channels_last):
        shape = real(lib, x, w, s, p, d, g, channels_last)
        return (*shape[:-1], shape[-1] + 1)

    monkeypatch.setattr(cpu_checks, "output_dims", off_by_one)
    with pytest.raises(CheckFailed, match=r"x\[2, 4, 5\] w\[8, 4, 3\]"):
        cpu_checks.output_dims_agree(_binding.cudnn())


def test_output_dims_check_catches_one_sided_refusal(monkeypatch):
    from convfuse.errors import CudnnError

    def refuses(*args):
        raise CudnnError(2000, "cudnnGetConvolutionNdForwardOutputDim", "CUDNN_STATUS_BAD_PARAM")

    monkeypatch.setattr(cpu_checks, "output_dims", refuses)
    with pytest.raises(CheckFailed, match=r"convfuse says \(2, 8, 3\), cuDNN says CudnnError"):
        cpu_checks.output_dims_agree(_binding.cudnn())


def test_bad_param_check_needs_the_real_status_text():
    lib = LyingLib(getErrorString=lambda status: "BAD PARAM")
    with pytest.raises(CheckFailed, match="getErrorString"):
        cpu_checks.bad_param_maps_to_cudnn_error(lib)


def test_handle_check_fails_if_a_handle_appears_without_a_gpu():
    with pytest.raises(CheckFailed, match="succeeded although no GPU"):
        cpu_checks.handle_without_gpu(LyingLib(Handle=lambda: object()), gpu=False)


def test_plan_check_catches_descriptors_left_alive(monkeypatch):
    from convfuse import plan

    kept = []
    real_get = plan.get_plan
    monkeypatch.setattr(plan, "get_plan", lambda *a, **k: kept.append(real_get(*a, **k)))
    try:
        with pytest.raises(CheckFailed, match="descriptors still alive"):
            cpu_checks.plans_build(_binding.cudnn())
    finally:
        kept.clear()
        plan.clear_plan_cache()


def test_leak_check_catches_a_kept_descriptor():
    lib = _binding.cudnn()
    baseline = lib.liveDescriptorCount()
    kept = lib.TensorDescriptor()
    with pytest.raises(CheckFailed, match="1 descriptors created by these checks"):
        cpu_checks.no_descriptor_leak(lib, baseline)
    del kept


def test_reference_check_notices_a_modified_input(monkeypatch):
    import convfuse.ops as ops

    real = ops.conv_bias_act

    def scribbles(x, *args, **kwargs):
        out = real(x, *args, **kwargs)
        x[(0,) * x.ndim] += 1.0
        return out

    monkeypatch.setattr(ops, "conv_bias_act", scribbles)
    with pytest.raises(CheckFailed, match="modified its input"):
        reference_checks.forward_vs_loops()


def test_reference_check_notices_a_wrong_dtype(monkeypatch):
    import convfuse.ops as ops

    real = ops.conv_bias_act
    monkeypatch.setattr(ops, "conv_bias_act",
                        lambda *a, **k: tuple(None if v is None else v.astype(np.float64)
                                              for v in real(*a, **k)))
    with pytest.raises(CheckFailed, match="float16 conv_bias_act returned float64"):
        reference_checks.narrow_dtype("float16")


def test_kernel_compile_check_compiles_and_reports_nvrtc_errors(monkeypatch):
    from convfuse import kernels

    pytest.importorskip("cupy")
    monkeypatch.setattr(kernels, "names", lambda: ["optim"])  # the quickest real source
    out = cpu_checks.kernels_compile()
    assert out.detail == "1 sources (optim) compiled to PTX for compute_80"
    monkeypatch.setattr(kernels, "source",
                        lambda name: 'extern "C" __global__ void k(float* x) { x[0] = y; }')
    with pytest.raises(CheckFailed, match=r"optim\.cu failed to compile for compute_80: .*y"):
        cpu_checks.kernels_compile()
    monkeypatch.setattr(kernels, "names", lambda: [])
    with pytest.raises(CheckFailed, match="no kernel sources"):
        cpu_checks.kernels_compile()


def test_cpu_only_on_a_gpu_machine_skips_the_gpu_checks(monkeypatch, quick):
    import convfuse.selfcheck as sc

    monkeypatch.setattr(sc, "gpu_unavailable_reason", lambda: None)
    rep = run(cpu_only=True, kernels=False)
    assert rep.gpu_reason == "GPU checks skipped (--cpu-only)"
    assert rep.not_checked == list(GPU_ONLY) and rep.ok
    assert not any(c.group.startswith("gpu") for c in rep.checks)


def test_environment_survives_a_broken_cupy(monkeypatch):
    from convfuse.selfcheck import environment

    def broken():
        raise RuntimeError("driver exploded")

    fake = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(
        driverGetVersion=broken, runtimeGetVersion=broken)))
    monkeypatch.setattr(environment, "cupy_module", lambda: fake)
    assert environment.driver_version() == 0 and environment.runtime_version() == 0


def test_module_available_never_raises():
    assert install.module_available("json")
    assert not install.module_available("json.no_such_module.deeper")
    assert not install.module_available("no_such_top_level_module_xyz")


def test_table_cells_for_skips_and_errorless_failures():
    checks = [CheckResult("gpu", "a", SKIP, "no bf16", dtype="bfloat16"),
              CheckResult("gpu", "b", FAIL, "x" * 300, dtype="bfloat16")]
    out = io.StringIO()
    write_gpu_matrix(checks, out)
    text = out.getvalue()
    assert "skip" in text.splitlines()[3] and text.splitlines()[4].split()[-1] == "FAIL"
    assert "x" * 107 + "..." in text and "x" * 108 not in text
    assert relative_error(np.zeros(0), np.zeros(0)) == 0.0


# --- the GPU case table (its bodies only run on a GPU) --------------------------------------


def test_gpu_cases_cover_every_op_layer_and_training_piece():
    from convfuse.selfcheck.gpu_checks import OP_CASES
    from convfuse.selfcheck.gpu_training import TRAINING_CASES

    names = [n for n, _ in (*OP_CASES, *TRAINING_CASES)]
    assert len(names) == len(set(names))
    for act in reference_checks.activations.ACTIVATIONS:
        assert f"conv_bias_act {act}" in names
    for expected in ("conv_backward_data", "conv_backward_filter", "conv_backward_bias",
                     "activation kernels", "pooling", "conv layers", "Linear layer",
                     "plan autotune", "fused SGD", "fused Adam", "fused AdamW", "pooling layers",
                     "captured training step"):
        assert expected in names
    fixed = {n: getattr(fn, "dtypes", None) for n, fn in TRAINING_CASES}
    assert fixed["plan autotune"] == ("float32",) == fixed["captured training step"]
    assert fixed["conv layers"] is None  # every dtype the GPU supports


def test_gpu_inputs_are_rounded_to_their_dtype_before_the_reference_sees_them():
    from convfuse.selfcheck.gpu_checks import f64, host_inputs

    a, b = host_inputs(np.random.default_rng(0), "bfloat16", (3, 4), (5,))
    assert a.dtype.name == "bfloat16" and a.shape == (3, 4) and b.shape == (5,)
    a64, none = f64(a, None)
    assert none is None and a64.dtype == np.float64
    np.testing.assert_array_equal(a64.astype(a.dtype), a)  # exactly the same values


def test_gpu_cases_run_end_to_end_with_numpy_standing_in_for_cupy(monkeypatch):
    """A dry run of every GPU case on the CPU: CuPy is replaced by NumPy, so the cases'
    "GPU" arrays go to the reference engine and each compares the engine with itself in
    float64. This checks the cases' plumbing (call signatures, shapes, layouts, dtypes,
    layer and optimizer APIs, the capture protocol), not GPU numbers: on the GPU the same
    code compares cuDNN with the reference."""
    import convfuse
    from convfuse import backend, graph
    from convfuse.nn import container, module
    from convfuse.selfcheck import gpu_checks
    from convfuse.selfcheck.gpu_training import TRAINING_CASES

    backend.cupy_module()  # cache the real answer first: is_cupy() must not see the stand-in
    stream = SimpleNamespace(synchronize=lambda: None)
    fake_cupy = SimpleNamespace(
        asarray=np.asarray, asnumpy=np.asarray, full=np.full,
        cuda=SimpleNamespace(Device=lambda: SimpleNamespace(compute_capability="90"),
                             get_current_stream=lambda: stream))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    for where in (module, container):
        monkeypatch.setattr(where, "resolve_device", lambda device: "cpu")

    def capture(step_fn, *inputs, warmup=1):
        for _ in range(warmup):
            step_fn(*inputs)
        return _Replay(step_fn)

    monkeypatch.setattr(graph, "capture", capture)
    # Autotuning is a cuDNN plan's business; the reference engine builds no plan to count.
    cases = (*gpu_checks.OP_CASES, *(c for c in TRAINING_CASES if c[0] != "plan autotune"))
    results = gpu_checks.run_gpu_checks(cases)
    assert {r.dtype for r in results} == {"float64", "float32", "float16", "bfloat16"}
    bad = [(r.name, r.dtype, r.detail) for r in results if r.status != PASS]
    assert bad == []
    assert convfuse.config.get().allow_tf32 is True  # restored after the checks


class _Replay:
    """Stands in for a CapturedStep: replays by running the step eagerly."""

    def __init__(self, step_fn):
        self.step_fn = step_fn

    def __call__(self, *inputs):
        return self.step_fn(*inputs)

    def synchronize(self):
        return None
