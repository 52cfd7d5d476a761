"""Transposed convolution on cuDNN: the forward convolution G's calls with x and y swapped
(Note [transposed convolution as a swapped convolution] in convfuse/transpose_geometry.py),
through G's cached plan, so algorithm choice, workspace, the walk down the ranking on
refusal or out-of-memory, and the capture rules are the convolution's (ranked.py).

Forward: convolutionBackwardData writes y, then one pass of convfuse's bias + activation
(+ scaled residual) kernel over y (Note [bias + activation pass] in kernels/activation.cu),
none when there is no bias, no residual and the activation is identity. elu, silu and gelu
save their pre-activation, so they write it with that pass and apply the activation in a second.

float64 channels-last runs channels-first, as Conv does (Note [float64 runs channels-first]
in layout.py): the three cuDNN-calling ops go through layout.run_channels_first. The bias +
activation passes and the bias gradient are convfuse's kernels, which read channels-last.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from ... import activations
from ..._binding import cudnn
from ...errors import CudnnError
from ...plan import Candidate, get_transpose_plan
from ...transpose_geometry import ConvTransposeGeometry
from .. import elementwise
from . import layout
from .conv import data_into, filter_into
from .device import context_of, is_device_array, on_cupy
from .handle import Workspace, get_handle
from .ranked import forward_into, run_ranked
from .split import parts, rows

# G's filter gradient with x and dz swapped (its x is this op's dz): the op errors name
_FILTER = "conv_transpose_backward_filter"


@contextlib.contextmanager
def _named(op: str, tgeom: ConvTransposeGeometry) -> Iterator[None]:
    """cuDNN errors (G's algorithm queries included) name the transposed op and geometry,
    not only G's, whose x is the user's output."""
    try:
        yield
    except CudnnError as err:
        raise err.with_context(f"in {op} of the {tgeom.describe()}") from None


def _needs_cupy(tgeom: ConvTransposeGeometry, a: Any) -> bool:
    """Whether a DeviceArray call takes the CuPy fallback of Note [the pointer path]: a
    windowed output is sliced, and float64 channels-last is copied channels-first (Note
    [float64 runs channels-first]), both with CuPy array arithmetic."""
    return is_device_array(a) and (tgeom.windowed or layout.runs_channels_first(tgeom, a.dtype))


def conv_transpose_forward(x: Any, w: Any, tgeom: ConvTransposeGeometry) -> Any:  # pragma: gpu
    if _needs_cupy(tgeom, x):
        return on_cupy(conv_transpose_forward, x, w, tgeom)
    with _named("conv_transpose_forward", tgeom):
        if layout.runs_channels_first(tgeom, x.dtype):  # Note [float64 runs channels-first]
            return layout.run_channels_first(_forward, tgeom, x.dtype, (x, w))
        return _forward(x, w, tgeom)


def _forward(x: Any, w: Any, tgeom: ConvTransposeGeometry) -> Any:  # pragma: gpu
    import cupy as cp

    ctx = context_of(x)
    handle = get_handle(ctx)
    split = parts(tgeom)
    if split is None:
        plan = get_transpose_plan(tgeom, x.dtype)
    else:  # Note [batch split]: every part's plan (and refusal) first
        plans = [get_transpose_plan(t, x.dtype) for t, _, _ in split]
    core = ctx.empty(tgeom.conv.input_shape, x.dtype)
    if split is None:
        data_into(plan, handle, ctx, w, x, core, 0.0, "conv_transpose_forward")
    else:
        for plan, (_, i, j) in zip(plans, split):
            data_into(plan, handle, ctx, w, rows(x, i, j), rows(core, i, j), 0.0,
                      "conv_transpose_forward")
    return tgeom.from_conv_output(core, cp)


def conv_transpose_bias_act(x: Any, w: Any, b: Any, tgeom: ConvTransposeGeometry,
                            activation: str = "identity", residual: Any = None,
                            residual_scale: float = 1.0) -> tuple[Any, Any]:  # pragma: gpu
    act = activations.normalize(activation)
    y = conv_transpose_forward(x, w, tgeom)
    if b is None and residual is None and act == "identity":
        return y, None
    epi = tgeom.epilogue
    if activations.saves(act) != "preactivation":
        elementwise.bias_act_forward(y, b, residual, float(residual_scale), act, epi)
        return y, None
    elementwise.bias_act_forward(y, b, residual, float(residual_scale), "identity", epi)
    out = context_of(y).empty(tuple(y.shape), y.dtype)
    elementwise.activation_forward(y, act, out)
    return out, y


def conv_transpose_backward_data(dz: Any, w: Any, tgeom: ConvTransposeGeometry, out: Any = None,
                                 beta: float = 0.0) -> Any:  # pragma: gpu
    if _needs_cupy(tgeom, dz):
        return on_cupy(conv_transpose_backward_data, dz, w, tgeom, out, beta)
    with _named("conv_transpose_backward_data", tgeom):
        if layout.runs_channels_first(tgeom, dz.dtype):  # Note [float64 runs channels-first]
            return layout.run_channels_first(_backward_data, tgeom, dz.dtype, (dz, w), out,
                                             beta)
        return _backward_data(dz, w, tgeom, out, beta)


def _backward_data(dz: Any, w: Any, tgeom: ConvTransposeGeometry, out: Any,
                   beta: float) -> Any:  # pragma: gpu
    import cupy as cp

    ctx = context_of(dz)
    handle = get_handle(ctx)
    split = parts(tgeom)
    if split is None:
        plan = get_transpose_plan(tgeom, dz.dtype)
    else:  # Note [batch split]: every part's plan (and refusal) first
        plans = [get_transpose_plan(t, dz.dtype) for t, _, _ in split]
    dx = out if out is not None else ctx.empty(tgeom.input_shape, dz.dtype)
    src = tgeom.to_conv_output(dz, cp)
    b = float(beta) if out is not None else 0.0
    if split is None:
        _data_into(plan, handle, ctx, src, w, dx, b)
    else:
        for plan, (_, i, j) in zip(plans, split):  # each part writes its rows
            _data_into(plan, handle, ctx, rows(src, i, j), w, rows(dx, i, j), b)
    return dx


def _data_into(plan: Any, handle: Any, ctx: Any, src: Any, w: Any, dx: Any,
               b: float) -> None:  # pragma: gpu
    if b == 0.0:
        forward_into(plan, handle, ctx, src, w, dx, "conv_transpose_backward_data")
        return

    def call(cand: Candidate, ws: Workspace) -> None:
        cudnn().convolutionForward(
            handle, 1.0, plan.x_desc, src.data.ptr, plan.w_desc, w.data.ptr,
            plan.conv_desc_for(cand), cand.algo, ws.ptr, ws.size, b, plan.y_desc, dx.data.ptr)

    run_ranked(plan, "fwd", handle, (src.data.ptr, w.data.ptr), ctx, call,
               "conv_transpose_backward_data")


def conv_transpose_backward_filter(x: Any, dz: Any, tgeom: ConvTransposeGeometry,
                                   out: Any = None, beta: float = 0.0) -> Any:  # pragma: gpu
    if _needs_cupy(tgeom, x):
        return on_cupy(conv_transpose_backward_filter, x, dz, tgeom, out, beta)
    with _named("conv_transpose_backward_filter", tgeom):
        if layout.runs_channels_first(tgeom, x.dtype):  # Note [float64 runs channels-first]
            return layout.run_channels_first(_backward_filter, tgeom, x.dtype, (x, dz), out,
                                             beta)
        return _backward_filter(x, dz, tgeom, out, beta)


def _backward_filter(x: Any, dz: Any, tgeom: ConvTransposeGeometry, out: Any,
                     beta: float) -> Any:  # pragma: gpu
    import cupy as cp

    ctx = context_of(x)
    handle = get_handle(ctx)
    split = parts(tgeom)
    if split is None:
        plan = get_transpose_plan(tgeom, x.dtype)
    else:  # Note [batch split]: every part's plan (and refusal) first
        plans = [get_transpose_plan(t, x.dtype) for t, _, _ in split]
    dw = out if out is not None else ctx.empty(tgeom.weight_shape, x.dtype)
    b = float(beta) if out is not None else 0.0
    src = tgeom.to_conv_output(dz, cp)
    if split is None:
        filter_into(plan, handle, ctx, src, x, dw, b, _FILTER)
    else:
        for plan, (_, i, j) in zip(plans, split):  # the later parts accumulate
            filter_into(plan, handle, ctx, rows(src, i, j), rows(x, i, j), dw,
                        b if i == 0 else 1.0, _FILTER)
    return dw


def conv_transpose_activation_backward_bias(
    dy: Any, saved: Any, activation: str, tgeom: ConvTransposeGeometry, db_out: Any = None,
    beta: float = 0.0,
) -> tuple[Any, Any]:  # pragma: gpu
    """One launch of the fused activation-backward + bias-gradient kernel (Note [fused
    activation-backward + bias gradient] in activation.cu); for identity it writes db only
    and dz is dy itself."""
    ctx = context_of(dy)
    db = db_out if db_out is not None else ctx.empty(tgeom.bias_shape, dy.dtype)
    b = float(beta) if db_out is not None else 0.0
    dz = None if activation == "identity" else ctx.empty(tuple(dy.shape), dy.dtype)
    elementwise.activation_backward_bias(dy, saved, activation, tgeom.epilogue, dz, db, b)
    return (dy if dz is None else dz), db


def bind(name: str, tgeom: Any, dtype: Any, ctx: Any, act: str = "identity",
         bias: bool = False, residual: bool = False) -> Any:
    """A call of this module's <name> bound to one signature (Note [bound calls] in
    bound.py): None while the plan is still deciding, False for what is never bound."""
    from . import bound  # it checks this module's functions, so it imports this one

    return bound.bind_transpose(sys.modules[__name__], name, tgeom, dtype, ctx, act)


#: The functions a bound call stands for, as defined here (Note [bound calls]).
AS_IMPORTED = {name: globals()[name] for name in (
    "conv_transpose_bias_act", "conv_transpose_backward_data",
    "conv_transpose_backward_filter")}
