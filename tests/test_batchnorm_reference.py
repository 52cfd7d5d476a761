"""The batch-normalization ops on the NumPy engine against independent oracles: naive
per-channel loops, PyTorch's CPU batch_norm in float64 (values, running statistics and
autograd gradients), and central finite differences."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import convfuse.ops as ops
from convfuse.dtypes import bfloat16
from tests.gradcheck import assert_grad_close

SHAPES = {  # channels-first shapes, rank 0 to 3 spatial
    "N,C": (5, 3),
    "N,C,L": (3, 4, 5),
    "N,C,H,W": (2, 3, 4, 5),
    "N,C,D,H,W": (2, 2, 3, 2, 3),
}
TORCH_ACT = {
    "identity": lambda t: t, "relu": torch.relu, "sigmoid": torch.sigmoid,
    "tanh": torch.tanh, "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu,
    "elu": torch.nn.functional.elu, "leaky_relu": torch.nn.functional.leaky_relu,
    "relu6": torch.nn.functional.relu6,
}


def to_layout(a: np.ndarray, layout: str) -> np.ndarray:
    return np.ascontiguousarray(np.moveaxis(a, 1, -1)) if layout == "NHWC" else a


def from_layout(a: np.ndarray, layout: str) -> np.ndarray:
    return np.moveaxis(a, -1, 1) if layout == "NHWC" else a


def make(rng, shape, affine=True, stats=True, dtype=np.float64):
    c = shape[1]
    x = rng.standard_normal(shape) * 2 + 0.5
    w = rng.standard_normal(c) if affine else None
    b = rng.standard_normal(c) if affine else None
    rm = rng.standard_normal(c) if stats else None
    rv = rng.random(c) + 0.5 if stats else None
    return x.astype(dtype), w, b, rm, rv


def naive_training(x, w, b, eps):
    """Per-channel loops over (N, C, ...) data, float64."""
    n_c = x.shape[1]
    y = np.empty_like(x)
    means, vars_ = np.empty(n_c), np.empty(n_c)
    for c in range(n_c):
        vals = x[:, c].reshape(-1)
        m = sum(vals) / len(vals)
        v = sum((v - m) ** 2 for v in vals) / len(vals)
        means[c], vars_[c] = m, v
        scale = (w[c] if w is not None else 1.0) / np.sqrt(v + eps)
        y[:, c] = (x[:, c] - m) * scale + (b[c] if b is not None else 0.0)
    return y, means, vars_


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_training_forward_against_naive_loops(rng, shape, layout):
    x, w, b, rm, rv = make(rng, SHAPES[shape])
    rm0, rv0 = rm.copy(), rv.copy()
    y, saved = ops.batchnorm_forward_training(to_layout(x, layout), w, b, rm, rv, layout, 1e-3,
                                              0.25)
    want, m, v = naive_training(x, w, b, 1e-3)
    np.testing.assert_allclose(from_layout(y, layout), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(saved.mean, m, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(saved.invstd, 1 / np.sqrt(v + 1e-3), rtol=1e-12)
    n = x.size // x.shape[1]
    np.testing.assert_allclose(rm, 0.75 * rm0 + 0.25 * m, rtol=1e-12)
    np.testing.assert_allclose(rv, 0.75 * rv0 + 0.25 * v * n / (n - 1), rtol=1e-12)
    assert saved.training and saved.saved is None and y.dtype == np.float64


def _torch_case(x, w, b, rm, rv, training, momentum, eps, act, res):
    t = {k: (torch.tensor(v, requires_grad=k in "xwbr") if v is not None else None)
         for k, v in dict(x=x, w=w, b=b, r=res).items()}
    rm_t = torch.tensor(rm) if rm is not None else None
    rv_t = torch.tensor(rv) if rv is not None else None
    z = torch.nn.functional.batch_norm(t["x"], rm_t, rv_t, t["w"], t["b"], training, momentum,
                                       eps)
    if res is not None:
        z = z + t["r"]
    return TORCH_ACT[act](z), t, rm_t, rv_t


CASES = [  # training, activation, residual, affine, running stats
    (True, "identity", False, True, True),
    (True, "relu", True, True, True),
    (True, "gelu", True, False, True),
    (True, "sigmoid", False, True, False),  # track_running_stats=False
    (False, "relu", True, True, True),
    (False, "silu", False, False, True),
    (False, "tanh", True, True, True),
]


@pytest.mark.parametrize(("training", "act", "has_res", "affine", "stats"), CASES)
@pytest.mark.parametrize("shape", ["N,C", "N,C,L", "N,C,H,W", "N,C,D,H,W"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_forward_and_backward_match_torch_float64(rng, training, act, has_res, affine, stats,
                                                  shape, layout):
    x, w, b, rm, rv = make(rng, SHAPES[shape], affine, stats)
    res = rng.standard_normal(x.shape) if has_res else None
    dy = rng.standard_normal(x.shape)
    yt, t, rm_t, rv_t = _torch_case(x, w, b, rm, rv, training, 0.1, 1e-5, act, res)
    yt.backward(torch.tensor(dy))
    L = lambda a: to_layout(a, layout) if a is not None else None  # noqa: E731
    inputs = [L(x), w, b, rm, rv, L(res), L(dy)]
    copies = [a.copy() if a is not None else None for a in inputs]
    if training:
        y, saved = ops.batchnorm_forward_training(L(x), w, b, rm, rv, layout, 1e-5, 0.1, act,
                                                  L(res))
    else:
        y, saved = ops.batchnorm_forward_inference(L(x), w, b, rm, rv, layout, 1e-5, act, L(res))
    np.testing.assert_allclose(from_layout(y, layout), yt.detach().numpy(), rtol=1e-10,
                               atol=1e-12)
    if stats:
        np.testing.assert_allclose(rm, rm_t.numpy(), rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(rv, rv_t.numpy(), rtol=1e-12, atol=1e-15)
    dx, dw, db, dres = ops.batchnorm_backward(L(dy), L(x), w, b, saved, layout, 1e-5, act,
                                              has_res)
    np.testing.assert_allclose(from_layout(dx, layout), t["x"].grad.numpy(), rtol=1e-9,
                               atol=1e-11)
    if affine:
        np.testing.assert_allclose(dw, t["w"].grad.numpy(), rtol=1e-9, atol=1e-11)
        np.testing.assert_allclose(db, t["b"].grad.numpy(), rtol=1e-9, atol=1e-11)
    else:
        assert dw is None and db is None
    if has_res:
        np.testing.assert_allclose(from_layout(dres, layout), t["r"].grad.numpy(), rtol=1e-9,
                                   atol=1e-11)
    else:
        assert dres is None
    # Inputs are never modified (the running statistics are outputs in training only).
    for i, (a, c) in enumerate(zip(inputs, copies, strict=True)):
        if a is not None and not (training and i in (3, 4)):
            np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize(("act", "has_res", "affine"), [
    ("identity", False, True), ("relu", True, True), ("silu", False, False),
    ("tanh", True, False)])
@pytest.mark.parametrize("shape", ["N,C", "N,C,H,W", "N,C,D,H,W"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_inference_without_statistics_matches_torch_float64(rng, act, has_res, affine, shape,
                                                             layout):
    """stats=False (Note [inference without statistics]): torch.nn.functional's
    evaluation-mode batch norm in float64, inputs untouched, no statistics kept."""
    x, w, b, rm, rv = make(rng, SHAPES[shape], affine, True)
    res = rng.standard_normal(x.shape) if has_res else None
    yt, *_ = _torch_case(x, w, b, rm, rv, False, 0.1, 1e-5, act, res)
    L = lambda a: to_layout(a, layout) if a is not None else None  # noqa: E731
    inputs = [L(x), w, b, rm, rv, L(res)]
    copies = [a.copy() if a is not None else None for a in inputs]
    y, saved = ops.batchnorm_forward_inference(L(x), w, b, rm, rv, layout, 1e-5, act, L(res),
                                               stats=False)
    np.testing.assert_allclose(from_layout(y, layout), yt.detach().numpy(), rtol=1e-10,
                               atol=1e-12)
    assert saved.mean is None and saved.invstd is None and not saved.training
    for a, c in zip(inputs, copies, strict=True):
        if a is not None:
            np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("momentum", [0.1, 0.5, None])
def test_running_statistics_follow_torch_over_steps(rng, momentum):
    bn = torch.nn.BatchNorm2d(3, momentum=momentum, dtype=torch.float64)
    rm, rv = np.zeros(3), np.ones(3)
    for step in range(1, 6):
        x = rng.standard_normal((4, 3, 2, 3)) * step + step
        bn.train()(torch.tensor(x))
        factor = ops.batchnorm.as_factor(momentum, step)
        ops.batchnorm_forward_training(x, None, None, rm, rv, "NCHW", bn.eps, factor)
        np.testing.assert_allclose(rm, bn.running_mean.numpy(), rtol=1e-13)
        np.testing.assert_allclose(rv, bn.running_var.numpy(), rtol=1e-13)
    assert int(bn.num_batches_tracked) == 5


@pytest.mark.parametrize("act", ["gelu", "elu", "identity"])
@pytest.mark.parametrize("training", [True, False])
def test_backward_against_finite_differences(rng, act, training):
    x, w, b, rm, rv = make(rng, (3, 2, 3, 2))
    res = rng.standard_normal(x.shape)
    proj = rng.standard_normal(x.shape)

    def loss():
        f = ops.batchnorm_forward_training if training else ops.batchnorm_forward_inference
        args = (x, w, b, rm.copy(), rv.copy(), "NCHW", 1e-5)
        y, _ = f(*args, 0.1, act, res) if training else f(*args, act, res)
        return float((y * proj).sum())

    f = ops.batchnorm_forward_training if training else ops.batchnorm_forward_inference
    args = (x, w, b, rm.copy(), rv.copy(), "NCHW", 1e-5)
    _, saved = f(*args, 0.1, act, res) if training else f(*args, act, res)
    dx, dw, db, dres = ops.batchnorm_backward(proj, x, w, b, saved, "NCHW", 1e-5, act, True)
    for grad, arr in ((dx, x), (dw, w), (db, b), (dres, res)):
        assert_grad_close(grad, loss, arr, rtol=1e-5, atol=1e-7, max_entries=12)


@pytest.mark.parametrize("dtype", [np.float16, bfloat16, np.float32])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_reduced_precision_against_float64(rng, dtype, layout):
    x, w, b, rm, rv = make(rng, (4, 4, 3, 3))
    xr = to_layout(x, layout).astype(dtype)
    res = to_layout(rng.standard_normal(x.shape), layout).astype(dtype)
    x64 = xr.astype(np.float64)
    f32 = [a.astype(np.float32) for a in (w, b, rm, rv)]
    y, saved = ops.batchnorm_forward_training(xr, *f32, layout, 1e-5, 0.1, "relu", res)
    want, _ = ops.batchnorm_forward_training(x64, w, b, rm.copy(), rv.copy(), layout, 1e-5, 0.1,
                                             "relu", res.astype(np.float64))
    assert y.dtype == dtype and saved.mean.dtype == np.float32 and f32[2].dtype == np.float32
    tol = {np.dtype(np.float16): 4e-3, bfloat16: 3e-2, np.dtype(np.float32): 1e-5}[np.dtype(dtype)]
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=tol, atol=tol)
    dy = rng.standard_normal(xr.shape).astype(dtype)
    dx, dw, db, _ = ops.batchnorm_backward(dy, xr, f32[0], f32[1], saved, layout, 1e-5, "relu",
                                           True)
    assert dx.dtype == dtype and dw.dtype == np.float32 and db.dtype == np.float32


def test_accumulates_into_gradient_outputs(rng):
    x, w, b, rm, rv = make(rng, (3, 2, 4))
    _, saved = ops.batchnorm_forward_training(x, w, b, rm, rv)
    dy = rng.standard_normal(x.shape)
    _, dw, db, _ = ops.batchnorm_backward(dy, x, w, b, saved)
    gw, gb = np.full(2, 0.5), np.full(2, -1.0)
    _, rw, rb, _ = ops.batchnorm_backward(dy, x, w, b, saved, weight_grad=gw, bias_grad=gb,
                                          param_beta=1.0)
    assert rw is gw and rb is gb
    np.testing.assert_allclose(gw, dw + 0.5, rtol=1e-14)
    np.testing.assert_allclose(gb, db - 1.0, rtol=1e-14)
    dx, _, _, _ = ops.batchnorm_backward(dy, x, w, b, saved, need_dx=False)
    assert dx is None
