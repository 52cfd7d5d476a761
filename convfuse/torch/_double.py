"""The layers' backward passes built from differentiable pieces (_grad_ops.py), used when
autograd records the backward itself (create_graph=True): double backward and beyond.

Note [two backward paths]
Autograd runs a backward with grad mode equal to create_graph. When it is off (every
ordinary training step, and torch.compile's traced backward), the layers keep their one
fused backward op (`conv_bias_act_backward`, `batchnorm_backward`): one call, convfuse's
fused activation-backward + bias kernel, only the gradients asked for. When it is on, the
same gradients are composed from ops that have autograd formulas of their own:
activation_grad, then conv_data_grad / conv_filter_grad (Conv) or the batch-norm formulas
below (BatchNorm), so torch.autograd.grad(..., create_graph=True) returns gradients that
can be differentiated again, to any order. The fused path is also left when the forward's
pre-activation output z (elu, silu and gelu keep it) received a gradient of its own: then
the gradient at the pre-activation is act'(z) dy + dz, which the fused op does not take.

The layers save y (or z, for elu, silu and gelu) as their forward returned it, not a
detached copy: in a recorded backward, a gradient reaching `saved` flows on through the
forward's autograd node, which is how act'' meets the chain rule (Note [second derivatives
of the activations] in _grad_ops.py). For the same reason z is a differentiable output for
elu, silu and gelu (the layers discard it; nothing reaches it in a first-order backward)
and the forward's autograd node does not materialise zero gradients for unused outputs.

Note [transposed convolution double backward]
A transposed convolution is the data gradient of the convolution G it is built on (Note
[transposed convolution as a swapped convolution]), so its recorded backward needs no ops
of its own: with gz the gradient at its pre-activation, dx = conv_forward(gz, w) and
dw = conv_filter_grad(gz, x) of G (_grad_ops.py; torch's (in, out/groups, *k) weight is
G's as it is), and their derivatives are Note [three convolutions]'s. An output_padding at
or above the stride makes G's output larger than the transposed one: gz is then placed into
G's output at ConvTransposeGeometry's `window_slices` with `F.pad` (cropping where a pad is
negative), a torch op whose derivative is the opposite crop and pad, to any order.

Note [batch norm's backward with torch ops]
In the recorded path the batch norm's own part of the backward (everything after the
activation) is written with torch's reductions and elementwise ops, and the batch
statistics are recomputed from x there (two reductions) instead of taking the forward's
saved mean and invstd: the second derivative with respect to x runs through the
statistics, and differentiating the statistics' formulas is exactly what autograd does
for these ops. A convfuse op would buy nothing here: these are per-channel reductions and
broadcasts, memory-bound, once per recorded backward, and the fused kernels of
convfuse.ops.batchnorm_backward have no derivative of their own. In evaluation mode (running
statistics) mean and invstd are the forward's, constants as in torch. Half-precision data
computes in float32 (convfuse's compute dtype) and the results are rounded once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .. import activations
from ..transpose_geometry import ConvTransposeGeometry
from . import _autocast
from ._arrays import geometry


def takes_recorded_path(dz_output: torch.Tensor | None,
                        dy: torch.Tensor | None = None) -> bool:
    """Whether a layer's backward must leave its fused op (Note [two backward paths]).

    Under torch.compile a gradient for z is only ever a placeholder: dynamo hands one for
    every output of an autograd.Function's backward, and compiled graphs do not support
    double backward, the only way a real one arises (z is discarded by the layers).

    A batched dy (autograd.grad's is_grads_batched, a vectorized jacobian or hessian,
    gradcheck's batched check: torch's legacy vmap) takes it too: the engines take plain
    arrays, the recorded path torch's ops, which vmap batches. (The eager paths' nodes do
    not ask this per call: they take it when reading such a dy fails, see `batched`.)"""
    if torch.is_grad_enabled():
        return True
    if dy is not None and not torch.compiler.is_compiling() and batched(dy):
        return True  # (dynamo traces no such query, and batches nothing this way)
    return (dz_output is not None and bool(dz_output.numel())
            and not torch.compiler.is_compiling())


_legacy_batched = torch._C._functorch.is_legacy_batchedtensor


def batched(dy: torch.Tensor | None) -> bool:
    """Whether `dy` is batched by torch's legacy vmap (takes_recorded_path). The eager
    paths' backward asks only after reading dy as an array failed: a query per call would
    cost every backward host time for a rare case."""
    return dy is not None and bool(_legacy_batched(dy))


def _channel_dims(t: torch.Tensor) -> list[int]:
    return [d for d in range(t.dim()) if d != 1]


def _bias_grad(g: torch.Tensor) -> torch.Tensor:
    return g.sum(_channel_dims(g))


def preactivation_grad(dy: torch.Tensor | None, dz_out: torch.Tensor | None,
                       saved: torch.Tensor | None, activation: str) -> torch.Tensor | None:
    """The gradient at the pre-activation: act'(.) dy (+ the gradient that reached the
    forward's z output), differentiable; None when neither gradient exists."""
    g = None
    if dy is not None:
        act = activations.normalize(activation)
        g = dy if act == "identity" else torch.ops.convfuse.activation_grad(dy, saved, act)
    if dz_out is not None and dz_out.numel():
        g = dz_out if g is None else g + dz_out
    return g


def _conv_grads(ctx: Any, g: torch.Tensor | None, dx_fn: Any, dw_fn: Any,
                nonetensor: int) -> tuple[Any, ...]:
    """(dx, dw, db, dres) from the gradient g at the pre-activation, each only where
    autograd asks for it, then None for the `nonetensor` non-tensor arguments."""
    if g is None:
        return (None,) * (4 + nonetensor)
    need_dx, need_dw, need_db, need_dres = ctx.needs_input_grad[:4]
    dev = g.device.type
    if _autocast.enabled(dev):
        # A recorded backward inside an autocast region (a gradient penalty under AMP):
        # torch's convolution_backward has no autocast rule and keeps the forward's dtypes,
        # where the convolution ops here, which are also forwards, would be cast
        with torch.autocast(dev, enabled=False):
            return _conv_grads(ctx, g, dx_fn, dw_fn, nonetensor)
    return (dx_fn(g) if need_dx else None, dw_fn(g) if need_dw else None,
            _bias_grad(g) if need_db and ctx.has_bias else None, g if need_dres else None,
            *(None,) * nonetensor)


def conv_backward(ctx: Any, dy: torch.Tensor | None, dz_out: torch.Tensor | None,
                  x: torch.Tensor, weight: torch.Tensor, saved: torch.Tensor | None,
                  stride: list[int], padding: list[int], dilation: list[int], groups: int,
                  activation: str) -> tuple[Any, ...]:
    """conv_bias_act's input gradients (x, weight, bias, residual) from differentiable ops
    (Note [two backward paths]); the 5 non-tensor arguments get None."""
    return _conv_grads(
        ctx, preactivation_grad(dy, dz_out, saved, activation),
        lambda g: torch.ops.convfuse.conv_data_grad(g, weight, list(x.shape), stride,
                                                    padding, dilation, groups),
        lambda g: torch.ops.convfuse.conv_filter_grad(x, g, list(weight.shape), stride,
                                                      padding, dilation, groups), 5)


def conv_transpose_backward(ctx: Any, dy: torch.Tensor | None, dz_out: torch.Tensor | None,
                            x: torch.Tensor, weight: torch.Tensor, saved: torch.Tensor | None,
                            stride: list[int], padding: list[int],
                            output_padding: list[int], dilation: list[int], groups: int,
                            activation: str) -> tuple[Any, ...]:
    """conv_transpose_bias_act's input gradients (x, weight, bias, residual) from
    differentiable ops (Note [transposed convolution double backward]); the 6 non-tensor
    arguments get None."""
    tgeom = geometry(ConvTransposeGeometry, x.shape, weight.shape, False, stride, padding,
                     output_padding, dilation, groups)  # logical shapes: channels-first
    g_pad = list(tgeom.conv.padding)
    window: list[int] = []  # F.pad's (low, high) per spatial dim, last dim first
    if tgeom.windowed:
        _, theirs = tgeom.window_slices
        for where, size, out in zip(theirs[2:], tgeom.conv.input_shape[2:],
                                    tgeom.output_shape[2:]):
            window[:0] = [where.start, size - where.start - out]

    def g_out(g: torch.Tensor) -> torch.Tensor:
        return F.pad(g, window) if window else g

    return _conv_grads(
        ctx, preactivation_grad(dy, dz_out, saved, activation),
        lambda g: torch.ops.convfuse.conv_forward(g_out(g), weight, stride, g_pad, dilation,
                                                  groups),
        lambda g: torch.ops.convfuse.conv_filter_grad(g_out(g), x, list(weight.shape),
                                                      stride, g_pad, dilation, groups), 6)


def batchnorm_backward(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                       mean: torch.Tensor, invstd: torch.Tensor, use_batch_stats: bool,
                       eps: float, need: tuple[bool, bool, bool]
                       ) -> tuple[torch.Tensor | None, ...]:
    """(dx, dweight, dbias) of batchnorm(x) given the gradient g at its output, in torch ops
    (Note [batch norm's backward with torch ops])."""
    need_dx, need_dw, need_db = need
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    dims = _channel_dims(x)
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    xf, gf = x.to(cd), g.to(cd)
    if use_batch_stats:
        mu = xf.mean(dims, keepdim=True)
        invstd_t = ((xf - mu).square().mean(dims, keepdim=True) + eps).rsqrt()
    else:
        mu, invstd_t = mean.to(cd).view(shape), invstd.to(cd).view(shape)
    xhat = (xf - mu) * invstd_t
    dx = dw = db = None
    if need_dx:
        scale = invstd_t if weight is None else invstd_t * weight.to(cd).view(shape)
        if use_batch_stats:
            gx = gf - gf.mean(dims, keepdim=True) \
                - xhat * (gf * xhat).mean(dims, keepdim=True)
        else:
            gx = gf
        dx = (gx * scale).to(x.dtype)
    if need_dw and weight is not None:
        dw = (gf * xhat).sum(dims).to(weight.dtype)
    if need_db and weight is not None:
        db = gf.sum(dims).to(weight.dtype)
    return dx, dw, db
