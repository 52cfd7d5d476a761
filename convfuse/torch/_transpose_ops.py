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
from typing import Any

import torch

from .. import activations
from ..transpose_geometry import ConvTransposeGeometry, transpose_output_size
from . import _autocast, _functorch
from ._arrays import conv_channels_last, empty_in_layout
from ._ops import (
    call_fused,
    eager_function,
    empty_backward,
    fused_autograd,
    fused_backward,
    fused_forward,
    prepare,
    register_fused_autograd,
)
from ._signature import tensor_key


def output_shape(x_shape: Sequence[int], w_shape: Sequence[int], stride: Sequence[int],
                 padding: Sequence[int], output_padding: Sequence[int],
                 dilation: Sequence[int], groups: int) -> list[int]:
    """The logical (N, C, *spatial) output shape; weight in PyTorch's (in, out/g, *k)."""
    spatial = [transpose_output_size(n, k, s, p, d, o) for n, k, s, p, d, o in
               zip(x_shape[2:], w_shape[2:], stride, padding, dilation, output_padding)]
    return [x_shape[0], w_shape[1] * groups, *spatial]


def _conv_transpose_bias_act(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    residual: torch.Tensor | None, stride: Sequence[int], padding: Sequence[int],
    output_padding: Sequence[int], dilation: Sequence[int], groups: int, activation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, z): y = act(conv_transpose(x, weight) + bias + residual); z is the
    pre-activation when the activation's backward needs it (elu, silu, gelu), else empty."""
    prep = prepare(ConvTransposeGeometry, x, weight, (stride, padding, dilation, groups),
                   (tensor_key(bias), tensor_key(residual)), output_padding)
    return fused_forward("conv_transpose_bias_act", prep, x, weight, bias, residual,
                         activation)


conv_transpose_bias_act = torch.library.custom_op(
    "convfuse::conv_transpose_bias_act", _conv_transpose_bias_act, mutates_args=())


@conv_transpose_bias_act.register_fake
def _(x, weight, bias, residual, stride, padding, output_padding, dilation, groups, activation):
    cl = conv_channels_last(x, weight, stride, padding, dilation, groups, output_padding)
    shape = output_shape(x.shape, weight.shape, stride, padding, output_padding, dilation,
                         groups)
    y = empty_in_layout(x, shape, cl)
    if activations.saves(activation) == "preactivation":
        return y, empty_in_layout(x, shape, cl)
    return y, x.new_empty(0)


def _conv_transpose_bias_act_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, saved: torch.Tensor | None,
    stride: Sequence[int], padding: Sequence[int], output_padding: Sequence[int],
    dilation: Sequence[int], groups: int, activation: str, need_dx: bool, need_dw: bool,
    need_db: bool, need_dz: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db, dz), each computed only when its `need_*` is set (else empty). dz is the
    pre-activation's gradient (the residual's); for identity it is dy, never returned."""
    prep = prepare(ConvTransposeGeometry, x, weight, (stride, padding, dilation, groups),
                   (tensor_key(dy), tensor_key(saved)), output_padding)
    return fused_backward(dy, x, weight, saved, prep, activation,
                          (need_dx, need_dw, need_db, need_dz), BACKWARD)


conv_transpose_bias_act_backward = torch.library.custom_op(
    "convfuse::conv_transpose_bias_act_backward", _conv_transpose_bias_act_backward,
    mutates_args=())

BACKWARD = ("conv_transpose_backward_bias", "conv_transpose_activation_backward_bias",
             "conv_transpose_backward_filter", "conv_transpose_backward_data")


@conv_transpose_bias_act_backward.register_fake
def _(dy, x, weight, saved, stride, padding, output_padding, dilation, groups, activation,
      need_dx, need_dw, need_db, need_dz):
    cl = conv_channels_last(x, weight, stride, padding, dilation, groups, output_padding)
    return empty_backward(dy, x, weight, cl, activation,
                          weight.shape[1] * groups, (need_dx, need_dw, need_db, need_dz))


register_fused_autograd(conv_transpose_bias_act,
                        torch.ops.convfuse.conv_transpose_bias_act_backward,
                        "conv_transpose_backward")
_autocast.register_conv(conv_transpose_bias_act)

ConvTransposeBiasAct = eager_function(
    "ConvTransposeBiasAct", _conv_transpose_bias_act, _conv_transpose_bias_act_backward,
    "conv_transpose_backward")
TransformedConvTransposeBiasAct = _functorch.function(
    "TransformedConvTransposeBiasAct", torch.ops.convfuse.conv_transpose_bias_act,
    torch.ops.convfuse.conv_transpose_bias_act_backward,
    *fused_autograd(torch.ops.convfuse.conv_transpose_bias_act_backward,
                    "conv_transpose_backward"))


def conv_transpose_bias_act_call(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.ops.convfuse.conv_transpose_bias_act(*args), taking the eager path where it
    may."""
    return call_fused(torch.ops.convfuse.conv_transpose_bias_act, ConvTransposeBiasAct,
                      _conv_transpose_bias_act, args, TransformedConvTransposeBiasAct)
