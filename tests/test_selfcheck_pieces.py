"""The pieces of `convfuse selfcheck`: its error measure, the GPU table, its loop oracle
against the test suite's, and the GPU case table (whose bodies only run on a GPU, but
whose plumbing is dry-run here with NumPy standing in for CuPy).
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from convfuse.selfcheck import cpu_checks, oracle, reference_checks
from convfuse.selfcheck.report import FAIL, PASS, CheckResult, write_gpu_matrix
from convfuse.selfcheck.runner import CheckFailed, Outcome, Worst, relative_error
from tests import naive

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


# --- the GPU case table (its bodies only run on a GPU) --------------------------------------


def test_gpu_cases_cover_every_op_layer_and_training_piece():
    from convfuse.selfcheck.gpu_batchnorm import BATCHNORM_CASES
    from convfuse.selfcheck.gpu_checks import OP_CASES
    from convfuse.selfcheck.gpu_training import TRAINING_CASES

    names = [n for n, _ in (*OP_CASES, *TRAINING_CASES, *BATCHNORM_CASES)]
    assert len(names) == len(set(names))
    for act in reference_checks.activations.ACTIVATIONS:
        assert f"conv_bias_act {act}" in names
    for expected in ("conv_backward_data", "conv_backward_filter", "conv_backward_bias",
                     "activation kernels", "pooling", "conv layers", "Linear layer",
                     "plan autotune", "fused SGD", "fused Adam", "fused AdamW", "pooling layers",
                     "captured training step", "batchnorm train/eval, fused/plain",
                     "tiny ResNet training step"):
        assert expected in names
    fixed = {n: getattr(fn, "dtypes", None) for n, fn in TRAINING_CASES}
    assert fixed["plan autotune"] == ("float32",) == fixed["captured training step"]
    assert fixed["conv layers"] is None  # every dtype the GPU supports
    bn = {n: getattr(fn, "dtypes", None) for n, fn in BATCHNORM_CASES}
    assert bn == {"batchnorm train/eval, fused/plain": None,
                  "tiny ResNet training step": ("float32",)}


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
    from convfuse.nn import module
    from convfuse.selfcheck import gpu_checks, gpu_suite
    from convfuse.selfcheck.gpu_arrays import TF32_TOLERANCE
    from convfuse.selfcheck.gpu_batchnorm import BATCHNORM_CASES
    from convfuse.selfcheck.gpu_training import TRAINING_CASES

    backend.is_cupy(None)  # cache the real answer first: is_cupy() must not see the stand-in
    stream = SimpleNamespace(synchronize=lambda: None)
    allocators = []  # each case runs under gpu_suite's NaN-filling allocator

    @contextlib.contextmanager
    def using_allocator(malloc):
        allocators.append(malloc)
        yield

    fake_cupy = SimpleNamespace(
        asarray=np.asarray, asnumpy=np.asarray, full=np.full,
        get_default_memory_pool=lambda: SimpleNamespace(malloc=lambda n: None),
        cuda=SimpleNamespace(Device=lambda: SimpleNamespace(compute_capability="90"),
                             get_current_stream=lambda: stream,
                             using_allocator=using_allocator))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(module, "resolve_device", lambda device: "cpu")

    def capture(step_fn, *inputs, warmup=1):
        for _ in range(warmup):
            step_fn(*inputs)
        return _Replay(step_fn)

    monkeypatch.setattr(graph, "capture", capture)
    # Autotuning is a cuDNN plan's business; the reference engine builds no plan to count.
    cases = (*gpu_checks.OP_CASES, *(c for c in TRAINING_CASES if c[0] != "plan autotune"),
             *BATCHNORM_CASES)
    results = gpu_suite.run_gpu_checks(cases, tf32=gpu_suite.tf32_cases())
    assert {r.dtype for r in results} == {"float64", "float32", "float16", "bfloat16"}
    bad = [(r.name, r.dtype, r.detail) for r in results if r.status != PASS]
    assert bad == []
    assert len(allocators) == len(results) and all(callable(a) for a in allocators)
    ran = {(r.name, r.dtype) for r in results}
    for dtype in ("float64", "float32", "float16", "bfloat16"):
        assert ("batchnorm train/eval, fused/plain", dtype) in ran
    assert {d for n, d in ran if n == "tiny ResNet training step"} == {"float32"}
    assert convfuse.config.get().allow_tf32 is True  # restored after the checks
    # The float32 convolution cases ran again with TF32 allowed, at the TF32 tolerance.
    tf32 = [r for r in results if r.name.endswith("(TF32 default)")]
    assert {r.name for r in tf32} == {f"{n} (TF32 default)" for n, _ in gpu_checks.OP_CASES
                                      if n.startswith("conv_")}
    assert all(r.dtype == "float32" and r.tolerance == TF32_TOLERANCE for r in tf32)
    strict = [r for r in results if r.dtype == "float32" and r.name.startswith("conv_")
              and r not in tf32]
    assert strict and all(r.tolerance == 1e-5 for r in strict)


class _Replay:
    """Stands in for a CapturedStep: replays by running the step eagerly."""

    def __init__(self, step_fn):
        self.step_fn = step_fn

    def __call__(self, *inputs):
        return self.step_fn(*inputs)

    def synchronize(self):
        return None


def test_gpu_case_modules_do_not_import_each_other():
    """gpu_checks.py and gpu_training.py once imported each other; both now take their
    helpers from gpu_arrays.py and gpu_suite.py runs them (issue #13)."""
    import ast
    from importlib import resources

    def imported(module):
        tree = ast.parse((resources.files("convfuse.selfcheck") / f"{module}.py").read_text())
        return {node.module for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module}

    assert not {"gpu_training", "gpu_suite"} & imported("gpu_checks")
    assert not {"gpu_checks", "gpu_suite"} & imported("gpu_training")
    assert {"gpu_checks", "gpu_training"} <= imported("gpu_suite")


def test_forward_path_report_lists_the_unfused_plans():
    from convfuse.geometry import ConvGeometry
    from convfuse.plan import ForwardPath, clear_plan_cache, get_plan
    from convfuse.selfcheck.gpu_suite import forward_path_report

    clear_plan_cache()
    try:
        geom = ConvGeometry.create((1, 2, 5, 5), (3, 2, 3, 3))
        get_plan(geom, "float32", "relu").set_forward_path(ForwardPath("fused", "heuristics"))
        get_plan(geom, "float32").set_forward_path(ForwardPath("unfused", "timed", 2.0, 1.5))
        get_plan(geom, "float16").set_forward_path(ForwardPath("unfused", "refused"))
        get_plan(geom, "float64")  # never ran: not reported
        report = forward_path_report(1)
    finally:
        clear_plan_cache()
    assert report.status == PASS
    assert report.detail.startswith("1 plan(s) fused, 2 unfused; 1 FusedFallbackWarning(s)")
    assert "dtype=float32 activation=identity residual=False (timed, fused 2.000 ms vs " \
           "unfused 1.500 ms)" in report.detail
    assert "dtype=float16 activation=identity residual=False (refused)" in report.detail


def test_batchnorm_case_checks_which_path_ran():
    """gpu_batchnorm._check_path: a documented fused configuration that ran plain without a
    recorded refusal fails, as does a fused run outside the documented configuration; a
    recorded refusal (or memory back-off) makes the plain run legitimate."""
    from types import SimpleNamespace as NS

    from convfuse.errors import CudnnError
    from convfuse.ops.cudnn.batchnorm import EngineState
    from convfuse.plan import clear_plan_cache
    from convfuse.plan.batchnorm import BatchNormGeometry, get_batchnorm_plan
    from convfuse.selfcheck.gpu_batchnorm import _check_path

    clear_plan_cache()
    try:
        fusable = BatchNormGeometry.create((4, 3, 3, 8), "NHWC")
        plain = BatchNormGeometry.create((4, 8, 3, 3), "NCHW")
        _check_path(NS(engine_state=None), fusable, "float16", "relu", True, "dry run")
        _check_path(NS(engine_state=EngineState(True)), fusable, "float16", "relu", True, "ok")
        _check_path(NS(engine_state=EngineState(False)), plain, "float16", "relu", True, "ok")
        with pytest.raises(CheckFailed, match="ran the plain calls"):
            _check_path(NS(engine_state=EngineState(False)), fusable, "float16", "relu", True,
                        "lost")
        with pytest.raises(CheckFailed, match="outside the documented"):
            _check_path(NS(engine_state=EngineState(True)), plain, "float16", "relu", True, "x")
        with pytest.raises(CheckFailed, match="outside the documented"):  # float32: no fusion
            _check_path(NS(engine_state=EngineState(True)), fusable, "float32", "relu", True,
                        "x")
        get_batchnorm_plan(fusable, "float16", "relu", True).refuse_fused(
            CudnnError(3000, "cudnnBatchNormalizationForwardTrainingEx", "refused"))
        _check_path(NS(engine_state=EngineState(False)), fusable, "float16", "relu", True,
                    "refused")
        plan = get_batchnorm_plan(fusable, "float16", "relu", False)
        assert plan.fused_out_of_memory()  # a memory back-off, then its countdown runs out
        while plan.fused_off():
            pass
        assert plan.tries_fused and plan.fell_back  # the plain run was still legitimate
        _check_path(NS(engine_state=EngineState(False)), fusable, "float16", "relu", False,
                    "backed off")
    finally:
        clear_plan_cache()


def test_binding_checks_count_descriptors_from_empty_plan_caches():
    """Plans cached before the selfcheck (a live session's) are freed by its plan check:
    that must not read as a negative leak."""
    from convfuse._binding import cudnn
    from convfuse.geometry import ConvGeometry
    from convfuse.plan import get_plan
    from convfuse.selfcheck import cpu_checks

    lib = cudnn()
    get_plan(ConvGeometry.create((1, 2, 5, 5), (3, 2, 3, 3), 1, 1, 1, 1, "NCHW"), "float32")
    checks = dict(cpu_checks.binding_checks(lib, gpu=False))
    checks["plans build and cache"]()
    assert "back to" in checks["no descriptor leak"]().detail


def test_a_refused_geometry_is_named_and_the_others_still_measured():
    """runner.Worst.attempt: cuDNN's refusal of one geometry (a 3xxx status, or no
    algorithm left) is recorded and the case goes on; its outcome then fails naming every
    refused geometry with the others' worst error. Other errors still end the case."""
    from convfuse.errors import CudnnError
    from convfuse.plan.algorithms import NoAlgorithmError

    worst = Worst(1e-3)
    with worst.attempt("geometry A"):
        raise CudnnError(3002, "cudnnConvolutionForward", "CUDNN_STATUS_NOT_SUPPORTED_SHAPE")
    with worst.attempt("geometry B"):
        worst.compare(np.array([1.0, 2.0]), np.array([1.0, 2.0005]), "B y")
    with worst.attempt("geometry C"):
        raise NoAlgorithmError("cuDNN refused every fwd algorithm")
    with pytest.raises(CudnnError), worst.attempt("geometry D"):
        raise CudnnError(2000, "cudnnConvolutionForward", "CUDNN_STATUS_BAD_PARAM")
    with pytest.raises(CheckFailed) as info:
        worst.outcome("unused")
    text = str(info.value)
    assert text.startswith("cuDNN refused 2 geometries: geometry A: CudnnError")
    assert "geometry C: NoAlgorithmError" in text and "geometry D" not in text
    assert "the other 1 results within 1e-03, worst 2.50e-04" in text
    assert Worst(1e-3).outcome("fine").detail == "fine"
