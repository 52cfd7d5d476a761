"""convfuse._cudnn's descriptors against the real libcudnn, on the CPU (no handle, so no
compute calls): every set/get round trip, with numpy's own stride arithmetic as the oracle
for layouts, and the values cuDNN refuses."""

from __future__ import annotations

import numpy as np
import pytest

from convfuse.errors import CudnnError
from tests._binding_helpers import DESIGN_CONSTANTS, conv, filt, lib, packed_strides

DTYPES = {  # cuDNN data type -> numpy dtype of the same width
    "CUDNN_DATA_FLOAT": np.float32,
    "CUDNN_DATA_HALF": np.float16,
    "CUDNN_DATA_BFLOAT16": np.uint16,  # only the item size matters for strides
    "CUDNN_DATA_DOUBLE": np.float64,
}

GEOMETRIES = {  # logical N, C, *spatial
    "1d": [2, 3, 10],
    "1d-as-2d": [2, 3, 1, 10],
    "2d": [2, 3, 7, 5],
    "3d": [1, 4, 3, 5, 6],
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "NHWC"])
def test_tensor_descriptor_round_trip(dtype, geometry, channels_last):
    dims = GEOMETRIES[geometry]
    strides = packed_strides(dims, channels_last, np.dtype(DTYPES[dtype]).itemsize)
    d = lib.TensorDescriptor()
    dims_in, strides_in = list(dims), list(strides)
    d.setNd(getattr(lib, dtype), dims_in, strides_in)
    assert d.getNd() == (getattr(lib, dtype), dims, strides)
    assert (dims_in, strides_in) == (dims, strides)  # inputs untouched
    assert d.ptr != 0


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("fmt", ["CUDNN_TENSOR_NCHW", "CUDNN_TENSOR_NHWC"])
@pytest.mark.parametrize("dims", [[4, 3, 5], [4, 3, 1, 5], [8, 3, 3, 2], [6, 2, 3, 1, 2]])
def test_filter_descriptor_round_trip(dtype, fmt, dims):
    d = filt(dims, dtype, fmt)
    assert d.getNd() == (getattr(lib, dtype), getattr(lib, fmt), dims)


@pytest.mark.parametrize("compute", ["CUDNN_DATA_FLOAT", "CUDNN_DATA_DOUBLE", "CUDNN_DATA_HALF"])
@pytest.mark.parametrize("mode", ["CUDNN_CROSS_CORRELATION", "CUDNN_CONVOLUTION"])
@pytest.mark.parametrize(
    "pads,strides,dilations",
    [([1], [2], [3]), ([0, 2], [1, 3], [2, 1]), ([1, 0, 2], [2, 2, 1], [1, 3, 1])],
)
def test_convolution_descriptor_round_trip(compute, mode, pads, strides, dilations):
    d = lib.ConvolutionDescriptor()
    assert d.getGroupCount() == 1 and d.getMathType() == lib.CUDNN_DEFAULT_MATH  # defaults
    d.setNd(pads, strides, dilations, getattr(lib, mode), getattr(lib, compute))
    assert d.getNd() == (pads, strides, dilations, getattr(lib, mode), getattr(lib, compute))


def test_convolution_descriptor_rejects_bfloat16_compute():
    # A cuDNN fact worth knowing upstream: bfloat16 data computes in float.
    d = lib.ConvolutionDescriptor()
    with pytest.raises(CudnnError) as info:
        d.setNd([1, 1], [1, 1], [1, 1], lib.CUDNN_CROSS_CORRELATION, lib.CUDNN_DATA_BFLOAT16)
    assert info.value.status == lib.CUDNN_STATUS_BAD_PARAM
    assert info.value.function == "cudnnSetConvolutionNdDescriptor"


def test_convolution_group_count_and_math_type():
    d = conv([1, 1], [1, 1], [1, 1])
    for groups in (1, 2, 3, 32):
        d.setGroupCount(groups)
        assert d.getGroupCount() == groups
    for name in ("CUDNN_DEFAULT_MATH", "CUDNN_TENSOR_OP_MATH",
                 "CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION", "CUDNN_FMA_MATH"):
        d.setMathType(getattr(lib, name))
        assert d.getMathType() == getattr(lib, name)
    with pytest.raises(CudnnError) as info:
        d.setGroupCount(0)
    assert (info.value.status, info.value.function) == (2000, "cudnnSetConvolutionGroupCount")
    with pytest.raises(CudnnError) as info:
        d.setMathType(4)
    assert info.value.function == "cudnnSetConvolutionMathType"
    assert d.getMathType() == lib.CUDNN_FMA_MATH  # a failed set leaves the last good one


@pytest.mark.parametrize("mode", [n for n in DESIGN_CONSTANTS if n.startswith("CUDNN_ACTIVATION_")])
@pytest.mark.parametrize("nan", ["CUDNN_NOT_PROPAGATE_NAN", "CUDNN_PROPAGATE_NAN"])
def test_activation_descriptor_round_trip(mode, nan):
    d = lib.ActivationDescriptor()
    d.set(getattr(lib, mode), getattr(lib, nan), 6.5)
    assert d.get() == (getattr(lib, mode), getattr(lib, nan), 6.5)


def test_activation_descriptor_rejects_unknown_mode():
    d = lib.ActivationDescriptor()
    with pytest.raises(CudnnError) as info:
        d.set(7, lib.CUDNN_NOT_PROPAGATE_NAN, 0.0)
    assert (info.value.status, info.value.function) == (2000, "cudnnSetActivationDescriptor")


@pytest.mark.parametrize("mode", [n for n in DESIGN_CONSTANTS if n.startswith("CUDNN_POOLING_")])
@pytest.mark.parametrize(
    "window,pads,strides",
    [([3], [1], [2]), ([2, 3], [0, 1], [2, 1]), ([2, 3, 2], [1, 1, 0], [1, 2, 2])],
)
def test_pooling_descriptor_round_trip(mode, window, pads, strides):
    d = lib.PoolingDescriptor()
    d.setNd(getattr(lib, mode), lib.CUDNN_PROPAGATE_NAN, window, pads, strides)
    assert d.getNd() == (getattr(lib, mode), lib.CUDNN_PROPAGATE_NAN, window, pads, strides)
