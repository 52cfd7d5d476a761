"""`convfuse selfcheck` failures: a failing check is reported with its numbers and makes
the exit code non-zero, and every check can fail (each is shown a lying binding or a
broken function and must notice).
"""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest

from convfuse import _binding
from convfuse.selfcheck import (
    GPU_ONLY,
    NO_KERNELS,
    cpu_checks,
    install,
    reference_checks,
    run,
)
from convfuse.selfcheck.report import FAIL, SKIP, CheckResult, write_gpu_matrix
from convfuse.selfcheck.runner import CheckFailed, Outcome, relative_error, run_check
from tests import _selfcheck_helpers

quick = _selfcheck_helpers.quick  # fixture


# --- failures are reported, with numbers, and make the exit code non-zero ------------------


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
    real_load = install.load_binding

    class OnAGpu:  # the real binding, but cudnnCreate succeeds, as it does on a GPU
        def __init__(self, lib):
            self._lib = lib

        def __getattr__(self, name):
            return getattr(self._lib, name)

        def Handle(self):
            return object()

    def load():
        path, lib, problems = real_load()
        return path, OnAGpu(lib), problems

    monkeypatch.setattr(install, "load_binding", load)
    rep = run(cpu_only=True, kernels=False)
    assert rep.gpu_reason == "GPU checks skipped (--cpu-only)"
    assert rep.not_checked == [*GPU_ONLY, NO_KERNELS] and rep.ok
    # the binding's checks still know a GPU is there: cudnnCreate is expected to succeed
    # (expecting NOT_INITIALIZED, the check failed on every working GPU machine)
    [create] = [c for c in rep.checks if c.name == "cudnnCreate"]
    assert create.status == "pass", create
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


def test_the_kernels_compile_is_listed_as_unchecked_only_when_skipped(monkeypatch, quick):
    import convfuse.selfcheck as sc

    monkeypatch.setattr(sc, "gpu_unavailable_reason", lambda: "no GPU (as if)")
    monkeypatch.setattr(cpu_checks, "kernels_compile", lambda: Outcome("compiled (as if)"))
    with_kernels = run()
    assert any(c.group == "kernels" for c in with_kernels.checks)
    assert with_kernels.not_checked == list(GPU_ONLY)
    without = run(kernels=False)
    assert not any(c.group == "kernels" for c in without.checks)
    assert without.not_checked == [*GPU_ONLY, NO_KERNELS]


def test_a_gpu_without_the_binding_keeps_the_no_kernels_entry(monkeypatch, quick):
    """A usable GPU whose cuDNN binding did not load lists every GPU check as unchecked,
    and a --no-kernels run still lists the kernels' compile."""
    import convfuse.selfcheck as sc

    monkeypatch.setattr(sc, "gpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(install, "load_binding", lambda: (None, None, []))
    rep = run(kernels=False)
    assert rep.not_checked == ["every GPU check: the cuDNN binding did not load", *GPU_ONLY,
                               NO_KERNELS]
