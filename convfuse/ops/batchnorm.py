"""Batch-normalization ops: validate, then run on the engine of the arrays (DESIGN.md "Ops").

Stateless: the layer's running statistics are passed in and, in training, updated in place
(they are the ops' documented outputs; nothing else passed in is modified). The data
arrays (x, residual, dy) share one dtype; the per-channel arrays (weight, bias, running
statistics, the saved mean and invstd, gradient outputs) are (C,) in the data's compute
dtype: float32 for float32/float16/bfloat16 data, float64 for float64 (cuDNN's derived BN
descriptor type, Note [BatchNorm in cuDNN]). weight and bias may be None (affine=False:
scale 1, shift 0); the backward, whose weight and bias gradients come as a pair, refuses a
bias without a weight. Outputs never alias inputs.
"""

from __future__ import annotations

import math
from typing import Any

from .. import activations, backend
from ..dtypes import SUPPORTED, compute_dtype
from ..errors import DeviceMismatchError
from ..plan.batchnorm import BatchNormGeometry
from . import _checks, validated
from ._checks import Arg, check_activation, check_scalar, validate, zero_filled
from .validated import BatchNormSaved


def batchnorm_forward_training(x: Any, weight: Any, bias: Any, running_mean: Any,
                               running_var: Any, layout: str = "NCHW", eps: float = 1e-5,
                               exponential_average_factor: float = 0.1,
                               activation: str | None = None,
                               residual: Any = None) -> tuple[Any, BatchNormSaved]:
    """y = act(batchnorm(x) + residual) with the batch's statistics; returns (y, saved).

    running_mean/var (both or neither) become (1 - f) * running + f * batch statistic,
    f = exponential_average_factor, the variance's batch statistic being unbiased.
    """
    op = "batchnorm_forward_training"
    act = _activation(op, activation)
    g = _geometry(op, x, layout)
    eps = _check_eps(op, eps)
    f = check_scalar(op, "exponential_average_factor", exponential_average_factor)
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"{op}: exponential_average_factor must lie in [0, 1], got {f}")
    if g.count == 1:  # torch.nn's rule; an empty batch (count 0) is returned empty
        raise ValueError(
            f"{op}: expected more than 1 value per channel when training, got input shape "
            f"{g.shape}")
    _both_or_neither(op, running_mean, running_var)
    xp = _validate(op, g, [Arg("x", x, g.shape), Arg("residual", residual, g.shape, True)],
                   [Arg("weight", weight, None, True), Arg("bias", bias, None, True),
                    Arg("running_mean", running_mean, None, True, output=True),
                    Arg("running_var", running_var, None, True, output=True)], x)
    if g.count == 0:  # the running statistics are left as they are, as torch.nn leaves them
        return _empty_batch(xp, x, g, act, True, True)
    return validated.batchnorm_forward_training(
        _checks.engine(xp, "batchnorm"), x, weight, bias, running_mean, running_var, g, eps,
        f, act, residual)


def batchnorm_forward_inference(x: Any, weight: Any, bias: Any, running_mean: Any,
                                running_var: Any, layout: str = "NCHW", eps: float = 1e-5,
                                activation: str | None = None, residual: Any = None,
                                stats: bool = True) -> tuple[Any, BatchNormSaved]:
    """y = act(batchnorm(x) + residual) with the running statistics; returns (y, saved).

    stats=False: no backward will follow (inference), so saved holds no mean and invstd
    (None) and batchnorm_backward refuses it; on the GPU that spares their computation,
    CuPy arithmetic on the statistics (Note [inference without statistics] in
    ops/cudnn/batchnorm.py)."""
    op = "batchnorm_forward_inference"
    if type(stats) is not bool:
        raise TypeError(f"{op}: stats must be a bool, got {type(stats).__name__}")
    act = _activation(op, activation)
    g = _geometry(op, x, layout)
    eps = _check_eps(op, eps)
    if running_mean is None or running_var is None:
        raise ValueError(f"{op}: running_mean and running_var are required (got None)")
    xp = _validate(op, g, [Arg("x", x, g.shape), Arg("residual", residual, g.shape, True)],
                   [Arg("weight", weight, None, True), Arg("bias", bias, None, True),
                    Arg("running_mean", running_mean, None),
                    Arg("running_var", running_var, None)], x)
    if g.count == 0:
        return _empty_batch(xp, x, g, act, False, stats)
    return validated.batchnorm_forward_inference(
        _checks.engine(xp, "batchnorm"), x, weight, bias, running_mean, running_var, g, eps,
        act, residual, stats)


def batchnorm_backward(dy: Any, x: Any, weight: Any, bias: Any, saved: BatchNormSaved,
                       layout: str = "NCHW", eps: float = 1e-5,
                       activation: str | None = None, residual: bool = False,
                       need_dx: bool = True, weight_grad: Any = None, bias_grad: Any = None,
                       param_beta: float = 0.0) -> tuple[Any, Any, Any, Any]:
    """(dx, dweight, dbias, dresidual) of y = act(batchnorm(x) + residual).

    Uses the forward's saved mean/invstd (and activation tensor). dx is None when
    need_dx is False; dresidual (= the gradient at the sum) only when residual is True.
    dweight/dbias are None without weight (affine=False). With weight_grad/bias_grad
    given, the gradients are written there: param_beta=1 accumulates (PyTorch's .grad
    semantics), 0 overwrites. Nothing is written if validation fails.
    """
    op = "batchnorm_backward"
    act = _activation(op, activation)
    g = _geometry(op, x, layout)
    eps = _check_eps(op, eps)
    beta = check_scalar(op, "param_beta", param_beta)
    if not isinstance(saved, BatchNormSaved):
        raise TypeError(f"{op}: saved must be the BatchNormSaved a forward returned, got "
                        f"{type(saved).__name__}")
    if saved.mean is None or saved.invstd is None:
        raise ValueError(f"{op}: saved holds no statistics (its forward ran with "
                         "stats=False): run batchnorm_forward_inference with stats=True "
                         "to differentiate it")
    if (weight_grad is None) != (bias_grad is None):
        raise ValueError(f"{op}: pass weight_grad and bias_grad together, or neither")
    if weight_grad is not None and weight is None:
        raise ValueError(f"{op}: weight_grad given but weight is None (affine=False)")
    if weight is None and bias is not None:
        # the gradients come as a pair, and weight None means affine=False (none): the
        # bias's would be dropped silently
        raise ValueError(f"{op}: bias given without a weight: pass a weight of ones to get "
                         "the bias's gradient (weight and bias None is affine=False)")
    if beta != 0.0 and weight_grad is None:
        raise ValueError(f"{op}: param_beta={param_beta!r} accumulates into weight_grad and "
                         "bias_grad, but they are None")
    need = activations.saves(act)
    if need != "none" and saved.saved is None:
        raise ValueError(f"{op}: activation {act!r} needs the forward's saved tensor, got None")
    xp = _validate(op, g, [Arg("dy", dy, g.shape), Arg("x", x, g.shape),
                           Arg("saved.saved", saved.saved, g.shape, True)],
                   [Arg("weight", weight, None, True), Arg("bias", bias, None, True),
                    Arg("saved.mean", saved.mean, None), Arg("saved.invstd", saved.invstd, None),
                    Arg("weight_grad", weight_grad, None, True, output=True),
                    Arg("bias_grad", bias_grad, None, True, output=True)], x)
    if g.count == 0:
        cd = compute_dtype(x.dtype)
        has_w = weight is not None
        dw = zero_filled(xp, weight_grad, (g.channels,), cd, beta) if has_w else None
        db = zero_filled(xp, bias_grad, (g.channels,), cd, beta) if has_w else None
        empty = xp.empty(g.shape, dy.dtype)
        return (empty if need_dx else None, dw, db,
                xp.empty(g.shape, dy.dtype) if residual else None)
    return validated.batchnorm_backward(_checks.engine(xp, "batchnorm"), dy, x, weight, bias,
                                        saved, g, eps, act, bool(residual), bool(need_dx),
                                        weight_grad, bias_grad, beta)


def _empty_batch(xp: Any, x: Any, g: BatchNormGeometry, act: str, training: bool,
                 stats: bool) -> tuple[Any, BatchNormSaved]:
    """A forward of an empty batch (N = 0), which reaches no engine: an empty y, and
    statistics for its backward (zeros: nothing reads them, the gradients being empty or
    zero) unless stats is False."""
    cd = compute_dtype(x.dtype)
    mean, invstd = (xp.zeros((g.channels,), cd), xp.zeros((g.channels,), cd)) if stats \
        else (None, None)
    saved = xp.empty(g.shape, x.dtype) if activations.saves(act) != "none" else None
    return xp.empty(g.shape, x.dtype), BatchNormSaved(mean, invstd, saved, training)


def _activation(op: str, activation: Any) -> str:
    return check_activation(op, activation)


def _geometry(op: str, x: Any, layout: str) -> BatchNormGeometry:
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"{op}: x must be a NumPy or CuPy array, got {type(x).__name__}")
    return BatchNormGeometry.create(shape, layout, op)


def _check_eps(op: str, eps: Any) -> float:
    e = check_scalar(op, "eps", eps)
    if e < 0.0:  # CUDNN_BN_MIN_EPSILON is 0 in cuDNN 9
        raise ValueError(f"{op}: eps must be >= 0, got {eps!r}")
    return e


def _both_or_neither(op: str, running_mean: Any, running_var: Any) -> None:
    if (running_mean is None) != (running_var is None):
        raise ValueError(f"{op}: pass running_mean and running_var together, or neither")


def _validate(op: str, g: BatchNormGeometry, data: list[Arg], per_channel: list[Arg],
              x: Any) -> Any:
    """Data arrays share x's dtype and shape; per-channel arrays are (C,) in its compute
    dtype; no output overlaps any input; NumPy and CuPy are not mixed."""
    xp = validate(op, data, g.layout)
    want = compute_dtype(x.dtype)
    shaped = [Arg(a.name, a.array, (g.channels,), a.optional, a.output) for a in per_channel]
    present = [a for a in shaped if a.array is not None]
    for a in present:
        dt = getattr(a.array, "dtype", None)
        if dt is not None and dt in SUPPORTED.values() and dt != want:
            raise ValueError(
                f"{op}: {a.name} has dtype {dt} but {want} is expected for {x.dtype} data "
                "(per-channel arrays are in the compute dtype)")
    if any(a.array is None and not a.optional for a in shaped) or present:
        pxp = validate(op, shaped)
        if pxp is not xp:
            raise DeviceMismatchError(
                f"{op}: cannot mix NumPy and CuPy arrays in one call (x is "
                f"{'CuPy' if backend.is_cupy(x) else 'NumPy'}, {present[0].name} is not)")
    outs = [a for a in shaped if a.output and a.array is not None]
    if outs:  # per-channel inputs against outputs were checked by validate() above
        _checks._check_overlap(op, [a for a in data if a.array is not None] + outs)
    for i, a in enumerate(outs):
        for b in outs[i + 1:]:
            if _checks._overlaps(a.array, b.array):
                raise ValueError(f"{op}: {b.name} overlaps output '{a.name}'; pass separate "
                                 "arrays")
    return xp


def as_factor(momentum: float | None, num_batches_tracked: int) -> float:
    """PyTorch's exponential_average_factor: momentum, or 1/num_batches_tracked (already
    incremented for this batch) for momentum=None, the cumulative moving average."""
    if momentum is None:
        return 1.0 / max(int(num_batches_tracked), 1)
    if not math.isfinite(momentum):
        raise ValueError(f"momentum must be finite or None, got {momentum!r}")
    return float(momentum)
