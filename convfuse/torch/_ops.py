"""convfuse's fused convolution as two opaque PyTorch custom ops, with autograd.

`torch.ops.convfuse.conv_bias_act` (forward) and `torch.ops.convfuse.conv_bias_act_backward`
are `torch.library.custom_op`s with fake (meta) implementations, and the forward's
gradient is registered with `register_autograd`. So `torch.compile(model, fullgraph=True)`
sees each layer as one op in the forward graph and one in the backward graph, with no graph
break, and never traces into NumPy or CuPy.

Both ops work on the tensors' memory through convfuse's stateless ops (convfuse.ops), with
the layout rules of Note [layouts across the bridge] and, on CUDA, PyTorch's stream and
allocator (Note [CUDA streams and memory]). The backward is convfuse's own: the bias
gradient comes from cudnnConvolutionBackwardBias or the fused activation-backward + bias
kernel (never a PyTorch reduction), and only the gradients autograd asks for are computed
(`ctx.needs_input_grad`): the first layer of a network computes no dx.

Custom ops may return neither None nor an input, so gradients that were not asked for come
back as empty tensors (never read), and the residual's gradient for an identity activation
(which is dy itself) is handed out by the autograd formula, not by the op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import activations, ops
from ..geometry import ConvGeometry
from . import _autocast, _double
from ._arrays import (
    conv_channels_last,
    empty_in_layout,
    engine_context,
    geometry,
    logical,
    physical,
    to_array,
    to_tensor,
)
from ._grad_ops import conv_output_shape  # and registers the differentiable ops


def _array_or_none(t: torch.Tensor | None, channels_last: bool) -> object:
    return None if t is None else to_array(physical(t, channels_last))


@torch.library.custom_op("convfuse::conv_bias_act", mutates_args=())
def conv_bias_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  residual: torch.Tensor | None, stride: Sequence[int], padding: Sequence[int],
                  dilation: Sequence[int], groups: int,
                  activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, z): y = act(conv(x, weight) + bias + residual); z is the pre-activation when the
    activation's backward needs it (silu, gelu), else an empty tensor. Both are in the
    memory format torch.nn's convolution returns (Note [layouts across the bridge])."""
    cl = conv_channels_last(x, weight, stride, padding, dilation, groups)
    xp, wp = physical(x, cl), physical(weight, cl)
    geom = geometry(ConvGeometry, xp.shape, wp.shape, cl, stride, padding, dilation, groups)
    with engine_context(x.device):
        y, z = ops.conv_bias_act(
            to_array(xp), to_array(wp), None if bias is None else to_array(bias), geom,
            activation=activation, residual=_array_or_none(residual, cl),
        )
        yt = logical(to_tensor(y), cl)
        zt = logical(to_tensor(z), cl) if z is not None else x.new_empty(0)
    return yt, zt


@conv_bias_act.register_fake
def _(x, weight, bias, residual, stride, padding, dilation, groups, activation):
    cl = conv_channels_last(x, weight, stride, padding, dilation, groups)
    shape = conv_output_shape(x.shape, weight.shape, stride, padding, dilation)
    y = empty_in_layout(x, shape, cl)
    if activations.saves(activation) == "preactivation":
        return y, empty_in_layout(x, y.shape, cl)
    return y, x.new_empty(0)


@torch.library.custom_op("convfuse::conv_bias_act_backward", mutates_args=())
def conv_bias_act_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, saved: torch.Tensor | None,
    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], groups: int,
    activation: str, need_dx: bool, need_dw: bool, need_db: bool, need_dz: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db, dz) of conv_bias_act, each computed only when its `need_*` is set
    (else an empty tensor). dz is the pre-activation's gradient, which is the residual's;
    for identity it is dy itself, so the op never returns it then."""
    cl = conv_channels_last(x, weight, stride, padding, dilation, groups)
    xp, wp = physical(x, cl), physical(weight, cl)
    geom = geometry(ConvGeometry, xp.shape, wp.shape, cl, stride, padding, dilation, groups)
    return fused_backward(dy, x, weight, saved, xp, wp, geom, cl, activation,
                          (need_dx, need_dw, need_db, need_dz), CONV_BACKWARD)


#: The convfuse.ops functions a fused backward calls, by name (looked up at each call):
#: bias gradient, activation backward + bias gradient, filter gradient, data gradient.
CONV_BACKWARD = ("conv_backward_bias", "activation_backward_bias", "conv_backward_filter",
                 "conv_backward_data")


def fused_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   saved: torch.Tensor | None, xp: torch.Tensor, wp: torch.Tensor, geom: Any,
                   cl: bool, activation: str, needs: tuple[bool, bool, bool, bool],
                   names: tuple[str, str, str, str],
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The body of a fused backward op (conv_bias_act's or conv_transpose_bias_act's):
    (dx, dw, db, dz), each only when asked (else an empty tensor), with convfuse's fused
    activation-backward + bias-gradient kernel; `names` are the ops to call."""
    bias_grad, act_bias_grad, filter_grad, data_grad = (getattr(ops, n) for n in names)
    need_dx, need_dw, need_db, need_dz = needs
    act = activations.normalize(activation)
    # Outputs PyTorch owns: allocated here in the forward's layout (ordinary tensors, not
    # views), written by convfuse through `out=` on their physical views.
    dx_t = empty_in_layout(x, x.shape, cl) if need_dx else None
    dw_t = empty_in_layout(weight, weight.shape, cl) if need_dw else None
    db_t = torch.empty(geom.out_channels, dtype=x.dtype, device=x.device) if need_db else None
    with engine_context(x.device):
        dya = to_array(physical(dy, cl))
        sa = _array_or_none(saved, cl)
        db_a = None if db_t is None else to_array(db_t)
        if act == "identity":
            dz = dya
            if need_db:
                bias_grad(dz, geom, out=db_a)
        elif need_db:
            dz, _ = act_bias_grad(dya, sa, act, geom, db_out=db_a)
        else:
            dz = ops.activation_backward(dya, sa, act)
        if dw_t is not None:  # need_dw
            filter_grad(to_array(xp), dz, geom, out=to_array(physical(dw_t, cl)))
        if dx_t is not None:  # need_dx
            data_grad(dz, to_array(wp), geom, out=to_array(physical(dx_t, cl)))
        dz_t = logical(to_tensor(dz), cl) if (need_dz and act != "identity") else None
    empty = dy.new_empty(0)
    return (
        dx_t if dx_t is not None else empty,
        dw_t if dw_t is not None else empty.clone(),
        db_t if db_t is not None else empty.clone(),
        dz_t if dz_t is not None else empty.clone(),
    )


@conv_bias_act_backward.register_fake
def _(dy, x, weight, saved, stride, padding, dilation, groups, activation, need_dx, need_dw,
      need_db, need_dz):
    cl = conv_channels_last(x, weight, stride, padding, dilation, groups)
    return empty_backward(dy, x, weight, cl, activation, weight.shape[0],
                          (need_dx, need_dw, need_db, need_dz))


def empty_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, cl: bool,
                   activation: str, out_channels: int, needs: tuple[bool, bool, bool, bool],
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `fused_backward` returns, unwritten: the fake implementations' outputs."""
    need_dx, need_dw, need_db, need_dz = needs
    act = activations.normalize(activation)
    dx = empty_in_layout(x, x.shape, cl) if need_dx else dy.new_empty(0)
    dw = empty_in_layout(weight, weight.shape, cl) if need_dw else dy.new_empty(0)
    db = dy.new_empty(out_channels) if need_db else dy.new_empty(0)
    dz = empty_in_layout(dy, dy.shape, cl) if (need_dz and act != "identity") \
        else dy.new_empty(0)
    return dx, dw, db, dz


def register_fused_autograd(forward: Any, backward_op: Any, recorded: str) -> None:
    """Autograd for a fused forward op `forward(x, weight, bias, residual, *hyper,
    activation) -> (y, z)` (conv_bias_act, conv_transpose_bias_act): its fused backward op
    `backward_op(dy, x, weight, saved, *hyper, activation, need_dx, need_dw, need_db,
    need_dz)`, or _double's function named `recorded`, (ctx, dy, dz, x, weight, saved,
    *hyper, activation), when the backward itself is recorded (Note [two backward paths]
    in _double.py)."""

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, weight, bias, _residual, *hyper, activation = inputs
        y, z = output
        kind = activations.saves(activation)
        saved = {"none": None, "output": y, "preactivation": z}[kind]
        ctx.save_for_backward(x, weight, saved)
        ctx.hyper = [list(h) if isinstance(h, (list, tuple)) else int(h) for h in hyper]
        ctx.activation = activation
        ctx.has_bias = bias is not None
        # z stays differentiable where it is saved (Note [two backward paths] in
        # _double.py), and an unused z must not look like a gradient.
        if kind != "preactivation":
            ctx.mark_non_differentiable(z)
        ctx.set_materialize_grads(False)

    def backward(ctx: Any, dy: torch.Tensor | None,
                 dz_output: torch.Tensor | None) -> tuple[Any, ...]:
        x, weight, saved = ctx.saved_tensors
        activation, rest = ctx.activation, (None,) * (len(ctx.hyper) + 1)
        if _double.takes_recorded_path(dz_output):
            return getattr(_double, recorded)(ctx, dy, dz_output, x, weight, saved,
                                              *ctx.hyper, activation)
        need_dx, need_dw, need_db, need_dres = ctx.needs_input_grad[:4]
        need_db = bool(need_db and ctx.has_bias)
        identity = activations.normalize(activation) == "identity"
        if dy is None:  # y itself fed nothing that needs a gradient
            return (None,) * 4 + rest
        dx, dw, db, dz = backward_op(dy, x, weight, saved, *ctx.hyper, activation,
                                     bool(need_dx), bool(need_dw), need_db,
                                     bool(need_dres) and not identity)
        dres = (dy if identity else dz) if need_dres else None
        return (dx if need_dx else None, dw if need_dw else None, db if need_db else None,
                dres, *rest)

    forward.register_autograd(backward, setup_context=setup_context)


register_fused_autograd(conv_bias_act, torch.ops.convfuse.conv_bias_act_backward,
                        "conv_backward")
_autocast.register_conv(conv_bias_act)
