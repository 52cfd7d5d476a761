"""Which memory layout cuDNN is given for a convolution, and the copies between layouts.

Note [float64 runs channels-first]
cuDNN's channels-last (NHWC) convolution kernels are written for float, half and
bfloat16; for double it may rank no algorithm, or rank some and refuse each at the call.
PyTorch never asks: cudnn_conv_suggest_memory_format returns channels-first for float64
input ("disable NHWC for float64 input", aten/src/ATen/native/ConvUtils.h). convfuse does
the same. A float64 channels-last convolution runs as the channels-first one of the same
geometry (`cudnn_geometry`): inputs are copied to channels-first, the channels-first plan
runs, and results are copied back into the caller's channels-last array (for beta = 1
outputs, the prior values are copied in first, so cuDNN's own blend accumulates them).

Describing NHWC strides under NCHW-ordered dims instead would not help: cuDNN reads the
layout from the strides (that is how convfuse describes NHWC at every rank, Note in
plan/descriptors.py), and a filter descriptor has no strides at all, only a format. So the
data has to move. float64 convolutions are for checking, not speed; the copies (one pass
over each array) cost far less than the convolution itself.

`run_channels_first` is that route for any convolution op. ConvTranspose's ops take it
(conv_transpose.py: a transposed convolution's cuDNN calls are its forward convolution G's,
and G of the channels-first twin is the channels-first twin of G); conv.py's ops spell out
the same steps inline.

The bias gradient needs no copy: it stays on the channels-last plan, where a refusal of
cudnnConvolutionBackwardBias already moves the plan to convfuse's bias kernel, which reads
channels-last itself (BiasGradFallbackWarning, conv_backward_bias in conv.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from ...dtypes import name as dtype_name
from ...errors import ConvfuseError, CudnnError
from ...geometry import ConvGeometry
from ...transpose_geometry import ConvTransposeGeometry

G = TypeVar("G", ConvGeometry, ConvTransposeGeometry)


def runs_channels_first(geom: ConvGeometry | ConvTransposeGeometry, dtype: Any) -> bool:
    """Whether this convolution goes to cuDNN channels-first although its arrays are
    channels-last (Note [float64 runs channels-first])."""
    return geom.channels_last and dtype_name(dtype) == "float64"


def cudnn_geometry(geom: G, dtype: Any) -> G:
    """The geometry whose plan runs `geom`'s convolution in `dtype`: `geom` itself, or
    its channels-first twin (Note [float64 runs channels-first])."""
    if not runs_channels_first(geom, dtype):
        return geom
    return dataclasses.replace(geom, input_shape=geom.input_shape_cf,
                               weight_shape=geom.weight_shape_cf, channels_last=False)


@contextlib.contextmanager
def named_as(geom: ConvGeometry | ConvTransposeGeometry) -> Iterator[None]:
    """Errors of the channels-first run also name the caller's geometry, which is the one
    the caller knows."""
    why = f"run channels-first for {geom.describe()} (Note [float64 runs channels-first])"
    try:
        yield
    except CudnnError as err:
        raise err.with_context(why) from None
    except ConvfuseError as err:
        try:
            renamed = type(err)(f"{err}; {why}")
        except TypeError:  # a constructor taking more than a message: keep it as it is
            raise err from None
        raise renamed.with_traceback(err.__traceback__) from None


def run_channels_first(op: Callable[..., Any], geom: G, dtype: Any, arrays: Sequence[Any],
                       out: Any = None, beta: float | None = None) -> Any:  # pragma: gpu
    """`op` run on channels-first copies of the channels-last `arrays` with `geom`'s
    channels-first twin, its result copied back to channels-last (into `out` when given).

    A forward op is called `op(*arrays_cf, geom_cf)` (beta None); a gradient op
    `op(*arrays_cf, geom_cf, prior, beta)`, `prior` being a channels-first copy of `out`
    when beta != 0 (cuDNN's own blend then accumulates it once) and None otherwise.
    """
    cf = cudnn_geometry(geom, dtype)
    copies = [to_channels_first(a) for a in arrays]
    with named_as(geom):
        if beta is None:
            result = op(*copies, cf)
        else:
            prior = to_channels_first(out) if out is not None and float(beta) != 0.0 else None
            result = op(*copies, cf, prior, beta)
    return to_channels_last(result, out)


def to_channels_first(a: Any) -> Any:  # pragma: gpu
    """A C-contiguous channels-first copy of a channels-last array (channels moved from the
    last axis to axis 1; weights (K, *kernel, C/g) alike)."""
    import cupy as cp

    return cp.ascontiguousarray(cp.moveaxis(a, -1, 1))


def to_channels_last(a_cf: Any, out: Any = None) -> Any:  # pragma: gpu
    """a_cf in channels-last order: written into `out` when given, else a new C-contiguous
    array. Returns it."""
    import cupy as cp

    view = cp.moveaxis(a_cf, 1, -1)
    if out is None:
        return cp.ascontiguousarray(view)
    out[...] = view
    return out
