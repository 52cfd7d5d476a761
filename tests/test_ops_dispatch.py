"""NumPy arrays reach the reference engine (and CuPy arrays the cuDNN engine) with the
arguments normalized; the op returns exactly the engine's result, which is checked here
against independent oracles (naive loops, the adjoint identity, closed forms)."""

from __future__ import annotations

import importlib
import itertools

import numpy as np
import pytest

import convfuse.ops as ops
from convfuse.ops import _checks
from convfuse.pool_geometry import PoolGeometry
from tests._ops_dispatch_helpers import GEOMS

KINDS = {
    "conv": ("conv_bias_act", "conv_forward", "conv_backward_data", "conv_backward_filter",
             "conv_backward_bias"),
    "activation": ("activation_forward", "activation_backward", "activation_backward_bias"),
    "pooling": ("pool_forward", "pool_backward"),
}


@pytest.fixture
def engines(monkeypatch):
    """Record every engine call; the reference runs for real, cuDNN must not be reached."""
    calls = []
    for kind, names in KINDS.items():
        ref = importlib.import_module(f"convfuse.ops.reference.{kind}")
        gpu = importlib.import_module(f"convfuse.ops.cudnn.{kind}")
        for name in names:
            real = getattr(ref, name)

            def spy(*args, _real=real, _name=name, **kwargs):
                result = _real(*args, **kwargs)
                calls.append(("reference", _name, args, kwargs, result))
                return result

            def forbidden(*args, _name=name, **kwargs):
                raise AssertionError(f"cuDNN engine reached by {_name} with NumPy arrays")

            monkeypatch.setattr(ref, name, spy)
            monkeypatch.setattr(gpu, name, forbidden)
    return calls


def naive_conv(x, w, geom):
    """Direct loops in float64, channels-first, any rank; tiny sizes only."""
    xc = np.moveaxis(x, -1, 1) if geom.channels_last else x
    wc = np.moveaxis(w, -1, 1) if geom.channels_last else w
    xc, wc = xc.astype(np.float64), wc.astype(np.float64)
    n, c = xc.shape[:2]
    k = wc.shape[0]
    cg, kg = c // geom.groups, k // geom.groups
    pad = [(0, 0), (0, 0)] + [(p, p) for p in geom.padding]
    xp = np.pad(xc, pad)
    y = np.zeros(geom.output_shape_cf)
    for idx in itertools.product(*(range(s) for s in geom.output_spatial)):
        for oc in range(k):
            g = oc // kg
            acc = np.zeros(n)
            for taps in itertools.product(*(range(s) for s in geom.kernel_size)):
                pos = tuple(i * s + t * d for i, s, t, d in
                            zip(idx, geom.stride, taps, geom.dilation, strict=True))
                patch = xp[(slice(None), slice(g * cg, (g + 1) * cg), *pos)]
                acc += patch @ wc[(oc, slice(None), *taps)]
            y[(slice(None), oc, *idx)] = acc
    return np.moveaxis(y, 1, -1) if geom.channels_last else y


def rand(rng, shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: g.layout)
def test_conv_forward_runs_the_reference(engines, rng, geom):
    x, w = rand(rng, geom.input_shape), rand(rng, geom.weight_shape)
    x0, w0 = x.copy(), w.copy()
    y = ops.conv_forward(x, w, geom)
    [(engine, name, args, _, result)] = engines
    assert (engine, name) == ("reference", "conv_forward")
    assert args[0] is x and args[1] is w and args[2] is geom
    assert y is result
    np.testing.assert_allclose(y, naive_conv(x, w, geom), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(w, w0)


@pytest.mark.parametrize(("activation", "saves_z"), [("relu", False), ("swish", True),
                                                     (None, False), ("tanh", False)])
def test_conv_bias_act_normalizes_and_returns_the_reference(engines, rng, activation, saves_z):
    geom = GEOMS[1]
    x, w, b = rand(rng, geom.input_shape), rand(rng, geom.weight_shape), rand(rng, (6,))
    res = rand(rng, geom.output_shape)
    y, z = ops.conv_bias_act(x, w, b, geom, activation, residual=res, residual_scale=2)
    [(_, name, args, _, result)] = engines
    assert name == "conv_bias_act"
    normalized = {"relu": "relu", "swish": "silu", None: "identity", "tanh": "tanh"}
    assert args[4] == normalized[activation] and args[5] is res
    assert args[6] == 2.0 and isinstance(args[6], float)
    assert y is result[0] and z is result[1]
    pre = naive_conv(x, w, geom) + b + 2.0 * res
    act = {"relu": lambda v: np.maximum(v, 0), "swish": lambda v: v / (1 + np.exp(-v)),
           None: lambda v: v, "tanh": np.tanh}[activation]
    np.testing.assert_allclose(y, act(pre), rtol=1e-10, atol=1e-12)
    if saves_z:
        np.testing.assert_allclose(z, pre, rtol=1e-10, atol=1e-12)
    else:
        assert z is None


def test_conv_backward_ops_satisfy_the_adjoint_identity(engines, rng):
    """<conv(x, w), dz> = <x, dx> = <w, dw>: backward is the adjoint of the forward."""
    geom = GEOMS[0]
    x, w = rand(rng, geom.input_shape), rand(rng, geom.weight_shape)
    dz = rand(rng, geom.output_shape)
    ref = float(np.vdot(naive_conv(x, w, geom), dz))
    dx = ops.conv_backward_data(dz, w, geom)
    dw = ops.conv_backward_filter(x, dz, geom)
    db = ops.conv_backward_bias(dz, geom)
    assert [c[1] for c in engines] == ["conv_backward_data", "conv_backward_filter",
                                       "conv_backward_bias"]
    assert all(c[4] is r for c, r in zip(engines, (dx, dw, db), strict=True))
    assert np.vdot(x, dx) == pytest.approx(ref, rel=1e-12)
    assert np.vdot(w, dw) == pytest.approx(ref, rel=1e-12)
    np.testing.assert_allclose(db, dz.sum(axis=(0, 2, 3)), rtol=1e-12)


def test_out_and_beta_reach_the_engine(engines, rng):
    geom = GEOMS[2]
    dz, w = rand(rng, geom.output_shape), rand(rng, geom.weight_shape)
    out = rand(rng, geom.input_shape)
    start = out.copy()
    dx = ops.conv_backward_data(dz, w, geom, out=out, beta=1)
    [(_, _, args, _, _)] = engines
    assert args[3] is out and args[4] == 1.0
    assert dx is out
    np.testing.assert_allclose(out - start, ops.conv_backward_data(dz, w, geom), rtol=1e-12,
                               atol=1e-12)


def test_activation_ops_run_the_reference(engines, rng):
    geom = GEOMS[3]
    z = rand(rng, geom.output_shape)
    y = ops.activation_forward(z, "sigmoid")
    np.testing.assert_allclose(y, 1 / (1 + np.exp(-z)), rtol=1e-12)
    dy = rand(rng, z.shape)
    dz = ops.activation_backward(dy, y, "sigmoid")
    np.testing.assert_allclose(dz, dy * y * (1 - y), rtol=1e-12)
    db_out = np.ones(geom.bias_shape)
    dz2, db = ops.activation_backward_bias(dy, y, "sigmoid", geom, db_out=db_out, beta=1.0)
    assert db is db_out
    np.testing.assert_allclose(dz2, dz, rtol=1e-12)
    np.testing.assert_allclose(db, 1 + dz.sum(axis=(0, 1, 2, 3)), rtol=1e-12)
    assert [c[1] for c in engines] == ["activation_forward", "activation_backward",
                                       "activation_backward_bias"]
    assert engines[2][2][2] == "sigmoid" and engines[2][2][3] is geom


@pytest.mark.parametrize("mode", ["max", "avg"])
def test_pool_ops_run_the_reference(engines, rng, mode):
    pg = PoolGeometry.create((1, 5, 6, 2), 3, 2, 1, mode, "NHWC")
    x = rand(rng, pg.input_shape)
    y = ops.pool_forward(x, pg)
    xc = np.pad(np.moveaxis(x, -1, 1), [(0, 0), (0, 0), (1, 1), (1, 1)],
                constant_values=-np.inf if mode == "max" else 0.0)
    want = np.empty(pg.output_shape_cf)
    for i, j in itertools.product(*(range(s) for s in pg.output_spatial)):
        win = xc[:, :, 2 * i:2 * i + 3, 2 * j:2 * j + 3]
        want[:, :, i, j] = win.max(axis=(2, 3)) if mode == "max" else win.sum(axis=(2, 3)) / 9
    np.testing.assert_allclose(y, np.moveaxis(want, 1, -1), rtol=1e-12)
    dy = rand(rng, pg.output_shape)
    dx = ops.pool_backward(dy, x, y, pg)
    # Pooling is linear in x for avg and piecewise linear for max: <pool(x), dy> = <x, dx>.
    assert np.vdot(x, dx) == pytest.approx(np.vdot(y, dy), rel=1e-12)
    assert [c[1] for c in engines] == ["pool_forward", "pool_backward"]


def test_cupy_arrays_reach_the_cudnn_engine(monkeypatch):
    """With the device query and the engine stubbed, CuPy arrays (over memory nobody
    touches) are dispatched to convfuse.ops.cudnn, with the arguments normalized."""
    cp = pytest.importorskip("cupy")
    from tests.test_ops_validation import fake_cupy

    monkeypatch.setattr(_checks, "current_device", lambda: 0)
    seen = []
    gpu = importlib.import_module("convfuse.ops.cudnn.conv")
    ref = importlib.import_module("convfuse.ops.reference.conv")
    monkeypatch.setattr(gpu, "conv_bias_act", lambda *a: seen.append(a) or ("y", "z"))
    monkeypatch.setattr(ref, "conv_bias_act", lambda *a: pytest.fail("reference reached"))
    geom = GEOMS[0]
    x, w = fake_cupy(geom.input_shape), fake_cupy(geom.weight_shape)
    assert isinstance(x, cp.ndarray)
    assert ops.conv_bias_act(x, w, None, geom, "Swish", None, 1) == ("y", "z")
    [(ax, aw, ab, ag, act, res, scale)] = seen
    assert ax is x and aw is w and ab is None and ag is geom and res is None
    assert act == "silu" and scale == 1.0 and isinstance(scale, float)
