"""cuDNN's own answer to "what shape does this convolution produce?", from raw numbers.

Used by the selfcheck and the fuzz tests to hold convfuse's geometry rule against
cudnnGetConvolutionNdForwardOutputDim. On purpose this builds descriptors straight from the
user's numbers, not from a validated ConvGeometry, so that cuDNN can reject on its own.

1-D convolutions are lifted to 2-D with a unit height, as convfuse's plans do (Note [1-D
convolutions as 2-D] in convfuse/plan/descriptors.py): x (N, C, 1, W), w (K, C/g, 1, k),
padding (0, p), stride (1, s), dilation (1, d). The lift is written out again here rather
than imported, so that a mistake in it cannot cancel out. (Through ctypes, cuDNN 9.28 also
answered the output-dim query for 3-d tensors; the lift is what runs on the GPU.)
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

_DATA_TYPE_NAMES = {
    "float32": "CUDNN_DATA_FLOAT",
    "float64": "CUDNN_DATA_DOUBLE",
    "float16": "CUDNN_DATA_HALF",
    "bfloat16": "CUDNN_DATA_BFLOAT16",
}


def data_type(lib: ModuleType, dtype: str) -> int:
    return int(getattr(lib, _DATA_TYPE_NAMES[dtype]))


def compute_type(lib: ModuleType, dtype: str) -> int:
    """float64 computes in double; every narrower type computes in float (FACTS: no true half)."""
    return data_type(lib, "float64" if dtype == "float64" else "float32")


def channels_first(shape: Sequence[int], channels_last: bool) -> list[int]:
    s = list(shape)
    return [s[0], s[-1], *s[1:-1]] if channels_last else s


def channels_last_order(shape_cf: Sequence[int]) -> list[int]:
    s = list(shape_cf)
    return [s[0], *s[2:], s[1]]


def packed_strides(dims_cf: Sequence[int], channels_last: bool) -> list[int]:
    """Strides, in channels-first dim order, of a packed array in either memory order."""
    order = [0, *range(2, len(dims_cf)), 1] if channels_last else list(range(len(dims_cf)))
    strides = [0] * len(dims_cf)
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= dims_cf[axis]
    return strides


def lift_1d(x_cf: list[int], w_cf: list[int], stride: list[int], padding: list[int],
            dilation: list[int]) -> tuple[list[int], ...]:
    """Insert a unit height everywhere (see the module docstring)."""
    return ([*x_cf[:2], 1, *x_cf[2:]], [*w_cf[:2], 1, *w_cf[2:]], [1, *stride],
            [0, *padding], [1, *dilation])


def output_dims(lib: ModuleType, x_shape: Sequence[int], w_shape: Sequence[int],
                stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                groups: int, channels_last: bool, dtype: str = "float32") -> tuple[int, ...]:
    """cuDNN's output shape, in the layout's own order; raises CudnnError when cuDNN refuses.

    Shapes are given in the layout's order; in channels-last the weight is (K, *k, C/g),
    cuDNN's NHWC filter format, whose dims cuDNN still takes in KCRS order.
    """
    x_cf, w_cf = channels_first(x_shape, channels_last), channels_first(w_shape, channels_last)
    st, pad, dil = list(stride), list(padding), list(dilation)
    rank = len(x_cf) - 2
    if rank == 1:
        x_cf, w_cf, st, pad, dil = lift_1d(x_cf, w_cf, st, pad, dil)
    dt = data_type(lib, dtype)
    x_desc = lib.TensorDescriptor()
    x_desc.setNd(dt, x_cf, packed_strides(x_cf, channels_last))
    w_desc = lib.FilterDescriptor()
    fmt = lib.CUDNN_TENSOR_NHWC if channels_last else lib.CUDNN_TENSOR_NCHW
    w_desc.setNd(dt, fmt, w_cf)
    conv = lib.ConvolutionDescriptor()
    conv.setNd(pad, st, dil, lib.CUDNN_CROSS_CORRELATION, compute_type(lib, dtype))
    conv.setGroupCount(int(groups))
    out = [int(d) for d in lib.getConvolutionNdForwardOutputDim(conv, x_desc, w_desc)]
    if rank == 1:
        out = [out[0], out[1], *out[3:]]
    return tuple(channels_last_order(out) if channels_last else out)
