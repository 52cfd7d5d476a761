"""Conv1d/2d/3d through the public API on the CPU engine.

Oracles: naive loops (tests/naive.py) for the forward, finite differences for every
gradient, a transposed channels-first run for channels-last layers.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import convfuse as cf
from convfuse.errors import BackwardBeforeForwardError
from tests import naive
from tests.gradcheck import assert_grad_close

ACTS = ["identity", "relu", "sigmoid", "tanh", "elu", "relu6", "leaky_relu", "silu", "gelu"]
LAYERS = {1: cf.Conv1d, 2: cf.Conv2d, 3: cf.Conv3d}
SPATIAL = {1: (7,), 2: (6, 5), 3: (4, 5, 3)}
KERNEL = {1: 3, 2: (3, 2), 3: (2, 3, 2)}


def make(rank, act="relu", groups=1, stride=1, padding=1, dilation=1, bias=True,
         layout="NCHW", cin=4, cout=8, seed=0):
    return LAYERS[rank](cin, cout, KERNEL[rank], stride=stride, padding=padding,
                        dilation=dilation, groups=groups, bias=bias, activation=act,
                        layout=layout, dtype="float64", device="cpu", seed=seed)


def random_input(rank, rng, cin=4, layout="NCHW", n=2):
    shape = (n, cin, *SPATIAL[rank])
    x = rng.standard_normal(shape)
    return np.ascontiguousarray(np.moveaxis(x, 1, -1)) if layout == "NHWC" else x


def forward_loss(layer, x, r, residual=None):
    return lambda: float(np.sum(layer(x, residual=residual) * r))


GRID = [
    (rank, act, groups, stride, padding, dilation, bias)
    for rank, act in itertools.product((1, 2, 3), ACTS)
    for groups, stride, padding, dilation, bias in [(1, 1, 1, 1, True), (2, 2, 0, 1, False)]
] + [
    (2, "relu", 4, 1, 2, 2, True),   # depthwise (groups == in_channels), dilated
    (1, "gelu", 2, 2, 1, 2, True),
    (3, "silu", 1, 2, 1, 1, False),
]


@pytest.mark.parametrize("rank,act,groups,stride,padding,dilation,bias", GRID)
def test_forward_matches_naive_loops(rank, act, groups, stride, padding, dilation, bias, rng):
    layer = make(rank, act, groups, stride, padding, dilation, bias)
    x = random_input(rank, rng)
    z = rng.standard_normal(layer(x).shape)
    y = layer(x, residual=z)
    expect = naive.conv_forward(x, layer.weight.data, stride=stride, padding=padding,
                                dilation=dilation, groups=groups)
    if bias:
        expect += layer.bias.data.reshape(1, -1, *([1] * rank))
    expect = naive.act_array(act, expect + z)
    np.testing.assert_allclose(y, expect, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("rank,act,groups,stride,padding,dilation,bias", GRID)
def test_gradients_match_finite_differences(rank, act, groups, stride, padding, dilation,
                                            bias, rng):
    layer = make(rank, act, groups, stride, padding, dilation, bias)
    x = random_input(rank, rng)
    y = layer(x)
    z = rng.standard_normal(y.shape)
    r = rng.standard_normal(y.shape)
    layer(x, residual=z)
    dx, dz = layer.backward(r)
    loss = forward_loss(layer, x, r, residual=z)
    assert_grad_close(dx, loss, x)
    assert_grad_close(dz, loss, z)
    assert_grad_close(layer.weight.grad, loss, layer.weight.data)
    if bias:
        assert_grad_close(layer.bias.grad, loss, layer.bias.data)


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("act", ["relu", "gelu", "tanh"])
def test_channels_last_equals_channels_first(rank, act, rng):
    first = make(rank, act, groups=2, stride=2, layout="NCHW", seed=3)
    last = make(rank, act, groups=2, stride=2, layout="NHWC", seed=3)
    np.testing.assert_array_equal(np.moveaxis(first.weight.data, 1, -1), last.weight.data)
    x = random_input(rank, rng)
    y_first = first(x)
    y_last = last(np.ascontiguousarray(np.moveaxis(x, 1, -1)))
    np.testing.assert_allclose(np.moveaxis(y_last, -1, 1), y_first, rtol=1e-12, atol=1e-13)
    r = rng.standard_normal(y_first.shape)
    dx_first = first.backward(r)
    dx_last = last.backward(np.ascontiguousarray(np.moveaxis(r, 1, -1)))
    np.testing.assert_allclose(np.moveaxis(dx_last, -1, 1), dx_first, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(np.moveaxis(last.weight.grad, -1, 1), first.weight.grad,
                               rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(last.bias.grad, first.bias.grad, rtol=1e-11, atol=1e-12)


def test_gradients_accumulate_and_zero_grad(rng):
    layer = make(2, "tanh")
    x = random_input(2, rng)
    r = rng.standard_normal(layer(x).shape)
    layer.backward(r)
    w1, b1 = layer.weight.grad.copy(), layer.bias.grad.copy()
    layer(x)
    layer.backward(r)
    np.testing.assert_allclose(layer.weight.grad, 2 * w1, rtol=1e-12)
    np.testing.assert_allclose(layer.bias.grad, 2 * b1, rtol=1e-12)
    layer.zero_grad()
    assert not layer.weight.grad.any() and not layer.bias.grad.any()


def test_inputs_are_never_modified(rng):
    layer = make(2, "silu")
    x = random_input(2, rng)
    z = rng.standard_normal(layer(x).shape)
    r = rng.standard_normal(z.shape)
    copies = [a.copy() for a in (x, z, r)]
    layer(x, residual=z)
    layer.backward(r)
    for a, c in zip((x, z, r), copies):
        np.testing.assert_array_equal(a, c)


def test_residual_scale_scales_forward_and_gradient(rng):
    layer = make(2, "identity")
    layer.residual_scale = 0.5
    x = random_input(2, rng)
    z = rng.standard_normal(layer(x).shape)
    np.testing.assert_allclose(layer(x, residual=z) - layer(x), 0.5 * z, atol=1e-12)
    layer(x, residual=z)
    r = rng.standard_normal(z.shape)
    _, dz = layer.backward(r)
    np.testing.assert_allclose(dz, 0.5 * r)
    assert dz is not r


@pytest.mark.parametrize("transposed", [False, True])
def test_a_scaled_residual_gradient_keeps_bfloat16(rng, transposed):
    """dresidual comes back in the data's dtype, as dx, dw and db do (bfloat16 times a
    Python float is float32 in ml_dtypes): passing it on as another layer's dy works."""
    bf16 = np.dtype("bfloat16")
    cls = cf.ConvTranspose2d if transposed else cf.Conv2d
    layer = cls(2, 2, 1, dtype="bfloat16", device="cpu", seed=0)
    layer.residual_scale = 0.5
    x = rng.standard_normal((1, 2, 3, 3)).astype(bf16)
    z = rng.standard_normal(layer(x).shape).astype(bf16)
    layer(x, residual=z)
    r = rng.standard_normal(z.shape).astype(bf16)
    dx, dz = layer.backward(r)
    assert dx.dtype == dz.dtype == bf16
    np.testing.assert_array_equal(dz.astype(np.float64), 0.5 * r.astype(np.float64))


def test_default_init_matches_pytorch_bounds_and_seed():
    layer = cf.Conv2d(6, 8, (3, 5), groups=2, device="cpu", seed=7)
    bound = 1 / math.sqrt(3 * 3 * 5)
    assert layer.weight.shape == (8, 3, 3, 5) and layer.weight.dtype == np.float32
    assert np.abs(layer.weight.data).max() <= bound and np.abs(layer.bias.data).max() <= bound
    assert np.abs(layer.weight.data).max() > 0.8 * bound  # spread over the range, not tiny
    again = cf.Conv2d(6, 8, (3, 5), groups=2, device="cpu", seed=7)
    np.testing.assert_array_equal(layer.weight.data, again.weight.data)
    nhwc = cf.Conv2d(6, 8, (3, 5), groups=2, layout="NHWC", device="cpu", seed=7)
    assert nhwc.weight.shape == (8, 3, 5, 3)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_reduced_precision_follows_float64(dtype, rng):
    ref = make(2, "relu")
    low = cf.Conv2d(4, 8, KERNEL[2], padding=1, activation="relu", dtype=dtype, device="cpu",
                    seed=0)
    ref.weight.data[...] = low.weight.data.astype(np.float64)
    ref.bias.data[...] = low.bias.data.astype(np.float64)
    x = random_input(2, rng)
    y = low(x.astype(low.dtype))
    assert y.dtype == low.dtype
    tol = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 3e-2}[dtype]
    expect = ref(x.astype(low.dtype).astype(np.float64))
    np.testing.assert_allclose(y.astype(np.float64), expect, rtol=tol, atol=tol)


def test_bad_input_gets_clear_errors(rng):
    layer = make(2, "relu")
    x = random_input(2, rng)
    with pytest.raises(BackwardBeforeForwardError):
        layer.backward(np.zeros((2, 8, 6, 4)))
    with pytest.raises(ValueError, match="expects a 4-d input"):
        layer(x[0])
    with pytest.raises(ValueError, match=r"input channels must match the weight: 3 vs\. 4"):
        layer(x[:, :3].copy())
    with pytest.raises(ValueError, match="dtype float64 but its input has dtype float32"):
        layer(x.astype(np.float32))
    with pytest.raises(TypeError, match="NumPy or CuPy array"):
        layer(x.tolist())
    y = layer(x)
    with pytest.raises(ValueError, match="dy has shape"):
        layer.backward(np.zeros((2, 8, 3, 3)))
    layer.backward(np.ones_like(y))  # the rejected dy did not consume the forward
    with pytest.raises(ValueError, match="unknown activation"):
        make(2, "swishy")
    with pytest.raises(ValueError, match="divisible by groups"):
        cf.Conv2d(3, 4, 3, groups=2, device="cpu")
    with pytest.raises(ValueError, match="in_channels must be a positive int"):
        cf.Conv2d(0, 4, 3, device="cpu")


def test_functional_form_matches_layer(rng):
    layer = make(2, "gelu", groups=2, stride=2)
    x = random_input(2, rng)
    y = cf.functional.conv_bias_act(x, layer.weight.data, layer.bias.data, stride=2, padding=1,
                                    groups=2, activation="gelu")
    np.testing.assert_allclose(y, layer(x), rtol=0, atol=0)
    y2, ctx = cf.functional.conv_bias_act_forward(x, layer.weight.data, layer.bias.data,
                                                  stride=2, padding=1, groups=2,
                                                  activation="gelu")
    r = rng.standard_normal(y2.shape)
    grads = cf.functional.conv_bias_act_backward(r, ctx)
    dx = layer.backward(r)
    np.testing.assert_allclose(grads.dx, dx, rtol=1e-13)
    np.testing.assert_allclose(grads.dweight, layer.weight.grad, rtol=1e-13)
    np.testing.assert_allclose(grads.dbias, layer.bias.grad, rtol=1e-13)
    assert grads.dresidual is None
