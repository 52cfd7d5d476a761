"""AdaptiveAvgPool2d against torch.nn.functional.adaptive_avg_pool2d and finite differences."""

from __future__ import annotations

import warnings

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
def test_window_path_equals_matmul_path(rng, adjoint):
    """The CuPy route (window sums: Note [adaptive pooling without cuBLAS]) is plain array
    code: run it on NumPy against the matrix product."""
    for length, out in [(7, 3), (5, 2), (4, 6), (1, 3), (9, 9)]:
        m = np.zeros((out, length))
        for i, (start, end) in enumerate(adaptive_pool.windows(length, out)):
            m[i, start:end] = 1.0 / (end - start)
        np.testing.assert_array_equal(m, adaptive_pool.pooling_matrix(length, out))
    shape = (2, 3, 2, 3) if adjoint else (2, 7, 5, 3)  # NHWC
    x = rng.standard_normal(shape)
    args = ((7, 3), (5, 2), 1, 2, np.dtype(np.float64), adjoint)
    ref = adaptive_pool._separable(x, *args)
    got = adaptive_pool._separable_windows(np, x, *args)
    np.testing.assert_allclose(got, ref, rtol=1e-13)


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_a_non_finite_value_stays_in_its_windows(value, layout):
    """torch keeps an inf or NaN to the windows holding it, in the forward and in the input
    gradient; a matrix product spread 0 * inf = NaN to every cell (Note [non-finite values
    in adaptive pooling]). Sizes that do not divide, so the general path runs."""
    x = np.zeros((1, 2, 5, 7))
    x[0, 1, 0, 0] = value
    x[0, 0, 4, 5:] = [np.inf, -np.inf]  # one window holding both: NaN, as in torch
    dy = np.zeros((1, 2, 3, 4))
    dy[0, 0, 2, 3] = value
    pool = cf.AdaptiveAvgPool2d((3, 4), layout=layout)
    nhwc = layout == "NHWC"
    to = (lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1))) if nhwc else (lambda a: a)
    back = (lambda a: a.transpose(0, 3, 1, 2)) if nhwc else (lambda a: a)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no NumPy warning on the way
        y = back(pool(to(x)))
        dx = back(pool.backward(to(dy)))
    xt = torch.tensor(x, requires_grad=True)
    yt = F.adaptive_avg_pool2d(xt, (3, 4))
    yt.backward(torch.tensor(dy))
    np.testing.assert_array_equal(y, yt.detach().numpy())
    np.testing.assert_array_equal(dx, xt.grad.numpy())


def test_hyperparameters_assigned_after_construction_are_validated():
    pool = cf.AdaptiveAvgPool2d(2)
    x = np.arange(2 * 3 * 4 * 6, dtype=np.float64).reshape(2, 3, 4, 6)
    pool.layout = "nhwc"  # either case, as the constructor takes it
    assert pool.layout == "NHWC"
    pool.layout = "NCHW"
    pool.output_size = 3  # torch.nn's int form
    np.testing.assert_allclose(pool(x), F.adaptive_avg_pool2d(torch.tensor(x), 3).numpy())
    for attr, value, error in [("layout", "bogus", ValueError), ("layout", 1, ValueError),
                               ("output_size", 0, ValueError),
                               ("output_size", 2.0, TypeError)]:
        with pytest.raises(error, match=f"^AdaptiveAvgPool2d: {attr} "):
            setattr(pool, attr, value)
    assert (pool.layout, pool.output_size) == ("NCHW", (3, 3))  # refused: nothing changed


def test_a_global_pool_on_a_map_of_its_size_returns_a_writable_gradient():
    pool = cf.AdaptiveAvgPool2d(1)
    pool(np.ones((2, 3, 1, 1)))
    dx = pool.backward(np.ones((2, 3, 1, 1)))
    dx *= 2  # the caller's array, as every other size gives
    np.testing.assert_array_equal(dx, 2.0)


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
