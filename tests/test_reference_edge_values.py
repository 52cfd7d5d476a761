"""Edge values on the NumPy engine against PyTorch's CPU engine (issue #11, items 13-15).

NaN and inf inputs, ties and all -inf windows: the reference engine must route gradients
and produce values exactly as torch does, and NumPy's RuntimeWarnings must not escape.

The oracle for the activations is torch in float64 (inputs widened exactly, results
rounded to the tested dtype), never torch's float32 kernels: those run whole vectors in
SIMD lanes and the tail in a scalar loop, with other approximations (expm1, erf) and other
answers at infinities (gelu(+inf) is NaN in a lane), so comparing with them would make a
test's verdict depend on the machine (issue 19, item 11).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from convfuse.ops import reference as ref
from convfuse.pool_geometry import PoolGeometry

torch = pytest.importorskip("torch")
F = torch.nn.functional

EDGE = [-np.inf, -1e300, -1e30, -100.0, -90.0, -20.0, -1e-30, -0.0, 0.0, 1e-30, 0.5, 20.0,
        1e30, 1e300, np.inf, np.nan]


def _edge(dtype):
    with np.errstate(over="ignore"):
        return np.array(EDGE, dtype)


# --- item 13: relu's gradient at a NaN pre-activation -------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_gradient_passes_dy_at_nan_like_torch(dtype):
    z = _edge(dtype)
    dy = np.linspace(1.0, 2.0, z.size).astype(dtype)
    y = ref.activation_forward(z, "relu")  # what convfuse saves for relu
    dz = ref.activation_backward(dy, y, "relu")
    want_y, want = _torch_grad("relu", z, dy)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(dz, want)
    assert dz[-1] == dy[-1]  # the NaN pre-activation passes dy on
    # a NaN dy where y <= 0 still gives exactly +0, as torch's threshold_backward
    dz2 = ref.activation_backward(np.full_like(dy, np.nan), y, "relu")
    assert np.all(dz2[y <= 0] == 0) and not np.any(np.signbit(dz2[y <= 0]))


# --- relu6 and elu at NaN, +-inf and their kinks (0, and 6 for relu6) ----------------------

KINKS = [6.0, 3.0, -1.0, 7.0, 5.9999995, 6.0000005]


def _torch_grad(act, z, dy):
    """torch's forward and gradient in float64, rounded to z's dtype (module docstring)."""
    tz = torch.from_numpy(z.astype(np.float64)).requires_grad_(True)
    ty = getattr(F, act)(tz)
    (tdz,) = torch.autograd.grad(ty, tz, torch.from_numpy(dy.astype(np.float64)))
    return ty.detach().numpy().astype(z.dtype), tdz.numpy().astype(z.dtype)


@pytest.mark.parametrize("act", ["relu6", "elu"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu6_elu_edge_values_match_torch(act, dtype):
    """Forward is torch's everywhere, -0.0 included; backward (from the saved y for relu6,
    the saved z for elu) is torch's at every non-NaN value: exactly +0 for relu6 at z = 0,
    z >= 6 and -inf, dy for elu at +-0 and +inf, 0 at -inf. At a NaN pre-activation dy
    passes on (next test)."""
    with np.errstate(over="ignore"):
        z = np.array(EDGE + KINKS, dtype)
    dy = np.linspace(1.0, 2.0, z.size).astype(dtype)
    y = ref.activation_forward(z, act)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exp(+-inf), exp(1e30): quiet
        dz = ref.activation_backward(dy, y if act == "relu6" else z, act)
    want_y, want_dz = _torch_grad(act, z, dy)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(np.signbit(y), np.signbit(want_y))  # -0.0 stays -0.0
    nan = np.isnan(z)
    if act == "relu6":
        np.testing.assert_array_equal(dz[~nan], want_dz[~nan])
    else:  # dy * exp(z), as torch from z: a few ulps, subnormals (exp(-100)) included
        info = np.finfo(dtype)
        np.testing.assert_allclose(dz[~nan], want_dz[~nan], rtol=4 * info.eps,
                                   atol=4 * info.smallest_subnormal)
    np.testing.assert_array_equal(np.signbit(dz[~nan]), np.signbit(want_dz[~nan]))
    assert np.all(dz[nan] == dy[nan])
    if act == "relu6":
        at = np.isin(z, [0.0, 6.0, 7.0, np.inf, -np.inf])
        assert np.all(dz[at] == 0) and not np.any(np.signbit(dz[at]))
    else:
        assert np.all(dz[z == 0] == dy[z == 0]) and dz[z == -np.inf][0] == 0


@pytest.mark.parametrize("act", ["relu6", "elu"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu6_elu_pass_dy_at_nan_as_torchs_elementwise_rule(act, dtype):
    """torch writes hardtanh_backward and elu_backward, in its scalar CPU loop and its CUDA
    kernels, as `y <= lo || y >= hi ? 0 : dy` and (from the input, torch.nn.ELU's
    is_result=False) `z <= 0 ? dy * exp(z) : dy`: a NaN y or z passes dy on. A one-element
    tensor runs that scalar loop (its SIMD loop only takes whole vectors), so it shows the
    rule; in longer tensors the SIMD lanes give 0 (relu6) and NaN (elu) instead, a
    position-dependent quirk convfuse does not copy."""
    z = np.array([np.nan], dtype)
    dy = np.array([1.75], dtype)
    y = ref.activation_forward(z, act)
    want_y, want_dz = _torch_grad(act, z, dy)
    assert np.isnan(y[0]) and np.isnan(want_y[0])
    np.testing.assert_array_equal(
        ref.activation_backward(dy, y if act == "relu6" else z, act), want_dz)
    assert want_dz[0] == dy[0]
    # the same at any position of a long array, mixed with ordinary values
    zz = np.tile(np.array([np.nan, -1.0, 3.0, 7.0], dtype), 20)
    dd = np.linspace(1.0, 2.0, zz.size).astype(dtype)
    saved = ref.activation_forward(zz, act) if act == "relu6" else zz
    got = ref.activation_backward(dd, saved, act)
    np.testing.assert_array_equal(got[0::4], dd[0::4])


# --- item 15: no RuntimeWarnings from silu and gelu at +-inf and huge values --------------

@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_silu_gelu_edge_values_are_quiet_and_match_torch(act, dtype):
    """Finite inputs against torch in float64; +-inf and NaN against the written rule
    (Note [edge values]). torch's float32 answer at an infinity depends on its SIMD lanes
    (gelu(+inf) is NaN in a whole vector, +inf in the scalar tail and in float64), so it
    is no oracle there: it would make the verdict depend on the machine (issue 19, 11)."""
    z = _edge(dtype)  # in float32, +-1e300 are +-inf too
    dy = np.ones_like(z)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any RuntimeWarning fails the test
        y = ref.activation_forward(z, act)
        dz = ref.activation_backward(dy, z, act)
    finite = np.isfinite(z)
    tz = torch.from_numpy(z[finite].astype(np.float64)).requires_grad_(True)
    ty = getattr(F, act)(tz)
    (tdz,) = torch.autograd.grad(ty.sum(), tz)
    # finite values close (float32 results may be subnormals that round differently, hence
    # the absolute tolerance), and no NaN on either side
    for got, want in ((y[finite], ty.detach().numpy()), (dz[finite], tdz.numpy())):
        assert not np.isnan(want).any() and not np.isnan(got).any()
        np.testing.assert_allclose(got, want.astype(dtype), rtol=1e-6, atol=1e-37)
    # the rule: -inf * 0 is NaN at -inf, +inf passes at +inf, the gradients at +-inf are NaN
    assert np.isnan(y[z == -np.inf]).all() and (y[z == np.inf] == np.inf).all()
    assert np.isnan(dz[np.isinf(z)]).all()
    assert np.isnan(y[np.isnan(z)]).all() and np.isnan(dz[np.isnan(z)]).all()


@pytest.mark.parametrize("act", ["silu", "gelu", "sigmoid", "tanh", "elu"])
def test_edge_values_quiet_inside_a_fused_layer_on_threads(act, monkeypatch):
    from convfuse.geometry import ConvGeometry
    from convfuse.ops.reference import _threads

    monkeypatch.setattr(_threads, "MIN_ELEMENTS", 1)
    _threads.set_num_threads(3)
    try:
        x = np.zeros((4, 1, 4, 4), np.float32)
        x[:, 0, 0, 0] = [np.inf, -np.inf, 1e30, -1e30]
        w = np.ones((2, 1, 1, 1), np.float32)
        g = ConvGeometry.create(x.shape, w.shape)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y, z = ref.conv_bias_act(x, w, None, g, act)
            saved = z if z is not None else y
            ref.activation_backward(np.ones_like(y), saved, act)
    finally:
        _threads.set_num_threads(None)


# --- item 14: max-pool routing against torch.nn.functional.max_pool{1,2,3}d -------------

POOLS = {  # name: (kernel, stride, padding)
    "k2": (2, 2, 0),
    "k3_s2_p1": (3, 2, 1),
    "k3_s1_p1": (3, 1, 1),
    "k2_s3_p1": (2, 3, 1),
    "k2_s1_p1": (2, 1, 1),
}


def _torch_pool_grad(x, dy, kernel, stride, padding):
    """torch's max pooling and its gradient in float64, rounded to x's dtype (the module
    docstring: never torch's float32 kernels as the oracle)."""
    rank = x.ndim - 2
    pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[rank]
    tx = torch.from_numpy(x.astype(np.float64)).requires_grad_(True)
    ty = pool(tx, kernel, stride, padding)
    (tdx,) = torch.autograd.grad(ty, tx, torch.from_numpy(dy.astype(np.float64)))
    return ty.detach().numpy().astype(x.dtype), tdx.numpy().astype(x.dtype)


def _nasty(shape, rng, dtype):
    """Small integers (many ties), several NaNs per window, -inf regions, +inf."""
    x = rng.integers(-2, 3, shape).astype(dtype)
    pick = rng.random(shape)
    x[pick < 0.15] = np.nan
    x[(pick >= 0.15) & (pick < 0.35)] = -np.inf
    x[(pick >= 0.35) & (pick < 0.38)] = np.inf
    return x


@pytest.mark.parametrize("name", list(POOLS))
@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_max_pool_routes_gradients_like_torch(name, rank, channels_last, dtype):
    kernel, stride, padding = POOLS[name]
    spatial = {1: (11,), 2: (7, 8), 3: (5, 6, 5)}[rank]
    rng = np.random.default_rng(hash((name, rank, channels_last)) % 2**32)
    shape_cf = (3, 2, *spatial)
    x_cf = _nasty(shape_cf, rng, dtype)
    pg_cf = PoolGeometry.create(shape_cf, kernel, stride, padding, "max")
    dy_cf = rng.uniform(0.5, 1.5, pg_cf.output_shape).astype(dtype)
    want_y, want_dx = _torch_pool_grad(x_cf, dy_cf, kernel, stride, padding)
    if channels_last:
        x, dy = np.ascontiguousarray(np.moveaxis(x_cf, 1, -1)), np.moveaxis(dy_cf, 1, -1)
        dy = np.ascontiguousarray(dy)
        pg = PoolGeometry.create(x.shape, kernel, stride, padding, "max", "NHWC")
    else:
        x, dy, pg = x_cf, dy_cf, pg_cf
    y = ref.pool_forward(x, pg)
    dx = ref.pool_backward(dy, x, y, pg)
    if channels_last:
        y, dx = np.moveaxis(y, -1, 1), np.moveaxis(dx, -1, 1)
    np.testing.assert_array_equal(y, want_y)
    if stride >= kernel:  # each element in one window at most: the very same numbers
        np.testing.assert_array_equal(dx, want_dx)
    else:  # shared elements sum several windows' dy, in another order than torch
        np.testing.assert_array_equal(dx == 0, want_dx == 0)
        np.testing.assert_allclose(dx, want_dx, rtol=4 * np.finfo(dtype).eps)
    # nothing is lost into padding: every window's gradient lands on a real element
    np.testing.assert_allclose(dx.sum(dtype=np.float64), dy.sum(dtype=np.float64),
                               rtol=100 * np.finfo(dtype).eps)


def test_max_pool_several_nans_route_to_the_last_one():
    x = np.array([[[np.nan, 1.0, np.nan, 0.0]]])
    pg = PoolGeometry.create(x.shape, 4, layout="NCW")
    dx = ref.pool_backward(np.ones((1, 1, 1)), x, ref.pool_forward(x, pg), pg)
    np.testing.assert_array_equal(dx, [[[0.0, 0.0, 1.0, 0.0]]])
    np.testing.assert_array_equal(dx, _torch_pool_grad(x, np.ones((1, 1, 1)), 4, 4, 0)[1])


def test_max_pool_all_minus_inf_window_at_padding_goes_to_first_real_element():
    x = np.full((1, 1, 3, 3), -np.inf)
    pg = PoolGeometry.create(x.shape, 3, 2, 1, "max")  # outputs 2x2, every window padded
    dy = np.array([[[[1.0, 2.0], [3.0, 4.0]]]])
    dx = ref.pool_backward(dy, x, ref.pool_forward(x, pg), pg)
    want = np.zeros_like(x)
    want[0, 0, 0, 0], want[0, 0, 0, 1], want[0, 0, 1, 0], want[0, 0, 1, 1] = 1, 2, 3, 4
    np.testing.assert_array_equal(dx, want)
    np.testing.assert_array_equal(dx, _torch_pool_grad(x, dy, 3, 2, 1)[1])
    assert dx.sum() == dy.sum()


def test_max_pool_nan_in_dy_stays_in_its_window():
    # a losing position must get exactly 0, not 0 * NaN
    x = np.array([[[1.0, 2.0, 3.0, 0.0]]])
    pg = PoolGeometry.create(x.shape, 2, layout="NCW")
    dx = ref.pool_backward(np.array([[[np.nan, 1.0]]]), x, ref.pool_forward(x, pg), pg)
    np.testing.assert_array_equal(dx, [[[0.0, np.nan, 1.0, 0.0]]])
