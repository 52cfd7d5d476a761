"""What cuDNN's descriptors of a convolution must hold, computed from a ConvGeometry.

The pure functions here decide dims, strides, pads and enum names (the CPU suite checks
them against `getNd()`); `build_*` turn them into binding objects.

Note [1-D convolutions as 2-D]
cuDNN's Nd convolution accepts 2 or 3 spatial dims only. A 1-D convolution over width W
is expressed as a 2-D one with a unit height: dims (N, C, 1, W), kernel (1, k), and on
the height axis pad 0, stride 1, dilation 1. Channels-last keeps its meaning, since an
(N, W, C) array is byte for byte an (N, 1, W, C) one. Checked against libcudnn 9.28 by
tests/test_plan.py: getConvolutionNdForwardOutputDim answers (N, K, 1, W_out).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from ..dtypes import canonical
from ..dtypes import name as dtype_name
from ..errors import TensorTooLargeError
from ..geometry import ConvGeometry

#: The most elements a cuDNN descriptor indexes: its dims, strides and sizes are int32.
MAX_ELEMENTS = 2**31 - 1


def check_elements(what: str, dims: Sequence[int], describe: Callable[[], str],
                   splittable: bool = False) -> None:
    """Refuse a tensor of `dims` that cuDNN cannot describe, before any cuDNN call on it
    (where setNd would fail with NOT_SUPPORTED, or a stride would not fit an int at all).
    The convolution ops split a batch too large into parts whose plans fit (Note [batch
    split] in ops/cudnn/split.py): `splittable` says a convolution's plan asks, where a
    batch too large reaches this only through a direct plan request. Batch norm and pooling
    are not split."""
    n = math.prod(int(v) for v in dims)
    if n > MAX_ELEMENTS:
        shape = " x ".join(str(int(v)) for v in dims)
        per_sample = math.prod(int(v) for v in dims[1:])
        if what == "w":
            hint = "a weight is not split: use fewer channels or a smaller kernel"
        elif per_sample > MAX_ELEMENTS:
            hint = (f"even one sample has {per_sample:,}: use a smaller spatial size or "
                    "fewer channels (or run this layer on the CPU engine)")
        elif splittable:
            hint = ("the convolution ops split such a batch into parts; this plan is one "
                    "call: use a smaller batch (or run this layer on the CPU engine)")
        else:
            hint = ("batch norm and pooling are not split into parts: use a smaller batch "
                    "(or run this layer on the CPU engine)")
        raise TensorTooLargeError(
            f"{describe()}: {what} ({shape}, channels first) has {n:,} elements; cuDNN "
            f"indexes at most {MAX_ELEMENTS:,} per tensor (32-bit descriptors), so the "
            f"cuDNN engine cannot run it: {hint}")


_DATA_TYPES = {
    "float32": "CUDNN_DATA_FLOAT",
    "float16": "CUDNN_DATA_HALF",
    "bfloat16": "CUDNN_DATA_BFLOAT16",
    "float64": "CUDNN_DATA_DOUBLE",
}


def data_type_name(dtype: Any) -> str:
    return _DATA_TYPES[canonical(dtype).name]


def compute_type_name(dtype: Any) -> str:
    """double accumulates in double; float, half and bfloat16 accumulate in float (FACTS:
    a true-half config of the fused call is NOT_SUPPORTED)."""
    return "CUDNN_DATA_DOUBLE" if canonical(dtype).name == "float64" else "CUDNN_DATA_FLOAT"


def math_type_name(dtype: Any, allow_tf32: bool) -> str:
    """float32 may use TF32 only when allowed (FMA_MATH forbids tensor cores); half and
    bfloat16 want tensor cores; double has no tensor-core path to ask for."""
    name = dtype_name(dtype)
    if name == "float32":
        return "CUDNN_DEFAULT_MATH" if allow_tf32 else "CUDNN_FMA_MATH"
    if name in ("float16", "bfloat16"):
        return "CUDNN_TENSOR_OP_MATH"
    return "CUDNN_DEFAULT_MATH"


def lift(shape_cf: Sequence[int]) -> tuple[int, ...]:
    """Channels-first dims as cuDNN sees them (Note [1-D convolutions as 2-D])."""
    s = tuple(shape_cf)
    return (s[0], s[1], 1, s[2]) if len(s) == 3 else s


def lifted_params(geom: ConvGeometry) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(pads, strides, dilations) for the convolution descriptor."""
    if geom.rank == 1:  # Note [1-D convolutions as 2-D]
        return (0, *geom.padding), (1, *geom.stride), (1, *geom.dilation)
    return geom.padding, geom.stride, geom.dilation


def packed_strides(dims_cf: Sequence[int], channels_last: bool) -> tuple[int, ...]:
    """Strides, in elements and in cuDNN's (N, C, *spatial) order, of a packed array.

    Channels-last is described to cuDNN by these explicit strides on NCHW-ordered dims
    (C has stride 1), which is how cuDNN's Nd descriptors express NHWC at any rank.
    """
    dims = tuple(dims_cf)
    order = (0, *range(2, len(dims)), 1) if channels_last else tuple(range(len(dims)))
    strides = [0] * len(dims)
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= dims[axis]
    return tuple(strides)


def bias_dims(geom: ConvGeometry) -> tuple[int, ...]:
    """1xKx1x1 (or 1xKx1x1x1): one value per output channel, broadcast by cuDNN."""
    return (1, geom.out_channels, *([1] * (len(lift(geom.output_shape_cf)) - 2)))


def bias_descriptor(lib: ModuleType, dtype: Any, geom: ConvGeometry) -> Any:
    """The bias in the data's dtype, K contiguous values (FACTS: 1xKx1x1, stride 1 on K).

    The strides follow the convolution's layout, as PyTorch gives the fused call's bias
    descriptor the convolution's memory format: for 1xKx1x1 both layouts put K values
    at stride 1 (same bytes), but cuDNN checks the bias, dy and db descriptors' layouts
    against y's, and NHWC strides are (K, 1, K, K). The same descriptor serves the fused
    call, convolutionBackwardBias and addTensor.
    """
    desc = lib.TensorDescriptor()
    dims = bias_dims(geom)
    desc.setNd(getattr(lib, data_type_name(dtype)), list(dims),
               list(packed_strides(dims, geom.channels_last)))
    return desc


def tensor_descriptor(lib: ModuleType, dtype: Any, dims_cf: Sequence[int],
                      channels_last: bool) -> Any:
    desc = lib.TensorDescriptor()
    dims = lift(dims_cf)
    desc.setNd(getattr(lib, data_type_name(dtype)), list(dims),
               list(packed_strides(dims, channels_last)))
    return desc


def filter_descriptor(lib: ModuleType, dtype: Any, geom: ConvGeometry) -> Any:
    """Dims are always K, C/groups, *kernel; the format says how they lie in memory."""
    desc = lib.FilterDescriptor()
    fmt = lib.CUDNN_TENSOR_NHWC if geom.channels_last else lib.CUDNN_TENSOR_NCHW
    desc.setNd(getattr(lib, data_type_name(dtype)), fmt, list(lift(geom.weight_shape_cf)))
    return desc


def convolution_descriptor(lib: ModuleType, dtype: Any, geom: ConvGeometry,
                           math_type: int) -> Any:
    """Cross-correlation, as every framework's 'convolution' (and the reference) computes."""
    desc = lib.ConvolutionDescriptor()
    pads, strides, dilations = lifted_params(geom)
    desc.setNd(list(pads), list(strides), list(dilations), lib.CUDNN_CROSS_CORRELATION,
               getattr(lib, compute_type_name(dtype)))
    desc.setGroupCount(geom.groups)
    desc.setMathType(math_type)
    return desc


def activation_descriptor(lib: ModuleType, fused_activation: str) -> Any:
    """RELU or IDENTITY; the fused call rejects any NaN option but NOT_PROPAGATE (FACTS)."""
    desc = lib.ActivationDescriptor()
    relu = fused_activation == "relu"
    mode = lib.CUDNN_ACTIVATION_RELU if relu else lib.CUDNN_ACTIVATION_IDENTITY
    desc.set(mode, lib.CUDNN_NOT_PROPAGATE_NAN, 0.0)
    return desc
