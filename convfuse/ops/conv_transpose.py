"""Transposed-convolution ops: validate, then run on the engine of the arrays (DESIGN.md
"Ops"). Each is one of the forward convolution G's calls with x and y swapped (Note
[transposed convolution as a swapped convolution] in convfuse/transpose_geometry.py).

The bias gradient (and, with an activation, dz) comes from the activation-backward +
bias-gradient op (`activation_backward_bias`) over the output: the fused kernel on the GPU,
never a generic reduction.
"""

from __future__ import annotations

from typing import Any

from .. import activations
from ..transpose_geometry import ConvTransposeGeometry
from . import _checks, validated
from ._checks import (
    Arg,
    check_activation,
    check_beta,
    check_data_grad_args,
    check_filter_grad_args,
    check_forward_args,
    check_fused_args,
    validate,
    zero_filled,
)


def check_transpose_geometry(op: str, tgeom: Any) -> ConvTransposeGeometry:
    if not isinstance(tgeom, ConvTransposeGeometry):
        raise TypeError(
            f"{op}: tgeom must be a ConvTransposeGeometry (ConvTransposeGeometry.create(...)), "
            f"got {type(tgeom).__name__}")
    return tgeom


def conv_transpose_bias_act(x: Any, w: Any, b: Any, tgeom: Any,
                            activation: str | None = "identity", residual: Any = None,
                            residual_scale: float = 1.0) -> tuple[Any, Any]:
    """y = act(conv_transpose(x, w) + b + residual_scale * residual); returns (y, z), z the
    pre-activation when the activation's backward needs it (elu, silu, gelu), else None."""
    op = "conv_transpose_bias_act"
    g = check_transpose_geometry(op, tgeom)
    xp, act, scale = check_fused_args(op, g, x, w, b, residual, activation, residual_scale)
    if g.batch == 0:
        z = xp.empty(g.output_shape, x.dtype) if activations.saves(act) == "preactivation" \
            else None
        return xp.empty(g.output_shape, x.dtype), z
    return validated.conv_transpose_bias_act(_checks.engine(xp, "conv_transpose"), x, w, b, g,
                                             act, residual, scale)


def conv_transpose_forward(x: Any, w: Any, tgeom: Any) -> Any:
    """y = conv_transpose(x, w), no bias and no activation (cudnnConvolutionBackwardData)."""
    op = "conv_transpose_forward"
    g = check_transpose_geometry(op, tgeom)
    xp = check_forward_args(op, g, x, w)
    if g.batch == 0:
        return xp.empty(g.output_shape, x.dtype)
    return _checks.engine(xp, "conv_transpose").conv_transpose_forward(x, w, g)


def conv_transpose_backward_data(dz: Any, w: Any, tgeom: Any, out: Any = None,
                                 beta: float = 0.0) -> Any:
    """dx = beta * out + conv(dz, w): the forward convolution G of the output gradient."""
    op = "conv_transpose_backward_data"
    g = check_transpose_geometry(op, tgeom)
    xp, bt = check_data_grad_args(op, g, dz, w, out, beta)
    if g.batch == 0:
        return out if out is not None else xp.empty(g.input_shape, dz.dtype)
    return validated.conv_transpose_backward_data(_checks.engine(xp, "conv_transpose"), dz, w, g,
                                                  out, bt)


def conv_transpose_backward_filter(x: Any, dz: Any, tgeom: Any, out: Any = None,
                                   beta: float = 0.0) -> Any:
    """dw = beta * out + G's filter gradient with x and dz swapped."""
    op = "conv_transpose_backward_filter"
    g = check_transpose_geometry(op, tgeom)
    xp, bt = check_filter_grad_args(op, g, x, dz, out, beta)
    if g.batch == 0:
        return zero_filled(xp, out, g.weight_shape, x.dtype, bt)
    return validated.conv_transpose_backward_filter(_checks.engine(xp, "conv_transpose"), x, dz, g,
                                                    out, bt)


def conv_transpose_activation_backward_bias(dy: Any, saved: Any, activation: str | None,
                                            tgeom: Any, db_out: Any = None,
                                            beta: float = 0.0) -> tuple[Any, Any]:
    """(dz, db): the activation's backward and db = beta * db_out + dz summed per channel,
    over the transposed convolution's output. On the GPU always convfuse's fused
    activation-backward + bias-gradient kernel: one read of dy and the saved tensor (for
    identity, db alone and dz is dy), whatever config.bias_grad says for convolutions."""
    op = "conv_transpose_activation_backward_bias"
    g = check_transpose_geometry(op, tgeom)
    act = check_activation(op, activation)
    if activations.saves(act) != "none" and saved is None:
        raise ValueError(f"{op}: activation {act!r} needs saved (what the forward saved), "
                         "got None")
    bt = check_beta(op, beta, db_out, "db_out")
    xp = validate(op, [
        Arg("dy", dy, g.output_shape), Arg("saved", saved, g.output_shape, optional=True),
        Arg("db_out", db_out, g.bias_shape, optional=True, output=True),
    ], g.layout)
    if g.batch == 0:
        return xp.empty(g.output_shape, dy.dtype), zero_filled(xp, db_out, g.bias_shape,
                                                                dy.dtype, bt)
    return validated.conv_transpose_activation_backward_bias(
        _checks.engine(xp, "conv_transpose"), dy, saved, act, g, db_out, bt)


def conv_transpose_backward_bias(dz: Any, tgeom: Any, out: Any = None,
                                 beta: float = 0.0) -> Any:
    """db = beta * out + dz summed over all axes but the channels; shape (out_channels,).
    The bias-only mode of the activation-backward + bias-gradient kernel on the GPU."""
    return conv_transpose_activation_backward_bias(dz, None, "identity", tgeom, out, beta)[1]
