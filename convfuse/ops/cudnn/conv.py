"""The convolution ops on CuPy arrays: one cuDNN call each, through a cached ConvPlan.

Outputs and workspace come from the call's ExecContext (CuPy's pool for CuPy arrays, the
caller's allocator for DeviceArrays: Note [the pointer path] in device.py); nothing else is
allocated per call (the zero bias for bias-free layers is cached per device, dtype and
channel count).

The fused forward and its fallbacks live in fused.py (Note [unfused fallback], Note
[forced algorithm versus speed]); running a plan's ranked algorithms in ranked.py; float64
channels-last convolutions run channels-first (Note [float64 runs channels-first] in
layout.py).

Note [nothing to fuse]
A conv_bias_act with no bias, no residual and an activation cuDNN does not apply (identity,
or one convfuse's kernel applies after: silu, gelu, ...) has nothing for the fused call to
fuse: it would be convolutionBiasActivationForward in IDENTITY mode, whose algorithm is
forced (Note [IDENTITY needs IMPLICIT_PRECOMP_GEMM]) and which reads a cached zero bias, to
compute what convolutionForward computes with the best-ranked algorithm. That is the
bias-free convolution before a batch norm, most convolutions of a ResNet or a MobileNet.
So it runs convolutionForward, one cuDNN call as before, with the plan's "fwd" choice (no
timing, no zero bias, no forward path recorded: the plan's fused question does not arise).
A bias, a residual or ReLU keeps the fused call.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from ... import activations, config
from ..._binding import cudnn
from ...errors import CudnnError
from ...plan import BiasGradFallbackWarning, Candidate, get_plan
from .. import elementwise
from . import fused, layout
from .device import context_of, is_device_array, on_cupy
from .handle import Workspace, get_handle
from .ranked import forward_into, refused, run_ranked, where
from .split import parts, rows

__all__ = ["AS_IMPORTED", "bind", "conv_backward_bias", "conv_backward_data",
           "conv_backward_filter", "conv_bias_act", "conv_forward", "refused"]


def conv_bias_act(x: Any, w: Any, b: Any, geom: Any, activation: str = "identity",
                  residual: Any = None,
                  residual_scale: float = 1.0) -> tuple[Any, Any]:  # pragma: gpu
    """y = act(conv(x, w) + b + residual_scale * residual) in one fused cuDNN call (one
    convolutionForward when there is nothing to fuse: Note [nothing to fuse]), plus one
    activation kernel when cuDNN cannot apply the activation itself (or the unfused path
    of Note [unfused fallback] when cuDNN refuses the fused call)."""
    if layout.runs_channels_first(geom, x.dtype):  # Note [float64 runs channels-first]
        if is_device_array(x):  # CuPy copies: Note [the pointer path]
            return on_cupy(conv_bias_act, x, w, b, geom, activation, residual, residual_scale)
        res = None if residual is None else layout.to_channels_first(residual)
        with layout.named_as(geom):
            y_cf, z_cf = _conv_bias_act(layout.to_channels_first(x),
                                        layout.to_channels_first(w), b,
                                        layout.cudnn_geometry(geom, x.dtype), activation, res,
                                        residual_scale)
        return (layout.to_channels_last(y_cf),
                None if z_cf is None else layout.to_channels_last(z_cf))
    return _conv_bias_act(x, w, b, geom, activation, residual, residual_scale)


def _conv_bias_act(x: Any, w: Any, b: Any, geom: Any, activation: str, residual: Any,
                   residual_scale: float) -> tuple[Any, Any]:  # pragma: gpu
    act = activations.normalize(activation)
    ctx = context_of(x)
    handle = get_handle(ctx)
    has_res = residual is not None
    split = parts(geom)
    if split is None:
        plan = get_plan(geom, x.dtype, act, has_res)
    else:  # Note [batch split]: every part's plan (and refusal) first
        plans = [get_plan(g, x.dtype, act, has_res) for g, _, _ in split]
    conv_out = ctx.empty(geom.output_shape, x.dtype)
    if split is None:
        _fused_into(plan, handle, ctx, x, w, b, residual, residual_scale, conv_out)
    else:
        for plan, (_, i, j) in zip(plans, split):
            _fused_into(plan, handle, ctx, rows(x, i, j), w, b, rows(residual, i, j),
                        residual_scale, rows(conv_out, i, j))
    if act in activations.FUSED_IN_CUDNN:
        return conv_out, None
    if activations.saves(act) == "preactivation":
        y = ctx.empty(geom.output_shape, x.dtype)
        elementwise.activation_forward(conv_out, act, y)
        return y, conv_out
    elementwise.activation_forward(conv_out, act, conv_out)
    return conv_out, None


def _fused_into(plan: Any, handle: Any, ctx: Any, x: Any, w: Any, b: Any, residual: Any,
                residual_scale: float, out: Any) -> None:  # pragma: gpu
    if b is None and residual is None and plan.key.activation == "identity":
        forward_into(plan, handle, ctx, x, w, out, "conv_bias_act")  # Note [nothing to fuse]
    else:
        fused.fused_forward(plan, handle, ctx, x, w, b, residual, float(residual_scale), out)


def conv_forward(x: Any, w: Any, geom: Any) -> Any:  # pragma: gpu
    if layout.runs_channels_first(geom, x.dtype):  # Note [float64 runs channels-first]
        if is_device_array(x):  # CuPy copies: Note [the pointer path]
            return on_cupy(conv_forward, x, w, geom)
        with layout.named_as(geom):
            y_cf = conv_forward(layout.to_channels_first(x), layout.to_channels_first(w),
                                layout.cudnn_geometry(geom, x.dtype))
        return layout.to_channels_last(y_cf)
    ctx = context_of(x)
    handle = get_handle(ctx)
    split = parts(geom)
    if split is None:
        plan = get_plan(geom, x.dtype)
    else:  # Note [batch split]: every part's plan (and refusal) first
        plans = [get_plan(g, x.dtype) for g, _, _ in split]
    y = ctx.empty(geom.output_shape, x.dtype)
    if split is None:
        forward_into(plan, handle, ctx, x, w, y, "conv_forward")
        return y
    for plan, (_, i, j) in zip(plans, split):
        forward_into(plan, handle, ctx, rows(x, i, j), w, rows(y, i, j), "conv_forward")
    return y


def conv_backward_data(dz: Any, w: Any, geom: Any, out: Any = None,
                       beta: float = 0.0) -> Any:  # pragma: gpu
    if layout.runs_channels_first(geom, dz.dtype):  # Note [float64 runs channels-first]
        if is_device_array(dz):  # CuPy copies: Note [the pointer path]
            return on_cupy(conv_backward_data, dz, w, geom, out, beta)
        start = _prior(out, beta)
        with layout.named_as(geom):
            dx_cf = conv_backward_data(layout.to_channels_first(dz),
                                       layout.to_channels_first(w),
                                       layout.cudnn_geometry(geom, dz.dtype), start, beta)
        return layout.to_channels_last(dx_cf, out)
    ctx = context_of(dz)
    handle = get_handle(ctx)
    split = parts(geom)
    if split is None:
        plan = get_plan(geom, dz.dtype)
    else:  # Note [batch split]: every part's plan (and refusal) first
        plans = [get_plan(g, dz.dtype) for g, _, _ in split]
    dx = out if out is not None else ctx.empty(geom.input_shape, dz.dtype)
    beta = float(beta) if out is not None else 0.0
    if split is None:
        data_into(plan, handle, ctx, w, dz, dx, beta)
        return dx
    for plan, (_, i, j) in zip(plans, split):  # each part writes its rows
        data_into(plan, handle, ctx, w, rows(dz, i, j), rows(dx, i, j), beta)
    return dx


def data_into(plan: Any, handle: Any, ctx: Any, w: Any, dz: Any, dx: Any, beta: float,
              what: str = "conv_backward_data") -> None:  # pragma: gpu
    """`plan`'s convolutionBackwardData of dz into dx, down its ranking (run_ranked); also
    a transposed convolution's forward (Note [transposed convolution as a swapped
    convolution]), `what` naming the op in errors."""

    def call(cand: Candidate, ws: Workspace) -> None:
        cudnn().convolutionBackwardData(
            handle, 1.0, plan.w_desc, w.data.ptr, plan.y_desc, dz.data.ptr,
            plan.conv_desc_for(cand), cand.algo, ws.ptr, ws.size, beta, plan.x_desc, dx.data.ptr)

    run_ranked(plan, "bwd_data", handle, (w.data.ptr, dz.data.ptr), ctx, call, what)


def conv_backward_filter(x: Any, dz: Any, geom: Any, out: Any = None,
                         beta: float = 0.0) -> Any:  # pragma: gpu
    if layout.runs_channels_first(geom, x.dtype):  # Note [float64 runs channels-first]
        if is_device_array(x):  # CuPy copies: Note [the pointer path]
            return on_cupy(conv_backward_filter, x, dz, geom, out, beta)
        start = _prior(out, beta)
        with layout.named_as(geom):
            dw_cf = conv_backward_filter(layout.to_channels_first(x),
                                         layout.to_channels_first(dz),
                                         layout.cudnn_geometry(geom, x.dtype), start, beta)
        return layout.to_channels_last(dw_cf, out)
    ctx = context_of(x)
    handle = get_handle(ctx)
    split = parts(geom)
    if split is None:
        plan = get_plan(geom, x.dtype)
    else:  # Note [batch split]: every part's plan (and refusal) first
        plans = [get_plan(g, x.dtype) for g, _, _ in split]
    dw = out if out is not None else ctx.empty(geom.weight_shape, x.dtype)
    beta = float(beta) if out is not None else 0.0
    if split is None:
        filter_into(plan, handle, ctx, x, dz, dw, beta)
        return dw
    for plan, (_, i, j) in zip(plans, split):  # the later parts accumulate
        filter_into(plan, handle, ctx, rows(x, i, j), rows(dz, i, j), dw,
                     beta if i == 0 else 1.0)
    return dw


def filter_into(plan: Any, handle: Any, ctx: Any, x: Any, dz: Any, dw: Any, beta: float,
                what: str = "conv_backward_filter") -> None:  # pragma: gpu
    """`plan`'s convolutionBackwardFilter of (x, dz) into dw, down its ranking; also a
    transposed convolution's filter gradient (x and dz swapped), `what` naming the op."""

    def call(cand: Candidate, ws: Workspace) -> None:
        cudnn().convolutionBackwardFilter(
            handle, 1.0, plan.x_desc, x.data.ptr, plan.y_desc, dz.data.ptr,
            plan.conv_desc_for(cand), cand.algo, ws.ptr, ws.size, beta, plan.w_desc, dw.data.ptr)

    run_ranked(plan, "bwd_filter", handle, (x.data.ptr, dz.data.ptr), ctx, call, what)


def conv_backward_bias(dz: Any, geom: Any, out: Any = None,
                       beta: float = 0.0) -> Any:  # pragma: gpu
    """db of shape (K,): cudnnConvolutionBackwardBias through the plan's 1xKx1x1 bias
    descriptor (same bytes), or the bias-only mode of the fused kernel when
    config bias_grad == "fused"; never a generic reduction.

    Should cuDNN refuse BackwardBias for a plan (any NOT_SUPPORTED code), the plan
    remembers it, warns once (BiasGradFallbackWarning) and uses the kernel from then on.
    """
    ctx = context_of(dz)
    db = out if out is not None else ctx.empty(geom.bias_shape, dz.dtype)
    beta = float(beta) if out is not None else 0.0
    if config.get().bias_grad == "fused" or parts(geom) is not None:
        # a batch too large for one descriptor (Note [batch split]) sums in the kernel,
        # which indexes in 64 bits, in one launch rather than one cuDNN call per part
        elementwise.activation_backward_bias(dz, None, "identity", geom, None, db, beta)
        return db
    handle = get_handle(ctx)
    plan = get_plan(geom, dz.dtype)
    if plan.bias_grad_refusal is None:
        try:
            cudnn().convolutionBackwardBias(
                handle, 1.0, plan.y_desc, dz.data.ptr, beta, plan.bias_desc, db.data.ptr)
            return db
        except CudnnError as err:
            err = err.with_context(where(plan, "conv_backward_bias"))
            if not refused(err, cudnn()):
                raise err from None
            if plan.refuse_bias_grad(err):
                warnings.warn(
                    f"cuDNN refused {err.function} with {err.status_name} ({err.status}) "
                    f"for {plan.describe()}; computing the bias gradient with convfuse's "
                    "bias kernel instead (as config bias_grad='fused' does) from now on",
                    BiasGradFallbackWarning, stacklevel=4)  # < ops.validated < ops
    elementwise.activation_backward_bias(dz, None, "identity", geom, None, db, beta)
    return db


def bind(name: str, geom: Any, dtype: Any, ctx: Any, act: str = "identity", bias: bool = False,
         residual: bool = False) -> Any:
    """A call of this module's <name> bound to one signature, for a caller that repeats it
    (Note [bound calls] in bound.py): None while the plan is still deciding, False for
    what is never bound."""
    from . import bound  # it checks this module's functions, so it imports this one

    return bound.bind(sys.modules[__name__], name, geom, dtype, ctx, act, bias, residual)


def _prior(out: Any, beta: float) -> Any:  # pragma: gpu
    """The channels-first copy of a channels-last `out` that a beta != 0 call blends into
    (None when the prior values are not read)."""
    return layout.to_channels_first(out) if out is not None and float(beta) != 0.0 else None


#: The functions a bound call stands for, as defined here (Note [bound calls]): a bound call
#: runs only while the module attribute is still this one, so a spy sees every call.
AS_IMPORTED = {name: globals()[name] for name in (
    "conv_bias_act", "conv_backward_data", "conv_backward_filter", "conv_backward_bias")}
