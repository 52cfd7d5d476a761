"""cuDNN's output shapes through convfuse._cudnn, on the CPU: convolutions against
convfuse.geometry.conv_output_size, pooling against a formula written here, and the
errors for shapes cuDNN refuses.

Note [1-D convolutions in cuDNN] (csrc/descriptors.h): cuDNN accepts 3-d descriptors for
shapes, but its kernels want 4-d; the tests below check both forms give the same shape.
"""

from __future__ import annotations

import itertools

import pytest

from convfuse.errors import CudnnError
from convfuse.geometry import conv_output_size
from tests._binding_helpers import conv, filt, lib, tensor


def test_forward_output_dim_facts_example():
    x, w = tensor([2, 3, 32, 32]), filt([8, 3, 3, 3])
    c = conv([1, 1], [2, 2], [1, 1])
    assert lib.getConvolutionNdForwardOutputDim(c, x, w) == [2, 8, 16, 16]


def _conv_cases():
    """(x dims, w dims, pads, strides, dilations, groups) over ranks 1-3, kept valid."""
    cases = []
    sizes = {1: [9], 2: [7, 6], 3: [5, 4, 6]}
    kernels = {1: [3], 2: [3, 2], 3: [2, 3, 1]}
    for rank, pad, stride, dil, groups in itertools.product((1, 2, 3), (0, 1, 2), (1, 2, 3),
                                                            (1, 2), (1, 2)):
        n, k = sizes[rank], kernels[rank]
        if any(d * (kk - 1) + 1 > nn + 2 * pad for nn, kk, d in zip(n, k, [dil] * rank)):
            continue
        cases.append(([2, 4, *n], [6, 4 // groups, *k], [pad] * rank, [stride] * rank,
                      [dil] * rank, groups))
    return cases


@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "NHWC"])
def test_forward_output_dim_matches_geometry(channels_last):
    fmt = "CUDNN_TENSOR_NHWC" if channels_last else "CUDNN_TENSOR_NCHW"
    cases = _conv_cases()
    assert len(cases) > 80
    for xd, wd, pads, strides, dils, groups in cases:
        spatial = zip(xd[2:], wd[2:], strides, pads, dils)
        expect = [xd[0], wd[0]] + [conv_output_size(n, k, s, p, d) for n, k, s, p, d in spatial]
        x = tensor(xd, channels_last=channels_last)
        got = lib.getConvolutionNdForwardOutputDim(conv(pads, strides, dils, groups), x,
                                                   filt(wd, fmt=fmt))
        assert got == expect, (xd, wd, pads, strides, dils, groups)


def test_one_d_as_three_d_or_unit_height_agree():
    x3, w3 = tensor([2, 3, 11]), filt([5, 3, 3])
    x4, w4 = tensor([2, 3, 1, 11]), filt([5, 3, 1, 3])
    got3 = lib.getConvolutionNdForwardOutputDim(conv([2], [3], [2]), x3, w3)
    got4 = lib.getConvolutionNdForwardOutputDim(conv([0, 2], [1, 3], [1, 2]), x4, w4)
    assert got3 == [2, 5, conv_output_size(11, 3, 3, 2, 2)]
    assert got4 == [2, 5, 1, got3[2]]


@pytest.mark.parametrize(
    "xd,wd,pads",
    [
        ([2, 3, 2, 2], [8, 3, 3, 3], [0, 0]),  # kernel larger than the input
        ([2, 5, 32, 32], [8, 3, 3, 3], [1, 1]),  # channel mismatch
        ([2, 3, 8, 8, 8], [8, 3, 3, 3, 3], [1, 1]),  # conv rank 2, tensors rank 3
    ],
)
def test_forward_output_dim_bad_shape_raises_cudnn_error(xd, wd, pads):
    with pytest.raises(CudnnError, match="cudnnGetConvolutionNdForwardOutputDim") as info:
        lib.getConvolutionNdForwardOutputDim(conv(pads, [1, 1], [1, 1]), tensor(xd), filt(wd))
    err = info.value
    assert err.status == lib.CUDNN_STATUS_BAD_PARAM
    assert err.function == "cudnnGetConvolutionNdForwardOutputDim"
    assert err.status_name == "CUDNN_STATUS_BAD_PARAM" and "BAD_PARAM" in str(err)


def test_forward_output_dim_with_unset_descriptors_raises():
    x, w, c = tensor([2, 3, 8, 8]), filt([4, 3, 3, 3]), conv([1, 1], [1, 1], [1, 1])
    for args in ((lib.ConvolutionDescriptor(), x, w), (c, lib.TensorDescriptor(), w),
                 (c, x, lib.FilterDescriptor())):
        with pytest.raises(CudnnError) as info:
            lib.getConvolutionNdForwardOutputDim(*args)
        assert info.value.status == lib.CUDNN_STATUS_BAD_PARAM


def pool_output_size(size: int, window: int, pad: int, stride: int) -> int:
    return (size + 2 * pad - window) // stride + 1


def test_pooling_output_dim_matches_formula():
    checked = 0
    sizes = {1: [9], 2: [7, 8], 3: [5, 6, 7]}
    for rank, window, pad, stride in itertools.product((1, 2, 3), (1, 2, 3), (0, 1), (1, 2, 3)):
        if pad >= window:
            continue
        p = lib.PoolingDescriptor()
        p.setNd(lib.CUDNN_POOLING_MAX, lib.CUDNN_NOT_PROPAGATE_NAN, [window] * rank, [pad] * rank,
                [stride] * rank)
        xd = [2, 3, *sizes[rank]]
        expect = xd[:2] + [pool_output_size(n, window, pad, stride) for n in xd[2:]]
        assert lib.getPoolingNdForwardOutputDim(p, tensor(xd)) == expect
        checked += 1
    assert checked > 40


def test_pooling_output_dim_window_too_large_raises():
    p = lib.PoolingDescriptor()
    p.setNd(lib.CUDNN_POOLING_MAX, lib.CUDNN_NOT_PROPAGATE_NAN, [9, 9], [0, 0], [1, 1])
    with pytest.raises(CudnnError, match="cudnnGetPoolingNdForwardOutputDim"):
        lib.getPoolingNdForwardOutputDim(p, tensor([2, 3, 7, 8]))
