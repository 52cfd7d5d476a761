"""The fused convolutions under torch.func's autodiff transforms and forward-mode AD (Note
[torch.func transforms] in _eager.py).

Note [a fused convolution under torch.func]
torch.func differentiates an operator through its autograd formula: a custom op's
`register_autograd` formula is refused under torch.func.grad (torch wants a Function with
setup_context), and under torch.func.jvp the custom op's tangent came back zero. So under
a Grad or Jvp transform, or with a forward-AD dual level open, a Conv or ConvTranspose call
goes through `function(...)`'s torch.autograd.Function instead:
- its forward is the fused custom op itself, its setup_context and backward the custom
  op's own (`_ops.fused_autograd`): the same numbers and gradients as the eager path;
- its vmap rule is generated (torch.func runs forward and backward under vmap, where the
  custom ops take their own batching rules: Note [a fused convolution under vmap] in
  _vmap.py);
- its jvp is the convolution's: with t_pre = conv(tx, w) + conv(x, tw) + tb + tr, the
  output's tangent is act'(pre) * t_pre, computed by the custom ops (the forward with
  identity, and the backward op's dz, which is act'(pre) * dy for dy = t_pre); the
  pre-activation output (elu, silu, gelu) has tangent t_pre.
Second-order transforms (hessian, jacrev(jacrev(f)), jacfwd(jacrev(f)), grad(grad(f))) would
differentiate the backward or the jvp, whose custom ops have no torch.func rule (and would
give zero): they are refused with TransformError when the backward or the jvp finds a Grad
or Jvp level other than the one its setup ran at (levels, not counts: a vjp's backward runs
after its own level is gone), or, in plain forward AD, a dual tensor reaching the backward.
Outside functorch (a dual level open, no dual tensor) the backward records as the eager
one does, double backward included. A batch norm under torch.func runs torch's own ops instead
(Note [torch.func transforms] in _eager.py).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from .. import activations
from . import _eager
from ._errors import TransformError


def _refuse_second_order(ctx: Any, name: str, what: str, tensors: tuple[Any, ...]) -> None:
    """Refuse a backward or jvp that another autodiff transform would differentiate: one
    whose level is not the call's own (`ctx.own_level`, the innermost at setup; a vjp's
    backward may run after its own level is gone, so levels are compared, not counted), or
    forward AD's dual tensors reaching it (forward-over-reverse)."""
    own = ctx.own_level
    outer = [level for level in _eager.autodiff_levels() if level != own]
    # plain forward AD only: under functorch (whose jvp opens a dual level too) the levels
    # say it, and unpack_dual has no batching rule
    dual = (_eager._interpreters() is None and _eager._dual_level() >= 0 and any(
        t is not None and _eager._fwad.unpack_dual(t).tangent is not None for t in tensors))
    if outer or dual:
        raise TransformError(
            f"{name}: a transform around its {what} (a second-order one: hessian, "
            "jacrev(jacrev(f)), jacfwd(jacrev(f)), grad(grad(f)), forward-over-reverse AD) "
            "cannot differentiate convfuse's fused ops; first-order torch.func transforms "
            "and torch.autograd's double backward can")


def torch_activation(name: str) -> Any:
    """convfuse's activation `name` as torch's function (a batch norm under torch.func runs
    torch's ops: Note [torch.func transforms] in _eager.py)."""
    act = activations.normalize(name)
    if act == "identity":
        return _identity
    if act == "leaky_relu":
        return functools.partial(F.leaky_relu, negative_slope=activations.LEAKY_RELU_SLOPE)
    if act == "elu":
        return functools.partial(F.elu, alpha=activations.ELU_ALPHA)
    return {"relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu6": F.relu6,
            "silu": F.silu, "gelu": F.gelu}[act]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class Hyper:
    """A fused op's non-tensor arguments between the residual and the activation (stride,
    padding, ...), as one argument of the Function: torch.func flattens a Function's
    arguments as pytrees, and lists of ints there would be taken for more inputs, which
    its generated vmap rule for the jvp cannot match with their tangents."""

    __slots__ = ("args",)

    def __init__(self, args: tuple[Any, ...]) -> None:
        self.args = args


def function(name: str, forward_op: Any, backward_op: Any, setup_context: Any,
             backward: Any) -> type[torch.autograd.Function]:
    """A fused forward custom op `forward_op(x, weight, bias, residual, *hyper,
    activation) -> (y, z)` as a torch.autograd.Function torch.func can transform (Note [a
    fused convolution under torch.func]), applied as `(x, weight, bias, residual,
    Hyper(hyper), activation)`; `setup_context` and `backward` are _ops.fused_autograd's
    for its backward op `backward_op`."""

    def forward(x: Any, weight: Any, bias: Any, residual: Any, hyper: Hyper,
                activation: str) -> Any:
        return forward_op(x, weight, bias, residual, *hyper.args, activation)

    def setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, weight, bias, residual, hyper, activation = inputs
        setup_context(ctx, (x, weight, bias, residual, *hyper.args, activation), output)
        y, z = output
        kind = activations.saves(activation)  # what setup_context saved for the backward
        ctx.save_for_forward(x, weight, None if kind == "none" else y if kind == "output"
                             else z)
        levels = _eager.autodiff_levels()  # setup runs at the call's own transform level
        ctx.own_level = max(levels) if levels else None

    def transformed_backward(ctx: Any, *grads: Any) -> Any:
        _refuse_second_order(ctx, name, "backward", (*grads, *ctx.saved_tensors))
        if _eager._interpreters() is None:  # plain autograd (a dual level open): as ever,
            dx, dw, db, dres, *_ = backward(ctx, *grads)  # double backward included
        else:
            # torch.func runs a backward with grad mode on (for a transform around it,
            # refused above), which would take the recorded path's differentiable ops
            with torch.no_grad():
                dx, dw, db, dres, *_ = backward(ctx, *grads)
        return dx, dw, db, dres, None, None

    def jvp(ctx: Any, tx: Any, tw: Any, tb: Any, tr: Any, _hyper: Any, _act: Any) -> Any:
        x, weight, saved = ctx.saved_tensors
        _refuse_second_order(ctx, name, "forward-mode derivative", ())
        hyper, act = ctx.hyper, activations.normalize(ctx.activation)
        parts = []
        if tx is not None:  # conv(tx, w) + tb + tr in one call
            parts.append(forward_op(tx, weight, tb, tr, *hyper, "identity")[0])
            tb = tr = None
        if tw is not None or not parts:  # (a zero weight: tb + tr alone, in y's layout)
            parts.append(forward_op(x, torch.zeros_like(weight) if tw is None else tw, tb, tr,
                                    *hyper, "identity")[0])
        t = parts[0] if len(parts) == 1 else parts[0] + parts[1]
        ty = t if act == "identity" else \
            backward_op(t, x, weight, saved, *hyper, act, False, False, False, True)[3]
        return ty, (t if activations.saves(act) == "preactivation" else None)

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup),
        "backward": staticmethod(transformed_backward), "jvp": staticmethod(jvp),
        "generate_vmap_rule": True, "__module__": __name__,
        "__doc__": f"{name}: the fused custom op under torch.func (Note [a fused convolution "
                   "under torch.func])."})

