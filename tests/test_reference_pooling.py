"""PoolGeometry's rules and the NumPy engine's pooling against naive loops."""

from __future__ import annotations

import numpy as np
import pytest

from convfuse.dtypes import bfloat16
from convfuse.ops import reference as ref
from convfuse.pool_geometry import PoolGeometry
from tests import naive

SPATIAL = {1: (9,), 2: (6, 7), 3: (4, 5, 4)}
# name: (kernel, stride (None = kernel), padding)
CASES = {
    "k2": (2, None, 0),
    "k3_s2_p1": (3, 2, 1),
    "k3_s1_p1_overlap": (3, 1, 1),
    "k2_s3_p1": (2, 3, 1),
    "per_dim": ((3, 2, 2), (1, 2, 3), (1, 1, 0)),
}


def per_dim(v, rank):
    return v[:rank] if isinstance(v, tuple) else v


def make(rank, case, mode, channels_last, rng, dtype=np.float64, batch=2, channels=3):
    kernel, stride, padding = (per_dim(v, rank) for v in CASES[case])
    sp = SPATIAL[rank]
    shape = (batch, *sp, channels) if channels_last else (batch, channels, *sp)
    pg = PoolGeometry.create(shape, kernel, stride, padding, mode,
                             "NHWC" if channels_last else "NCHW")
    kw = dict(kernel=kernel, stride=stride, padding=padding, mode=mode,
              channels_last=channels_last)
    x = rng.standard_normal(shape).astype(dtype)
    dy = rng.standard_normal(pg.output_shape).astype(dtype)
    return pg, kw, x, dy


# --- geometry -------------------------------------------------------------------------------

@pytest.mark.parametrize(("shape", "kernel", "stride", "padding", "layout", "out"), [
    ((8, 1, 28, 28), 2, None, 0, "NCHW", (8, 1, 14, 14)),
    ((2, 3, 5, 5), 3, 2, 1, "NCHW", (2, 3, 3, 3)),
    ((2, 3, 7), 3, 2, 0, "NCW", (2, 3, 3)),
    ((2, 7, 3), 3, 2, 0, "NWC", (2, 3, 3)),
    ((1, 6, 5, 4, 2), (2, 3, 2), (2, 1, 1), (1, 1, 0), "NHWC", (1, 4, 5, 3, 2)),
    ((1, 2, 1, 1), 2, 1, 1, "NCHW", (1, 2, 2, 2)),
])
def test_output_shape_floor_rule(shape, kernel, stride, padding, layout, out):
    pg = PoolGeometry.create(shape, kernel, stride, padding, "avg", layout)
    assert pg.output_shape == out
    assert pg.output_shape == naive.pool_output_shape(shape, kernel, stride, padding,
                                                      pg.channels_last)


def test_geometry_properties():
    pg = PoolGeometry.create((2, 5, 6, 3), (3, 2), layout="NHWC")
    assert pg.stride == (3, 2) and pg.padding == (0, 0) and pg.mode == "max"
    assert pg.rank == 2 and pg.layout == "NHWC" and pg.channels == 3 and pg.batch == 2
    assert pg.input_shape_cf == (2, 3, 5, 6) and pg.output_shape_cf == (2, 3, 1, 3)
    assert pg.channel_axis == 3 and pg.window_size == 6
    assert "kernel=[3, 2]" in pg.describe()
    assert PoolGeometry.create((2, 5, 6, 3), (3, 2), layout="NHWC") == pg  # hashable value
    assert hash(pg) == hash(PoolGeometry.create((2, 5, 6, 3), (3, 2), layout="NHWC"))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(input_shape=(1, 1, 4, 4), kernel_size=3, padding=2), ValueError,
     "at most half the kernel.*padding 2 vs. kernel 3"),
    (dict(input_shape=(1, 1, 4, 4), kernel_size=2, padding=(0, 2)), ValueError,
     "spatial dim 1.*padding 2 vs. kernel 2"),
    (dict(input_shape=(1, 1, 2, 4), kernel_size=3), ValueError,
     "kernel larger than the padded input along spatial dim 0: kernel 3 vs. padded size 2"),
    (dict(input_shape=(1, 1, 4, 4), kernel_size=2, mode="mean"), ValueError,
     "mode must be one of max, avg"),
    (dict(input_shape=(1, 1, 4, 4), kernel_size=0), ValueError, "kernel_size must be >= 1"),
    (dict(input_shape=(1, 1, 4, 4), kernel_size=2, stride=0), ValueError, "stride must be >= 1"),
    (dict(input_shape=(1, 1, 4, 4), kernel_size=2, padding=-1), ValueError,
     "padding must be >= 0"),
    (dict(input_shape=(1, 4, 4), kernel_size=(2, 2)), ValueError,
     "kernel_size must be an int or 1 ints for a 1-d pooling"),
    (dict(input_shape=(4, 4), kernel_size=2), ValueError, "3, 4 or 5 dims"),
    (dict(input_shape=(1, 1, 1, 1, 1, 4), kernel_size=2), ValueError, "3, 4 or 5 dims"),
    (dict(input_shape=(1, 1, 4, 4), kernel_size=2, layout="NCW"), ValueError,
     "is for 1-d convolutions"),
    (dict(input_shape=(1, 1, 4, 4), kernel_size=2, layout="CHWN"), ValueError,
     "unknown layout"),
    (dict(input_shape=(1, 0, 4, 4), kernel_size=2), ValueError, "non-positive dimension"),
    (dict(input_shape=(1, 1, 4.0, 4), kernel_size=2), TypeError, "must hold ints"),
    (dict(input_shape=4, kernel_size=2), TypeError, "sequence of ints"),
    (dict(input_shape=(1, 1, 4, 4), kernel_size=2.5), ValueError, "kernel_size must be"),
])
def test_geometry_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        PoolGeometry.create(**kwargs)


# --- engine against naive loops ----------------------------------------------------------------

GRID = [(r, c, m, cl) for r in (1, 2, 3) for c in CASES for m in ("max", "avg")
        for cl in (False, True)]


@pytest.mark.parametrize(("rank", "case", "mode", "channels_last"), GRID)
def test_forward_and_backward_match_naive_loops(rank, case, mode, channels_last):
    rng = np.random.default_rng(GRID.index((rank, case, mode, channels_last)))
    pg, kw, x, dy = make(rank, case, mode, channels_last, rng)
    y = ref.pool_forward(x, pg)
    assert y.shape == pg.output_shape and y.dtype == np.float64 and y.flags.c_contiguous
    np.testing.assert_allclose(y, naive.pool_forward(x, **kw), rtol=1e-14, atol=1e-15)
    dx = ref.pool_backward(dy, x, y, pg)
    assert dx.shape == x.shape and dx.flags.c_contiguous
    np.testing.assert_allclose(dx, naive.pool_backward(dy, x, **kw), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_reduced_precision(mode, channels_last, dtype):
    dtype = np.dtype(dtype)
    pg, kw, x, dy = make(2, "k3_s1_p1_overlap", mode, channels_last, np.random.default_rng(1),
                         dtype=dtype)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    y = ref.pool_forward(x, pg)
    dx = ref.pool_backward(dy, x, y, pg)
    assert y.dtype == dx.dtype == dtype
    eps = {np.dtype(np.float32): 2.0**-23, np.dtype(np.float16): 2.0**-10, bfloat16: 2.0**-7}[dtype]
    # max picks an element exactly; avg and the gradient sums round once at the end, after
    # float32 sums whose terms (|x| < ~4) may cancel
    np.testing.assert_allclose(y.astype(np.float64), naive.pool_forward(x64, **kw),
                               rtol=eps if mode == "avg" else 0,
                               atol=1e-6 if mode == "avg" else 0)
    np.testing.assert_allclose(dx.astype(np.float64), naive.pool_backward(dy64, x64, **kw),
                               rtol=eps, atol=1e-6)


@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_gradient_matches_finite_differences(mode, channels_last):
    rng = np.random.default_rng(2)
    pg, _, x, c = make(2, "k3_s1_p1_overlap", mode, channels_last, rng)
    dx = ref.pool_backward(c, x, ref.pool_forward(x, pg), pg)
    h = 1e-6
    numeric = np.zeros_like(x)
    for idx in np.ndindex(x.shape):  # random data: no ties, so max is smooth here
        xp, xm = x.copy(), x.copy()
        xp[idx] += h
        xm[idx] -= h
        numeric[idx] = np.sum(c * (ref.pool_forward(xp, pg) - ref.pool_forward(xm, pg))) / (2 * h)
    np.testing.assert_allclose(dx, numeric, rtol=1e-7, atol=1e-8)


def test_max_tie_goes_to_first_element_in_row_major_order():
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 1, 1] = x[0, 0, 1, 2] = x[0, 0, 2, 1] = 5.0  # three tied maxima
    pg = PoolGeometry.create(x.shape, 3, 1, 0, "max")
    dy = np.array([[[[1.0, 10.0], [100.0, 1000.0]]]])
    dx = ref.pool_backward(dy, x, ref.pool_forward(x, pg), pg)
    # every 3x3 window holds all three 5s; (1, 1) comes first in each
    expected = np.zeros_like(x)
    expected[0, 0, 1, 1] = 1111.0
    np.testing.assert_array_equal(dx, expected)
    np.testing.assert_array_equal(dx, naive.pool_backward(dy, x, 3, 1, 0, "max"))
    # all-equal windows, stride 2: the top-left of each window
    x = np.ones((1, 1, 4, 4))
    pg = PoolGeometry.create(x.shape, 2, layout="NCHW")
    dx = ref.pool_backward(np.ones((1, 1, 2, 2)), x, ref.pool_forward(x, pg), pg)
    np.testing.assert_array_equal(dx[0, 0], [[1, 0, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0],
                                             [0, 0, 0, 0]])


def test_max_never_picks_padding_and_avg_counts_it():
    x = -np.arange(1.0, 10.0).reshape(1, 1, 3, 3)  # all negative: a 0 pad would win
    pg_max = PoolGeometry.create(x.shape, 2, 2, 1, "max")
    np.testing.assert_array_equal(ref.pool_forward(x, pg_max)[0, 0], [[-1, -2], [-4, -5]])
    pg_avg = PoolGeometry.create(x.shape, 2, 2, 1, "avg")
    # the top-left window holds one real element (-1) and three zeros of padding
    np.testing.assert_array_equal(ref.pool_forward(x, pg_avg)[0, 0],
                                  [[-1 / 4, -5 / 4], [-11 / 4, -28 / 4]])


def test_nan_wins_max_windows():
    x = np.array([[[1.0, np.nan, 3.0, 2.0]]])
    pg = PoolGeometry.create(x.shape, 2, layout="NCW")
    y = ref.pool_forward(x, pg)
    assert np.isnan(y[0, 0, 0]) and y[0, 0, 1] == 3.0
    dx = ref.pool_backward(np.ones_like(y), x, y, pg)
    np.testing.assert_array_equal(dx, [[[0.0, 1.0, 1.0, 0.0]]])


@pytest.mark.parametrize("mode", ["max", "avg"])
def test_inputs_untouched_and_not_aliased(mode):
    pg, _, x, dy = make(2, "k2", mode, True, np.random.default_rng(3), dtype=np.float32)
    x0, dy0 = x.copy(), dy.copy()
    y = ref.pool_forward(x, pg)
    y0 = y.copy()
    dx = ref.pool_backward(dy, x, y, pg)
    for a, b in ((x, x0), (dy, dy0), (y, y0)):
        np.testing.assert_array_equal(a, b)
    assert not np.shares_memory(y, x) and not np.shares_memory(dx, dy)


@pytest.fixture
def walks(monkeypatch):
    """Counts the per-offset winner walks (Note [first maximal element]: the tiled path
    skips them unless a window holds NaN)."""
    from convfuse.ops.reference import pooling

    calls = []
    real = pooling._max_winners

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(pooling, "_max_winners", spy)
    return calls


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize(("spatial", "kernel"), [((6, 7), 2), ((9, 6), (3, 2)), ((8,), 4)])
@pytest.mark.parametrize("trouble", [None, "tie", "nan", "-inf", "inf tie", "nan and tie",
                                     "relu zeros"])
def test_tiled_max_backward_walks_only_for_nan_and_keeps_the_tie_rule(
        walks, spatial, kernel, trouble, channels_last):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, *spatial))
    kernel_t = (kernel,) * len(spatial) if isinstance(kernel, int) else kernel
    first_window = tuple(slice(0, k) for k in kernel_t)
    pair = ((0,) * (len(spatial) - 1) + (0,), (0,) * (len(spatial) - 1) + (1,))  # one window
    if trouble == "tie":
        x[(1, 2, *pair[0])] = x[(1, 2, *pair[1])] = 9.0
    elif trouble == "nan":
        x[(0, 1, *pair[0])] = np.nan
    elif trouble == "nan and tie":
        x[(0, 1, *pair[0])] = np.nan
        x[(0, 2, *pair[0])] = x[(0, 2, *pair[1])] = 9.0
    elif trouble == "-inf":
        x[(0, 0, *first_window)] = -np.inf
    elif trouble == "relu zeros":  # a ReLU before the pool: windows of tied zeros
        x = np.maximum(x, 0)
    elif trouble == "inf tie":
        x[(1, 0, *pair[0])] = x[(1, 0, *pair[1])] = np.inf
    if channels_last:
        x = np.ascontiguousarray(np.moveaxis(x, 1, -1))
    layout = ("NWC" if x.ndim == 3 else "NHWC") if channels_last else (
        "NCW" if x.ndim == 3 else "NCHW")
    pg = PoolGeometry.create(x.shape, kernel, None, 0, "max", layout)
    dy = rng.standard_normal(pg.output_shape)
    y = ref.pool_forward(x, pg)
    got = ref.pool_backward(dy, x, y, pg)
    want = naive.pool_backward(dy, x, kernel, mode="max", channels_last=channels_last)
    np.testing.assert_array_equal(got, want)  # ties: the first maximal element, as torch
    assert bool(walks) == (trouble is not None and "nan" in trouble)
