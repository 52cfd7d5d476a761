"""Fused transposed convolution for users who keep their own parameters: the counterpart
of convfuse.functional's conv_bias_act for ConvTranspose, with the same contracts
(contiguous copies of non-contiguous inputs, TypeErrors naming the argument, read-only
saved tensors on the CPU, every output buffer checked before the first write).

The context holds x (for the filter gradient), the weight (for the data gradient) and one
output-sized tensor (the output or the pre-activation, Note [what backward saves]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import ops
from .backend import device_of
from .errors import ConvfuseError
from .functional import (
    ConvGrads,
    _array,
    _bias_act_backward,
    _check_dy,
    _check_outputs,
    _fused_args,
    _residual_grad,
    _saved,
    check_device_outputs,
    check_geometry_types,
    released,
    with_signature_names,
)
from .geometry import IntOrTuple
from .transpose_geometry import ConvTransposeGeometry


@dataclass(frozen=True)
class ConvTransposeContext:
    """What `conv_transpose_bias_act_backward` needs from the forward, and nothing more."""

    geom: ConvTransposeGeometry
    activation: str
    x: Any
    weight: Any
    saved: Any  # y, z or None (Note [what backward saves])
    has_bias: bool
    has_residual: bool
    residual_scale: float


def conv_transpose_bias_act_forward(
    x: Any,
    weight: Any,
    bias: Any = None,
    stride: IntOrTuple = 1,
    padding: IntOrTuple = 0,
    output_padding: IntOrTuple = 0,
    groups: int = 1,
    dilation: IntOrTuple = 1,
    activation: str | None = None,
    residual: Any = None,
    residual_scale: float = 1.0,
    layout: str = "NCHW",
    output_size: Sequence[int] | None = None,
    geom: ConvTransposeGeometry | None = None,
) -> tuple[Any, ConvTransposeContext]:
    """act(conv_transpose(x, weight) + bias + residual_scale * residual), and the context.

    Arguments follow torch.nn.functional.conv_transpose2d's order. On CuPy arrays this is
    one cudnnConvolutionBackwardData and at most one pass of the bias + activation kernel
    (none without bias, residual and activation). Pass `geom` to skip re-validation.
    """
    try:
        return _forward(x, weight, bias, stride, padding, output_padding, groups, dilation,
                        activation, residual, residual_scale, layout, output_size, geom)
    except (TypeError, ValueError, ConvfuseError) as exc:
        raise with_signature_names(exc, "conv_transpose_bias_act") from None


def _forward(x: Any, weight: Any, bias: Any, stride: Any, padding: Any, output_padding: Any,
             groups: Any, dilation: Any, activation: Any, residual: Any, residual_scale: Any,
             layout: Any, output_size: Any, geom: Any) -> tuple[Any, ConvTransposeContext]:
    op = "conv_transpose_bias_act"
    x, weight, bias, residual, act, scale = _fused_args(op, x, weight, bias, residual,
                                                        activation, residual_scale)
    if geom is None:
        from ._memory import check_bytes, check_conv

        check_geometry_types(op, stride=stride, padding=padding, output_padding=output_padding,
                             dilation=dilation, groups=groups, layout=layout,
                             output_size=output_size)
        geom = ConvTransposeGeometry.create(x.shape, weight.shape, stride, padding,
                                            output_padding, dilation, groups, layout,
                                            output_size)
        check_bytes(geom.output_shape, x.dtype, device_of(x), "output")
        if geom.batch:
            check_conv(geom.conv, x.dtype, device_of(x))
    elif not isinstance(geom, ConvTransposeGeometry):
        raise TypeError(f"{op}: geom must be a ConvTransposeGeometry or None, got "
                        f"{type(geom).__name__}")
    y, z = ops.conv_transpose_bias_act(x, weight, bias, geom, activation=act,
                                       residual=residual, residual_scale=scale)
    ctx = ConvTransposeContext(geom, act, x, weight, _saved(act, y, z), bias is not None,
                               residual is not None, scale)
    return y, ctx


def conv_transpose_bias_act_known(x: Any, weight: Any, bias: Any, residual: Any, act: str,
                                  scale: float, geom: ConvTransposeGeometry
                                  ) -> tuple[Any, ConvTransposeContext]:
    """The forward of a signature already checked (functional.conv_bias_act_known's
    contract): only the op's own checks run again."""
    y, z = ops.conv_transpose_bias_act(x, weight, bias, geom, activation=act,
                                       residual=residual, residual_scale=scale)
    ctx = ConvTransposeContext(geom, act, x, weight, _saved(act, y, z), bias is not None,
                               residual is not None, scale)
    return y, ctx


def conv_transpose_bias_act(x: Any, weight: Any, bias: Any = None, stride: IntOrTuple = 1,
                            padding: IntOrTuple = 0, output_padding: IntOrTuple = 0,
                            groups: int = 1, dilation: IntOrTuple = 1,
                            activation: str | None = None, residual: Any = None,
                            residual_scale: float = 1.0, layout: str = "NCHW",
                            output_size: Sequence[int] | None = None) -> Any:
    """The forward alone (its y writable: nothing is kept for a backward)."""
    y, _ = conv_transpose_bias_act_forward(x, weight, bias, stride, padding, output_padding,
                                           groups, dilation, activation, residual,
                                           residual_scale, layout, output_size)
    return released(y)


def conv_transpose_bias_act_backward(dy: Any, ctx: ConvTransposeContext, *,
                                     need_dx: bool = True, dweight: Any = None,
                                     dbias: Any = None, accumulate: bool = False) -> ConvGrads:
    """Gradients w.r.t. x, weight, bias and residual (conv_bias_act_backward's contract).

    db (and dz, with an activation) come from one activation-backward + bias-gradient pass
    over dy and the saved tensor; dw from G's filter gradient with x and dy swapped; dx
    from G's forward convolution of dz.
    """
    try:
        return _backward(dy, ctx, need_dx, dweight, dbias, accumulate)
    except (TypeError, ValueError, ConvfuseError) as exc:
        raise with_signature_names(exc, "conv_transpose_bias_act_backward") from None


def _backward(dy: Any, ctx: Any, need_dx: Any, dweight: Any, dbias: Any,
              accumulate: Any) -> ConvGrads:
    op = "conv_transpose_bias_act_backward"
    if not isinstance(ctx, ConvTransposeContext):
        raise TypeError(f"{op}: ctx must be the ConvTransposeContext "
                        f"conv_transpose_bias_act_forward returned, got {type(ctx).__name__}")
    given, dy = dy, _array(op, "dy", dy)
    geom = ctx.geom
    _check_dy(dy, ctx)
    _check_outputs(op, dy, ctx, dweight, dbias, accumulate, given, need_dx)
    if not isinstance(dy, np.ndarray):  # pragma: gpu
        check_device_outputs(op, dweight, dbias)
    beta = 1.0 if accumulate else 0.0
    dz, db = _bias_act_backward(dy, ctx, dbias, beta, ops.conv_transpose_backward_bias,
                                ops.conv_transpose_activation_backward_bias)
    dw = ops.conv_transpose_backward_filter(ctx.x, dz, geom, out=dweight, beta=beta)
    dx = ops.conv_transpose_backward_data(dz, ctx.weight, geom) if need_dx else None
    return ConvGrads(dx, dw, db, _residual_grad(dy, dz, ctx))
