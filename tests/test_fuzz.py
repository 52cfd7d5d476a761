"""Fuzzing over convolution geometries (ranks 1-3, stride, padding, dilation, groups
including depthwise, both layouts, all dtypes), with hypothesis.

(a) cuDNN's own cudnnGetConvolutionNdForwardOutputDim and convfuse's geometry rule give the
    same output shape, or both refuse the case (convfuse with ValueError, cuDNN with
    CudnnError BAD_PARAM). One deliberate difference is asserted, not hidden: see
    `test_output_dims_agree_with_cudnn`.
(b) The reference engine's forward and every gradient match the naive loops of
    tests/naive.py on tiny sizes.

Profiles (tests/conftest.py): HYPOTHESIS_PROFILE=ci (default, 300 examples per test,
derandomized) or long (5000 random examples); see docs/VERIFYING.md.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import event, given, note  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import convfuse.ops as ops  # noqa: E402
from convfuse import activations, dtypes  # noqa: E402
from convfuse.errors import CudnnError  # noqa: E402
from convfuse.geometry import ConvGeometry  # noqa: E402
from convfuse.selfcheck.descriptors import output_dims  # noqa: E402
from tests import naive  # noqa: E402

DTYPES = ("float32", "float64", "float16", "bfloat16")
TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}
BAD_PARAM = 2000


@pytest.fixture(scope="module")
def lib():
    from convfuse._binding import cudnn

    return cudnn()


def layout_order(shape_cf: tuple[int, ...], channels_last: bool) -> tuple[int, ...]:
    return (shape_cf[0], *shape_cf[2:], shape_cf[1]) if channels_last else tuple(shape_cf)


@st.composite
def raw_geometries(draw: st.DrawFn) -> dict:
    """Any geometry, valid or not: sizes, kernels and hyperparameters drawn independently,
    plus an occasional deliberate fault (channel mismatch, K not divisible by groups, a
    zero stride or dilation, negative padding)."""
    rank = draw(st.integers(1, 3))
    channels_last = draw(st.booleans())
    groups = draw(st.integers(1, 4))
    depthwise = draw(st.booleans())
    c_per = 1 if depthwise else draw(st.integers(1, 3))
    k_per = draw(st.integers(1, 3))
    c_in, k_out, w_c = groups * c_per, groups * k_per, c_per
    fault = draw(st.sampled_from(
        (None,) * 6 + ("channels", "k_not_divisible", "stride0", "dilation0", "pad_negative")))
    size = [draw(st.integers(1, 12)) for _ in range(rank)]
    kernel = [draw(st.integers(1, 6)) for _ in range(rank)]
    stride = [draw(st.integers(1, 5)) for _ in range(rank)]
    padding = [draw(st.integers(0, 6)) for _ in range(rank)]
    dilation = [draw(st.integers(1, 4)) for _ in range(rank)]
    axis = draw(st.integers(0, rank - 1))
    if fault == "channels":
        w_c += draw(st.sampled_from((-1, 1))) if w_c > 1 else 1
    elif fault == "k_not_divisible":
        k_out += 1 if groups > 1 else 0
    elif fault == "stride0":
        stride[axis] = 0
    elif fault == "dilation0":
        dilation[axis] = 0
    elif fault == "pad_negative":
        padding[axis] = -1
    x_cf = (draw(st.integers(1, 3)), c_in, *size)
    w_cf = (k_out, w_c, *kernel)
    return {
        "x": layout_order(x_cf, channels_last), "w": layout_order(w_cf, channels_last),
        "stride": tuple(stride), "padding": tuple(padding), "dilation": tuple(dilation),
        "groups": groups, "channels_last": channels_last, "fault": fault,
        "dtype": draw(st.sampled_from(DTYPES)),
    }


def _rule(case: dict):
    try:
        return ConvGeometry.create(case["x"], case["w"], case["stride"], case["padding"],
                                   case["dilation"], case["groups"],
                                   "NHWC" if case["channels_last"] else "NCHW")
    except ValueError as exc:
        return exc


def _cudnn(lib, case: dict):
    try:
        return output_dims(lib, case["x"], case["w"], case["stride"], case["padding"],
                           case["dilation"], case["groups"], case["channels_last"],
                           case["dtype"])
    except CudnnError as exc:
        return exc


def _formula(case: dict) -> tuple[int, ...]:
    """The output shape written out once more, for the one case convfuse refuses."""
    cl = case["channels_last"]
    x_cf = (case["x"][0], case["x"][-1], *case["x"][1:-1]) if cl else case["x"]
    w_cf = (case["w"][0], case["w"][-1], *case["w"][1:-1]) if cl else case["w"]
    out = [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, s, p, d in
           zip(x_cf[2:], w_cf[2:], case["stride"], case["padding"], case["dilation"])]
    return layout_order((x_cf[0], w_cf[0], *out), cl)


@given(raw_geometries())
def test_output_dims_agree_with_cudnn(lib, case):
    """Both accept with equal shapes, or both refuse. The recorded exception: cuDNN's
    output-dim query does not check that out_channels is divisible by groups (it answers
    the formula's shape); convfuse refuses it, as PyTorch does, because the grouped
    compute calls need it. Any other disagreement fails."""
    rule, cud = _rule(case), _cudnn(lib, case)
    note(f"case={case} rule={rule!r} cudnn={cud!r}")
    event(f"rank {len(case['x']) - 2}, fault {case['fault']}: convfuse "
          f"{'refuses' if isinstance(rule, ValueError) else 'accepts'}, cuDNN "
          f"{'refuses' if isinstance(cud, CudnnError) else 'accepts'}")
    if isinstance(cud, CudnnError):
        assert cud.status == BAD_PARAM, cud
        assert cud.function.startswith("cudnn") and cud.function in str(cud)
    if isinstance(rule, ValueError):
        assert str(rule), "convfuse refused without saying why"
        if not isinstance(cud, CudnnError):
            k_out = case["w"][0]
            assert k_out % case["groups"] != 0 and "out_channels" in str(rule), (rule, cud)
            assert cud == _formula(case)
    else:
        assert not isinstance(cud, CudnnError), f"cuDNN refused what convfuse accepts: {cud}"
        assert cud == rule.output_shape


@given(raw_geometries())
def test_plans_build_for_every_accepted_geometry(lib, case):
    """get_plan builds cuDNN descriptors for every geometry convfuse accepts (it checks
    cuDNN's output dims against the rule itself, raising if they differ)."""
    from convfuse import plan

    geom = _rule(case)
    if isinstance(geom, ValueError):
        return
    built = plan.get_plan(geom, case["dtype"], "relu", residual=case["groups"] % 2 == 0)
    assert built is plan.get_plan(geom, case["dtype"], "relu",
                                  residual=case["groups"] % 2 == 0)


@pytest.fixture(scope="module", autouse=True)
def _empty_plan_cache_after():
    yield
    from convfuse import plan

    plan.clear_plan_cache()


NAIVE_BUDGET = 3000  # product terms per naive loop: keeps 300 examples to a few seconds


@st.composite
def valid_geometries(draw: st.DrawFn) -> ConvGeometry:
    """Tiny geometries convfuse accepts: each input size is drawn at least as large as the
    dilated kernel minus the padding, so no example is thrown away as invalid."""
    rank = draw(st.integers(1, 3))
    channels_last = draw(st.booleans())
    groups = draw(st.integers(1, 3))
    c_per = 1 if draw(st.booleans()) else draw(st.integers(1, 2))  # often depthwise
    k_per = draw(st.integers(1, 2))
    max_k = {1: 4, 2: 3, 3: 2}[rank]
    kernel, stride, padding, dilation, size = [], [], [], [], []
    for _ in range(rank):
        k, d = draw(st.integers(1, max_k)), draw(st.integers(1, 2))
        p = draw(st.integers(0, 2))
        span = d * (k - 1) + 1
        kernel.append(k)
        dilation.append(d)
        padding.append(p)
        stride.append(draw(st.integers(1, 3)))
        size.append(draw(st.integers(max(1, span - 2 * p), max(1, span - 2 * p) + 4 - rank)))
    x_cf = (draw(st.integers(1, 2)), groups * c_per, *size)
    w_cf = (groups * k_per, c_per, *kernel)
    geom = ConvGeometry.create(layout_order(x_cf, channels_last),
                               layout_order(w_cf, channels_last), tuple(stride),
                               tuple(padding), tuple(dilation), groups,
                               "NHWC" if channels_last else "NCHW")
    terms = math.prod(geom.output_shape_cf) * c_per * math.prod(kernel)
    hypothesis.assume(terms <= NAIVE_BUDGET)
    return geom


def _mag(a) -> float:
    return float(np.max(np.abs(a))) if np.size(a) else 0.0


def _rel(got, ref, scale: float | None = None) -> float:
    """max |got - ref| over max |ref| (or over `scale`), after checking shape and finiteness."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    assert np.all(np.isfinite(got))
    if not ref.size:
        return 0.0
    if scale is None:
        scale = float(np.max(np.abs(ref)))
    return float(np.max(np.abs(got - ref))) / max(scale, 1e-30)


@given(valid_geometries(), st.sampled_from(DTYPES), st.sampled_from(activations.ACTIVATIONS),
       st.booleans(), st.booleans(), st.integers(0, 2**32 - 1))
def test_reference_matches_naive_loops(geom, dtype, act, with_bias, with_residual, seed):
    """conv_bias_act (y and z), backward data, filter and bias against tests/naive.py."""
    dt = dtypes.SUPPORTED[dtype]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(geom.input_shape).astype(dt)
    w = rng.standard_normal(geom.weight_shape).astype(dt)
    b = rng.standard_normal(geom.out_channels).astype(dt) if with_bias else None
    res = rng.standard_normal(geom.output_shape).astype(dt) if with_residual else None
    dz = rng.standard_normal(geom.output_shape).astype(dt)
    x64, w64, dz64 = (a.astype(np.float64) for a in (x, w, dz))
    kw = {"stride": geom.stride, "padding": geom.padding, "dilation": geom.dilation,
          "groups": geom.groups, "channels_last": geom.channels_last}
    note(f"{geom.describe()} {dtype} {act} bias={with_bias} residual={with_residual}")
    copies = [None if a is None else a.copy() for a in (x, w, b, res, dz)]

    # Errors are measured against the magnitude of the sums (the same sums over |terms|):
    # rounding in float32 and narrower is relative to those, and a result that cancels to
    # nearly zero must not turn a 1e-7 rounding error into a large relative one.
    a64 = [np.abs(v) for v in (x64, w64, dz64)]
    z_ref = naive.conv_forward(x64, w64, **kw)
    z_mag = naive.conv_forward(a64[0], a64[1], **kw)
    if b is not None:
        shape = [1] * z_ref.ndim
        shape[geom.channel_axis] = -1
        z_ref = z_ref + b.astype(np.float64).reshape(shape)
        z_mag = z_mag + np.abs(b.astype(np.float64)).reshape(shape)
    if res is not None:
        z_ref = z_ref + 0.5 * res.astype(np.float64)
        z_mag = z_mag + 0.5 * np.abs(res.astype(np.float64))
    y, z = ops.conv_bias_act(x, w, b, geom, act, residual=res, residual_scale=0.5)
    y_ref = naive.act_array(act, z_ref)
    assert y.dtype == dt
    assert _rel(y, y_ref, _mag(z_mag) + _mag(y_ref)) <= TOL[dtype]
    if activations.saves(act) == "preactivation":
        assert z.dtype == dt and _rel(z, z_ref, _mag(z_mag)) <= TOL[dtype]
    else:
        assert z is None

    kw_grad = {k: v for k, v in kw.items() if k != "channels_last"}
    data = functools.partial(naive.conv_backward_data, x_shape=geom.input_shape, **kw_grad,
                             channels_last=geom.channels_last)
    dx = ops.conv_backward_data(dz, w, geom)
    assert dx.dtype == dt
    assert _rel(dx, data(dz64, w64), _mag(data(a64[2], a64[1]))) <= TOL[dtype]
    filt = functools.partial(naive.conv_backward_filter, w_shape=geom.weight_shape, **kw_grad,
                             channels_last=geom.channels_last)
    dw = ops.conv_backward_filter(x, dz, geom)
    assert dw.dtype == dt
    assert _rel(dw, filt(x64, dz64), _mag(filt(a64[0], a64[2]))) <= TOL[dtype]
    db = ops.conv_backward_bias(dz, geom)
    db_mag = _mag(naive.conv_backward_bias(a64[2], geom.channels_last))
    assert _rel(db, naive.conv_backward_bias(dz64, geom.channels_last), db_mag) <= TOL[dtype]
    for a, copy in zip((x, w, b, res, dz), copies):
        assert a is None or np.array_equal(a, copy)


@given(valid_geometries(), st.sampled_from(DTYPES), st.sampled_from(activations.ACTIVATIONS),
       st.integers(0, 2**32 - 1))
def test_activation_gradients_match_naive(geom, dtype, act, seed):
    """activation_backward and activation_backward_bias (dz and the per-channel db) against
    naive.act_grad, from the saved tensor each activation keeps. Pre-activations stay
    0.25 away from relu/leaky_relu/relu6 kinks, so rounding to float16/bfloat16 cannot move
    a value across one."""
    dt = dtypes.SUPPORTED[dtype]
    rng = np.random.default_rng(seed)
    shape = geom.output_shape
    z = (rng.uniform(0.25, 3.0, shape) * rng.choice((-1.0, 1.0), shape))
    z.flat[::5] = 6.5
    z = z.astype(dt)
    dy = rng.standard_normal(shape).astype(dt)
    z64, dy64 = z.astype(np.float64), dy.astype(np.float64)
    pre = activations.saves(act) == "preactivation"
    saved = z if pre else naive.act_array(act, z64).astype(dt)
    ref = dy64 * naive.act_grad_array(act, z64)
    # Measured against max |dy|: a derivative read from a saved output rounded to the dtype
    # is off by about the dtype's epsilon times |dy|, however small the slope itself is.
    scale = float(np.max(np.abs(dy64)))
    dz = ops.activation_backward(dy, saved, act)
    assert dz.dtype == dt and _rel(dz, ref, scale) <= TOL[dtype]
    dz2, db = ops.activation_backward_bias(dy, saved, act, geom)
    assert dz2.dtype == dt and _rel(dz2, ref, scale) <= TOL[dtype]
    db_ref = naive.conv_backward_bias(ref, geom.channels_last)
    count = math.prod(shape) // geom.out_channels  # db sums this many dz entries
    assert _rel(db, db_ref, scale * count) <= TOL[dtype]
