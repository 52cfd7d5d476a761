"""convfuse's fused transposed convolution as two opaque PyTorch custom ops, with autograd.

`torch.ops.convfuse.conv_transpose_bias_act` (forward) and
`torch.ops.convfuse.conv_transpose_bias_act_backward` follow _ops.py's conv ops exactly:
`torch.library.custom_op`s with fake implementations and the forward's gradient registered
with `register_autograd`, so `torch.compile(fullgraph=True)` sees one op per layer in each
graph and never traces into NumPy or CuPy; layouts per Note [layouts across the bridge],
CUDA streams and memory per Note [CUDA streams and memory]. They run convfuse.ops'
transposed-convolution ops (Note [transposed convolution as a swapped convolution]): the
forward is G's data gradient, the backward G's forward (dx) and filter gradient (dw), and
db with dz from the fused activation-backward + bias-gradient kernel. Only the gradients
autograd asks for are computed.

As for conv_bias_act, a backward run with create_graph=True is composed of differentiable
ops instead (Note [transposed convolution double backward] in _double.py), and the forward
has an autocast kernel that casts like torch's conv_transpose (Note [autocast]).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import activations, ops
from ..transpose_geometry import ConvTransposeGeometry, transpose_output_size
from . import _autocast, _double
from ._arrays import (
    empty_in_layout,
    engine_context,
    geometry,
    is_channels_last,
    logical,
    physical,
    to_array,
    to_tensor,
)
from ._ops import _array_or_none, fused_backward


def output_shape(x_shape: Sequence[int], w_shape: Sequence[int], stride: Sequence[int],
                 padding: Sequence[int], output_padding: Sequence[int],
                 dilation: Sequence[int], groups: int) -> list[int]:
    """The logical (N, C, *spatial) output shape; weight in PyTorch's (in, out/g, *k)."""
    spatial = [transpose_output_size(n, k, s, p, d, o) for n, k, s, p, d, o in
               zip(x_shape[2:], w_shape[2:], stride, padding, dilation, output_padding)]
    return [x_shape[0], w_shape[1] * groups, *spatial]


@torch.library.custom_op("convfuse::conv_transpose_bias_act", mutates_args=())
def conv_transpose_bias_act(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    residual: torch.Tensor | None, stride: Sequence[int], padding: Sequence[int],
    output_padding: Sequence[int], dilation: Sequence[int], groups: int, activation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, z): y = act(conv_transpose(x, weight) + bias + residual); z is the
    pre-activation when the activation's backward needs it (silu, gelu), else empty."""
    cl = is_channels_last(x)
    xp, wp = physical(x, cl), physical(weight, cl)
    geom = geometry(ConvTransposeGeometry, xp.shape, wp.shape, cl, stride, padding,
                    output_padding, dilation, groups)
    with engine_context(x.device):
        y, z = ops.conv_transpose_bias_act(
            to_array(xp), to_array(wp), None if bias is None else to_array(bias), geom,
            activation=activation, residual=_array_or_none(residual, cl))
        yt = logical(to_tensor(y), cl)
        zt = logical(to_tensor(z), cl) if z is not None else x.new_empty(0)
    return yt, zt


@conv_transpose_bias_act.register_fake
def _(x, weight, bias, residual, stride, padding, output_padding, dilation, groups, activation):
    cl = is_channels_last(x)
    shape = output_shape(x.shape, weight.shape, stride, padding, output_padding, dilation,
                         groups)
    y = empty_in_layout(x, shape, cl)
    if activations.saves(activation) == "preactivation":
        return y, empty_in_layout(x, shape, cl)
    return y, x.new_empty(0)


@torch.library.custom_op("convfuse::conv_transpose_bias_act_backward", mutates_args=())
def conv_transpose_bias_act_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, saved: torch.Tensor | None,
    stride: Sequence[int], padding: Sequence[int], output_padding: Sequence[int],
    dilation: Sequence[int], groups: int, activation: str, need_dx: bool, need_dw: bool,
    need_db: bool, need_dz: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db, dz), each computed only when its `need_*` is set (else empty). dz is the
    pre-activation's gradient (the residual's); for identity it is dy, never returned."""
    cl = is_channels_last(x)
    xp, wp = physical(x, cl), physical(weight, cl)
    geom = geometry(ConvTransposeGeometry, xp.shape, wp.shape, cl, stride, padding,
                    output_padding, dilation, groups)
    return fused_backward(dy, x, weight, saved, xp, wp, geom, cl, activation,
                          (need_dx, need_dw, need_db, need_dz), _BACKWARD)


_BACKWARD = ("conv_transpose_backward_bias", "conv_transpose_activation_backward_bias",
             "conv_transpose_backward_filter", "conv_transpose_backward_data")


@conv_transpose_bias_act_backward.register_fake
def _(dy, x, weight, saved, stride, padding, output_padding, dilation, groups, activation,
      need_dx, need_dw, need_db, need_dz):
    cl = is_channels_last(x)
    act = activations.normalize(activation)
    dx = empty_in_layout(x, x.shape, cl) if need_dx else dy.new_empty(0)
    dw = empty_in_layout(weight, weight.shape, cl) if need_dw else dy.new_empty(0)
    db = dy.new_empty(weight.shape[1] * groups) if need_db else dy.new_empty(0)
    dz = empty_in_layout(dy, dy.shape, cl) if (need_dz and act != "identity") \
        else dy.new_empty(0)
    return dx, dw, db, dz


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, _residual, stride, padding, output_padding, dilation, groups, act = inputs
    y, z = output
    saved = {"none": None, "output": y, "preactivation": z}[activations.saves(act)]
    ctx.save_for_backward(x, weight, saved)
    ctx.hyper = (list(stride), list(padding), list(output_padding), list(dilation),
                 int(groups), act)
    ctx.has_bias = bias is not None
    # z is an output so that a double backward can differentiate through it; an unused z
    # must not look like a gradient (then the fused backward op would be skipped).
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dz_output):
    x, weight, saved = ctx.saved_tensors
    stride, padding, output_padding, dilation, groups, activation = ctx.hyper
    if _double.takes_recorded_path(dz_output):
        # Recorded backward (create_graph=True): Note [transposed convolution double
        # backward] in _double.py.
        return _double.conv_transpose_backward(ctx, dy, dz_output, x, weight, saved, stride,
                                               padding, output_padding, dilation, groups,
                                               activation)
    need_dx, need_dw, need_db, need_dres = ctx.needs_input_grad[:4]
    need_db = bool(need_db and ctx.has_bias)
    identity = activations.normalize(activation) == "identity"
    if dy is None:  # y itself fed nothing that needs a gradient
        return (None,) * 10
    dx, dw, db, dz = torch.ops.convfuse.conv_transpose_bias_act_backward(
        dy, x, weight, saved, stride, padding, output_padding, dilation, groups, activation,
        bool(need_dx), bool(need_dw), need_db, bool(need_dres) and not identity)
    dres = (dy if identity else dz) if need_dres else None
    return (dx if need_dx else None, dw if need_dw else None, db if need_db else None, dres,
            None, None, None, None, None, None)


conv_transpose_bias_act.register_autograd(_backward, setup_context=_setup_context)
_autocast.register_conv(conv_transpose_bias_act)
