"""The activation ops on CuPy arrays: convfuse's own kernels (ops/elementwise.py), and
cuDNN's bias-gradient call or the fused kernel, per config.get().bias_grad."""

from __future__ import annotations

from typing import Any

from ... import activations
from ...config import get as get_flags
from .. import elementwise
from . import conv
from .device import context_of


def activation_forward(z: Any, activation: str, out: Any = None) -> Any:  # pragma: gpu
    y = out if out is not None else context_of(z).empty(tuple(z.shape), z.dtype)
    elementwise.activation_forward(z, activations.normalize(activation), y)
    return y


def activation_backward(dy: Any, saved: Any, activation: str,
                        out: Any = None) -> Any:  # pragma: gpu
    dz = out if out is not None else context_of(dy).empty(tuple(dy.shape), dy.dtype)
    elementwise.activation_backward(dy, saved, activations.normalize(activation), dz)
    return dz


def activation_backward_bias(dy: Any, saved: Any, activation: str, geom: Any,
                             db_out: Any = None,
                             beta: float = 0.0) -> tuple[Any, Any]:  # pragma: gpu
    """(dz, db). Never CuPy's generic reduction: either cuDNN's convolutionBackwardBias
    after the activation kernel, or one kernel doing both (config bias_grad="fused")."""
    act = activations.normalize(activation)
    ctx = context_of(dy)
    dz = ctx.empty(tuple(dy.shape), dy.dtype)
    db = db_out if db_out is not None else ctx.empty(geom.bias_shape, dy.dtype)
    beta = float(beta) if db_out is not None else 0.0
    if get_flags().bias_grad == "fused":
        elementwise.activation_backward_bias(dy, saved, act, geom, dz, db, beta)
    else:
        elementwise.activation_backward(dy, saved, act, dz)
        conv.conv_backward_bias(dz, geom, db, beta)
    return dz, db
