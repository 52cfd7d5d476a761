"""Pooling ops: validate, then run on the engine of the arrays (DESIGN.md "Ops")."""

from __future__ import annotations

from typing import Any

from . import _checks
from ._checks import Arg, check_pool_geometry, validate


def pool_forward(x: Any, pgeom: Any) -> Any:
    """Max or average pooling (pgeom.mode) of x."""
    op = "pool_forward"
    g = check_pool_geometry(op, pgeom)
    xp = validate(op, [Arg("x", x, g.input_shape)], g.layout)
    if g.batch == 0:  # an empty batch reaches no engine
        return xp.empty(g.output_shape, x.dtype)
    return _checks.engine(xp, "pooling").pool_forward(x, g)


def pool_backward(dy: Any, x: Any, y: Any, pgeom: Any) -> Any:
    """dx from dy, the forward's input x and output y."""
    op = "pool_backward"
    g = check_pool_geometry(op, pgeom)
    xp = validate(op, [
        Arg("dy", dy, g.output_shape), Arg("x", x, g.input_shape), Arg("y", y, g.output_shape),
    ], g.layout)
    if g.batch == 0:
        return xp.empty(g.input_shape, dy.dtype)
    return _checks.engine(xp, "pooling").pool_backward(dy, x, y, g)
