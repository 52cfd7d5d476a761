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
from convfuse.functional_transpose import (
    conv_transpose_bias_act_backward,
    conv_transpose_bias_act_forward,
)
from convfuse.plan import get_transpose_plan
from convfuse.plan.conv_transpose import TRANSPOSE_DIRECTIONS
from convfuse.transpose_geometry import ConvTransposeGeometry
from tests._fault_injection import NumericGpu
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
            assert tgeom.conv.describe() in msg
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
        plan = get_transpose_plan(tgeom, "float64")
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
