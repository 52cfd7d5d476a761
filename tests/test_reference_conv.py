"""The NumPy engine's convolutions against naive loops and finite differences."""

from __future__ import annotations

import numpy as np
import pytest

from convfuse import activations as acts
from convfuse.dtypes import bfloat16
from convfuse.geometry import ConvGeometry
from convfuse.ops import reference as ref
from tests import naive

ACTS = acts.ACTIVATIONS
SPATIAL = {1: (9,), 2: (6, 7), 3: (3, 5, 3)}
KERNEL = {1: (3,), 2: (3, 2), 3: (2, 3, 2)}
# name: (C, K, groups, stride, padding, dilation, kernel override or None)
CASES = {
    "plain": (3, 4, 1, 1, 0, 1, None),
    "stride2_pad1": (4, 4, 1, 2, 1, 1, None),
    "dilation2_pad2": (3, 2, 1, 1, 2, 2, None),
    "groups2": (4, 6, 2, 1, 1, 1, None),
    "depthwise_x2": (4, 8, 4, 1, 1, 1, None),
    "mixed_per_dim": (4, 4, 2, (2, 1, 3), (1, 0, 1), (1, 2, 1), None),
    "pointwise_stride2": (3, 5, 1, 2, 0, 1, 1),
}
TOL = {  # rtol: 2 units in the last place of the storage dtype
    np.dtype(np.float32): 2.0**-22, np.dtype(np.float16): 2.0**-10, bfloat16: 2.0**-7,
}


def dtype_id(d) -> str:
    return np.dtype(d).name


def per_dim(v, rank):
    return v[:rank] if isinstance(v, tuple) else v


def make(rank, case, channels_last, rng, batch=2, dtype=np.float64):
    """Random x, w, b, residual and upstream gradient, plus the geometry and naive kwargs."""
    c, k, groups, stride, padding, dilation, kover = CASES[case]
    stride, padding, dilation = (per_dim(v, rank) for v in (stride, padding, dilation))
    kernel = KERNEL[rank] if kover is None else (kover,) * rank
    if rank == 3:
        batch = 1
    x_cf, w_cf = (batch, c, *SPATIAL[rank]), (k, c // groups, *kernel)
    x_shape = (batch, *SPATIAL[rank], c) if channels_last else x_cf
    w_shape = (k, *kernel, c // groups) if channels_last else w_cf
    geom = ConvGeometry.create(x_shape, w_shape, stride, padding, dilation, groups,
                               "NHWC" if channels_last else "NCHW")
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups,
              channels_last=channels_last)
    x = rng.standard_normal(x_shape).astype(dtype)
    w = rng.standard_normal(w_shape).astype(dtype)
    b = rng.standard_normal(k).astype(dtype)
    y_shape = naive.conv_output_shape(x_shape, w_shape, stride, padding, dilation,
                                      channels_last)
    res = rng.standard_normal(y_shape).astype(dtype)
    dy = rng.standard_normal(y_shape).astype(dtype)
    return geom, kw, x, w, b, res, dy


def bias_view(b, ndim, channels_last):
    shape = [1] * ndim
    shape[-1 if channels_last else 1] = b.size
    return np.asarray(b, np.float64).reshape(shape)


def close(actual, expected, dtype):
    assert actual.dtype == dtype and actual.shape == expected.shape
    assert actual.flags.c_contiguous
    a = actual.astype(np.float64)
    if dtype == np.float64:
        np.testing.assert_allclose(a, expected, rtol=1e-12, atol=1e-12)
    else:  # one final rounding, plus float32 accumulation relative to the largest value
        scale = max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(a, expected, rtol=TOL[np.dtype(dtype)], atol=2e-6 * scale)


def check_everything(rank, case, channels_last, activation, with_bias, with_res, rng,
                     dtype=np.float64):
    geom, kw, x, w, b, res, dy = make(rank, case, channels_last, rng, dtype=dtype)
    x64, w64, b64, r64, dy64 = (a.astype(np.float64) for a in (x, w, b, res, dy))
    conv = naive.conv_forward(x64, w64, **kw)
    z_ref = conv + (bias_view(b64, conv.ndim, channels_last) if with_bias else 0.0)
    z_ref = z_ref + (0.5 * r64 if with_res else 0.0)
    y, z = ref.conv_bias_act(x, w, b if with_bias else None, geom, activation,
                             res if with_res else None, residual_scale=0.5)
    close(y, naive.act_array(activation, z_ref), dtype)
    if acts.saves(activation) == "preactivation":
        close(z, z_ref, dtype)
    else:
        assert z is None
    close(ref.conv_forward(x, w, geom), conv, dtype)
    close(ref.conv_backward_data(dy, w, geom), naive.conv_backward_data(dy64, w64, x.shape, **kw),
          dtype)
    close(ref.conv_backward_filter(x, dy, geom),
          naive.conv_backward_filter(x64, dy64, w.shape, **kw), dtype)
    close(ref.conv_backward_bias(dy, geom), naive.conv_backward_bias(dy64, channels_last), dtype)


GRID = [(rank, case, cl) for rank in (1, 2, 3) for case in CASES for cl in (False, True)]


@pytest.mark.parametrize(("rank", "case", "channels_last"), GRID)
def test_all_ops_match_naive_loops_float64(rank, case, channels_last):
    # activation, bias and residual rotate through the grid so every combination appears
    i = GRID.index((rank, case, channels_last))
    check_everything(rank, case, channels_last, ACTS[i % len(ACTS)], i % 2 == 0, i % 4 < 2,
                     np.random.default_rng(i))


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("with_res", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("activation", ACTS)
def test_every_activation_bias_residual_combination(activation, with_bias, with_res,
                                                     channels_last):
    check_everything(1, "groups2", channels_last, activation, with_bias, with_res,
                     np.random.default_rng(7))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16], ids=dtype_id)
@pytest.mark.parametrize(("rank", "case", "channels_last", "activation"), [
    (2, "stride2_pad1", False, "relu"),
    (2, "mixed_per_dim", True, "gelu"),
    (2, "depthwise_x2", True, "silu"),
    (1, "dilation2_pad2", False, "tanh"),
    (3, "groups2", True, "elu"),
])
def test_reduced_precision_matches_float64_loops(rank, case, channels_last, activation, dtype):
    check_everything(rank, case, channels_last, activation, True, True,
                     np.random.default_rng(3), dtype=np.dtype(dtype))


def test_known_values_2d():
    # all-ones 3x3 input, 2x2 all-ones kernel, padding 1: counts of covered cells
    geom = ConvGeometry.create((1, 1, 3, 3), (1, 1, 2, 2), padding=1)
    y = ref.conv_forward(np.ones((1, 1, 3, 3)), np.ones((1, 1, 2, 2)), geom)
    expected = [[1, 2, 2, 1], [2, 4, 4, 2], [2, 4, 4, 2], [1, 2, 2, 1]]
    np.testing.assert_array_equal(y[0, 0], expected)
    # cross-correlation, not convolution: the kernel is not flipped
    geom = ConvGeometry.create((1, 1, 3), (1, 1, 2))
    y = ref.conv_forward(np.array([[[1.0, 2.0, 3.0]]]), np.array([[[10.0, 1.0]]]), geom)
    np.testing.assert_array_equal(y, [[[12.0, 23.0]]])


# --- gradients against central finite differences ----------------------------------------

def _fd_setup(activation, rank, channels_last):
    rng = np.random.default_rng(11)
    shape = {1: (7,), 2: (5, 4), 3: (3, 4, 3)}[rank]
    kernel = {1: (3,), 2: (3, 2), 3: (2, 2, 2)}[rank]
    stride, dilation = (2, 1, 1)[:rank], (1, 2, 1)[:rank]
    x_shape = (2, *shape, 4) if channels_last else (2, 4, *shape)
    w_shape = (6, *kernel, 2) if channels_last else (6, 2, *kernel)
    geom = ConvGeometry.create(x_shape, w_shape, stride, 1, dilation, 2,
                               "NHWC" if channels_last else "NCHW")
    # z spreads over about +-15, so relu6 sees both of its kinks
    x, w = rng.standard_normal(x_shape), 2.0 * rng.standard_normal(w_shape)
    b, r = rng.standard_normal(6), rng.standard_normal(geom.output_shape)
    c = rng.standard_normal(geom.output_shape)  # the linear functional L = sum(c * y)
    return geom, x, w, b, r, c


def _check_kinks_avoided(activation, z):
    kinks = {"relu": [0.0], "leaky_relu": [0.0], "relu6": [0.0, 6.0]}.get(activation, [])
    for k in kinks:  # FD across a kink is meaningless: the data must stay clear of it
        assert np.abs(z - k).min() > 1e-3
    if activation == "relu6":
        assert (z > 6).any() and (z < 0).any() and ((z > 0) & (z < 6)).any()


@pytest.mark.parametrize(("activation", "rank", "channels_last"),
                         [(a, 2, cl) for a in ACTS for cl in (False, True)]
                         + [("gelu", 1, True), ("relu6", 1, False), ("silu", 3, False),
                            ("elu", 3, True)])
def test_gradients_match_finite_differences(activation, rank, channels_last):
    geom, x, w, b, r, c = _fd_setup(activation, rank, channels_last)
    scale = 0.5

    def loss(x_, w_, b_, r_):
        return float(np.sum(c * ref.conv_bias_act(x_, w_, b_, geom, activation, r_, scale)[0]))

    y, z = ref.conv_bias_act(x, w, b, geom, activation, r, scale)
    z_full = ref.conv_bias_act(x, w, b, geom, "identity", r, scale)[0]
    _check_kinks_avoided(activation, z_full)
    saved = {"none": None, "output": y, "preactivation": z}[acts.saves(activation)]
    dz = ref.activation_backward(c, saved, activation)
    dz2, db2 = ref.activation_backward_bias(c, saved, activation, geom)
    np.testing.assert_array_equal(dz2, dz)
    grads = {
        "x": ref.conv_backward_data(dz, w, geom),
        "w": ref.conv_backward_filter(x, dz, geom),
        "b": ref.conv_backward_bias(dz, geom),
        "r": scale * dz,
    }
    np.testing.assert_allclose(db2, grads["b"], rtol=1e-13, atol=1e-13)
    args = {"x": x, "w": w, "b": b, "r": r}
    h = 1e-6
    for name, analytic in grads.items():
        numeric = np.zeros_like(args[name])
        for idx in np.ndindex(args[name].shape):
            bumped = {k: v.copy() for k, v in args.items()}
            bumped[name][idx] += h
            up = loss(**{k + "_": v for k, v in bumped.items()})
            bumped[name][idx] -= 2 * h
            down = loss(**{k + "_": v for k, v in bumped.items()})
            numeric[idx] = (up - down) / (2 * h)
        np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-6, err_msg=name)


# --- out / beta, and inputs left alone --------------------------------------------------------

def _backward_ops(geom, x, w, dy):
    return {
        "data": lambda **kw: ref.conv_backward_data(dy, w, geom, **kw),
        "filter": lambda **kw: ref.conv_backward_filter(x, dy, geom, **kw),
        "bias": lambda **kw: ref.conv_backward_bias(dy, geom, **kw),
    }


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, bfloat16], ids=dtype_id)
@pytest.mark.parametrize("op", ["data", "filter", "bias"])
def test_out_and_beta(op, dtype):
    rng = np.random.default_rng(5)
    geom, _, x, w, _, _, dy = make(2, "groups2", True, rng, dtype=dtype)
    call = _backward_ops(geom, x, w, dy)[op]
    fresh = call()
    # beta = 0 overwrites and never reads out: NaN there must not leak in
    out = np.full(fresh.shape, np.nan, dtype)
    assert call(out=out, beta=0.0) is out
    np.testing.assert_array_equal(out, fresh)
    exact = _backward_ops(geom, *(a.astype(np.float64) for a in (x, w, dy)))[op]()
    for beta in (1.0, 0.5):
        prior = rng.standard_normal(fresh.shape).astype(dtype)
        out = prior.copy()
        assert call(out=out, beta=beta) is out
        expected = exact + beta * prior.astype(np.float64)
        if np.dtype(dtype) == np.float64:
            np.testing.assert_allclose(out, expected, rtol=1e-14, atol=1e-14)
        else:
            close(out, expected, np.dtype(dtype))
    with pytest.raises(ValueError, match="beta"):
        call(beta=1.0)


@pytest.mark.parametrize("dtype", [np.float64, np.float16, bfloat16], ids=dtype_id)
@pytest.mark.parametrize("channels_last", [False, True])
def test_inputs_are_never_modified_or_aliased(channels_last, dtype):
    rng = np.random.default_rng(9)
    geom, _, x, w, b, res, dy = make(2, "stride2_pad1", channels_last, rng, dtype=dtype)
    inputs = [x, w, b, res, dy]
    copies = [a.copy() for a in inputs]
    results = [
        *ref.conv_bias_act(x, w, b, geom, "gelu", res, 2.0),
        *ref.conv_bias_act(x, w, b, geom, "identity")[:1],
        ref.conv_forward(x, w, geom),
        ref.conv_backward_data(dy, w, geom),
        ref.conv_backward_filter(x, dy, geom),
        ref.conv_backward_bias(dy, geom),
    ]
    for a, c in zip(inputs, copies, strict=True):
        np.testing.assert_array_equal(a, c)
    for out in results:
        assert not any(np.shares_memory(out, a) for a in inputs)
