"""Convolution forward, backward data and backward filter through convfuse._cudnn on a
GPU, the algorithm searches (v7 heuristics, Find*Ex) and the bias gradient, against float64
NumPy oracles.

Conventions (NaN-poisoned outputs, the beta = 0.5 check, tolerances):
tests/gpu/_binding_gpu_helpers.py.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.register_assert_rewrite("tests.gpu._binding_gpu_helpers")

from tests.gpu import _binding_gpu_helpers  # noqa: E402
from tests.gpu._binding_gpu_helpers import (  # noqa: E402
    GEOMS,
    TRANSFORM_ALGOS,
    ConvCase,
    Geom,
    assert_close,
    bias_shape,
    check_scaled,
    conv_ref,
    cp,
    lib,
    padded,
    poisoned,
    taps,
    tdesc,
    workspace,
)

pytestmark = pytest.mark.gpu
handle = _binding_gpu_helpers.handle  # module-scoped fixture
prec = _binding_gpu_helpers.prec  # fixture: one Prec per precision


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
