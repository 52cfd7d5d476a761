"""Activation ops: validate, then run on the engine of the arrays (DESIGN.md "Ops").

`saved` is what the forward kept for backward (Note [what backward saves] in
convfuse.activations): y for most activations, the pre-activation z for elu, silu and gelu,
nothing for identity.
"""

from __future__ import annotations

from typing import Any

from .. import activations as _activations
from . import _checks, validated
from ._checks import Arg, check_activation, check_beta, check_geometry, validate, zero_filled


def activation_forward(z: Any, activation: str | None, out: Any = None) -> Any:
    """y = act(z), elementwise, any shape."""
    op = "activation_forward"
    act = _name(op, activation)
    shape = _shape_of(z)
    xp = validate(op, [Arg("z", z, None), Arg("out", out, shape, optional=True, output=True)])
    if z.size == 0:  # an empty batch reaches no engine, as in the other ops
        return out if out is not None else xp.empty(z.shape, z.dtype)
    return _checks.engine(xp, "activation").activation_forward(z, act, out)


def activation_backward(dy: Any, saved: Any, activation: str | None, out: Any = None) -> Any:
    """dz = dy * act'(...), from what the forward saved."""
    op = "activation_backward"
    act = _name(op, activation)
    _check_saved(op, act, saved)
    shape = _shape_of(dy)
    xp = validate(op, [
        Arg("dy", dy, None), Arg("saved", saved, shape, optional=True),
        Arg("out", out, shape, optional=True, output=True),
    ])
    if dy.size == 0:
        return out if out is not None else xp.empty(dy.shape, dy.dtype)
    return validated.activation_backward(_checks.engine(xp, "activation"), dy, saved, act, out)


def activation_backward_bias(dy: Any, saved: Any, activation: str | None, geom: Any,
                             db_out: Any = None, beta: float = 0.0) -> tuple[Any, Any]:
    """(dz, db): the activation's backward, and db = beta * db_out + dz summed per channel."""
    op = "activation_backward_bias"
    act = _name(op, activation)
    g = check_geometry(op, geom)
    _check_saved(op, act, saved)
    b = check_beta(op, beta, db_out, "db_out")
    xp = validate(op, [
        Arg("dy", dy, g.output_shape), Arg("saved", saved, g.output_shape, optional=True),
        Arg("db_out", db_out, g.bias_shape, optional=True, output=True),
    ], g.layout)
    if g.batch == 0:  # no engine: an empty dz, db zero (or beta-scaled)
        return xp.empty(g.output_shape, dy.dtype), zero_filled(xp, db_out, g.bias_shape,
                                                                dy.dtype, b)
    return validated.activation_backward_bias(_checks.engine(xp, "activation"), dy, saved, act,
                                              g, db_out, b)


def _check_saved(op: str, act: str, saved: Any) -> None:
    need = _activations.saves(act)
    if need != "none" and saved is None:
        what = "its output y" if need == "output" else "the pre-activation z"
        raise ValueError(f"{op}: activation {act!r} needs saved ({what}), got None")


def _shape_of(a: Any) -> tuple[int, ...] | None:
    # Only used to compare the other arguments with; validate() rejects non-arrays.
    shape = getattr(a, "shape", None)
    return tuple(shape) if shape is not None else None


def _name(op: str, activation: Any) -> str:
    return check_activation(op, activation)
