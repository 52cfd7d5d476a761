"""Convolution ops: validate, then run on the engine of the arrays (DESIGN.md "Ops").

An empty batch (N = 0) is validated like any other and reaches no engine: empty outputs,
and zero (or beta-scaled) weight and bias gradients, as torch.nn gives them.
"""

from __future__ import annotations

from typing import Any

from .. import activations
from . import _checks, validated
from ._checks import (
    Arg,
    check_beta,
    check_data_grad_args,
    check_filter_grad_args,
    check_forward_args,
    check_fused_args,
    check_geometry,
    validate,
    zero_filled,
)


def conv_bias_act(x: Any, w: Any, b: Any, geom: Any, activation: str | None = "identity",
                  residual: Any = None, residual_scale: float = 1.0) -> tuple[Any, Any]:
    """y = act(conv(x, w) + b + residual_scale * residual); returns (y, z).

    z is the pre-activation, returned only when the activation's backward needs it
    (activations.saves(act) == "preactivation": elu, silu, gelu), else None. b and residual
    may be None.
    """
    op = "conv_bias_act"
    g = check_geometry(op, geom)
    xp, act, scale = check_fused_args(op, g, x, w, b, residual, activation, residual_scale)
    if g.batch == 0:
        z = xp.empty(g.output_shape, x.dtype) if activations.saves(act) == "preactivation" \
            else None
        return xp.empty(g.output_shape, x.dtype), z
    return validated.conv_bias_act(_checks.engine(xp, "conv"), x, w, b, g, act, residual, scale)


def conv_forward(x: Any, w: Any, geom: Any) -> Any:
    """y = conv(x, w), no bias and no activation."""
    op = "conv_forward"
    g = check_geometry(op, geom)
    xp = check_forward_args(op, g, x, w)
    if g.batch == 0:
        return xp.empty(g.output_shape, x.dtype)
    return _checks.engine(xp, "conv").conv_forward(x, w, g)


def conv_backward_data(dz: Any, w: Any, geom: Any, out: Any = None, beta: float = 0.0) -> Any:
    """dx = beta * out + conv_transpose(dz, w)."""
    op = "conv_backward_data"
    g = check_geometry(op, geom)
    xp, b = check_data_grad_args(op, g, dz, w, out, beta)
    if g.batch == 0:
        return out if out is not None else xp.empty(g.input_shape, dz.dtype)
    return validated.conv_backward_data(_checks.engine(xp, "conv"), dz, w, g, out, b)


def conv_backward_filter(x: Any, dz: Any, geom: Any, out: Any = None, beta: float = 0.0) -> Any:
    """dw = beta * out + (gradient of the convolution with respect to w)."""
    op = "conv_backward_filter"
    g = check_geometry(op, geom)
    xp, b = check_filter_grad_args(op, g, x, dz, out, beta)
    if g.batch == 0:
        return zero_filled(xp, out, g.weight_shape, x.dtype, b)
    return validated.conv_backward_filter(_checks.engine(xp, "conv"), x, dz, g, out, b)


def conv_backward_bias(dz: Any, geom: Any, out: Any = None, beta: float = 0.0) -> Any:
    """db = beta * out + dz summed over every axis but the channels; shape (K,)."""
    op = "conv_backward_bias"
    g = check_geometry(op, geom)
    b = check_beta(op, beta, out)
    xp = validate(op, [
        Arg("dz", dz, g.output_shape),
        Arg("out", out, g.bias_shape, optional=True, output=True),
    ], g.layout)
    if g.batch == 0:
        return zero_filled(xp, out, g.bias_shape, dz.dtype, b)
    return validated.conv_backward_bias(_checks.engine(xp, "conv"), dz, g, out, b)
