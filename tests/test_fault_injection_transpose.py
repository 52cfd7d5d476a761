"""Fault injection for the transposed convolution: every cuDNN call its plan makes (the
forward convolution G's calls with x and y swapped: BackwardData for the forward,
Forward for the data gradient, BackwardFilter for the filter gradient, and their algorithm
queries) refuses, runs out of memory or fails in turn, with the same cases as the plain
convolution's (tests/test_fault_injection_backward.py). Every case ends on the documented
fallback with the right numbers (reference engine, float64) and exactly the warnings
listed, or on a typed convfuse error naming the transposed call and its geometry. Also:
which kernels run around the cuDNN calls (the bias + activation pass only when needed, the
activation-backward + bias-gradient kernel for db, never cudnnConvolutionBackwardBias)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import convfuse.ops as ops
from convfuse import config
from convfuse.errors import CudnnError
from convfuse.functional_transpose import (
    conv_transpose_bias_act_backward,
    conv_transpose_bias_act_forward,
)
from convfuse.ops.cudnn.layout import cudnn_geometry
from convfuse.plan import NoAlgorithmError, get_transpose_plan
from convfuse.plan.conv_transpose import TRANSPOSE_DIRECTIONS
from convfuse.plan.descriptors import lift, packed_strides
from convfuse.transpose_geometry import ConvTransposeGeometry
from tests._fault_injection import NOT_SUPPORTED, NumericGpu
from tests.test_fault_injection_backward import CASES, DIRECTIONS

TGEOMS = [
    ConvTransposeGeometry.create((2, 4, 3, 4), (4, 3, 3, 2), stride=2, padding=1,
                                 output_padding=(1, 0), groups=2),
    ConvTransposeGeometry.create((2, 3, 4, 4), (4, 2, 2, 3), stride=(2, 1), padding=(0, 1),
                                 layout="NHWC"),
]
#: G's direction -> the transposed op that runs it
OP_OF = {slot: op for op, slot in TRANSPOSE_DIRECTIONS.items()}


class TransposeGpu(NumericGpu):
    """NumericGpu whose kernels follow the geometry they are given (the transposed
    convolution's output, not G's)."""

    def _launch(self, name, args):
        if name == "activation_backward_bias":
            self.calls.append((name, args))
            dy, saved, act, geom, dz, db, beta = args
            assert (dz is None) == (act == "identity")
            sv = None if saved is None else self.get(saved)
            dz_h, db_h = ops.activation_backward_bias(self.get(dy), sv, act, geom)
            if dz is not None:
                self.host[dz.data.ptr][...] = dz_h
            self._blend(db.data.ptr, db_h, beta)
            return dz, db
        if name == "activation_backward":
            self.calls.append((name, args))
            dy, saved, act, out = args
            self.host[out.data.ptr][...] = ops.activation_backward(
                self.get(dy), self.get(saved), act)
            return out
        return super()._launch(name, args)


@pytest.fixture
def make_tgpu(monkeypatch):
    from convfuse.ops.cudnn import conv_transpose
    from convfuse.plan import clear_plan_cache

    def make(tgeom):
        gpu = TransposeGpu(monkeypatch, tgeom.conv)
        monkeypatch.setattr(conv_transpose, "get_handle", lambda *a: "H")
        return gpu

    yield make
    clear_plan_cache()


def _op(gpu, tgeom, direction, rng):
    """The transposed op that runs G's `direction` once: (device result, reference)."""
    x, w = rng.standard_normal(tgeom.input_shape), rng.standard_normal(tgeom.weight_shape)
    dy = rng.standard_normal(tgeom.output_shape)
    dx_, dw_, ddy = gpu.put(x), gpu.put(w), gpu.put(dy)
    op = OP_OF[direction]
    if op == "forward":
        return lambda: ops.conv_transpose_forward(dx_, dw_, tgeom), \
            ops.conv_transpose_forward(x, w, tgeom)
    if op == "backward_data":
        start = rng.standard_normal(tgeom.input_shape)
        out = gpu.put(start)
        return (lambda: ops.conv_transpose_backward_data(ddy, dw_, tgeom, out=out, beta=1.0),
                ops.conv_transpose_backward_data(dy, w, tgeom) + start)
    start = rng.standard_normal(tgeom.weight_shape)
    out = gpu.put(start)
    return (lambda: ops.conv_transpose_backward_filter(dx_, ddy, tgeom, out=out, beta=1.0),
            ops.conv_transpose_backward_filter(x, dy, tgeom) + start)


@pytest.mark.parametrize("tgeom", TGEOMS, ids=lambda g: g.layout)
@pytest.mark.parametrize(("direction", "case", "setup", "outcome"), CASES,
                         ids=[f"{OP_OF[c[0]]}-{c[1]}" for c in CASES])
def test_transposed_convolution_fault(make_tgpu, rng, tgeom, direction, case, setup, outcome):
    gpu = make_tgpu(tgeom)
    for name, status, times in setup.get("inject", []):
        gpu.inject(name, status, times)
    if setup.get("refuse_records"):
        gpu.perfs = [(a, m, 3000) for a, m, _ in gpu.perfs]
    if "min_ws" in setup:
        gpu.perfs = [(a, max(m, setup["min_ws"]), s) for a, m, s in gpu.perfs]
    gpu.oom_choice_at = setup.get("oom_choice_at")
    gpu.oom_call_at = setup.get("oom_call_at")
    run, want = _op(gpu, tgeom, direction, rng)
    kind, detail, warned = outcome
    with config.flags(**setup.get("flags", {})):
        if kind == "raises":
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                with pytest.raises(detail) as info:
                    run()
            msg = str(info.value)
            assert warned in msg
            # the plan that ran: G's, channels-first for float64 NHWC (Note [float64 runs
            # channels-first]), whose error also names the caller's geometry
            assert cudnn_geometry(tgeom, "float64").conv.describe() in msg
            if tgeom.channels_last:
                assert tgeom.describe() in msg
            if detail.__name__ == "CudnnError":  # names the transposed op and geometry
                assert f"conv_transpose_{OP_OF[direction]}" in msg and tgeom.describe() in msg
            assert len(record) <= 1
            return
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            got = run()
        np.testing.assert_allclose(gpu.get(got), want, rtol=1e-12, atol=1e-12)
        assert [w.category for w in record] == warned
        call = DIRECTIONS[direction][1]
        used = [a[7] for n, a in gpu.calls if n == call]
        assert used[-1] == detail
        plan = get_transpose_plan(cudnn_geometry(tgeom, "float64"), "float64")
        assert plan.choice(direction, "H").algo == detail


@pytest.mark.parametrize("tgeom", TGEOMS, ids=lambda g: g.layout)
@pytest.mark.parametrize("act", ["identity", "relu", "gelu"])
@pytest.mark.parametrize("bias", [False, True])
def test_kernels_around_the_cudnn_calls(make_tgpu, rng, tgeom, act, bias):
    """Forward: BackwardData, then the bias + activation pass only with a bias or an
    activation (gelu: the pass writes the pre-activation, then one activation kernel).
    Backward: the activation-backward + bias-gradient kernel for db; G's Forward for dx
    and BackwardFilter for dw. Numbers against the reference engine."""
    gpu = make_tgpu(tgeom)
    x, w = rng.standard_normal(tgeom.input_shape), rng.standard_normal(tgeom.weight_shape)
    b = rng.standard_normal(tgeom.bias_shape) if bias else None
    y_ref, ctx_ref = conv_transpose_bias_act_forward(x, w, b, activation=act, geom=tgeom)
    dy = rng.standard_normal(y_ref.shape)
    g_ref = conv_transpose_bias_act_backward(dy, ctx_ref)
    y, ctx = conv_transpose_bias_act_forward(
        gpu.put(x), gpu.put(w), None if b is None else gpu.put(b), activation=act, geom=tgeom)
    np.testing.assert_allclose(gpu.get(y), y_ref, rtol=1e-12, atol=1e-12)
    names = gpu.names()
    cudnn_calls = [n for n in names if n.startswith("convolution")]
    assert cudnn_calls == ["convolutionBackwardData"]
    passes = [n for n in names if n in ("bias_act_forward", "activation_forward")]
    want_passes = {"identity": [], "relu": ["bias_act_forward"],
                   "gelu": ["bias_act_forward", "activation_forward"]}[act]
    if bias and act == "identity":
        want_passes = ["bias_act_forward"]
    assert passes == want_passes
    gpu.calls.clear()
    g = conv_transpose_bias_act_backward(gpu.put(dy), ctx)
    np.testing.assert_allclose(gpu.get(g.dx), g_ref.dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gpu.get(g.dweight), g_ref.dweight, rtol=1e-12, atol=1e-12)
    names = gpu.names()
    assert "convolutionBackwardBias" not in names
    assert [n for n in names if n.startswith("convolution")] == [
        "convolutionBackwardFilter", "convolutionForward"]
    if bias:
        np.testing.assert_allclose(gpu.get(g.dbias), g_ref.dbias, rtol=1e-12, atol=1e-12)
        assert names.count("activation_backward_bias") == 1
        assert "activation_backward" not in names  # one kernel gives dz and db
    else:
        assert "activation_backward_bias" not in names


def test_conv_and_transpose_share_the_plan_of_g():
    """The transposed plan is G's plan itself (same cache entry), not a copy."""
    from convfuse.plan import clear_plan_cache, get_plan

    clear_plan_cache()
    tgeom = TGEOMS[0]
    assert get_transpose_plan(tgeom, "float32") is get_plan(tgeom.conv, "float32")
    with pytest.raises(TypeError, match="tgeom must be a ConvTransposeGeometry"):
        get_transpose_plan(tgeom.conv, "float32")
    clear_plan_cache()


#: the op name each transposed op gives its errors
OP_NAME = {d: f"conv_transpose_{op}" for d, op in OP_OF.items()}


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_float64_channels_last_runs_channels_first(make_tgpu, rng, direction):
    """Note [float64 runs channels-first], as for Conv: the right numbers (beta = 1
    accumulating once), and the cuDNN call of the transposed op carries the channels-first
    plan's (NCHW) descriptors and channels-first copies, the result copied back once."""
    tgeom = TGEOMS[1]
    assert tgeom.channels_last
    gpu = make_tgpu(tgeom)
    run, want = _op(gpu, tgeom, direction, rng)
    got = run()
    np.testing.assert_allclose(gpu.get(got), want, rtol=1e-12, atol=1e-12)
    assert got.shape == want.shape
    cf_tgeom = cudnn_geometry(tgeom, "float64")
    assert not cf_tgeom.channels_last and cf_tgeom.input_shape == tgeom.input_shape_cf
    cf = get_transpose_plan(cf_tgeom, "float64")
    nhwc = get_transpose_plan(tgeom, "float64")
    assert cf is not nhwc
    [(_, args)] = [(n, a) for n, a in gpu.calls if n == DIRECTIONS[direction][1]]
    want_descs = {"fwd": (cf.x_desc, cf.w_desc, cf.y_desc),
                  "bwd_data": (cf.w_desc, cf.y_desc, cf.x_desc),
                  "bwd_filter": (cf.x_desc, cf.y_desc, cf.w_desc)}[direction]
    assert (args[2], args[4], args[11]) == want_descs
    assert args[3] in gpu.channels_first and args[5] in gpu.channels_first
    for desc, shape in ((cf.x_desc, tgeom.conv.input_shape_cf),
                        (cf.y_desc, tgeom.conv.output_shape_cf)):
        dims = lift(shape)
        assert tuple(desc.getNd()[1]) == dims
        assert tuple(desc.getNd()[2]) == packed_strides(dims, channels_last=False)
    assert gpu.names().count("to_channels_last") == 1  # the result, copied back once


@pytest.mark.parametrize("tgeom", TGEOMS, ids=lambda g: g.layout)
@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_nothing_left_to_run_is_a_typed_error(make_tgpu, rng, tgeom, direction):
    """An empty ranking (every record refused) and a ranking cuDNN refuses at every call
    both end in a typed error naming the transposed op, the caller's geometry and what was
    tried: for float64 NHWC on the channels-first route too."""
    op = OP_NAME[direction]
    ran = cudnn_geometry(tgeom, "float64")
    gpu = make_tgpu(tgeom)
    gpu.perfs = [(a, m, NOT_SUPPORTED) for a, m, _ in gpu.perfs]
    run, _ = _op(gpu, tgeom, direction, rng)
    with pytest.raises(NoAlgorithmError) as info:
        run()
    msg = str(info.value)
    assert msg.startswith(f"{op}: ") and ran.conv.describe() in msg
    assert "cuDNN reported 3 algorithm(s), 0 runnable" in msg
    if tgeom.channels_last:
        assert f"run channels-first for {tgeom.describe()}" in msg
    assert not [n for n in gpu.names() if n.startswith("convolution")]

    gpu = make_tgpu(tgeom)
    gpu.inject(DIRECTIONS[direction][1], NOT_SUPPORTED)
    run, _ = _op(gpu, tgeom, direction, rng)
    with pytest.raises(CudnnError) as info:
        run()
    msg = str(info.value)
    call = DIRECTIONS[direction][1]
    assert f"cudnn{call[0].upper()}{call[1:]}" in msg and op in msg
    assert tgeom.describe() in msg and ran.conv.describe() in msg
    assert f"refused every {direction} algorithm this call tried (algo 6, 2, 0)" in msg
    assert [a[7] for n, a in gpu.calls if n == call] == [6, 2, 0]  # each tried once
    if tgeom.channels_last:
        assert gpu.channels_first  # the refused calls were the channels-first ones
        assert "to_channels_last" not in gpu.names()  # nothing copied back
