"""Explicit padding ops: validate, then run on the engine of the arrays (DESIGN.md "Ops").

The padding modes of torch.nn's Conv and the extra end zero of an asymmetric 'same'
(convfuse.pad_geometry); both engines run convfuse.ops.pad_slices.
"""

from __future__ import annotations

from typing import Any

from . import _checks
from ._checks import Arg, validate


def check_pad_geometry(op: str, pgeom: Any) -> Any:
    from ..pad_geometry import PadGeometry

    if not isinstance(pgeom, PadGeometry):
        raise TypeError(f"{op}: pgeom must be a PadGeometry (PadGeometry.create(...)), got "
                        f"{type(pgeom).__name__}")
    return pgeom


def pad_forward(x: Any, pgeom: Any) -> Any:
    """x padded per pgeom (mode and (begin, end) pads per spatial dim); a new array."""
    op = "pad_forward"
    g = check_pad_geometry(op, pgeom)
    xp = validate(op, [Arg("x", x, g.input_shape)], g.layout)
    if g.input_shape[0] == 0:  # an empty batch reaches no engine
        return xp.empty(g.output_shape, x.dtype)
    return _checks.engine(xp, "pad").pad_forward(x, g)


def pad_backward(dy: Any, pgeom: Any) -> Any:
    """dx from the padded output's gradient dy (Note [pad backward] in ops/pad_slices.py)."""
    op = "pad_backward"
    g = check_pad_geometry(op, pgeom)
    xp = validate(op, [Arg("dy", dy, g.output_shape)], g.layout)
    if g.input_shape[0] == 0:
        return xp.empty(g.input_shape, dy.dtype)
    return _checks.engine(xp, "pad").pad_backward(dy, g)
