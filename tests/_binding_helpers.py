"""Shared by the tests/test_binding_*.py files: the binding, the constants docs/DESIGN.md
names, and descriptor builders over packed (C-contiguous) strides."""

from __future__ import annotations

import numpy as np

from convfuse._binding import cudnn

lib = cudnn()

DESIGN_CONSTANTS = [
    "CUDNN_DATA_FLOAT", "CUDNN_DATA_HALF", "CUDNN_DATA_BFLOAT16", "CUDNN_DATA_DOUBLE",
    "CUDNN_TENSOR_NCHW", "CUDNN_TENSOR_NHWC", "CUDNN_CROSS_CORRELATION", "CUDNN_CONVOLUTION",
    "CUDNN_DEFAULT_MATH", "CUDNN_TENSOR_OP_MATH", "CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION",
    "CUDNN_FMA_MATH", "CUDNN_ACTIVATION_SIGMOID", "CUDNN_ACTIVATION_RELU",
    "CUDNN_ACTIVATION_TANH", "CUDNN_ACTIVATION_CLIPPED_RELU", "CUDNN_ACTIVATION_ELU",
    "CUDNN_ACTIVATION_IDENTITY", "CUDNN_ACTIVATION_SWISH", "CUDNN_NOT_PROPAGATE_NAN",
    "CUDNN_PROPAGATE_NAN", "CUDNN_POOLING_MAX", "CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING",
    "CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING", "CUDNN_POOLING_MAX_DETERMINISTIC",
    "CUDNN_NON_DETERMINISTIC", "CUDNN_DETERMINISTIC", "CUDNN_STATUS_SUCCESS",
    "CUDNN_STATUS_BAD_PARAM", "CUDNN_STATUS_NOT_INITIALIZED", "CUDNN_STATUS_NOT_SUPPORTED",
    "CUDNN_STATUS_INTERNAL_ERROR", "CUDNN_STATUS_EXECUTION_FAILED",
]


def packed_strides(dims: list[int], channels_last: bool, itemsize: int) -> list[int]:
    """Element strides of a C-contiguous array in dims' logical (N, C, *spatial) order."""
    if not channels_last:
        arr = np.empty(dims, dtype=np.dtype(f"V{itemsize}"))
        return [s // itemsize for s in arr.strides]
    stored = [dims[0], *dims[2:], dims[1]]  # how a channels-last array lies in memory
    arr = np.empty(stored, dtype=np.dtype(f"V{itemsize}"))
    logical = np.moveaxis(arr, -1, 1)
    return [s // itemsize for s in logical.strides]


def tensor(dims, dtype="CUDNN_DATA_FLOAT", channels_last=False):
    d = lib.TensorDescriptor()
    d.setNd(getattr(lib, dtype), list(dims), packed_strides(list(dims), channels_last, 4))
    return d


def filt(dims, dtype="CUDNN_DATA_FLOAT", fmt="CUDNN_TENSOR_NCHW"):
    d = lib.FilterDescriptor()
    d.setNd(getattr(lib, dtype), getattr(lib, fmt), list(dims))
    return d


def conv(pads, strides, dilations, groups=1, compute="CUDNN_DATA_FLOAT"):
    d = lib.ConvolutionDescriptor()
    d.setNd(list(pads), list(strides), list(dilations), lib.CUDNN_CROSS_CORRELATION,
            getattr(lib, compute))
    d.setGroupCount(groups)
    return d
