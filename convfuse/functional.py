"""Fused convolution for users who keep their own parameters.

`conv_bias_act` is the forward, `conv_bias_act_backward` the matching backward. The forward
returns (or records) a `ConvContext` holding exactly what the backward needs:
- x, for the filter gradient;
- the weight, for the data gradient;
- one activation-sized tensor, the output or the pre-activation, per
  convfuse.activations Note [what backward saves].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from . import activations, ops
from .backend import array_module
from .errors import DeviceMismatchError
from .geometry import ConvGeometry, IntOrTuple


@dataclass(frozen=True)
class ConvContext:
    """What `conv_bias_act_backward` needs from the forward, and nothing more."""

    geom: ConvGeometry
    activation: str
    x: Any
    weight: Any
    saved: Any  # y, z or None (Note [what backward saves])
    has_bias: bool
    has_residual: bool
    residual_scale: float


class ConvGrads(NamedTuple):
    dx: Any
    dweight: Any
    dbias: Any
    dresidual: Any


def conv_bias_act_forward(
    x: Any,
    weight: Any,
    bias: Any = None,
    stride: IntOrTuple = 1,
    padding: IntOrTuple | str = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
    activation: str | None = None,
    residual: Any = None,
    residual_scale: float = 1.0,
    layout: str = "NCHW",
    geom: ConvGeometry | None = None,
) -> tuple[Any, ConvContext]:
    """act(conv(x, weight) + bias + residual_scale * residual), and the backward's context.

    On CuPy arrays identity and relu are one cudnnConvolutionBiasActivationForward call;
    other activations add exactly one activation kernel. On NumPy arrays the reference
    engine computes the same thing. Pass `geom` to skip re-validating a known geometry.
    """
    act = activations.normalize(activation)
    array_module(x, weight, bias, residual)  # refuses NumPy/CuPy mixes up front
    if geom is None:
        geom = ConvGeometry.create(x.shape, weight.shape, stride, padding, dilation, groups, layout)
    y, z = ops.conv_bias_act(
        x, weight, bias, geom, activation=act, residual=residual,
        residual_scale=float(residual_scale),
    )
    kind = activations.saves(act)
    saved = {"none": None, "output": y, "preactivation": z}[kind]
    ctx = ConvContext(
        geom, act, x, weight, saved, bias is not None, residual is not None, float(residual_scale)
    )
    return y, ctx


def conv_bias_act(
    x: Any,
    weight: Any,
    bias: Any = None,
    stride: IntOrTuple = 1,
    padding: IntOrTuple | str = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
    activation: str | None = None,
    residual: Any = None,
    residual_scale: float = 1.0,
    layout: str = "NCHW",
) -> Any:
    """The forward alone: act(conv(x, weight) + bias + residual_scale * residual)."""
    y, _ = conv_bias_act_forward(
        x, weight, bias, stride, padding, dilation, groups, activation, residual,
        residual_scale, layout,
    )
    return y


def conv_bias_act_backward(
    dy: Any,
    ctx: ConvContext,
    *,
    need_dx: bool = True,
    dweight: Any = None,
    dbias: Any = None,
    accumulate: bool = False,
) -> ConvGrads:
    """Gradients of `conv_bias_act` w.r.t. x, weight, bias and residual.

    `dweight`/`dbias`, when given, are written in place; with `accumulate=True` the new
    gradient is added to what they hold (cuDNN's beta = 1, so no extra kernel). The bias
    gradient comes from cudnnConvolutionBackwardBias or the fused activation-backward +
    bias kernel (convfuse.config bias_grad), never from a generic reduction.
    """
    geom = ctx.geom
    _check_dy(dy, ctx)
    beta = 1.0 if accumulate else 0.0
    db = None
    if ctx.activation == "identity":
        dz = dy
        if ctx.has_bias:
            db = ops.conv_backward_bias(dz, geom, out=dbias, beta=beta)
    elif ctx.has_bias:
        dz, db = ops.activation_backward_bias(
            dy, ctx.saved, ctx.activation, geom, db_out=dbias, beta=beta
        )
    else:
        dz = ops.activation_backward(dy, ctx.saved, ctx.activation)
    dw = ops.conv_backward_filter(ctx.x, dz, geom, out=dweight, beta=beta)
    dx = ops.conv_backward_data(dz, ctx.weight, geom) if need_dx else None
    dres = None
    if ctx.has_residual:
        # dz may be the caller's dy (identity): hand back a new array, never an alias.
        dres = dz * ctx.residual_scale if (ctx.residual_scale != 1.0 or dz is dy) else dz
    return ConvGrads(dx, dw, db, dres)


def _check_dy(dy: Any, ctx: ConvContext) -> None:
    try:
        xp = array_module(dy, ctx.x)
    except DeviceMismatchError as exc:
        raise DeviceMismatchError(
            f"dy and the forward's input are on different devices: {exc}"
        ) from None
    del xp
    if tuple(dy.shape) != ctx.geom.output_shape:
        raise ValueError(
            f"dy has shape {tuple(dy.shape)}, but the forward's output has shape "
            f"{ctx.geom.output_shape} ({ctx.geom.layout})"
        )
    if dy.dtype != ctx.x.dtype:
        raise ValueError(f"dy has dtype {dy.dtype}, but the forward ran in {ctx.x.dtype}")
