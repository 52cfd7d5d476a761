"""Batch normalization on a real GPU against the float64 NumPy reference: every new cuDNN
call (training plain and Ex, inference, backward plain and Ex, the three size queries),
every dtype, both layouts, ranks 0-3, with NaN-poisoned outputs, and which path ran (the
binding is spied on). Where cuDNN documents the fused ops (Note [BatchNorm in cuDNN]) no
FusedFallbackWarning may appear; a forced refusal must land on the plain path with the
reference's numbers. Never run on the development machines (no GPU there)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import convfuse as cf
import convfuse.ops as ops
from convfuse._binding import cudnn
from convfuse.errors import CaptureError, CudnnError
from convfuse.ops.cudnn.handle import get_handle
from convfuse.plan import FusedFallbackWarning
from convfuse.plan.batchnorm import (
    BatchNormGeometry,
    clear_batchnorm_plan_cache,
    get_batchnorm_plan,
)
from tests.gpu.test_cudnn_ops import DTYPES, assert_close, host, poison_outputs

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
lib = cudnn()
BN_CALLS = ("batchNormalizationForwardTraining", "batchNormalizationForwardTrainingEx",
            "batchNormalizationBackward", "batchNormalizationBackwardEx",
            "batchNormalizationForwardInference")
SHAPES = [((6, 8), "NCHW"), ((3, 8, 7), "NCHW"), ((3, 7, 8), "NHWC"), ((2, 8, 5, 6), "NCHW"),
          ((2, 5, 6, 8), "NHWC"), ((2, 8, 3, 4, 3), "NCHW"), ((2, 3, 4, 3, 8), "NHWC")]
STAT_RTOL = {"float64": 1e-10, "float32": 1e-5, "float16": 1e-4, "bfloat16": 1e-4}
#: Normwise tolerance of dweight and dbias (sums over a channel's values, in float). On the
#: plain path dz = dy * act'(saved) is rounded to the data dtype before cuDNN sums it (unit
#: roundoff u = 2^-11 for float16, 2^-8 for bfloat16), so the sums' error is at most
#: u * sum|dz|; with at most 72 values per channel here, sum|dz| stays within about
#: 4 * max|dbias| (random signs), hence 4u, which STAT_RTOL * 10 = 1e-3 is not for
#: bfloat16 (simulated errors reach 1e-3 to 1e-2). Wider dtypes keep STAT_RTOL * 10.
GRAD_RTOL = {"float64": 1e-9, "float32": 1e-4, "float16": 4 * 2.0**-11,
             "bfloat16": 4 * 2.0**-8}


@pytest.fixture(autouse=True)
def fresh_plans():
    clear_batchnorm_plan_cache()
    yield
    clear_batchnorm_plan_cache()


@pytest.fixture
def spy(monkeypatch):
    calls = []
    for name in BN_CALLS:
        real = getattr(lib, name)
        # recorded once the call returns: a refused call is no call of the path
        monkeypatch.setattr(lib, name, lambda *a, _r=real, _n=name: (_r(*a), calls.append(_n))[0])
    return calls


class Case:
    """Device arrays in `dtype` and the float64 reference inputs they round to."""

    def __init__(self, rng, shape, layout, dtype, residual=True):
        self.g = BatchNormGeometry.create(shape, layout)
        c = self.g.channels
        pd = np.float64 if dtype == "float64" else np.float32
        x = (rng.standard_normal(shape) * 2 + 0.5).astype(cf.dtypes.SUPPORTED[dtype])
        r = rng.standard_normal(shape).astype(x.dtype) if residual else None
        dy = rng.standard_normal(shape).astype(x.dtype)
        w, b = rng.standard_normal(c).astype(pd), rng.standard_normal(c).astype(pd)
        rm, rv = rng.standard_normal(c).astype(pd), (rng.random(c) + 0.5).astype(pd)
        self.ref = {k: (v.astype(np.float64) if v is not None else None)
                    for k, v in dict(x=x, r=r, dy=dy, w=w, b=b, rm=rm, rv=rv).items()}
        self.dev = {k: (cp.asarray(v) if v is not None else None)
                    for k, v in dict(x=x, r=r, dy=dy, w=w, b=b, rm=rm, rv=rv).items()}


def as_device_saw(s_ref, saved):
    """The reference's statistics with the activation's saved tensor the device kept
    (y or the pre-activation, rounded to the data dtype): the reference backward then
    starts from exactly what the device's backward reads, so a ReLU mask flipped by a
    pre-activation rounded across zero, or a GELU slope taken at a value rounded by 2^-8
    in bfloat16, is not counted against the backward. The forward's own check (y against
    the float64 reference) bounds that rounding."""
    return s_ref if saved.saved is None else s_ref._replace(saved=host(saved.saved))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "layout"), SHAPES)
@pytest.mark.parametrize(("act", "residual"), [("identity", False), ("relu", True),
                                               ("relu", False), ("gelu", True)])
def test_training_matches_reference(monkeypatch, rng, spy, dtype, shape, layout, act, residual):
    k = Case(rng, shape, layout, dtype, residual)
    R, D = k.ref, k.dev
    y_ref, s_ref = ops.batchnorm_forward_training(R["x"], R["w"], R["b"], R["rm"], R["rv"],
                                                  layout, 1e-3, 0.2, act, R["r"])
    with poison_outputs(monkeypatch):
        y, saved = ops.batchnorm_forward_training(D["x"], D["w"], D["b"], D["rm"], D["rv"],
                                                  layout, 1e-3, 0.2, act, D["r"])
    assert_close(y, y_ref, dtype, "y")
    for got, ref, what in ((saved.mean, s_ref.mean, "mean"), (saved.invstd, s_ref.invstd,
                                                               "invstd"),
                           (D["rm"], R["rm"], "running_mean"), (D["rv"], R["rv"], "running_var")):
        assert_close(got, ref, "float64", what, STAT_RTOL[dtype])
    dx_ref, dw_ref, db_ref, dr_ref = ops.batchnorm_backward(
        R["dy"], R["x"], R["w"], R["b"], as_device_saw(s_ref, saved), layout, 1e-3, act,
        residual)
    with poison_outputs(monkeypatch):
        dx, dw, db, dr = ops.batchnorm_backward(D["dy"], D["x"], D["w"], D["b"], saved, layout,
                                                1e-3, act, residual)
    assert_close(dx, dx_ref, dtype, "dx")
    assert_close(dw, dw_ref, "float64", "dweight", GRAD_RTOL[dtype])
    assert_close(db, db_ref, "float64", "dbias", GRAD_RTOL[dtype])
    if residual:
        assert_close(dr, dr_ref, dtype, "dresidual")
    fused = saved.engine_state.fused
    assert spy == (["batchNormalizationForwardTrainingEx", "batchNormalizationBackwardEx"]
                   if fused else ["batchNormalizationForwardTraining",
                                  "batchNormalizationBackward"])
    plan = get_batchnorm_plan(k.g, dtype, act, residual)
    assert fused == (plan.fused_ops is not None)


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("shape", [(4, 5, 6, 8), (4, 30, 8)])  # NHWC; (N, L, C) lifted
def test_documented_fused_config_runs_fused_without_warning(monkeypatch, rng, spy, residual,
                                                           shape):
    k = Case(rng, shape, "NHWC", "float16", residual)
    R, D = k.ref, k.dev
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedFallbackWarning)
        with poison_outputs(monkeypatch):
            y, saved = ops.batchnorm_forward_training(D["x"], D["w"], D["b"], D["rm"], D["rv"],
                                                      "NHWC", 1e-5, 0.1, "relu", D["r"])
            dx, dw, db, dr = ops.batchnorm_backward(D["dy"], D["x"], D["w"], D["b"], saved,
                                                    "NHWC", 1e-5, "relu", residual)
    assert spy == ["batchNormalizationForwardTrainingEx", "batchNormalizationBackwardEx"]
    y_ref, s_ref = ops.batchnorm_forward_training(R["x"], R["w"], R["b"], R["rm"], R["rv"],
                                                  "NHWC", 1e-5, 0.1, "relu", R["r"])
    ref = ops.batchnorm_backward(R["dy"], R["x"], R["w"], R["b"], s_ref, "NHWC", 1e-5, "relu",
                                 residual)
    assert_close(y, y_ref, "float16", "y")
    assert_close(dx, ref[0], "float16", "dx")
    assert_close(dw, ref[1], "float64", "dweight", 1e-3)
    assert_close(db, ref[2], "float64", "dbias", 1e-3)
    if residual:
        assert_close(dr, ref[3], "float16", "dresidual")
    assert_close(D["rv"], R["rv"], "float64", "running_var", 1e-4)


@pytest.mark.parametrize("stage", ["batchNormalizationForwardTrainingEx",
                                   "getBatchNormalizationTrainingExReserveSpaceSize"])
def test_forced_refusal_falls_back_to_reference_numbers(monkeypatch, rng, stage):
    def refuse(*a):
        raise CudnnError(3000, "cudnn" + stage[0].upper() + stage[1:], lib.getErrorString(3000))

    monkeypatch.setattr(lib, stage, refuse)
    k = Case(rng, (4, 5, 6, 8), "NHWC", "float16")
    R, D = k.ref, k.dev
    refused = pytest.warns(FusedFallbackWarning, match=r"CUDNN_STATUS_NOT_SUPPORTED \(3000\)")
    with refused, poison_outputs(monkeypatch):
        y, saved = ops.batchnorm_forward_training(D["x"], D["w"], D["b"], D["rm"], D["rv"],
                                                  "NHWC", 1e-5, 0.1, "relu", D["r"])
    y_ref, _ = ops.batchnorm_forward_training(R["x"], R["w"], R["b"], R["rm"], R["rv"], "NHWC",
                                              1e-5, 0.1, "relu", R["r"])
    assert not saved.engine_state.fused
    assert_close(y, y_ref, "float16", "y (fallback)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "layout"), SHAPES[::2])
def test_inference_and_eval_backward_match_reference(monkeypatch, rng, spy, dtype, shape, layout):
    k = Case(rng, shape, layout, dtype)
    R, D = k.ref, k.dev
    y_ref, s_ref = ops.batchnorm_forward_inference(R["x"], R["w"], R["b"], R["rm"], R["rv"],
                                                   layout, 1e-5, "tanh", R["r"])
    with poison_outputs(monkeypatch):
        y, saved = ops.batchnorm_forward_inference(D["x"], D["w"], D["b"], D["rm"], D["rv"],
                                                   layout, 1e-5, "tanh", D["r"])
        dx, dw, db, dr = ops.batchnorm_backward(D["dy"], D["x"], D["w"], D["b"], saved, layout,
                                                1e-5, "tanh", True)
    assert spy == ["batchNormalizationForwardInference"]
    assert_close(y, y_ref, dtype, "y")
    ref = ops.batchnorm_backward(R["dy"], R["x"], R["w"], R["b"], as_device_saw(s_ref, saved),
                                 layout, 1e-5, "tanh", True)
    for got, want, what in zip((dx, dw, db, dr), ref, ("dx", "dw", "db", "dres"), strict=True):
        assert_close(got, want, dtype if what in ("dx", "dres") else "float64", what,
                     None if what in ("dx", "dres") else GRAD_RTOL[dtype])


@pytest.mark.parametrize("channels", [4, 3])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_inference_of_a_batch_above_65535_matches_reference(monkeypatch, rng, spy, layout,
                                                           channels):
    """Note [cuDNN's inference batch]: 65,543 rows of features (BatchNorm1d's (N, C)) or
    images run as two cuDNN inference calls on offsets, with the reference's numbers; with
    3 channels a sample is 12 bytes, so only a part size that is a multiple of 16 keeps
    the second call's pointers 16-byte aligned."""
    c = channels
    shape = (65543, c) if layout == "NCHW" else (65543, 1, 2, c)
    x = rng.standard_normal(shape).astype(np.float32)
    w, b, rm = (rng.standard_normal(c).astype(np.float32) for _ in range(3))
    rv = rng.uniform(0.5, 2.0, c).astype(np.float32)
    want, _ = ops.batchnorm_forward_inference(*(a.astype(np.float64) for a in (x, w, b, rm, rv)),
                                              layout, 1e-5, "relu")
    with poison_outputs(monkeypatch):
        y, _ = ops.batchnorm_forward_inference(*(cp.asarray(a) for a in (x, w, b, rm, rv)),
                                               layout, 1e-5, "relu")
    assert spy == ["batchNormalizationForwardInference"] * 2
    assert_close(y, want, "float32", "y")


def test_size_queries_answer_with_a_handle():
    plan = get_batchnorm_plan(BatchNormGeometry.create((4, 5, 6, 8), "NHWC"), "float16", "relu",
                              True)
    sizes = plan.sizes(get_handle())
    assert min(sizes.forward_workspace, sizes.backward_workspace, sizes.reserve) >= 0


def test_layer_on_gpu_matches_cpu_layer_over_steps(rng):
    gpu_bn = cf.BatchNorm2d(8, momentum=None, activation="relu", layout="NHWC", device="cuda")
    cpu_bn = cf.BatchNorm2d(8, momentum=None, activation="relu", layout="NHWC")
    for step in range(3):
        x = rng.standard_normal((2, 4, 4, 8)).astype(np.float32) + step
        r = rng.standard_normal(x.shape).astype(np.float32)
        y = gpu_bn(cp.asarray(x), residual=cp.asarray(r))
        assert_close(y, cpu_bn(x, residual=r).astype(np.float64), "float32", "y")
        dy = rng.standard_normal(x.shape).astype(np.float32)
        dx, _ = gpu_bn.backward(cp.asarray(dy))
        assert_close(dx, cpu_bn.backward(dy)[0].astype(np.float64), "float32", "dx")
    for name in ("running_mean", "running_var"):
        np.testing.assert_allclose(host(getattr(gpu_bn, name)), getattr(cpu_bn, name),
                                   rtol=1e-5)
    assert int(gpu_bn.num_batches_tracked.get()) == 3
    np.testing.assert_allclose(host(gpu_bn.weight.grad), cpu_bn.weight.grad, rtol=1e-4)


def test_momentum_none_refuses_graph_capture(rng):
    bn = cf.BatchNorm2d(4, momentum=None, device="cuda")
    x = cp.asarray(rng.standard_normal((2, 4, 3, 3)).astype(np.float32))
    with pytest.raises(CaptureError):
        cf.graph.capture(lambda a: bn(a), x)


def test_affine_false_fused_config_matches_reference(monkeypatch, rng, spy):
    """weight=bias=None pass the cached ones and zeros (from CuPy's default pool) to the
    fused calls; no parameter gradient comes back."""
    k = Case(rng, (4, 5, 6, 8), "NHWC", "float16")
    R, D = k.ref, k.dev
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedFallbackWarning)
        with poison_outputs(monkeypatch):
            y, saved = ops.batchnorm_forward_training(D["x"], None, None, D["rm"], D["rv"],
                                                      "NHWC", 1e-5, 0.1, "relu", D["r"])
            dx, dw, db, dr = ops.batchnorm_backward(D["dy"], D["x"], None, None, saved, "NHWC",
                                                    1e-5, "relu", True)
    assert saved.engine_state.fused and dw is None and db is None
    assert spy == ["batchNormalizationForwardTrainingEx", "batchNormalizationBackwardEx"]
    y_ref, s_ref = ops.batchnorm_forward_training(R["x"], None, None, R["rm"], R["rv"], "NHWC",
                                                  1e-5, 0.1, "relu", R["r"])
    ref = ops.batchnorm_backward(R["dy"], R["x"], None, None, s_ref, "NHWC", 1e-5, "relu", True)
    assert_close(y, y_ref, "float16", "y")
    assert_close(dx, ref[0], "float16", "dx")
    assert_close(dr, ref[3], "float16", "dresidual")
    assert_close(D["rm"], R["rm"], "float64", "running_mean", 1e-4)


def test_captured_fused_step_replays_with_reference_numbers(rng, spy):
    """The fused forward's reserve space and workspaces are allocated inside the capture
    (its private pool) and the sizes were asked by the eager warm-up: replays with new
    inputs give the reference's y, dx and dresidual."""
    bn = cf.BatchNorm2d(8, activation="relu", layout="NHWC", dtype="float16", device="cuda")

    def step(x, r, dy):
        y = bn(x, residual=r)
        dx, dres = bn.backward(dy)
        return y, dx, dres

    shape = (4, 5, 6, 8)
    first = [rng.standard_normal(shape).astype(np.float16) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedFallbackWarning)
        captured = cf.graph.capture(step, *(cp.asarray(a) for a in first))
        assert spy.count("batchNormalizationForwardTrainingEx") == 2  # warm-up + capture
        for _ in range(2):
            x, r, dy = (rng.standard_normal(shape).astype(np.float16) for _ in range(3))
            y, dx, dres = captured(cp.asarray(x), cp.asarray(r), cp.asarray(dy))
            captured.synchronize()
            x64, r64, dy64 = (a.astype(np.float64) for a in (x, r, dy))
            w64, b64 = np.ones(8), np.zeros(8)
            y_ref, s_ref = ops.batchnorm_forward_training(x64, w64, b64, None, None, "NHWC",
                                                          1e-5, 0.1, "relu", r64)
            ref = ops.batchnorm_backward(dy64, x64, w64, b64, s_ref, "NHWC", 1e-5, "relu", True)
            assert_close(y, y_ref, "float16", "replayed y")
            assert_close(dx, ref[0], "float16", "replayed dx")
            assert_close(dres, ref[3], "float16", "replayed dresidual")
    assert spy.count("batchNormalizationForwardTrainingEx") == 2  # replays call no binding


@pytest.mark.parametrize(("dtype", "layout", "shape"), [
    ("float16", "NHWC", (4, 5, 6, 8)),  # the documented fused config: BackwardEx
    ("float32", "NCHW", (2, 8, 5, 6)),  # the plain BatchNormalizationBackward
])
def test_parameter_gradients_accumulate_over_two_backwards(monkeypatch, rng, spy, dtype,
                                                           layout, shape):
    """Review 7.5: betaParamDiff = 1 (param_beta=1). NaN-poisoned weight_grad/bias_grad;
    step 1 overwrites (param_beta=0 never reads them), step 2 accumulates: the buffers
    must hold the sum of both steps' float64 references."""
    from tests.gpu.test_cudnn_ops import poisoned

    c = shape[-1] if layout == "NHWC" else shape[1]
    gw, gb = poisoned((c,), np.float32), poisoned((c,), np.float32)
    want_w, want_b = np.zeros(c), np.zeros(c)
    for step, beta in enumerate((0.0, 1.0)):
        k = Case(rng, shape, layout, dtype)
        R, D = k.ref, k.dev
        with warnings.catch_warnings():
            if dtype == "float16":
                warnings.simplefilter("error", FusedFallbackWarning)
            with poison_outputs(monkeypatch):
                _, saved = ops.batchnorm_forward_training(D["x"], D["w"], D["b"], D["rm"],
                                                          D["rv"], layout, 1e-5, 0.1, "relu",
                                                          D["r"])
                _, dw, db, _ = ops.batchnorm_backward(D["dy"], D["x"], D["w"], D["b"], saved,
                                                      layout, 1e-5, "relu", True,
                                                      weight_grad=gw, bias_grad=gb,
                                                      param_beta=beta)
        assert dw is gw and db is gb
        _, s_ref = ops.batchnorm_forward_training(R["x"], R["w"], R["b"], R["rm"], R["rv"],
                                                  layout, 1e-5, 0.1, "relu", R["r"])
        ref = ops.batchnorm_backward(R["dy"], R["x"], R["w"], R["b"],
                                     as_device_saw(s_ref, saved), layout, 1e-5, "relu", True)
        want_w, want_b = want_w + ref[1], want_b + ref[2]
        assert_close(gw, want_w, "float64", f"dweight after step {step + 1}", GRAD_RTOL[dtype])
        assert_close(gb, want_b, "float64", f"dbias after step {step + 1}", GRAD_RTOL[dtype])
    backward = "batchNormalizationBackwardEx" if dtype == "float16" else \
        "batchNormalizationBackward"
    assert spy.count(backward) == 2
