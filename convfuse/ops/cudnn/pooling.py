"""The pooling ops on CuPy arrays or DeviceArrays (device.py): one cuDNN call each,
through a cached PoolPlan."""

from __future__ import annotations

from typing import Any

from ..._binding import cudnn
from ...plan import get_pool_plan
from .device import context_of
from .handle import context, get_handle


def pool_forward(x: Any, pgeom: Any) -> Any:  # pragma: gpu
    ctx = context_of(x)
    handle = get_handle(ctx)
    plan = get_pool_plan(pgeom, x.dtype)
    y = ctx.empty(pgeom.output_shape, x.dtype)
    with context(lambda: f"pool_forward for {plan.describe()}"):
        cudnn().poolingForward(handle, plan.pool_desc, 1.0, plan.x_desc, x.data.ptr, 0.0,
                               plan.y_desc, y.data.ptr)
    return y


def pool_backward(dy: Any, x: Any, y: Any, pgeom: Any) -> Any:  # pragma: gpu
    """dx; cuDNN finds each window's maximum by comparing x with the forward's y."""
    ctx = context_of(x)
    handle = get_handle(ctx)
    plan = get_pool_plan(pgeom, x.dtype)
    dx = ctx.empty(pgeom.input_shape, x.dtype)
    with context(lambda: f"pool_backward for {plan.describe()}"):
        cudnn().poolingBackward(handle, plan.pool_desc, 1.0, plan.y_desc, y.data.ptr,
                                plan.y_desc, dy.data.ptr, plan.x_desc, x.data.ptr, 0.0,
                                plan.x_desc, dx.data.ptr)
    return dx
