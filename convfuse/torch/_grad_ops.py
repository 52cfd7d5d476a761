"""Differentiable pieces of convfuse's backward passes, for gradients of any order.

The layers' first-order backward is one fused op each (`conv_bias_act_backward`,
`batchnorm_backward`). Double backward (gradient penalties: WGAN-GP, R1) needs the backward
itself to be differentiable, so with create_graph=True the layers build it from the ops
below instead (Note [two backward paths] in _double.py):

- `convfuse::conv_forward(x, w)`, `convfuse::conv_data_grad(dz, w, input_size)` and
  `convfuse::conv_filter_grad(x, dz, weight_size)`: the three convolution primitives. They
  are each other's derivatives (Note [three convolutions]), so each one's autograd formula
  calls the other two and every order of derivative stays on convfuse's engines (NumPy or
  cuDNN, through convfuse.ops). A transposed convolution is `conv_data_grad` of its input
  with the transposed geometry, and gets its gradients from the same formulas (Note
  [transposed convolution double backward] in _double.py).
- `convfuse::activation_grad(dy, saved, activation)`: dz = dy * act'(.) from what the
  forward saved (Note [what backward saves] in convfuse.activations), on convfuse's engine;
  its derivative with respect to `saved` is written with torch elementwise ops
  (Note [second derivatives of the activations]).

Outputs are ordinary tensors (no views), laid out as the first tensor argument: channels
last in, channels last out (Note [layouts across the bridge]). Empty inputs give empty
outputs (and a zero filter gradient) without calling convfuse, which refuses zero sizes.

Note [three convolutions]
With B(x, w, dz) = <dz, conv(x, w)>, trilinear: conv(x, w) = dB/d(dz),
conv_data_grad(dz, w) = dB/dx and conv_filter_grad(x, dz) = dB/dw. Differentiating
<g, dB/dx> = B(g, w, dz) and <g, dB/dw> = B(x, g, dz) gives
- conv_forward(x, w):      d/dx = data_grad(g, w),   d/dw = filter_grad(x, g);
- conv_data_grad(dz, w):   d/ddz = conv(g, w),       d/dw = filter_grad(g, dz);
- conv_filter_grad(x, dz): d/dx = data_grad(dz, g),  d/ddz = conv(x, g).
data_grad takes the input's size: with stride > 1 several input sizes give one output size.

Note [second derivatives of the activations]
d(dz)/d(dy) is the activation's own backward (the op again, on convfuse's engine). The
derivative with respect to `saved` is dy * h(saved), one or two elementwise products per
activation, used only with create_graph=True:
- relu, relu6, leaky_relu: 0 (act' is piecewise constant; torch's threshold_backward,
  hardtanh_backward and leaky_relu_backward have zero derivative in `self` too, and the
  kinks take act's first-derivative rule at exactly 0 and 6, which the op applies);
- sigmoid (saved y): dy * (1 - 2y);  tanh (saved y): -2 dy y;
- elu (saved z, dz = dy exp(z) for z <= 0): dy exp(z) where z < 0, else 0; strictly below
  0 as torch's elu_double_backward (is_result=False: elu_backward times (z < 0)), so at
  z = 0 and at a NaN z the second derivative is 0 as in torch;
- silu (saved z): dy s (1 - s) (2 + z (1 - 2s)), s = sigmoid(z);
- gelu (saved z, exact erf form): dy phi(z) (2 - z^2), phi the normal density.
These are written with torch's elementwise ops rather than new convfuse kernels: each is a
memory-bound product that a kernel would not speed up noticeably next to the convolutions
of a double backward, and torch's ops are differentiable again, so third and higher
derivatives come for free. Through `saved` = y the chain rule continues into the layer's
forward (y = act(z)), which is why y itself, not a copy, is what the layers save (and z,
where they save z: Note [two backward paths] in _double.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .. import activations, ops
from ..geometry import ConvGeometry, conv_output_size, from_channels_first
from . import _autocast
from ._arrays import (
    empty_in_layout,
    geometry,
    is_channels_last,
    logical,
    physical,
    tensor_context,
    to_array,
    to_tensor,
)

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _layout(t: torch.Tensor) -> bool:
    """The layout every op here runs in and returns (channels-last or not): its first
    tensor argument's, so a channels-last tensor costs no copy. The one place to change
    when an op must return another memory format (a transposed convolution's output
    following torch.nn's rule, say); each op and its fake implementation call it."""
    return is_channels_last(t)


def _geometry(x_shape: Sequence[int], w_shape: Sequence[int], stride: Sequence[int],
              padding: Sequence[int], dilation: Sequence[int], groups: int,
              channels_last: bool) -> ConvGeometry:
    return geometry(ConvGeometry, from_channels_first(x_shape, channels_last),
                    from_channels_first(w_shape, channels_last), channels_last, stride,
                    padding, dilation, groups)


def conv_output_shape(x_shape: Sequence[int], w_shape: Sequence[int], stride: Sequence[int],
                      padding: Sequence[int], dilation: Sequence[int]) -> list[int]:
    """conv(x, w)'s logical (N, C, *spatial) shape (symbolic sizes stay symbolic)."""
    spatial = [conv_output_size(n, k, s, p, d) for n, k, s, p, d in
               zip(x_shape[2:], w_shape[2:], stride, padding, dilation)]
    return [x_shape[0], w_shape[0], *spatial]


# --- convolution primitives ------------------------------------------------------------

@torch.library.custom_op("convfuse::conv_forward", mutates_args=())
def conv_forward(x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int],
                 padding: Sequence[int], dilation: Sequence[int],
                 groups: int) -> torch.Tensor:
    """conv(x, weight): no bias, no activation."""
    cl = _layout(x)
    shape = conv_output_shape(x.shape, weight.shape, stride, padding, dilation)
    if x.numel() == 0 or 0 in shape:
        return empty_in_layout(x, shape, cl)
    geom = _geometry(x.shape, weight.shape, stride, padding, dilation, groups, cl)
    with tensor_context(x):
        y = to_tensor(ops.conv_forward(to_array(physical(x, cl)),
                                       to_array(physical(weight, cl)), geom))
    return logical(y, cl)


@conv_forward.register_fake
def _(x, weight, stride, padding, dilation, groups):
    shape = conv_output_shape(x.shape, weight.shape, stride, padding, dilation)
    return empty_in_layout(x, shape, _layout(x))


@torch.library.custom_op("convfuse::conv_data_grad", mutates_args=())
def conv_data_grad(dz: torch.Tensor, weight: torch.Tensor, input_size: Sequence[int],
                   stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                   groups: int) -> torch.Tensor:
    """The gradient of conv(x, weight) with respect to x (of size `input_size`), given the
    output's gradient dz; also a transposed convolution of dz."""
    cl = _layout(dz)
    out = empty_in_layout(dz, input_size, cl)
    if out.numel() == 0:
        return out
    if dz.numel() == 0:
        return out.zero_()
    geom = _geometry(input_size, weight.shape, stride, padding, dilation, groups, cl)
    with tensor_context(dz):
        ops.conv_backward_data(to_array(physical(dz, cl)), to_array(physical(weight, cl)),
                               geom, out=to_array(physical(out, cl)))
    return out


@conv_data_grad.register_fake
def _(dz, weight, input_size, stride, padding, dilation, groups):
    return empty_in_layout(dz, input_size, _layout(dz))


@torch.library.custom_op("convfuse::conv_filter_grad", mutates_args=())
def conv_filter_grad(x: torch.Tensor, dz: torch.Tensor, weight_size: Sequence[int],
                     stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                     groups: int) -> torch.Tensor:
    """The gradient of conv(x, w) with respect to w (of size `weight_size`), given the
    output's gradient dz."""
    cl = _layout(x)
    out = empty_in_layout(x, weight_size, cl)
    if x.numel() == 0 or dz.numel() == 0:
        return out.zero_()
    geom = _geometry(x.shape, weight_size, stride, padding, dilation, groups, cl)
    with tensor_context(x):
        ops.conv_backward_filter(to_array(physical(x, cl)), to_array(physical(dz, cl)),
                                 geom, out=to_array(physical(out, cl)))
    return out


@conv_filter_grad.register_fake
def _(x, dz, weight_size, stride, padding, dilation, groups):
    return empty_in_layout(x, weight_size, _layout(x))


def _save_conv(ctx, inputs, output) -> None:
    a, b, *rest = inputs
    ctx.save_for_backward(a, b)
    ctx.hyper = [list(v) if isinstance(v, (list, tuple)) else int(v) for v in rest]


def _conv_forward_backward(ctx, g):
    x, w = ctx.saved_tensors
    stride, padding, dilation, groups = ctx.hyper
    need_x, need_w = ctx.needs_input_grad[:2]
    dx = torch.ops.convfuse.conv_data_grad(g, w, list(x.shape), stride, padding, dilation,
                                           groups) if need_x else None
    dw = torch.ops.convfuse.conv_filter_grad(x, g, list(w.shape), stride, padding, dilation,
                                             groups) if need_w else None
    return dx, dw, None, None, None, None


def _conv_data_grad_backward(ctx, g):
    dz, w = ctx.saved_tensors
    _, stride, padding, dilation, groups = ctx.hyper
    need_dz, need_w = ctx.needs_input_grad[:2]
    gdz = torch.ops.convfuse.conv_forward(g, w, stride, padding, dilation,
                                          groups) if need_dz else None
    gw = torch.ops.convfuse.conv_filter_grad(g, dz, list(w.shape), stride, padding, dilation,
                                             groups) if need_w else None
    return gdz, gw, None, None, None, None, None


def _conv_filter_grad_backward(ctx, g):
    x, dz = ctx.saved_tensors
    _, stride, padding, dilation, groups = ctx.hyper
    need_x, need_dz = ctx.needs_input_grad[:2]
    gx = torch.ops.convfuse.conv_data_grad(dz, g, list(x.shape), stride, padding, dilation,
                                           groups) if need_x else None
    gdz = torch.ops.convfuse.conv_forward(x, g, stride, padding, dilation,
                                          groups) if need_dz else None
    return gx, gdz, None, None, None, None, None


conv_forward.register_autograd(_conv_forward_backward, setup_context=_save_conv)
conv_data_grad.register_autograd(_conv_data_grad_backward, setup_context=_save_conv)
conv_filter_grad.register_autograd(_conv_filter_grad_backward, setup_context=_save_conv)


# --- activation backward -----------------------------------------------------------------

@torch.library.custom_op("convfuse::activation_grad", mutates_args=())
def activation_grad(dy: torch.Tensor, saved: torch.Tensor | None,
                    activation: str) -> torch.Tensor:
    """dz = dy * act'(.) from the forward's saved tensor (y, or z for elu, silu and gelu)."""
    act = activations.normalize(activation)
    cl = _layout(dy)
    out = empty_in_layout(dy, dy.shape, cl)
    if out.numel() == 0:
        return out
    if act == "identity":
        return out.copy_(dy)
    with tensor_context(dy):
        ops.activation_backward(to_array(physical(dy, cl)),
                                None if saved is None else to_array(physical(saved, cl)), act,
                                out=to_array(physical(out, cl)))
    return out


@activation_grad.register_fake
def _(dy, saved, activation):
    return empty_in_layout(dy, dy.shape, _layout(dy))


def second_derivative_term(dy: torch.Tensor, saved: torch.Tensor, act: str
                           ) -> torch.Tensor | None:
    """The elementwise factor t with d<g, dz>/d(saved) = g * t for dz = activation_grad(dy,
    saved), or None where it is zero (Note [second derivatives of the activations])."""
    if act == "sigmoid":
        return dy * (1 - 2 * saved)
    if act == "tanh":
        return -2 * dy * saved
    if act == "elu":  # exp of min(z, 0): no inf whose masked gradient would be 0 * inf
        return dy * torch.where(saved < 0, torch.exp(saved.clamp(max=0)), 0)
    if act == "silu":
        s = torch.sigmoid(saved)
        return dy * s * (1 - s) * (2 + saved * (1 - 2 * s))
    if act == "gelu":
        return dy * torch.exp(-0.5 * saved * saved) * _INV_SQRT_2PI * (2 - saved * saved)
    return None  # identity, relu, relu6, leaky_relu


def _save_activation(ctx, inputs, output) -> None:
    dy, saved, activation = inputs
    ctx.save_for_backward(dy, saved)
    ctx.act = activations.normalize(activation)


def _activation_grad_backward(ctx, g):
    dy, saved = ctx.saved_tensors
    need_dy, need_saved = ctx.needs_input_grad[:2]
    gdy = torch.ops.convfuse.activation_grad(g, saved, ctx.act) if need_dy else None
    gsaved = None
    if need_saved and saved is not None:
        term = second_derivative_term(dy, saved, ctx.act)
        # Zero where the activation is piecewise linear, as a tensor, not None: torch.nn's
        # ReLU backward (threshold_backward) reports its zero this way, so what `saved` came
        # from still gets a gradient (a batch norm's bias: zeros, not "unused" in a penalty)
        gsaved = torch.zeros_like(saved) if term is None else g * term
    return gdy, gsaved, None


activation_grad.register_autograd(_activation_grad_backward, setup_context=_save_activation)

for _op in (conv_forward, conv_data_grad, conv_filter_grad):
    _autocast.register_conv(_op)  # conv_data_grad is also a transposed conv's forward
