"""AdaptiveAvgPool2d against torch.nn.functional.adaptive_avg_pool2d and finite differences."""

from __future__ import annotations

import numpy as np
import pytest

import convfuse as cf
from convfuse import dtypes
from convfuse.nn import adaptive_pool
from tests.gradcheck import assert_grad_close

torch = pytest.importorskip("torch")
F = torch.nn.functional

SIZES = [
    ((2, 3, 7, 5), 1),
    ((2, 3, 8, 6), (4, 3)),       # divides the input: the reshape + mean path
    ((1, 2, 7, 5), (3, 2)),       # windows overlap: the separable path
    ((1, 2, 4, 3), (6, 5)),       # larger than the input: windows repeat
    ((2, 1, 5, 9), (None, 4)),    # None keeps that dimension
    ((1, 2, 1, 1), 3),
]


def _torch_pool(x_nchw, size):
    t = torch.tensor(x_nchw, requires_grad=True)
    return t, F.adaptive_avg_pool2d(t, size)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("shape,size", SIZES)
def test_forward_and_backward_match_torch(rng, shape, size, layout):
    x = rng.standard_normal(shape)
    t, ty = _torch_pool(x, size)
    dy_cf = rng.standard_normal(tuple(ty.shape))
    ty.backward(torch.tensor(dy_cf))
    pool = cf.AdaptiveAvgPool2d(size, layout=layout)
    if layout == "NHWC":
        xin, dy = np.ascontiguousarray(x.transpose(0, 2, 3, 1)), dy_cf.transpose(0, 2, 3, 1)
    else:
        xin, dy = x, dy_cf
    keep = xin.copy()
    y = pool(xin)
    dx = pool.backward(np.ascontiguousarray(dy))
    np.testing.assert_array_equal(xin, keep)  # input untouched
    assert dx.flags.c_contiguous and dx.shape == xin.shape and dx.dtype == xin.dtype
    if layout == "NHWC":
        y, dx = y.transpose(0, 3, 1, 2), dx.transpose(0, 3, 1, 2)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dx, t.grad.numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("shape,size", [((1, 2, 5, 7), (2, 3)), ((2, 2, 6, 4), 2),
                                        ((1, 1, 3, 3), 1)])
def test_backward_matches_finite_differences(rng, shape, size):
    x = rng.standard_normal(shape)
    pool = cf.AdaptiveAvgPool2d(size)
    w = rng.standard_normal(pool(x).shape)
    dx = pool.backward(w)
    assert_grad_close(dx, lambda: float((pool(x) * w).sum()), x, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("adjoint", [False, True])
def test_separable_broadcast_path_equals_matmul_path(rng, adjoint):
    """The CuPy route (matrices built by elementwise kernels, broadcast multiply + sum: Note
    [adaptive pooling without cuBLAS]) is plain array code: run it on NumPy."""
    for length, out in [(7, 3), (5, 2), (4, 6), (1, 3), (9, 9)]:
        np.testing.assert_array_equal(
            adaptive_pool.device_pooling_matrix(np, length, out, np.float64),
            adaptive_pool.pooling_matrix(length, out))
    shape = (2, 3, 2, 3) if adjoint else (2, 7, 5, 3)  # NHWC
    x = rng.standard_normal(shape)
    args = ((7, 3), (5, 2), 1, 2, np.dtype(np.float64), adjoint)
    ref = adaptive_pool._separable(x, *args)
    got = adaptive_pool._separable_cupy(np, x, *args)
    np.testing.assert_allclose(got, ref, rtol=1e-13)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("size", [1, (3, 2)])
def test_reduced_precision_accumulates_in_float32(rng, dtype, size):
    x64 = rng.standard_normal((2, 3, 7, 6))
    x = x64.astype(dtypes.canonical(dtype))
    pool = cf.AdaptiveAvgPool2d(size)
    y = pool(x)
    assert y.dtype == x.dtype
    ref = F.adaptive_avg_pool2d(torch.tensor(x.astype(np.float64)), size).numpy()
    tol = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    np.testing.assert_allclose(y.astype(np.float64), ref, rtol=tol, atol=tol)
    dx = pool.backward(np.ones(y.shape, x.dtype))
    assert dx.dtype == x.dtype and dx.shape == x.shape


def test_rejected_dy_keeps_the_forward(rng):
    pool = cf.AdaptiveAvgPool2d(1)
    x = rng.standard_normal((2, 3, 4, 4))
    y = pool(x)
    with pytest.raises(ValueError, match=r"AdaptiveAvgPool2d: dy has shape \(2, 3\)"):
        pool.backward(np.ones((2, 3)))
    with pytest.raises(ValueError, match="dtype float32"):
        pool.backward(np.ones(y.shape, np.float32))
    with pytest.raises(TypeError, match="AdaptiveAvgPool2d: dy must be a NumPy or CuPy"):
        pool.backward([[1.0]])
    dx = pool.backward(np.ones_like(y))
    np.testing.assert_allclose(dx, np.full(x.shape, 1 / 16))
    with pytest.raises(cf.BackwardBeforeForwardError):
        pool.backward(np.ones_like(y))


def test_needs_input_grad_false_returns_none(rng):
    pool = cf.AdaptiveAvgPool2d(1)
    pool.needs_input_grad = False
    y = pool(rng.standard_normal((1, 2, 3, 3)))
    assert pool.backward(np.ones_like(y)) is None


@pytest.mark.parametrize("size,err,match", [
    (0, ValueError, "output_size entries must be >= 1"),
    ((1, 2, 3), ValueError, "output_size must be an int or a pair"),
    (1.5, TypeError, "output_size entries must be ints or None"),
    (True, TypeError, "output_size entries must be ints or None"),
])
def test_constructor_rejects(size, err, match):
    with pytest.raises(err, match=match):
        cf.AdaptiveAvgPool2d(size)


def test_call_rejects_bad_input(rng):
    with pytest.raises(ValueError, match="layout must be 'NCHW' or 'NHWC'"):
        cf.AdaptiveAvgPool2d(1, layout="NCDHW")
    pool = cf.AdaptiveAvgPool2d(1)
    with pytest.raises(ValueError, match=r"expects a 4-d input \(NCHW\), got shape \(2, 3\)"):
        pool(np.ones((2, 3)))
    with pytest.raises(TypeError,
                       match="AdaptiveAvgPool2d: input must be a NumPy or CuPy array, got list"):
        pool([1.0])
    with pytest.raises(ValueError, match="input dtype int64 is not supported"):
        pool(np.ones((1, 1, 2, 2), np.int64))
    with pytest.raises(ValueError, match="empty spatial dim"):
        pool(np.ones((1, 1, 0, 2)))
    pinned = cf.AdaptiveAvgPool2d(1).to("cpu")
    assert pinned.device == "cpu"
    assert pinned(np.ones((1, 1, 2, 2))).shape == (1, 1, 1, 1)


def test_repr_and_no_state():
    assert repr(cf.AdaptiveAvgPool2d(1)) == "AdaptiveAvgPool2d(output_size=1)"
    assert repr(cf.AdaptiveAvgPool2d((2, 3), layout="nhwc")) == \
        "AdaptiveAvgPool2d(output_size=(2, 3), layout='NHWC')"
    assert cf.AdaptiveAvgPool2d(1).state_dict() == {}
