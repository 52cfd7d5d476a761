"""`convfuse selfcheck` on broken installs.

Broken installs are simulated by monkeypatching package metadata, the loaders in
convfuse._binding and sys.modules; each must give a named problem with a fix and a
non-zero exit, never a traceback.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from convfuse import _binding, selfcheck
from convfuse.backend import gpu_unavailable_reason
from convfuse.errors import CudnnLoadError
from convfuse.selfcheck import install, run
from convfuse.selfcheck.report import SKIP, Report
from tests import _selfcheck_helpers

ROOT = Path(__file__).resolve().parents[1]
quick = _selfcheck_helpers.quick  # fixture


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
    assert "-e '.[cu12]' in the convfuse checkout" in text
    assert install.static_problems(driver_version=13000) == []


def test_a_driver_older_than_every_supported_line_is_told_to_update(monkeypatch):
    """A CUDA 11 driver has no convfuse line to switch to (there is no cu11 extra)."""
    fake_dists(monkeypatch, {"nvidia-cudnn-cu12": "9.28.0", "cupy-cuda12x": "14.2.0"})
    text = " ".join(p.fix for p in install.static_problems(driver_version=11080))
    assert "update the NVIDIA driver (convfuse needs a CUDA 12 or 13 driver)" in text
    assert "cu11" not in text


def test_a_cupy_that_is_installed_but_does_not_import(monkeypatch, quick, capsys):
    """Reported as not installed before (and selfcheck passed): the import's own error is
    the install problem, and the reason the GPU is unusable."""
    from convfuse import backend

    fake_dists(monkeypatch, {"nvidia-cudnn-cu12": "9.28.0", "cupy-cuda12x": "14.2.0"})
    error = "ImportError: libcudart.so.12: cannot open shared object file"
    for fn in (backend.cupy_module, backend.cupy_import_error, backend.gpu_unavailable_reason):
        fn.cache_clear()
    monkeypatch.setattr(backend, "cupy_module", lambda: None)
    monkeypatch.setattr(backend, "cupy_import_error", lambda: error)
    monkeypatch.setattr(install, "cupy_import_error", lambda: error)
    monkeypatch.setattr(selfcheck.environment, "cupy_import_error", lambda: error)
    monkeypatch.setattr(selfcheck.environment, "cupy_module", lambda: None)
    try:
        reason = backend.gpu_unavailable_reason()
        assert reason.startswith(f"CuPy is installed but does not import ({error})")
        rep, _ = broken_run(capsys)
        assert f"cupy-cuda12x==14.2.0 is installed but does not import ({error})" in \
            problems_text(rep)
        assert "pip install --force-reinstall cupy-cuda12x" in problems_text(rep)
        assert rep.environment["CuPy"].startswith("installed (cupy-cuda12x==14.2.0) but does "
                                                  "not import: ImportError")
    finally:
        backend.gpu_unavailable_reason.cache_clear()


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


def test_a_cuda_pathfinder_that_knows_no_cudnn(monkeypatch, quick, fresh_loaders, capsys):
    """cuda-pathfinder before 1.7 has no "cudnn" (DynamicLibUnknownError), which CuPy 14
    accepts: the fix is pathfinder, not reinstalling the cuDNN wheel."""
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "1.6.1" if name == "cuda-pathfinder" else real(name))

    def unknown():
        raise CudnnLoadError("cuda-pathfinder does not know cuDNN by name "
                             "(DynamicLibUnknownError: Unknown library name: 'cudnn')")

    monkeypatch.setattr(_binding, "load_library", unknown)
    rep, _ = broken_run(capsys)
    text = problems_text(rep)
    assert "cuda-pathfinder 1.6.1 does not know cuDNN by name" in text
    assert "pip install -U 'cuda-pathfinder>=1.7'" in text
    assert "--force-reinstall" not in text


def test_the_binding_names_an_old_cuda_pathfinder(monkeypatch, fresh_loaders):
    import cuda.pathfinder

    class DynamicLibUnknownError(Exception):
        pass

    def load(name):
        raise DynamicLibUnknownError(f"Unknown library name: {name!r}")

    monkeypatch.setattr(cuda.pathfinder, "load_nvidia_dynamic_lib", load)
    with pytest.raises(CudnnLoadError, match=r"pip install -U 'cuda-pathfinder>=1\.7'"):
        _binding.load_library()


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
    assert "pip install 'cuda-pathfinder>=1.7'" in text
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


# --- gpu_unusable_reason: what a script asks before choosing the GPU ----------------------


@pytest.fixture
def a_gpu(monkeypatch):
    """A CUDA device is usable (as far as CuPy says) with a driver for CUDA 13.0: what the
    install diagnosis sees on a GPU machine, short of running anything there."""
    monkeypatch.setattr(selfcheck, "gpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(selfcheck.environment, "driver_version", lambda: 13000)


def test_no_device_is_the_backend_reason():
    assert selfcheck.gpu_unusable_reason() == gpu_unavailable_reason()


def test_a_sound_install_with_a_device_is_usable(monkeypatch, a_gpu, fresh_loaders):
    # the wheels of one line (this venv's cu12 pair) and the real libcudnn and binding
    fake_dists(monkeypatch, {"nvidia-cudnn-cu12": "9.28.0", "cupy-cuda12x": "14.2.0"})
    assert selfcheck.gpu_unusable_reason() is None


def test_a_binding_that_was_never_built(monkeypatch, a_gpu, fresh_loaders):
    fake_dists(monkeypatch, {"nvidia-cudnn-cu12": "9.28.0", "cupy-cuda12x": "14.2.0"})
    monkeypatch.setitem(sys.modules, "convfuse._cudnn", None)
    reason = selfcheck.gpu_unusable_reason()
    assert reason.startswith("the GPU install is broken: the compiled binding "
                             "convfuse._cudnn is missing")
    assert "; fix: build it in the source checkout" in reason
    assert "more problem" not in reason


def test_the_first_of_several_problems_and_the_count(monkeypatch, a_gpu, fresh_loaders):
    fake_dists(monkeypatch, {"nvidia-cudnn-cu12": "9.28.0", "nvidia-cudnn-cu13": "9.28.0",
                             "cupy-cuda12x": "14.2.0"})
    monkeypatch.setattr(selfcheck.environment, "driver_version", lambda: 12040)
    reason = selfcheck.gpu_unusable_reason()
    # both cuDNN wheels, and the cu13 one needs a newer driver than 12.4
    assert reason.startswith("the GPU install is broken: both cuDNN wheels are installed")
    assert "(and 1 more problem(s): run `convfuse selfcheck`)" in reason
    assert "; fix: pip uninstall -y nvidia-cudnn-cu12 nvidia-cudnn-cu13" in reason


def test_an_unforeseen_loader_failure_is_a_reason(monkeypatch, a_gpu):
    fake_dists(monkeypatch, {"nvidia-cudnn-cu12": "9.28.0", "cupy-cuda12x": "14.2.0"})

    def weird():
        raise OSError("disk on fire")

    monkeypatch.setattr(install, "load_binding", weird)
    assert selfcheck.gpu_unusable_reason() == ("loading cuDNN failed unexpectedly "
                                               "(OSError: disk on fire)")
