"""Activation kernels (ops/elementwise.py) on a GPU against float64 NumPy oracles.

Outputs are poisoned with NaN before every launch, so an element a kernel fails to write
shows up; the oracles here are written independently of convfuse's reference engine.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from convfuse import activations
from convfuse.errors import DeviceMismatchError
from convfuse.geometry import ConvGeometry
from convfuse.ops import elementwise

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]
ACTS = list(activations.ACTIVATIONS)
_erf = np.frompyfunc(math.erf, 1, 1)


def erf(x):
    return _erf(x).astype(np.float64)


def sigmoid(z):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-z))


def forward64(z, act):
    z = np.asarray(z, np.float64)
    return {
        "identity": lambda: z,
        "relu": lambda: np.maximum(z, 0.0),
        "sigmoid": lambda: sigmoid(z),
        "tanh": lambda: np.tanh(z),
        "elu": lambda: np.where(z > 0, z, np.expm1(np.minimum(z, 0.0))),
        "relu6": lambda: np.clip(z, 0.0, 6.0),
        "leaky_relu": lambda: np.where(z > 0, z, 0.01 * z),
        "silu": lambda: z * sigmoid(z),
        "gelu": lambda: 0.5 * z * (1.0 + erf(z / math.sqrt(2.0))),
    }[act]()


def backward64(dy, s, act):
    """dz from dy and the saved tensor s (y, or z for elu/silu/gelu), in float64."""
    dy = np.asarray(dy, np.float64)
    s = None if s is None else np.asarray(s, np.float64)
    if act == "identity":
        return dy
    if act == "silu":
        sig = sigmoid(s)
        return dy * sig * (1.0 + s * (1.0 - sig))
    if act == "gelu":
        pdf = np.exp(-0.5 * s * s) / math.sqrt(2.0 * math.pi)
        return dy * (0.5 * (1.0 + erf(s / math.sqrt(2.0))) + s * pdf)
    return dy * {
        "relu": lambda: (s > 0).astype(np.float64),
        "sigmoid": lambda: s * (1.0 - s),
        "tanh": lambda: 1.0 - s * s,
        "elu": lambda: np.where(s <= 0, np.exp(np.minimum(s, 0.0)), 1.0),  # torch's, from z
        "relu6": lambda: ((s > 0) & (s < 6)).astype(np.float64),
        "leaky_relu": lambda: np.where(s > 0, 1.0, 0.01),
    }[act]()


def tol(dtype):
    """(rtol, atol) for one rounding of the result to dtype after float/double math."""
    return {
        np.dtype(np.float64): (1e-13, 1e-13),
        np.dtype(np.float32): (2e-6, 1e-6),
        np.dtype(np.float16): (1e-3, 1e-4),
        np.dtype(ml_dtypes.bfloat16): (8e-3, 1e-3),
    }[np.dtype(dtype)]


def check_close(got, want, dtype, what):
    host = cp.asnumpy(got).astype(np.float64)
    assert np.isfinite(host).all(), f"{what}: some elements were not written (NaN poison left)"
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(host, want, rtol=rtol, atol=atol, err_msg=what)


def poisoned(shape, dtype):
    return cp.full(shape, np.nan, dtype=dtype)


def sample_z(rng, shape, dtype):
    # spans relu6's cap and tanh/sigmoid saturation; keeps clear of the kinks at 0 and 6
    z = rng.uniform(-8.0, 8.0, shape)
    z = np.where(np.abs(z) < 1e-2, 0.5, z)
    z = np.where(np.abs(z - 6.0) < 1e-2, 5.5, z)
    return z.astype(dtype)


def saved_for(act, z_host, dtype):
    """What the forward keeps, as the kernel would get it (rounded to dtype)."""
    kind = activations.saves(act)
    if kind == "none":
        return None
    if kind == "preactivation":
        return z_host
    return forward64(z_host, act).astype(dtype)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_float64(rng, dtype, act):
    z_host = sample_z(rng, (3, 5, 7, 11), dtype)
    z = cp.asarray(z_host)
    y = elementwise.activation_forward(z, act, poisoned(z.shape, dtype))
    check_close(y, forward64(z_host, act), dtype, f"{act} forward")
    cp.testing.assert_array_equal(z, cp.asarray(z_host))  # input untouched
    inplace = z.copy()
    assert elementwise.activation_forward(inplace, act, inplace) is inplace
    cp.testing.assert_array_equal(inplace, y)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_float64(rng, dtype, act):
    z_host = sample_z(rng, (2, 3, 17, 19), dtype)
    dy_host = rng.standard_normal(z_host.shape).astype(dtype)
    saved_host = saved_for(act, z_host, dtype)
    saved = None if saved_host is None else cp.asarray(saved_host)
    dz = elementwise.activation_backward(
        cp.asarray(dy_host), saved, act, poisoned(z_host.shape, dtype)
    )
    check_close(dz, backward64(dy_host, saved_host, act), dtype, f"{act} backward")


@pytest.mark.parametrize("act", [a for a in ACTS if a != "identity"])
def test_backward_formula_is_the_derivative(rng, act):
    """float64: dz equals dy times a central difference of the forward in z."""
    z_host = sample_z(rng, (4, 257), np.float64)
    dy_host = rng.standard_normal(z_host.shape)
    saved_host = saved_for(act, z_host, np.float64)
    dz = elementwise.activation_backward(
        cp.asarray(dy_host), cp.asarray(saved_host), act, poisoned(z_host.shape, np.float64)
    )
    h = 1e-6
    fd = (forward64(z_host + h, act) - forward64(z_host - h, act)) / (2 * h)
    np.testing.assert_allclose(cp.asnumpy(dz), dy_host * fd, rtol=1e-6, atol=1e-8)


def conv_geometry(layout, n, k, spatial):
    """A 1x1 convolution whose output has batch n, k channels and the given spatial dims."""
    rank, cin = len(spatial), 2
    ones = (1,) * rank
    if layout in ("NCHW", "NCW", "NCDHW"):
        return ConvGeometry.create((n, cin, *spatial), (k, cin, *ones), layout=layout)
    return ConvGeometry.create((n, *spatial, cin), (k, *ones, cin), layout=layout)


BIAS_CASES = [
    ("NCHW", 2, 1, (5, 7)),        # K = 1
    ("NCHW", 2, 3, (9, 11)),       # K = 3, odd sizes
    ("NCHW", 2, 3, (128, 128)),    # large spatial: several blocks per channel
    ("NCHW", 3, 5, (2, 2)),        # few spatial elements: the rows kernel with groups
    ("NCHW", 64, 70, (1, 1)),      # 1x1 spatial
    ("NHWC", 2, 1, (5, 7)),
    ("NHWC", 2, 3, (9, 11)),
    ("NHWC", 2, 3, (128, 128)),
    ("NHWC", 4, 130, (3, 3)),      # two column tiles
    ("NDHWC", 2, 3, (4, 5, 6)),
    ("NCW", 3, 4, (1000,)),
]


@pytest.mark.parametrize("act", ["relu", "gelu", "identity", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", BIAS_CASES, ids=lambda c: f"{c[0]}-N{c[1]}-K{c[2]}-{c[3]}")
def test_backward_bias_matches_float64_sums(rng, case, dtype, act):
    layout, n, k, spatial = case
    geom = conv_geometry(layout, n, k, spatial)
    shape = geom.output_shape
    z_host = sample_z(rng, shape, dtype)
    dy_host = rng.standard_normal(shape).astype(dtype)
    saved_host = saved_for(act, z_host, dtype)
    dy = cp.asarray(dy_host)
    saved = None if saved_host is None else cp.asarray(saved_host)
    want_dz = backward64(dy_host, saved_host, act)
    want_db = want_dz.sum(axis=geom.reduce_axes)
    scale = np.abs(want_dz).sum(axis=geom.reduce_axes)  # bounds the summation error

    dz, db = elementwise.activation_backward_bias(
        dy, saved, act, geom, poisoned(shape, dtype), poisoned((k,), dtype)  # beta=0: unread
    )
    check_close(dz, want_dz, dtype, "dz")
    rtol, _ = tol(dtype)
    sum_tol = 1e-12 if dtype == np.float64 else 2e-5
    got_db = cp.asnumpy(db).astype(np.float64)
    assert np.isfinite(got_db).all(), "db was read with beta=0 or not written"
    bound = sum_tol * scale + rtol * np.abs(want_db)
    assert (np.abs(got_db - want_db) <= bound).all(), (got_db, want_db)

    # the fused dz is exactly the plain backward's, and a second run is bit-identical
    plain = elementwise.activation_backward(dy, saved, act, poisoned(shape, dtype))
    cp.testing.assert_array_equal(dz, plain)
    dz2, db2 = elementwise.activation_backward_bias(
        dy, saved, act, geom, poisoned(shape, dtype), poisoned((k,), dtype)
    )
    cp.testing.assert_array_equal(dz2, dz)
    cp.testing.assert_array_equal(db2, db)
    cp.testing.assert_array_equal(dy, cp.asarray(dy_host))


@pytest.mark.parametrize("beta", [1.0, 0.5])
@pytest.mark.parametrize("case", [BIAS_CASES[1], BIAS_CASES[2], BIAS_CASES[3], BIAS_CASES[8]])
def test_backward_bias_accumulates_with_beta(rng, case, beta):
    layout, n, k, spatial = case
    geom = conv_geometry(layout, n, k, spatial)
    z_host = sample_z(rng, geom.output_shape, np.float32)
    dy_host = rng.standard_normal(geom.output_shape).astype(np.float32)
    saved_host = saved_for("relu", z_host, np.float32)
    db0 = rng.standard_normal(k).astype(np.float32)
    db = cp.asarray(db0)
    elementwise.activation_backward_bias(
        cp.asarray(dy_host), cp.asarray(saved_host), "relu", geom,
        poisoned(geom.output_shape, np.float32), db, beta=beta,
    )
    want_dz = backward64(dy_host, saved_host, "relu")
    want = want_dz.sum(axis=geom.reduce_axes) + beta * db0
    scale = np.abs(want_dz).sum(axis=geom.reduce_axes) + np.abs(db0)
    assert (np.abs(cp.asnumpy(db) - want) <= 2e-5 * scale).all()


def test_bias_kernel_inside_stream_capture(rng):
    geom = conv_geometry("NCHW", 2, 3, (64, 64))
    dy_host = rng.standard_normal(geom.output_shape).astype(np.float32)
    z_host = sample_z(rng, geom.output_shape, np.float32)
    dy, z = cp.asarray(dy_host), cp.asarray(z_host)
    dz, db = cp.empty_like(dy), cp.empty(3, np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    pool = cp.cuda.MemoryPool()  # the scratch the graph reads lives as long as the graph
    with stream:
        elementwise.activation_backward_bias(dy, z, "gelu", geom, dz, db)  # compiles first
        stream.synchronize()
        dz.fill(np.nan)
        db.fill(np.nan)
        with cp.cuda.using_allocator(pool.malloc):
            stream.begin_capture()
            elementwise.activation_backward_bias(dy, z, "gelu", geom, dz, db)
            graph = stream.end_capture()
        assert pool.used_bytes() + pool.free_bytes() > 0  # the partial sums came from it
        # eager work after the capture takes the default pool's blocks, never the graph's
        cp.full(geom.output_shape, np.inf, np.float32)
        graph.launch(stream)
        stream.synchronize()
    want_dz = backward64(dy_host, z_host, "gelu")
    check_close(dz, want_dz, np.float32, "captured dz")
    np.testing.assert_allclose(cp.asnumpy(db), want_dz.sum(axis=(0, 2, 3)), rtol=1e-5, atol=1e-3)


def test_mixing_numpy_and_cupy_raises():
    z = cp.zeros((4, 4), np.float32)
    with pytest.raises(DeviceMismatchError):
        elementwise.activation_forward(z, "relu", np.zeros((4, 4), np.float32))
    geom = conv_geometry("NCHW", 1, 2, (2, 2))
    with pytest.raises(DeviceMismatchError):
        elementwise.activation_backward_bias(
            cp.zeros(geom.output_shape, np.float32), None, "identity", geom,
            cp.zeros(geom.output_shape, np.float32), np.zeros(2, np.float32),
        )


def test_arrays_on_two_gpus_raise():
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    with cp.cuda.Device(0):
        z = cp.zeros(8, np.float32)
    with cp.cuda.Device(1):
        out = cp.zeros(8, np.float32)
    with pytest.raises(DeviceMismatchError, match="different GPUs"):
        elementwise.activation_forward(z, "relu", out)
