"""Shared by the tests/gpu/test_binding_gpu_*.py files, which check every compute call of
convfuse._cudnn on a GPU against float64 NumPy oracles: precisions, convolution geometries,
the fixtures, the convolution oracle and the device helpers.

Each output is poisoned with NaN before the call and must come back fully written (beta = 0
tells cuDNN not to read it); each call also runs once with beta = 0.5 on a known output to
check the scaling factors (Note [scaling factor types] in csrc/common.h). Tolerances,
relative to the largest oracle magnitude: float64 1e-10, float32 1e-5 with FMA math (no
TF32). Transform-based algorithms a search may pick (FFT, Winograd) get 1e-4 in float32.
1-D convolutions use 4-d tensors with a unit H (Note [1-D convolutions in cuDNN]).

The test files register this module for pytest's assertion rewriting before importing it,
so its asserts report values as they did inside a test file.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import pytest

from convfuse._binding import cudnn

cp = pytest.importorskip("cupy")
lib = cudnn()


class Prec(NamedTuple):
    dtype: type
    code: int
    math: int
    rtol: float


PRECISIONS = {
    "float32": Prec(np.float32, lib.CUDNN_DATA_FLOAT, lib.CUDNN_FMA_MATH, 1e-5),
    "float64": Prec(np.float64, lib.CUDNN_DATA_DOUBLE, lib.CUDNN_DEFAULT_MATH, 1e-10),
}


class Geom(NamedTuple):
    x: tuple
    w: tuple
    pad: tuple
    stride: tuple
    dil: tuple
    groups: int


GEOMS = {
    "2d": Geom((2, 4, 7, 6), (6, 4, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    "2d-strided-dilated-grouped": Geom((1, 4, 9, 8), (4, 2, 3, 2), (1, 0), (2, 1), (1, 2), 2),
    "1d-as-2d": Geom((2, 3, 1, 11), (5, 3, 1, 3), (0, 2), (1, 2), (1, 1), 1),
    "3d": Geom((1, 2, 4, 5, 4), (3, 2, 2, 3, 2), (1, 1, 0), (1, 2, 1), (1, 1, 1), 1),
}
TRANSFORM_ALGOS = {
    "fwd": {lib.CUDNN_CONVOLUTION_FWD_ALGO_FFT, lib.CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
            lib.CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
            lib.CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED},
    "data": {lib.CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
             lib.CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
             lib.CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
             lib.CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED},
    "filter": {lib.CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
               lib.CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING,
               lib.CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED},
}


@pytest.fixture(scope="module")
def handle():
    return lib.Handle()


@pytest.fixture(params=list(PRECISIONS))
def prec(request) -> Prec:
    return PRECISIONS[request.param]


# --- float64 oracles --------------------------------------------------------------------


def out_size(n: int, k: int, p: int, s: int, d: int) -> int:
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def out_shape(g: Geom) -> tuple:
    spatial = zip(g.x[2:], g.w[2:], g.pad, g.stride, g.dil)
    return (g.x[0], g.w[0], *(out_size(*a) for a in spatial))


def taps(g: Geom):
    """Per group and kernel offset: channel slices and the strided input window it reads."""
    cg, kg = g.x[1] // g.groups, g.w[0] // g.groups
    out = out_shape(g)[2:]
    for grp in range(g.groups):
        for k in itertools.product(*map(range, g.w[2:])):
            window = tuple(slice(o * d, o * d + s * (m - 1) + 1, s)
                           for o, d, s, m in zip(k, g.dil, g.stride, out))
            yield slice(grp * cg, (grp + 1) * cg), slice(grp * kg, (grp + 1) * kg), k, window


def padded(x: np.ndarray, g: Geom) -> np.ndarray:
    return np.pad(x.astype(np.float64), [(0, 0), (0, 0), *((p, p) for p in g.pad)])


def conv_ref(x, w, g: Geom) -> np.ndarray:
    xp, w = padded(x, g), w.astype(np.float64)
    y = np.zeros(out_shape(g))
    for cs, ks, k, win in taps(g):
        tap = w[(ks, slice(None), *k)]
        y[:, ks] += np.einsum("nc...,kc->nk...", xp[(slice(None), cs, *win)], tap)
    return y


# --- device helpers ---------------------------------------------------------------------


def tdesc(a, prec: Prec):
    """TensorDescriptor for a CuPy array in logical (N, C, *spatial) order, any strides."""
    d = lib.TensorDescriptor()
    d.setNd(prec.code, list(a.shape), [s // a.itemsize for s in a.strides])
    return d


def fdesc(dims, prec: Prec, fmt=None):
    d = lib.FilterDescriptor()
    d.setNd(prec.code, lib.CUDNN_TENSOR_NCHW if fmt is None else fmt, list(dims))
    return d


def cdesc(g: Geom, prec: Prec):
    d = lib.ConvolutionDescriptor()
    d.setNd(list(g.pad), list(g.stride), list(g.dil), lib.CUDNN_CROSS_CORRELATION, prec.code)
    d.setGroupCount(g.groups)
    d.setMathType(prec.math)
    return d


def bias_shape(k: int, ndim: int) -> tuple:
    return (1, k) + (1,) * (ndim - 2)


def workspace(size: int):
    return cp.empty(max(int(size), 1), dtype=cp.uint8)


def rand(rng, shape, prec: Prec) -> np.ndarray:
    return rng.standard_normal(shape).astype(prec.dtype)


def poisoned(shape, prec: Prec):
    return cp.full(shape, np.nan, dtype=prec.dtype)


def assert_close(got, ref: np.ndarray, prec: Prec, loose: bool = False) -> None:
    got = cp.asnumpy(got).astype(np.float64)
    assert got.shape == ref.shape
    unwritten = int((~np.isfinite(got)).sum())
    assert unwritten == 0, f"{unwritten} of {got.size} output elements were not written"
    rtol = 1e-4 if loose and prec.dtype == np.float32 else prec.rtol
    err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-300)
    assert err <= rtol, f"relative error {err:.3g} > {rtol:g}"


def check_scaled(run, ref: np.ndarray, prec: Prec, rng, loose: bool = False) -> None:
    """run(alpha, beta, out) must give alpha * ref + beta * out, reading out only if beta != 0."""
    out = poisoned(ref.shape, prec)
    run(0.75, 0.0, out)
    assert_close(out, 0.75 * ref, prec, loose)
    prior = rand(rng, ref.shape, prec)
    out = cp.asarray(prior)
    run(0.75, 0.5, out)
    assert_close(out, 0.75 * ref + 0.5 * prior.astype(np.float64), prec, loose)


class ConvCase:
    """Device arrays and descriptors of one geometry and precision."""

    def __init__(self, g: Geom, prec: Prec, rng):
        self.g, self.prec = g, prec
        self.x, self.w = rand(rng, g.x, prec), rand(rng, g.w, prec)
        self.dy = rand(rng, out_shape(g), prec)
        self.x_d, self.w_d, self.dy_d = cp.asarray(self.x), cp.asarray(self.w), cp.asarray(self.dy)
        self.xDesc, self.wDesc = tdesc(self.x_d, prec), fdesc(g.w, prec)
        self.convDesc = cdesc(g, prec)
        self.yDesc = tdesc(self.dy_d, prec)  # y, z and dy share one shape
        got = lib.getConvolutionNdForwardOutputDim(self.convDesc, self.xDesc, self.wDesc)
        assert got == list(out_shape(g))
