"""Convolution layouts and shapes through convfuse._cudnn on a GPU: channels-last strides,
1-D with 3-d tensors (Note [1-D convolutions in cuDNN]) and an output descriptor of the
wrong shape, against float64 NumPy oracles.

Conventions (NaN-poisoned outputs, the beta = 0.5 check, tolerances):
tests/gpu/_binding_gpu_helpers.py.
"""

from __future__ import annotations

import pytest

from convfuse.errors import CudnnError

pytest.register_assert_rewrite("tests.gpu._binding_gpu_helpers")

from tests.gpu import _binding_gpu_helpers  # noqa: E402
from tests.gpu._binding_gpu_helpers import (  # noqa: E402
    GEOMS,
    TRANSFORM_ALGOS,
    ConvCase,
    Geom,
    assert_close,
    cdesc,
    conv_ref,
    cp,
    fdesc,
    lib,
    out_shape,
    poisoned,
    rand,
    tdesc,
    workspace,
)

pytestmark = pytest.mark.gpu
handle = _binding_gpu_helpers.handle  # module-scoped fixture
prec = _binding_gpu_helpers.prec  # fixture: one Prec per precision


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
    # The heuristics may rank an algorithm the call then refuses (Note [float64 runs
    # channels-first]): each in turn, with the workspace cuDNN asks for it, as the engine
    # walks its ranking; a refusal of every one is cuDNN's answer, not a failure.
    refusals = []
    for perf in ok:
        try:
            size = lib.getConvolutionForwardWorkspaceSize(handle, xDesc, wDesc, convDesc,
                                                          yDesc, perf.algo)
            ws = workspace(size)
            lib.convolutionForward(handle, 1.0, xDesc, x_d.data.ptr, wDesc, w_d.data.ptr,
                                   convDesc, perf.algo, ws.data.ptr, size, 0.0, yDesc,
                                   y.data.ptr)
        except CudnnError as err:
            if err.status // 1000 != lib.CUDNN_STATUS_NOT_SUPPORTED // 1000:
                raise
            refusals.append(f"{perf.algo}: {err}")
            continue
        assert_close(y, conv_ref(x, w, g), prec, loose=perf.algo in TRANSFORM_ALGOS["fwd"])
        return
    pytest.skip(f"cuDNN runs no NHWC algorithm for this config: {perfs} {refusals}")


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
