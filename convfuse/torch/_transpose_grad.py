"""Double backward for convfuse.torch's ConvTranspose: a differentiable backward.

Note [transposed convolution double backward]
The fused backward op (_transpose_ops.py) is opaque, so a backward run with
create_graph=True (gradient penalties: WGAN-GP, R1) instead composes ops autograd can
differentiate again: the activation's backward in torch ops on the saved y or z (which
keep their grad_fn), a plain sum for db, and three custom ops closed under
differentiation, the transposed convolution's three linear maps (Note [transposed
convolution as a swapped convolution]):
    data(x, w)          = conv_transpose(x, w)          = BackwardData_G(x, w)
    grad_input(dy, w)   = d<y, dy>/dx                   = Forward_G(dy, w)
    grad_weight(x, dy)  = d<y, dy>/dw                   = BackwardFilter_G(dy, x)
whose gradients are each other:
    data:        gx = grad_input(g, w),  gw = grad_weight(x, g)
    grad_input:  gdy = data(g, w),       gw = grad_weight(g, dy)
    grad_weight: gx = grad_input(dy, g), gdy = data(x, g)
so any order of derivative runs on convfuse's engines. The activations' derivatives are
torch's formulas on the saved tensor, so where a second derivative is undefined (relu's
kink) the result is torch's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import activations, ops
from ..geometry import from_channels_first
from ._arrays import (
    empty_in_layout,
    engine_context,
    is_channels_last,
    logical,
    physical,
    to_array,
    to_tensor,
)

Hyper = tuple[list[int], list[int], list[int], list[int], int]


def _geom(x_shape: Sequence[int], w_shape: Sequence[int], h: Hyper, cl: bool) -> Any:
    from ._transpose_ops import _geometry

    stride, padding, output_padding, dilation, groups = h
    return _geometry(tuple(x_shape), tuple(w_shape), tuple(stride), tuple(padding),
                     tuple(output_padding), tuple(dilation), int(groups), cl)


@torch.library.custom_op("convfuse::conv_transpose_data", mutates_args=())
def data(x: torch.Tensor, w: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
         output_padding: Sequence[int], dilation: Sequence[int], groups: int) -> torch.Tensor:
    """conv_transpose(x, w), no bias, no activation."""
    cl = is_channels_last(x)
    h = (list(stride), list(padding), list(output_padding), list(dilation), int(groups))
    xp, wp = physical(x, cl), physical(w, cl)
    geom = _geom(xp.shape, wp.shape, h, cl)
    with engine_context(x.device):
        return logical(to_tensor(ops.conv_transpose_forward(to_array(xp), to_array(wp), geom)),
                      cl)


@torch.library.custom_op("convfuse::conv_transpose_grad_input", mutates_args=())
def grad_input(dy: torch.Tensor, w: torch.Tensor, x_size: Sequence[int],
               stride: Sequence[int], padding: Sequence[int], output_padding: Sequence[int],
               dilation: Sequence[int], groups: int) -> torch.Tensor:
    """The input gradient of conv_transpose for an input of size `x_size`."""
    cl = is_channels_last(dy)
    h = (list(stride), list(padding), list(output_padding), list(dilation), int(groups))
    wp = physical(w, cl)
    geom = _geom(from_channels_first(x_size, cl), wp.shape, h, cl)
    out = torch.empty(geom.input_shape, dtype=dy.dtype, device=dy.device)
    with engine_context(dy.device):
        ops.conv_transpose_backward_data(to_array(physical(dy, cl)), to_array(wp), geom,
                                         out=to_array(out))
    return logical(out, cl)


@torch.library.custom_op("convfuse::conv_transpose_grad_weight", mutates_args=())
def grad_weight(x: torch.Tensor, dy: torch.Tensor, w_size: Sequence[int],
                stride: Sequence[int], padding: Sequence[int], output_padding: Sequence[int],
                dilation: Sequence[int], groups: int) -> torch.Tensor:
    """The weight gradient of conv_transpose for a weight of size `w_size`."""
    cl = is_channels_last(x)
    h = (list(stride), list(padding), list(output_padding), list(dilation), int(groups))
    xp = physical(x, cl)
    geom = _geom(xp.shape, from_channels_first(w_size, cl), h, cl)
    out = torch.empty(geom.weight_shape, dtype=x.dtype, device=x.device)
    with engine_context(x.device):
        ops.conv_transpose_backward_filter(to_array(xp), to_array(physical(dy, cl)), geom,
                                           out=to_array(out))
    return logical(out, cl)


@data.register_fake
def _(x, w, stride, padding, output_padding, dilation, groups):
    from ._transpose_ops import output_shape

    return empty_in_layout(x, output_shape(x.shape, w.shape, stride, padding, output_padding,
                                           dilation, groups), is_channels_last(x))


@grad_input.register_fake
def _(dy, w, x_size, stride, padding, output_padding, dilation, groups):
    return empty_in_layout(dy, x_size, is_channels_last(dy))


@grad_weight.register_fake
def _(x, dy, w_size, stride, padding, output_padding, dilation, groups):
    return empty_in_layout(x, w_size, is_channels_last(x))


def _hyper_setup(ctx: Any, inputs: tuple, first: int) -> None:
    ctx.h = tuple(inputs[first:])
    ctx.save_for_backward(inputs[0], inputs[1])


def _data_backward(ctx: Any, g: torch.Tensor) -> tuple:
    x, w = ctx.saved_tensors
    gx = grad_input(g, w, list(x.shape), *ctx.h) if ctx.needs_input_grad[0] else None
    gw = grad_weight(x, g, list(w.shape), *ctx.h) if ctx.needs_input_grad[1] else None
    return (gx, gw, *([None] * 5))


def _grad_input_backward(ctx: Any, g: torch.Tensor) -> tuple:
    dy, w = ctx.saved_tensors
    gdy = data(g, w, *ctx.h) if ctx.needs_input_grad[0] else None
    gw = grad_weight(g, dy, list(w.shape), *ctx.h) if ctx.needs_input_grad[1] else None
    return (gdy, gw, *([None] * 6))


def _grad_weight_backward(ctx: Any, g: torch.Tensor) -> tuple:
    x, dy = ctx.saved_tensors
    gx = grad_input(dy, g, list(x.shape), *ctx.h) if ctx.needs_input_grad[0] else None
    gdy = data(x, g, *ctx.h) if ctx.needs_input_grad[1] else None
    return (gx, gdy, *([None] * 6))


data.register_autograd(_data_backward,
                       setup_context=lambda ctx, inputs, output: _hyper_setup(ctx, inputs, 2))
grad_input.register_autograd(
    _grad_input_backward, setup_context=lambda ctx, inputs, output: _hyper_setup(ctx, inputs, 3))
grad_weight.register_autograd(
    _grad_weight_backward, setup_context=lambda ctx, inputs, output: _hyper_setup(ctx, inputs, 3))


def activation_backward(dy: torch.Tensor, saved: torch.Tensor | None,
                        activation: str) -> torch.Tensor:
    """dz from dy and the saved y (or z for silu and gelu), in torch ops: differentiable,
    with torch's derivatives (Note [what backward saves])."""
    act = activations.normalize(activation)
    if act == "identity":
        return dy
    assert saved is not None
    s = saved
    if act == "relu":
        return dy * (s > 0)
    if act == "relu6":
        return dy * ((s > 0) & (s < 6))
    if act == "leaky_relu":
        return dy * torch.where(s > 0, 1.0, 0.01).to(dy.dtype)
    if act == "elu":
        return dy * torch.where(s > 0, torch.ones_like(s), s + 1)
    if act == "sigmoid":
        return dy * s * (1 - s)
    if act == "tanh":
        return dy * (1 - s * s)
    if act == "silu":
        sig = torch.sigmoid(s)
        return dy * sig * (1 + s * (1 - sig))
    if act == "gelu":
        cdf = 0.5 * (1 + torch.erf(s * 0.7071067811865476))
        pdf = torch.exp(-0.5 * s * s) * 0.3989422804014327
        return dy * (cdf + s * pdf)
    raise ValueError(f"no differentiable backward for activation {act!r}")


def differentiable_backward(dy: torch.Tensor, dz_extra: torch.Tensor | None, x: torch.Tensor,
                            weight: torch.Tensor, saved: torch.Tensor | None, h: Hyper,
                            activation: str, needs: Sequence[bool],
                            has_bias: bool) -> tuple:
    """The gradients of conv_transpose_bias_act's inputs, as differentiable torch ops."""
    dz = activation_backward(dy, saved, activation)
    if dz_extra is not None:
        dz = dz + dz_extra
    need_dx, need_dw, need_db, need_dres = needs
    dx = grad_input(dz, weight, list(x.shape), *h) if need_dx else None
    dw = grad_weight(x, dz, list(weight.shape), *h) if need_dw else None
    db = dz.sum([d for d in range(dz.dim()) if d != 1]) if (need_db and has_bias) else None
    return dx, dw, db, (dz if need_dres else None)
