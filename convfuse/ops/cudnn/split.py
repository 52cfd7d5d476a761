"""A convolution too large for cuDNN's 32-bit descriptors, run as parts of its batch.

Note [batch split]
cuDNN describes a tensor with int dims and strides, so a tensor of more than 2**31 - 1
elements cannot be described (plan/descriptors.check_elements refuses it). A convolution
is independent per sample, so where its x or y (a residual has y's shape) is too large but
one sample of each fits, the cuDNN engine runs it as consecutive parts of the batch, each
part a view of the caller's arrays (the leading rows of a C-contiguous array are
contiguous in either layout) with a plan of its own:
- the forward and the data gradient write their rows of the output (whose prior rows a
  beta != 0 blends into, row by row);
- the filter and the bias gradients sum over the batch: the first part blends with the
  caller's beta, the later ones accumulate (beta = 1).
A part holds as many samples as fit (rounded down so that every part starts on a 16-byte
boundary of x and y, where that leaves it a sample), so a convolution has at most two part
geometries (a full part and the remainder), hence at most two plans. PyTorch splits its cuDNN
convolutions the same way (split_batch_dim_to_32bit_out in aten/src/ATen/native/cudnn/
Conv_v7.cpp). Not split, and still refused by the plan with TensorTooLargeError: a weight
too large, and a single sample too large (splitting spatial dims changes the arithmetic at
the seams). The elementwise kernels index in 64 bits (kernels/activation.cu) and run over
the whole arrays. Batch normalization and pooling are not split: their statistics and
windows are not per-part questions the same way, and PyTorch runs them natively there.

The parts of a geometry are computed once and kept on it (`parts`), so a call that fits
pays one dictionary lookup for this.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ...plan.descriptors import MAX_ELEMENTS
from .device import DeviceArray

#: (part geometry, first row, end row) for each part of one call
Parts = tuple[tuple[Any, int, int], ...]


def parts(geom: Any) -> Parts | None:
    """None where every tensor cuDNN describes for `geom` (a ConvGeometry, or a
    ConvTransposeGeometry, whose tensors are its forward convolution's) fits a descriptor,
    or where splitting the batch cannot help (the plan then refuses with
    TensorTooLargeError); else the parts of Note [batch split]. Kept on the geometry (an
    immutable value; its __dict__ holds its other cached answers too)."""
    try:
        return geom.__dict__["_batch_parts"]
    except KeyError:
        found = geom.__dict__["_batch_parts"] = _split(geom)
        return found


def _split(geom: Any) -> Parts | None:
    if not geom.input_shape[0]:  # an empty batch makes no cuDNN call (nor has a G)
        return None
    g = getattr(geom, "conv", geom)  # a transposed convolution's cuDNN tensors are G's
    n = int(g.input_shape[0])
    per_sample = max(math.prod(g.input_shape[1:]), math.prod(g.output_shape[1:]))
    if (n * per_sample <= MAX_ELEMENTS or per_sample > MAX_ELEMENTS
            or math.prod(g.weight_shape) > MAX_ELEMENTS):
        return None
    step = MAX_ELEMENTS // per_sample
    # parts start 16-byte aligned in x and in y, whatever the itemsize, as the ops require
    # of their arrays (ops/_checks.py) and cuDNN's vectorised kernels assume; where a part
    # holds too few samples for that, it holds as many as fit
    align = math.lcm(*(16 // math.gcd(16, math.prod(s[1:]))
                       for s in (g.input_shape, g.output_shape)))
    if step >= align:
        step -= step % align
    out: list[tuple[Any, int, int]] = []
    kinds: dict[int, Any] = {}
    for start in range(0, n, step):
        stop = min(start + step, n)
        size = stop - start
        if size not in kinds:
            kinds[size] = dataclasses.replace(
                geom, input_shape=(size, *geom.input_shape[1:]))
        out.append((kinds[size], start, stop))
    return tuple(out)


def rows(a: Any, start: int, stop: int) -> Any:
    """Rows start:stop of a C-contiguous array along its first axis: a view (None stays
    None). A DeviceArray's view keeps the whole array alive (it is its owner)."""
    if a is None:
        return None
    if isinstance(a, DeviceArray):
        row = a.nbytes // a.shape[0]
        return DeviceArray(a.ptr + start * row, (stop - start, *a.shape[1:]), a.dtype, a.ctx,
                           a)
    return a[start:stop]
