"""Activations, their gradients and erf/erfc against math.* on Python floats."""

from __future__ import annotations

import math

import numpy as np
import pytest

from convfuse import activations as acts
from convfuse.dtypes import bfloat16
from convfuse.geometry import ConvGeometry
from convfuse.ops import reference as ref
from tests import naive

ACTS = acts.ACTIVATIONS
SPECIAL = [0.0, -0.0, 1e-300, -1e-300, 1e-10, -1e-10, 0.5, -0.5, 1.0, -1.0, 3.0, -3.0,
           5.999999, 6.0, 6.000001, 20.0, -20.0, 40.0, -40.0, 100.0, -100.0, 700.0, -700.0,
           -745.0, 1000.0, -1000.0]


def grid(rng: np.random.Generator) -> np.ndarray:
    return np.concatenate([SPECIAL, 3.0 * rng.standard_normal(400),
                           rng.uniform(-40.0, 40.0, 200)])


def saved_for(activation, z, y):
    return {"none": None, "output": y, "preactivation": z}[acts.saves(activation)]


@pytest.mark.parametrize("activation", ACTS)
def test_forward_matches_pytorch_definitions(activation):
    z = grid(np.random.default_rng(1))
    y = ref.activation_forward(z, activation)
    assert y.dtype == np.float64 and y.shape == z.shape
    # a few ulps; atol only for results that underflow into subnormals (gelu's far tail)
    np.testing.assert_allclose(y, naive.act_array(activation, z), rtol=4e-15, atol=1e-300)


@pytest.mark.parametrize("activation", ACTS)
def test_backward_matches_math_derivatives(activation):
    rng = np.random.default_rng(2)
    z = grid(rng)
    dy = rng.standard_normal(z.shape)
    y = ref.activation_forward(z, activation)
    dz = ref.activation_backward(dy, saved_for(activation, z, y), activation)
    assert dz.dtype == np.float64 and dz.shape == z.shape
    # atol for tanh's 1 - y^2 (from y) and gelu's far tail; elu computes exp(z) from the
    # saved z (not y + 1, which cancels: exp(-40) would be 0), relative down to subnormals
    atol = 1e-15 if activation in ("tanh", "gelu") else 1e-300
    np.testing.assert_allclose(dz, dy * naive.act_grad_array(activation, z), rtol=1e-14,
                               atol=atol)


@pytest.mark.parametrize("activation", ACTS)
def test_backward_matches_finite_differences(activation):
    rng = np.random.default_rng(3)
    z = 4.0 * rng.standard_normal(300)
    z = z[(np.abs(z) > 1e-3) & (np.abs(z - 6.0) > 1e-3)]  # off the kinks
    h = 1e-6
    numeric = (ref.activation_forward(z + h, activation)
               - ref.activation_forward(z - h, activation)) / (2 * h)
    y = ref.activation_forward(z, activation)
    dz = ref.activation_backward(np.ones_like(z), saved_for(activation, z, y), activation)
    np.testing.assert_allclose(dz, numeric, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize(("activation", "z", "value", "grad"), [
    ("relu", 0.0, 0.0, 0.0), ("relu", 2.0, 2.0, 1.0), ("relu", -2.0, 0.0, 0.0),
    ("relu6", 0.0, 0.0, 0.0), ("relu6", 6.0, 6.0, 0.0), ("relu6", 3.0, 3.0, 1.0),
    ("relu6", 7.5, 6.0, 0.0), ("relu6", -1.0, 0.0, 0.0),
    ("leaky_relu", 0.0, 0.0, 0.01), ("leaky_relu", -2.0, -0.02, 0.01),
    ("leaky_relu", 3.0, 3.0, 1.0),
    ("elu", 0.0, 0.0, 1.0), ("elu", 2.0, 2.0, 1.0), ("elu", -1.0, math.expm1(-1.0), math.exp(-1)),
    ("sigmoid", 0.0, 0.5, 0.25), ("tanh", 0.0, 0.0, 1.0),
    ("silu", 0.0, 0.0, 0.5), ("gelu", 0.0, 0.0, 0.5), ("identity", -3.0, -3.0, 1.0),
])
def test_values_and_gradients_at_edges(activation, z, value, grad):
    z_arr = np.array([z])
    y = ref.activation_forward(z_arr, activation)
    dz = ref.activation_backward(np.ones(1), saved_for(activation, z_arr, y), activation)
    np.testing.assert_allclose(y, [value], rtol=1e-15, atol=0)
    np.testing.assert_allclose(dz, [grad], rtol=1e-15, atol=0)


@pytest.mark.parametrize("activation", [a for a in ACTS if a != "identity"])
def test_nan_propagates(activation):
    z = np.array([np.nan, 1.0])
    y = ref.activation_forward(z, activation)
    assert np.isnan(y[0]) and not np.isnan(y[1])


def test_erf_and_erfc_match_math_to_a_few_ulps():
    rng = np.random.default_rng(4)
    x = np.concatenate([
        rng.standard_normal(20000) * 3.0, rng.uniform(-28.0, 28.0, 20000),
        np.exp(rng.uniform(-700.0, 3.3, 5000)) * rng.choice([-1.0, 1.0], 5000),
        [0.5, -0.5, np.nextafter(0.5, 0), 1.0, 2.0 ** (1 / 3), 20.0, 26.5, 27.5, 32.0, 1e300],
    ])
    erf_ref = np.array([math.erf(v) for v in x])
    erfc_ref = np.array([math.erfc(v) for v in x])
    got_erf, got_erfc = ref.erf(x), ref.erfc(x)
    nonzero = erf_ref != 0
    assert np.max(np.abs(got_erf - erf_ref)[nonzero] / np.abs(erf_ref[nonzero])) < 1.5e-15
    normal = erfc_ref > 1e-300  # below that erfc is subnormal and relative error meaningless
    assert np.max(np.abs(got_erfc - erfc_ref)[normal] / erfc_ref[normal]) < 2e-15
    assert np.all(np.abs(got_erfc - erfc_ref)[~normal] < 1e-300)


def test_erf_special_values_and_shapes():
    x = np.array([[np.nan, np.inf], [-np.inf, -0.0]])
    e, ec = ref.erf(x), ref.erfc(x)
    assert e.shape == ec.shape == (2, 2) and e.dtype == np.float64
    assert np.isnan(e[0, 0]) and e[0, 1] == 1.0 and e[1, 0] == -1.0
    assert e[1, 1] == 0.0 and math.copysign(1.0, e[1, 1]) == -1.0
    assert np.isnan(ec[0, 0]) and ec[0, 1] == 0.0 and ec[1, 0] == 2.0 and ec[1, 1] == 1.0
    assert ref.erf(np.float32(0.25)).dtype == np.float64  # erf always answers in float64


RTOL = {np.dtype(np.float32): 1e-6, np.dtype(np.float16): 2.0**-9, bfloat16: 2.0**-6}


@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("activation", ACTS)
def test_reduced_precision_against_float64(activation, dtype):
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(5)
    z = (3.0 * rng.standard_normal(500)).astype(dtype)
    dy = rng.standard_normal(500).astype(dtype)
    z64, dy64 = z.astype(np.float64), dy.astype(np.float64)
    y = ref.activation_forward(z, activation)
    assert y.dtype == dtype
    np.testing.assert_allclose(y.astype(np.float64), naive.act_array(activation, z64),
                               rtol=RTOL[dtype], atol=RTOL[dtype] * 1e-2)
    saved = {"none": None, "output": y, "preactivation": z}[acts.saves(activation)]
    dz = ref.activation_backward(dy, saved, activation)
    assert dz.dtype == dtype
    # a saved y is rounded, which moves the derivative by about one ulp of y
    np.testing.assert_allclose(dz.astype(np.float64),
                               dy64 * naive.act_grad_array(activation, z64),
                               rtol=4 * RTOL[dtype], atol=4 * RTOL[dtype])


@pytest.mark.parametrize("dtype", [np.float64, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu", "identity", "tanh"])
def test_backward_bias(activation, channels_last, dtype):
    rng = np.random.default_rng(6)
    x_shape = (2, 5, 4, 3) if channels_last else (2, 3, 5, 4)
    w_shape = (4, 1, 1, 3) if channels_last else (4, 3, 1, 1)
    geom = ConvGeometry.create(x_shape, w_shape, layout="NHWC" if channels_last else "NCHW")
    z = rng.standard_normal(geom.output_shape).astype(dtype)
    dy = rng.standard_normal(geom.output_shape).astype(dtype)
    y = ref.activation_forward(z, activation)
    saved = saved_for(activation, z, y)
    dz, db = ref.activation_backward_bias(dy, saved, activation, geom)
    np.testing.assert_array_equal(dz, ref.activation_backward(dy, saved, activation))
    expected = naive.conv_backward_bias(
        dy.astype(np.float64) * naive.act_grad_array(activation, z.astype(np.float64)),
        channels_last)
    tol = 1e-13 if dtype == np.float64 else 1e-2
    assert db.dtype == dtype and db.shape == (4,)
    np.testing.assert_allclose(db.astype(np.float64), expected, rtol=tol, atol=tol)
    out = np.full(4, np.nan, dtype)  # beta = 0 must not read the NaN
    assert ref.activation_backward_bias(dy, saved, activation, geom, out, 0.0)[1] is out
    np.testing.assert_array_equal(out, db)
    prior = np.arange(4.0).astype(dtype)
    out = prior.copy()
    ref.activation_backward_bias(dy, saved, activation, geom, out, 1.0)
    np.testing.assert_allclose(out.astype(np.float64), expected + prior, rtol=tol, atol=tol)


@pytest.mark.parametrize("activation", ACTS)
def test_out_inputs_untouched_and_no_aliasing(activation):
    rng = np.random.default_rng(7)
    z, dy = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    z0, dy0 = z.copy(), dy.copy()
    y = ref.activation_forward(z, activation)
    out = np.full_like(z, np.nan)
    assert ref.activation_forward(z, activation, out=out) is out
    np.testing.assert_array_equal(out, y)
    saved = saved_for(activation, z, y)
    dz = ref.activation_backward(dy, saved, activation)
    out = np.full_like(z, np.nan)
    assert ref.activation_backward(dy, saved, activation, out=out) is out
    np.testing.assert_array_equal(out, dz)
    np.testing.assert_array_equal(z, z0)
    np.testing.assert_array_equal(dy, dy0)
    assert not np.shares_memory(y, z) and not np.shares_memory(dz, dy)


def test_names_aliases_and_errors():
    z = np.array([-1.0, 2.0])
    np.testing.assert_array_equal(ref.activation_forward(z, None), z)
    np.testing.assert_array_equal(ref.activation_forward(z, "swish"),
                                  ref.activation_forward(z, "silu"))
    with pytest.raises(ValueError, match="unknown activation 'softplus'"):
        ref.activation_forward(z, "softplus")
    with pytest.raises(ValueError, match="needs saved="):
        ref.activation_backward(z, None, "relu")
    with pytest.raises(ValueError, match="pre-activation"):
        ref.activation_backward(z, None, "gelu")
    np.testing.assert_array_equal(ref.activation_backward(z, None, "identity"), z)


@pytest.mark.parametrize("layout,shape", [("NCHW", (2, 3, 4, 5)), ("NHWC", (2, 4, 5, 3)),
                                          ("NCW", (1, 4, 6))])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_identity_bias_gradient_shortcut_is_the_pass_it_skips(layout, shape, dtype):
    """activation_backward_bias for identity on a small contiguous dy in its compute dtype
    takes no pass over the samples; its dz and db are the pass's, bit for bit, out= and
    beta included."""
    from convfuse.ops.reference.activation import _backward_cd, finish

    rank = len(shape) - 2
    c = shape[-1] if layout.endswith("C") else shape[1]
    w_shape = (c, *(1,) * rank, c) if layout.endswith("C") else (c, c, *(1,) * rank)
    g = ConvGeometry.create(shape, w_shape, 1, 0, 1, 1, layout)
    dy = np.random.default_rng(3).standard_normal(shape).astype(dtype)
    dz, db = ref.activation_backward_bias(dy, None, "identity", g)
    want_dz, rows = _backward_cd(dy, None, "identity", g.reduce_axes)
    np.testing.assert_array_equal(dz, want_dz)
    assert dz is not dy
    # what the pass returns: its rows summed (float64 rows for channels-last float32, Note
    # [channels-last sums]) and rounded once
    np.testing.assert_array_equal(db, finish(rows.sum(axis=0), dtype))
    out = np.full(c, 2.0, dtype)
    _, got = ref.activation_backward_bias(dy, None, "identity", g, out, 0.5)
    assert got is out
    np.testing.assert_array_equal(got, finish(rows.sum(axis=0), dtype, np.full(c, 2.0, dtype),
                                              0.5))
