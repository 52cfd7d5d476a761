"""The reference engine's tiny plans (reference/conv_tiny.py Note [tiny plans]): every op of
a tiny geometry through its TinyConv gives what the general columns path gives (forced with
GATHER_ELEMENTS = 0), out= and beta included; the runner the torch bridge takes equals
conv_bias_act; each thread's zero-extended buffer is its own."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from convfuse.geometry import ConvGeometry
from convfuse.ops.reference import conv as rc

# (x shape in its layout, weight shape in its layout, stride, padding, dilation, groups,
# layout): padding, strides, groups, dead taps, channels-last, 1-d and 3-d
CASES = [
    ((2, 3, 5, 5), (4, 3, 3, 3), 1, 1, 1, 1, "NCHW"),
    ((1, 4, 6, 5), (4, 2, 3, 3), 2, 1, 1, 2, "NCHW"),
    ((1, 2, 4, 4), (3, 2, 3, 3), 1, 4, 4, 1, "NCHW"),  # only the centre tap reads x
    ((2, 5, 5, 3), (4, 3, 3, 3), 1, 1, 1, 1, "NHWC"),
    ((2, 3, 7), (2, 3, 5), 1, 2, 1, 1, "NCW"),
    ((1, 2, 3, 4, 4), (2, 2, 3, 3, 3), 1, 1, 1, 1, "NCDHW"),
]


def _arrays(case, dtype, seed=0):
    xs, ws, stride, pad, dil, groups, layout = case
    g = ConvGeometry.create(xs, ws, stride, pad, dil, groups, layout)
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal(xs).astype(dtype), rng.standard_normal(ws).astype(dtype)
    b = rng.standard_normal(g.out_channels).astype(dtype)
    dy = rng.standard_normal(g.output_shape).astype(dtype)
    r = rng.standard_normal(g.output_shape).astype(dtype)
    return g, x, w, b, dy, r


def _ops(g, x, w, b, dy, r):
    """Every conv op of the engine on these arrays, out= and beta included."""
    dw0, dx0 = np.ones(w.shape, w.dtype), np.ones(x.shape, x.dtype)
    db0 = np.ones(g.out_channels, x.dtype)
    return [
        rc.conv_bias_act(x, w, b, g, "relu")[0],
        rc.conv_bias_act(x, w, None, g, "identity")[0],
        *rc.conv_bias_act(x, w, b, g, "silu", r, 0.5),
        rc.conv_backward_bias(dy, g),
        rc.conv_backward_bias(dy, g, db0.copy(), 1.0),
        rc.conv_backward_filter(x, dy, g),
        rc.conv_backward_filter(x, dy, g, dw0.copy(), 0.5),
        rc.conv_backward_data(dy, w, g),
        rc.conv_backward_data(dy, w, g, dx0.copy(), 2.0),
    ]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_tiny_plans_give_the_general_paths_results(monkeypatch, case, dtype):
    arrays = _arrays(case, dtype)
    assert rc._tiny(arrays[0], rc.compute_dtype(np.dtype(dtype))) is not None
    tiny = _ops(*arrays)
    monkeypatch.setattr(rc, "GATHER_ELEMENTS", 0)
    rc._tiny.cache_clear()
    try:
        general = _ops(*arrays)
    finally:
        rc._tiny.cache_clear()
    tol = {np.float16: 2e-3, np.float32: 2e-6, np.float64: 1e-13}[dtype]
    for got, want in zip(tiny, general, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.flags.c_contiguous
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   rtol=tol, atol=tol)


def test_dead_taps_keep_im2cols_non_finite_rule(monkeypatch):
    g, x, w, _, dy, _ = _arrays(CASES[2], np.float64)
    w[0, 0, 0, 0] = np.inf  # a dead tap: im2col multiplies it by padding zeros -> NaN
    dy[0, 0, 0, 0] = np.nan
    tiny = [rc.conv_forward(x, w, g), rc.conv_backward_filter(x, dy, g)]
    monkeypatch.setattr(rc, "GATHER_ELEMENTS", 0)
    rc._tiny.cache_clear()
    try:
        general = [rc.conv_forward(x, w, g), rc.conv_backward_filter(x, dy, g)]
    finally:
        rc._tiny.cache_clear()
    for got, want in zip(tiny, general, strict=True):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
    assert np.isnan(tiny[0][0, 0]).all()  # the channel with the non-finite dead tap


@pytest.mark.parametrize("act", ["identity", "relu"])
def test_the_runner_is_conv_bias_act(act):
    g, x, w, b, _, _ = _arrays(CASES[0], np.float32)
    run = rc.bias_act_runner(g, np.dtype(np.float32), act, False)
    assert run is not None
    for bias in (b, None):
        np.testing.assert_array_equal(run(x, w, bias), rc.conv_bias_act(x, w, bias, g, act)[0])
    assert rc.bias_act_runner(g, np.dtype(np.float32), act, True) is None  # a residual
    assert rc.bias_act_runner(g, np.dtype(np.float32), "silu", False) is None
    assert rc.bias_act_runner(g, np.dtype(np.float16), act, False) is None
    big = ConvGeometry.create((8, 64, 32, 32), (64, 64, 3, 3), 1, 1, 1, 1, "NCHW")
    assert rc.bias_act_runner(big, np.dtype(np.float32), act, False) is None  # not tiny


def test_each_thread_gathers_from_its_own_buffer():
    g, x, w, _, _, _ = _arrays(CASES[0], np.float64)
    inputs = [x * (i + 1) for i in range(8)]
    want = [rc.conv_forward(xi, w, g) for xi in inputs]
    got: dict[int, list[np.ndarray]] = {}
    start = threading.Barrier(2)

    def work(k: int) -> None:
        start.wait()
        got[k] = [rc.conv_forward(xi, w, g) for _ in range(50) for xi in inputs][-8:]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(2):
        for a, b in zip(got[k], want, strict=True):
            np.testing.assert_array_equal(a, b)
