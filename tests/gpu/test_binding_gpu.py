"""Every compute call of convfuse._cudnn on a GPU, against float64 NumPy oracles written here.

Each output is poisoned with NaN before the call and must come back fully written (beta = 0
tells cuDNN not to read it); each call also runs once with beta = 0.5 on a known output to
check the scaling factors (Note [scaling factor types] in csrc/common.h). Tolerances,
relative to the largest oracle magnitude: float64 1e-10, float32 1e-5 with FMA math (no
TF32). Transform-based algorithms a search may pick (FFT, Winograd) get 1e-4 in float32.
1-D convolutions use 4-d tensors with a unit H (Note [1-D convolutions in cuDNN]).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import pytest

from convfuse._binding import cudnn
from convfuse.errors import CudnnError

pytestmark = pytest.mark.gpu
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


def conv_data_ref(dy, w, g: Geom) -> np.ndarray:
    dy, w = dy.astype(np.float64), w.astype(np.float64)
    dxp = np.zeros(padded(np.zeros(g.x), g).shape)
    for cs, ks, k, win in taps(g):
        tap = w[(ks, slice(None), *k)]
        dxp[(slice(None), cs, *win)] += np.einsum("nk...,kc->nc...", dy[:, ks], tap)
    return dxp[(slice(None), slice(None), *(slice(p, p + n) for p, n in zip(g.pad, g.x[2:])))]


def conv_filter_ref(x, dy, g: Geom) -> np.ndarray:
    xp, dy = padded(x, g), dy.astype(np.float64)
    dw = np.zeros(g.w)
    for cs, ks, k, win in taps(g):
        a, b = xp[(slice(None), cs, *win)], dy[:, ks]
        dw[(ks, slice(None), *k)] = np.einsum("ncs,nks->kc", a.reshape(*a.shape[:2], -1),
                                              b.reshape(*b.shape[:2], -1))
    return dw


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


# --- handle -----------------------------------------------------------------------------


def test_handle_stream_round_trip():
    h = lib.Handle()
    assert h.ptr != 0 and h.getStream() == 0
    stream = cp.cuda.Stream(non_blocking=True)
    h.setStream(stream.ptr)
    assert h.getStream() == stream.ptr
    h.setStream(0)
    assert h.getStream() == 0


# --- convolution ------------------------------------------------------------------------

PREFERRED = {  # universally supported GEMM algorithms, used when the heuristics offer them
    "fwd": lib.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
    "data": lib.CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
    "filter": lib.CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
}


def heuristics(handle, c: ConvCase, direction: str) -> list:
    if direction == "fwd":
        n = lib.getConvolutionForwardAlgorithmMaxCount(handle)
        return lib.getConvolutionForwardAlgorithm_v7(handle, c.xDesc, c.wDesc, c.convDesc,
                                                     c.yDesc, n)
    if direction == "data":
        n = lib.getConvolutionBackwardDataAlgorithmMaxCount(handle)
        return lib.getConvolutionBackwardDataAlgorithm_v7(handle, c.wDesc, c.yDesc, c.convDesc,
                                                          c.xDesc, n)
    n = lib.getConvolutionBackwardFilterAlgorithmMaxCount(handle)
    return lib.getConvolutionBackwardFilterAlgorithm_v7(handle, c.xDesc, c.yDesc, c.convDesc,
                                                        c.wDesc, n)


def find_ex(handle, c: ConvCase, direction: str, buf) -> list:
    """Find*Ex with its own poisoned scratch output and the workspace buffer `buf`."""
    ws, size = buf.data.ptr, buf.size
    if direction == "fwd":
        n, y = lib.getConvolutionForwardAlgorithmMaxCount(handle), poisoned(c.dy.shape, c.prec)
        return lib.findConvolutionForwardAlgorithmEx(handle, c.xDesc, c.x_d.data.ptr, c.wDesc,
                                                     c.w_d.data.ptr, c.convDesc, c.yDesc,
                                                     y.data.ptr, n, ws, size)
    if direction == "data":
        n, dx = lib.getConvolutionBackwardDataAlgorithmMaxCount(handle), poisoned(c.g.x, c.prec)
        return lib.findConvolutionBackwardDataAlgorithmEx(handle, c.wDesc, c.w_d.data.ptr,
                                                          c.yDesc, c.dy_d.data.ptr, c.convDesc,
                                                          c.xDesc, dx.data.ptr, n, ws, size)
    n, dw = lib.getConvolutionBackwardFilterAlgorithmMaxCount(handle), poisoned(c.g.w, c.prec)
    return lib.findConvolutionBackwardFilterAlgorithmEx(handle, c.xDesc, c.x_d.data.ptr, c.yDesc,
                                                        c.dy_d.data.ptr, c.convDesc, c.wDesc,
                                                        dw.data.ptr, n, ws, size)


def choose(handle, c: ConvCase, direction: str) -> int:
    ok = [p.algo for p in heuristics(handle, c, direction) if p.status == lib.CUDNN_STATUS_SUCCESS]
    assert ok, f"no {direction} algorithm for {c.g} in {c.prec.dtype.__name__}"
    return PREFERRED[direction] if PREFERRED[direction] in ok else ok[0]


def run_direction(handle, c: ConvCase, direction: str, algo: int, alpha, beta, out) -> None:
    """One convolutionForward / BackwardData / BackwardFilter call with its own workspace."""
    if direction == "fwd":
        size = lib.getConvolutionForwardWorkspaceSize(handle, c.xDesc, c.wDesc, c.convDesc,
                                                      c.yDesc, algo)
        ws = workspace(size)
        lib.convolutionForward(handle, alpha, c.xDesc, c.x_d.data.ptr, c.wDesc, c.w_d.data.ptr,
                               c.convDesc, algo, ws.data.ptr, size, beta, c.yDesc, out.data.ptr)
    elif direction == "data":
        size = lib.getConvolutionBackwardDataWorkspaceSize(handle, c.wDesc, c.yDesc, c.convDesc,
                                                           c.xDesc, algo)
        ws = workspace(size)
        lib.convolutionBackwardData(handle, alpha, c.wDesc, c.w_d.data.ptr, c.yDesc,
                                    c.dy_d.data.ptr, c.convDesc, algo, ws.data.ptr, size, beta,
                                    c.xDesc, out.data.ptr)
    else:
        size = lib.getConvolutionBackwardFilterWorkspaceSize(handle, c.xDesc, c.yDesc,
                                                             c.convDesc, c.wDesc, algo)
        ws = workspace(size)
        lib.convolutionBackwardFilter(handle, alpha, c.xDesc, c.x_d.data.ptr, c.yDesc,
                                      c.dy_d.data.ptr, c.convDesc, algo, ws.data.ptr, size, beta,
                                      c.wDesc, out.data.ptr)
    assert isinstance(size, int) and size >= 0


def reference(c: ConvCase, direction: str) -> np.ndarray:
    if direction == "fwd":
        return conv_ref(c.x, c.w, c.g)
    if direction == "data":
        return conv_data_ref(c.dy, c.w, c.g)
    return conv_filter_ref(c.x, c.dy, c.g)


@pytest.mark.parametrize("direction", ["fwd", "data", "filter"])
@pytest.mark.parametrize("geom", list(GEOMS))
def test_convolution_forward_and_backward(handle, prec, geom, direction, rng):
    c = ConvCase(GEOMS[geom], prec, rng)
    algo = choose(handle, c, direction)
    check_scaled(lambda a, b, out: run_direction(handle, c, direction, algo, a, b, out),
                 reference(c, direction), prec, rng, loose=algo in TRANSFORM_ALGOS[direction])


@pytest.mark.parametrize("direction", ["fwd", "data", "filter"])
@pytest.mark.parametrize("search", ["v7", "FindEx"])
@pytest.mark.parametrize("geom", ["2d", "2d-strided-dilated-grouped"])
def test_algorithm_searches(handle, prec, geom, search, direction, rng):
    c = ConvCase(GEOMS[geom], prec, rng)
    buf = workspace(64 << 20)
    if search == "v7":
        perfs = heuristics(handle, c, direction)
    else:
        perfs = find_ex(handle, c, direction, buf)
    limit = {"fwd": lib.getConvolutionForwardAlgorithmMaxCount,
             "data": lib.getConvolutionBackwardDataAlgorithmMaxCount,
             "filter": lib.getConvolutionBackwardFilterAlgorithmMaxCount}[direction](handle)
    assert 1 <= len(perfs) <= limit
    count = {"fwd": lib.CUDNN_CONVOLUTION_FWD_ALGO_COUNT,
             "data": lib.CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT,
             "filter": lib.CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT}[direction]
    maths = (lib.CUDNN_DEFAULT_MATH, lib.CUDNN_TENSOR_OP_MATH,
             lib.CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION, lib.CUDNN_FMA_MATH)
    for p in perfs:
        assert 0 <= p.algo < count and p.mathType in maths
        assert p.determinism in (lib.CUDNN_NON_DETERMINISTIC, lib.CUDNN_DETERMINISTIC)
    ok = [p for p in perfs if p.status == lib.CUDNN_STATUS_SUCCESS]
    assert ok, f"no successful algorithm in {perfs}"
    if search == "FindEx":  # timed, within the workspace it was given
        assert all(p.time >= 0 and p.memory <= buf.size for p in ok)
    best = ok[0].algo
    out = poisoned(reference(c, direction).shape, prec)
    run_direction(handle, c, direction, best, 1.0, 0.0, out)
    assert_close(out, reference(c, direction), prec, loose=best in TRANSFORM_ALGOS[direction])


def test_requested_algo_count_must_be_positive(handle, prec, rng):
    c = ConvCase(GEOMS["2d"], prec, rng)
    with pytest.raises(ValueError, match="requestedAlgoCount"):
        lib.getConvolutionForwardAlgorithm_v7(handle, c.xDesc, c.wDesc, c.convDesc, c.yDesc, 0)


@pytest.mark.parametrize("geom", ["2d", "3d"])
def test_convolution_backward_bias(handle, prec, geom, rng):
    c = ConvCase(GEOMS[geom], prec, rng)
    shape = bias_shape(c.g.w[0], len(c.g.x))
    ref = c.dy.astype(np.float64).sum(axis=tuple(a for a in range(c.dy.ndim) if a != 1))
    db_desc = tdesc(cp.empty(shape, dtype=prec.dtype), prec)

    def run(alpha, beta, db):
        lib.convolutionBackwardBias(handle, alpha, c.yDesc, c.dy_d.data.ptr, beta, db_desc,
                                    db.data.ptr)

    check_scaled(run, ref.reshape(shape), prec, rng)


def fused_call(handle, c: ConvCase, act: int, alpha1, alpha2, z, bias, y) -> None:
    """convolutionBiasActivationForward with IMPLICIT_PRECOMP_GEMM (FACTS: IDENTITY's only)."""
    algo = lib.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM
    size = lib.getConvolutionForwardWorkspaceSize(handle, c.xDesc, c.wDesc, c.convDesc, c.yDesc,
                                                  algo)
    ws = workspace(size)
    actDesc = lib.ActivationDescriptor()
    actDesc.set(act, lib.CUDNN_NOT_PROPAGATE_NAN, 0.0)
    lib.convolutionBiasActivationForward(
        handle, alpha1, c.xDesc, c.x_d.data.ptr, c.wDesc, c.w_d.data.ptr, c.convDesc, algo,
        ws.data.ptr, size, alpha2, c.yDesc, z.data.ptr, tdesc(bias, c.prec), bias.data.ptr,
        actDesc, c.yDesc, y.data.ptr)


@pytest.mark.parametrize("geom", list(GEOMS))
@pytest.mark.parametrize("act", ["CUDNN_ACTIVATION_RELU", "CUDNN_ACTIVATION_IDENTITY"])
@pytest.mark.parametrize("residual", [True, False], ids=["z", "no-z"])
def test_convolution_bias_activation_forward(handle, prec, geom, act, residual, rng):
    c = ConvCase(GEOMS[geom], prec, rng)
    bias = rand(rng, bias_shape(c.g.w[0], len(c.g.x)), prec)
    y = poisoned(c.dy.shape, prec)
    pre = 0.75 * conv_ref(c.x, c.w, c.g) + bias.astype(np.float64)
    if residual:
        z = rand(rng, c.dy.shape, prec)
        pre += 0.5 * z.astype(np.float64)
        fused_call(handle, c, getattr(lib, act), 0.75, 0.5, cp.asarray(z), cp.asarray(bias), y)
    else:  # DESIGN: no residual passes z = y with alpha2 = 0 (y is still NaN here)
        fused_call(handle, c, getattr(lib, act), 0.75, 0.0, y, cp.asarray(bias), y)
    if act == "CUDNN_ACTIVATION_IDENTITY":
        assert (pre < 0).any()  # so a ReLU applied anyway would show
        assert_close(y, pre, prec)
    else:
        assert_close(y, np.maximum(pre, 0.0), prec)


def test_convolution_bias_activation_rejects_sigmoid(handle, prec, rng):
    c = ConvCase(GEOMS["2d"], prec, rng)
    y = poisoned(c.dy.shape, prec)
    bias = cp.zeros(bias_shape(c.g.w[0], 4), dtype=prec.dtype)
    with pytest.raises(CudnnError) as info:
        fused_call(handle, c, lib.CUDNN_ACTIVATION_SIGMOID, 1.0, 0.0, y, bias, y)
    assert info.value.function == "cudnnConvolutionBiasActivationForward"
    assert info.value.status // 1000 == lib.CUDNN_STATUS_NOT_SUPPORTED // 1000


def test_convolution_forward_channels_last(handle, prec, rng):
    g = GEOMS["2d-strided-dilated-grouped"]
    x, w = rand(rng, g.x, prec), rand(rng, g.w, prec)
    # Stored (N, H, W, C) and (K, R, S, C/g); described in logical order with NHWC strides.
    x_d = cp.ascontiguousarray(cp.asarray(x).transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    w_d = cp.ascontiguousarray(cp.asarray(w).transpose(0, 2, 3, 1))
    n, k, ho, wo = out_shape(g)
    y = poisoned((n, ho, wo, k), prec).transpose(0, 3, 1, 2)
    xDesc, yDesc = tdesc(x_d, prec), tdesc(y, prec)
    wDesc, convDesc = fdesc(g.w, prec, lib.CUDNN_TENSOR_NHWC), cdesc(g, prec)
    perfs = lib.getConvolutionForwardAlgorithm_v7(handle, xDesc, wDesc, convDesc, yDesc, 8)
    ok = [p for p in perfs if p.status == lib.CUDNN_STATUS_SUCCESS]
    if not ok:
        pytest.skip(f"cuDNN has no NHWC algorithm for this config: {perfs}")
    ws = workspace(ok[0].memory)
    lib.convolutionForward(handle, 1.0, xDesc, x_d.data.ptr, wDesc, w_d.data.ptr, convDesc,
                           ok[0].algo, ws.data.ptr, ws.size, 0.0, yDesc, y.data.ptr)
    assert_close(y, conv_ref(x, w, g), prec, loose=ok[0].algo in TRANSFORM_ALGOS["fwd"])


def test_one_d_with_three_d_tensors_is_right_or_refused(handle, prec, rng):
    # Records what cuDNN does with 3-d descriptors; correct values if it accepts them.
    g = Geom((2, 3, 11), (5, 3, 3), (2,), (2,), (1,), 1)
    x, w = rand(rng, g.x, prec), rand(rng, g.w, prec)
    x_d, w_d, y = cp.asarray(x), cp.asarray(w), poisoned(out_shape(g), prec)
    xDesc, yDesc = tdesc(x_d, prec), tdesc(y, prec)
    wDesc, convDesc = fdesc(g.w, prec), cdesc(g, prec)
    algo = lib.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM
    try:
        size = lib.getConvolutionForwardWorkspaceSize(handle, xDesc, wDesc, convDesc, yDesc, algo)
        ws = workspace(size)
        lib.convolutionForward(handle, 1.0, xDesc, x_d.data.ptr, wDesc, w_d.data.ptr, convDesc,
                               algo, ws.data.ptr, size, 0.0, yDesc, y.data.ptr)
    except CudnnError as err:
        assert err.status // 1000 in (2, 3), err  # BAD_PARAM or NOT_SUPPORTED families
        return
    assert_close(y, conv_ref(x, w, g), prec)


def test_convolution_forward_bad_output_shape_raises(handle, prec, rng):
    c = ConvCase(GEOMS["2d"], prec, rng)
    big = cp.zeros((4, 8, 9, 9), dtype=prec.dtype)  # room for any wrong shape's writes
    with pytest.raises(CudnnError) as info:
        lib.convolutionForward(handle, 1.0, c.xDesc, c.x_d.data.ptr, c.wDesc, c.w_d.data.ptr,
                               c.convDesc, lib.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, 0, 0, 0.0,
                               tdesc(big, prec), big.data.ptr)
    assert info.value.function == "cudnnConvolutionForward"
    assert info.value.status // 1000 == 2  # a BAD_PARAM code


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
