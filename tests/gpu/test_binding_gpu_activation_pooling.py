"""Activation, tensor add and pooling through convfuse._cudnn on a GPU, forward and
backward, against float64 NumPy oracles written here.

Conventions (NaN-poisoned outputs, the beta = 0.5 check, tolerances):
tests/gpu/_binding_gpu_helpers.py.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.register_assert_rewrite("tests.gpu._binding_gpu_helpers")

from tests.gpu import _binding_gpu_helpers  # noqa: E402
from tests.gpu._binding_gpu_helpers import check_scaled, cp, lib, rand, tdesc  # noqa: E402

pytestmark = pytest.mark.gpu
handle = _binding_gpu_helpers.handle  # module-scoped fixture
prec = _binding_gpu_helpers.prec  # fixture: one Prec per precision


# --- float64 oracles --------------------------------------------------------------------


def activation_ref(mode: int, coef: float, x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    if mode == lib.CUDNN_ACTIVATION_SIGMOID:
        return 1.0 / (1.0 + np.exp(-x))
    if mode == lib.CUDNN_ACTIVATION_RELU:
        return np.maximum(x, 0.0)
    if mode == lib.CUDNN_ACTIVATION_TANH:
        return np.tanh(x)
    if mode == lib.CUDNN_ACTIVATION_CLIPPED_RELU:
        return np.clip(x, 0.0, coef)
    if mode == lib.CUDNN_ACTIVATION_ELU:
        return np.where(x > 0, x, coef * np.expm1(x))
    raise AssertionError(mode)


def activation_grad_ref(mode: int, coef: float, x, y, dy) -> np.ndarray:
    x, y, dy = (a.astype(np.float64) for a in (x, y, dy))
    if mode == lib.CUDNN_ACTIVATION_SIGMOID:
        return dy * y * (1.0 - y)
    if mode == lib.CUDNN_ACTIVATION_RELU:
        return dy * (x > 0)
    if mode == lib.CUDNN_ACTIVATION_TANH:
        return dy * (1.0 - y * y)
    if mode == lib.CUDNN_ACTIVATION_CLIPPED_RELU:
        return dy * ((x > 0) & (x < coef))
    if mode == lib.CUDNN_ACTIVATION_ELU:
        return np.where(x > 0, dy, dy * (y + coef))
    raise AssertionError(mode)


def pool_windows(x_shape, window, pad, stride):
    """Per output position: its index and the clipped input window (padding excluded)."""
    outs = [(n + 2 * p - k) // s + 1 for n, k, p, s in zip(x_shape[2:], window, pad, stride)]
    for o in itertools.product(*map(range, outs)):
        lo = [i * s - p for i, s, p in zip(o, stride, pad)]
        yield o, tuple(slice(max(a, 0), min(a + k, n)) for a, k, n in zip(lo, window, x_shape[2:]))


def pool_ref(mode: int, x, window, pad, stride):
    x = x.astype(np.float64)
    pos = list(pool_windows(x.shape, window, pad, stride))
    y = np.zeros(x.shape[:2] + tuple(np.max([o for o, _ in pos], axis=0) + 1))
    for o, win in pos:
        part = x[(slice(None), slice(None), *win)].reshape(*x.shape[:2], -1)
        if mode in (lib.CUDNN_POOLING_MAX, lib.CUDNN_POOLING_MAX_DETERMINISTIC):
            y[(slice(None), slice(None), *o)] = part.max(axis=-1)
        elif mode == lib.CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING:
            y[(slice(None), slice(None), *o)] = part.sum(axis=-1) / np.prod(window)
        else:
            y[(slice(None), slice(None), *o)] = part.mean(axis=-1)
    return y


def pool_grad_ref(mode: int, x, dy, window, pad, stride):
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    dx = np.zeros(x.shape)
    for o, win in pool_windows(x.shape, window, pad, stride):
        g = dy[(slice(None), slice(None), *o)]
        if mode in (lib.CUDNN_POOLING_MAX, lib.CUDNN_POOLING_MAX_DETERMINISTIC):
            for n, c in itertools.product(*map(range, x.shape[:2])):
                part = x[(n, c, *win)]
                at = np.unravel_index(np.argmax(part), part.shape)
                dx[(n, c, *(s.start + i for s, i in zip(win, at)))] += g[n, c]
        else:
            count = np.prod(window) if mode == lib.CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING \
                else np.prod([s.stop - s.start for s in win])
            dx[(slice(None), slice(None), *win)] += (g / count)[(..., *([None] * len(win)))]
    return dx


# --- activation, tensor add, pooling ------------------------------------------------------

ACTIVATIONS = [("CUDNN_ACTIVATION_SIGMOID", 0.0), ("CUDNN_ACTIVATION_RELU", 0.0),
               ("CUDNN_ACTIVATION_TANH", 0.0), ("CUDNN_ACTIVATION_CLIPPED_RELU", 1.5),
               ("CUDNN_ACTIVATION_ELU", 0.7)]


@pytest.mark.parametrize("mode,coef", ACTIVATIONS)
def test_activation_forward_and_backward(handle, prec, mode, coef, rng):
    mode = getattr(lib, mode)
    actDesc = lib.ActivationDescriptor()
    actDesc.set(mode, lib.CUDNN_NOT_PROPAGATE_NAN, coef)
    x, dy = rand(rng, (2, 3, 4, 5), prec), rand(rng, (2, 3, 4, 5), prec)
    x_d, dy_d = cp.asarray(x), cp.asarray(dy)
    d = tdesc(x_d, prec)  # every operand has this shape

    def forward(alpha, beta, y):
        lib.activationForward(handle, actDesc, alpha, d, x_d.data.ptr, beta, d, y.data.ptr)

    check_scaled(forward, activation_ref(mode, coef, x), prec, rng)
    y = activation_ref(mode, coef, x).astype(prec.dtype)  # the y backward is given
    y_d = cp.asarray(y)

    def backward(alpha, beta, dx):
        lib.activationBackward(handle, actDesc, alpha, d, y_d.data.ptr, d, dy_d.data.ptr, d,
                               x_d.data.ptr, beta, d, dx.data.ptr)

    check_scaled(backward, activation_grad_ref(mode, coef, x, y, dy), prec, rng)


@pytest.mark.parametrize("a_shape", [(1, 3, 1, 1), (2, 3, 4, 5)], ids=["bias", "same"])
def test_add_tensor(handle, prec, a_shape, rng):
    a = rand(rng, a_shape, prec)
    a_d = cp.asarray(a)
    cDesc = tdesc(cp.empty((2, 3, 4, 5), dtype=prec.dtype), prec)
    ref = np.broadcast_to(a.astype(np.float64), (2, 3, 4, 5))

    def run(alpha, beta, c):
        lib.addTensor(handle, alpha, tdesc(a_d, prec), a_d.data.ptr, beta, cDesc, c.data.ptr)

    check_scaled(run, np.ascontiguousarray(ref), prec, rng)


POOL_MODES = ["CUDNN_POOLING_MAX", "CUDNN_POOLING_MAX_DETERMINISTIC",
              "CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING",
              "CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING"]


@pytest.mark.parametrize("mode", POOL_MODES)
@pytest.mark.parametrize("window,pad,stride", [((3, 3), (1, 1), (2, 2)), ((3, 2), (1, 0), (2, 1))])
def test_pooling_forward_and_backward(handle, prec, mode, window, pad, stride, rng):
    mode = getattr(lib, mode)
    poolDesc = lib.PoolingDescriptor()
    poolDesc.setNd(mode, lib.CUDNN_NOT_PROPAGATE_NAN, list(window), list(pad), list(stride))
    x = rand(rng, (2, 3, 7, 8), prec)
    x_d = cp.asarray(x)
    y_ref = pool_ref(mode, x, window, pad, stride)
    xDesc = tdesc(x_d, prec)
    assert lib.getPoolingNdForwardOutputDim(poolDesc, xDesc) == list(y_ref.shape)
    yDesc = tdesc(cp.empty(y_ref.shape, dtype=prec.dtype), prec)

    def forward(alpha, beta, y):
        lib.poolingForward(handle, poolDesc, alpha, xDesc, x_d.data.ptr, beta, yDesc, y.data.ptr)

    check_scaled(forward, y_ref, prec, rng)
    y_d = cp.asarray(y_ref.astype(prec.dtype))  # exact for max, the forward's own result
    dy = rand(rng, y_ref.shape, prec)
    dy_d = cp.asarray(dy)

    def backward(alpha, beta, dx):
        lib.poolingBackward(handle, poolDesc, alpha, yDesc, y_d.data.ptr, yDesc, dy_d.data.ptr,
                            xDesc, x_d.data.ptr, beta, xDesc, dx.data.ptr)

    check_scaled(backward, pool_grad_ref(mode, x, dy, window, pad, stride), prec, rng)
