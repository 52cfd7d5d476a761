"""What each op does after its checks: one entry per op, called by the public op once
its arguments passed, and by a caller that validated the same signature before (the torch
bridge, Note [per-signature decisions] in convfuse/torch/_signature.py).

Contract: every argument is what the public op of the same name accepted and normalized
(the geometry it checked, a canonical activation name, beta as a float), `eng` is the
engine module `_checks.engine` picks for the arrays, and the defaults are the public op's.
Nothing here checks anything: a call outside that contract is undefined. An empty batch
is the public ops' own (they answer it with the array module, not an engine: convolutions,
transposed ones, batch norm, pooling, padding), so these entries assume batch > 0.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, NamedTuple

import numpy as np


class BatchNormSaved(NamedTuple):
    """What a forward keeps for its backward: no statistic is recomputed there.

    mean and invstd are (C,): the batch's mean and 1/sqrt(biased var + eps) in training,
    the running ones in evaluation. saved is the activation's saved tensor
    (activations.saves: y or the pre-activation, None for identity). engine_state is
    engine-private (cuDNN: the path that ran and its reserve space), None on NumPy.
    """

    mean: Any
    invstd: Any
    saved: Any
    training: bool
    engine_state: Any = None


def conv_bias_act(eng: ModuleType, x: Any, w: Any, b: Any, g: Any, act: str = "identity",
                  residual: Any = None, scale: float = 1.0) -> tuple[Any, Any]:
    return eng.conv_bias_act(x, w, b, g, act, residual, scale)


def conv_bias_act_runner(eng: ModuleType, g: Any, dtype: Any, act: str,
                         residual: bool) -> Any:
    """conv_bias_act's y for one validated signature whose arrays are all `dtype`, as a
    callable (x, w, b) -> y with every per-call decision made, where the engine has one
    for it (the reference engine's tiny convolutions), else None. It computes what
    `conv_bias_act(eng, x, w, b, g, act)` returns as y, or returns None once the engine
    dropped what it runs (then the caller runs the validated entry, and may ask again); a
    caller uses it only while neither function is replaced (a spy must see every call)."""
    make = getattr(eng, "bias_act_runner", None)
    return None if make is None else make(g, dtype, act, residual)


def bound_call(eng: ModuleType, name: str, g: Any, dtype: Any, ctx: Any, act: str = "identity",
               bias: bool = False, residual: bool = False) -> Any:
    """<name>'s call bound to one validated signature, for a caller that repeats it with
    the same geometry, dtype, activation and optional arrays on the ExecContext `ctx`
    (Note [bound calls] in ops/cudnn/bound.py): called right after the op ran, it gives a
    callable of pointers that returns None/False where the caller must run the op's
    validated entry instead; None where the engine may bind later, False where it never
    binds this signature (it has no bound calls, the NumPy engine's case)."""
    bind = getattr(eng, "bind", None)
    return False if bind is None else bind(name, g, dtype, ctx, act, bias, residual)


def conv_backward_data(eng: ModuleType, dz: Any, w: Any, g: Any, out: Any = None,
                       beta: float = 0.0) -> Any:
    return eng.conv_backward_data(dz, w, g, out, beta)


def conv_backward_filter(eng: ModuleType, x: Any, dz: Any, g: Any, out: Any = None,
                         beta: float = 0.0) -> Any:
    return eng.conv_backward_filter(x, dz, g, out, beta)


def conv_backward_bias(eng: ModuleType, dz: Any, g: Any, out: Any = None,
                       beta: float = 0.0) -> Any:
    return eng.conv_backward_bias(dz, g, out, beta)


def activation_backward(eng: ModuleType, dy: Any, saved: Any, act: str,
                        out: Any = None) -> Any:
    return eng.activation_backward(dy, saved, act, out)


def activation_backward_bias(eng: ModuleType, dy: Any, saved: Any, act: str, g: Any,
                             db_out: Any = None, beta: float = 0.0) -> tuple[Any, Any]:
    return eng.activation_backward_bias(dy, saved, act, g, db_out, beta)


def conv_transpose_bias_act(eng: ModuleType, x: Any, w: Any, b: Any, g: Any,
                            act: str = "identity", residual: Any = None,
                            scale: float = 1.0) -> tuple[Any, Any]:
    return eng.conv_transpose_bias_act(x, w, b, g, act, residual, scale)


def conv_transpose_backward_data(eng: ModuleType, dz: Any, w: Any, g: Any, out: Any = None,
                                 beta: float = 0.0) -> Any:
    return eng.conv_transpose_backward_data(dz, w, g, out, beta)


def conv_transpose_backward_filter(eng: ModuleType, x: Any, dz: Any, g: Any, out: Any = None,
                                   beta: float = 0.0) -> Any:
    return eng.conv_transpose_backward_filter(x, dz, g, out, beta)


def conv_transpose_activation_backward_bias(eng: ModuleType, dy: Any, saved: Any, act: str,
                                            g: Any, db_out: Any = None,
                                            beta: float = 0.0) -> tuple[Any, Any]:
    return eng.conv_transpose_activation_backward_bias(dy, saved, act, g, db_out, beta)


def conv_transpose_backward_bias(eng: ModuleType, dz: Any, g: Any, out: Any = None,
                                 beta: float = 0.0) -> Any:
    return eng.conv_transpose_activation_backward_bias(dz, None, "identity", g, out, beta)[1]


_new_tuple = tuple.__new__


def batchnorm_forward_training(eng: ModuleType, x: Any, weight: Any, bias: Any,
                               running_mean: Any, running_var: Any, g: Any, eps: float,
                               f: float, act: str, residual: Any = None
                               ) -> tuple[Any, BatchNormSaved]:
    out = eng.batchnorm_forward_training(x, weight, bias, running_mean, running_var, g, eps,
                                         f, act, residual)
    # BatchNormSaved(mean, invstd, saved, True, state), without the namedtuple's Python
    # __new__ (this runs at every training call)
    return out[0], _new_tuple(BatchNormSaved, (out[2], out[3], out[1], True,
                                               out[4] if len(out) > 4 else None))


def batchnorm_forward_inference(eng: ModuleType, x: Any, weight: Any, bias: Any,
                                running_mean: Any, running_var: Any, g: Any, eps: float,
                                act: str, residual: Any = None,
                                stats: bool = True) -> tuple[Any, BatchNormSaved]:
    y, saved, mean, invstd = eng.batchnorm_forward_inference(
        x, weight, bias, running_mean, running_var, g, eps, act, residual, stats)
    return y, BatchNormSaved(mean, invstd, saved, False)


def batchnorm_backward(eng: ModuleType, dy: Any, x: Any, weight: Any, bias: Any,
                       saved: BatchNormSaved, g: Any, eps: float, act: str,
                       residual: bool = False, need_dx: bool = True, weight_grad: Any = None,
                       bias_grad: Any = None, beta: float = 0.0) -> tuple[Any, Any, Any, Any]:
    # The NumPy engine returns fresh gradients and accumulation happens here; cuDNN
    # accumulates itself (betaParamDiff), so its engine takes the outputs.
    if not isinstance(dy, np.ndarray):
        return eng.batchnorm_backward(dy, x, weight, bias, saved, g, eps, act, bool(residual),
                                      bool(need_dx), weight_grad, bias_grad, beta)
    dx, dw, db, dres = eng.batchnorm_backward(
        dy, x, weight, saved.saved, saved.mean, saved.invstd, saved.training, g, act,
        bool(residual), bool(need_dx))
    if weight is None:
        return dx, None, None, dres
    if weight_grad is not None:
        _accumulate(weight_grad, dw, beta)
        _accumulate(bias_grad, db, beta)
        dw, db = weight_grad, bias_grad
    return dx, dw, db, dres


def _accumulate(out: np.ndarray, value: np.ndarray, beta: float) -> None:
    # beta == 0 never reads `out` (cuDNN's rule), so stale NaN there cannot leak in.
    out[...] = value if beta == 0.0 else value + out.dtype.type(beta) * out
