"""The batch-normalization ops on CuPy arrays, through a cached BatchNormPlan.

Training forward: cudnnBatchNormalizationForwardTrainingEx with the plan's fused bnOps
(relu, or residual add + relu) when the plan tries them (Note [BatchNorm in cuDNN] in
convfuse/plan/batchnorm.py), else cudnnBatchNormalizationForwardTraining, then addTensor
for a residual and convfuse's activation kernel. cuDNN updates the running statistics in
place with exponentialAverageFactor and writes the saved mean and inverse std; nothing is
read back to the host. Inference: cudnnBatchNormalizationForwardInference, then the same
add and activation. Backward: cudnnBatchNormalizationBackwardEx after a fused forward
(it needs that forward's reserve space and output), else the activation kernel's backward
then cudnnBatchNormalizationBackward; both accumulate into the parameter gradients through
betaParamDiff. Outputs, workspace and reserve space come from the call's ExecContext
(CuPy's pool, or the caller's allocator on the pointer path: Note [the pointer path] in
device.py, which also says why inference and the evaluation-mode backward take CuPy's
path there).

Note [BatchNorm fallback]
Should cuDNN refuse the fused ops (any NOT_SUPPORTED status, conv.refused) at the size
query, the forward call or the backward call, the plan records it, warns once
(FusedFallbackWarning) and runs the plain path from then on: plain training forward,
addTensor(residual), the ReLU kernel; in backward the ReLU kernel's backward and plain
BatchNormalizationBackward. A backward refused after a fused forward still has what the
plain backward needs (the output y, the saved mean and inverse std), so it falls back
within the same step. Any other error is raised with the plan's shapes.
An out-of-memory for the fused calls' workspace or reserve space (CuPy's pool) takes the
same plain path for this call (backward: within the step) and backs off before trying the
fused calls again (Note [transient out-of-memory]); the plan's one warning covers it.

Evaluation-mode backward (rare: frozen statistics) is computed with CuPy arithmetic,
since cuDNN has no backward for inference; it is correct but not a tuned path.

Note [inference without statistics]
The statistics a backward of an evaluation-mode forward reads (a copy of the running
mean, and invstd = 1 / sqrt(running_var + eps)) are CuPy arithmetic: three or four small
kernels per call, and on the pointer path a CuPy scope around the whole call. A caller
with no backward to follow (an inference call; a torch layer under no_grad or with
nothing requiring grad) passes stats=False and gets y alone: on the pointer path the
cuDNN call (and the residual add and activation kernel, if any) on pointers, no CuPy.

Note [cuDNN's inference batch]
cuDNN's legacy batch-norm inference has refused batches above 65,535 samples (PyTorch
sends those to its own kernel: `_select_batch_norm_backend`'s "spatial, eval" bound;
OneFlow #3147 saw cudnnBatchNormalizationForwardInference fail at 65,536), a size a
BatchNorm1d over rows of features reaches in one evaluation batch. Inference uses the
running statistics, so its samples are independent and N is the outermost dimension in
both layouts: a larger batch runs as consecutive calls of at most INFERENCE_BATCH samples
on offsets into x and y, each with the plan of its own shape (two plans at most).
INFERENCE_BATCH is 65,520, a multiple of 16, so every offset keeps the 16-byte alignment
the ops require of their arrays (ops/_checks.py) whatever a sample's size: a BatchNorm1d(3)
sample is 6 or 12 bytes, and 65,535 of them would start the next call 10 or 4 bytes past a
multiple of 16. Training normalises with the batch's own statistics and cannot be split
so; PyTorch's bound there (880,801) is left to cuDNN, whose refusal is raised with the
plan's shapes.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any

from ... import activations
from ...dtypes import compute_dtype
from ...dtypes import name as dtype_name
from ...errors import CudnnError
from ...plan.batchnorm import BatchNormGeometry, BatchNormPlan, get_batchnorm_plan
from ...plan.conv import FusedFallbackWarning
from .. import elementwise
from .constants import DeviceConstant, cached
from .conv import refused
from .device import ExecContext, context_of, is_device_array, on_cupy
from .handle import Workspace, context, get_handle

_affine_defaults: dict[tuple[int, str, int], DeviceConstant] = {}
_affine_lock = threading.Lock()


@dataclass(frozen=True)
class EngineState:
    """Which path a training forward took, and (fused) its reserve space for backward and
    the bnOps that wrote it: BackwardEx reads a reserve space only of its own bnOps."""

    fused: bool
    reserve: Any = None  # Workspace
    ops: Any = None  # the forward plan's fused_ops


def _ones_zeros(cp: Any, dtype: Any, channels: int,
                ctx: ExecContext) -> tuple[Any, Any]:  # pragma: gpu
    """cuDNN needs scale and bias pointers, so affine=False passes cached ones and zeros:
    like fused.zero_bias, from CuPy's default pool, never made inside a capture, and
    ordered before this call's stream reads them (Note [cached constants across streams]
    in constants.py)."""
    key = (ctx.device, dtype_name(dtype), int(channels))
    ones, zeros = cached(cp, _affine_defaults, _affine_lock, key,
                         f"the cached batch-normalization ones and zeros ({channels} x "
                         f"{key[1]})",
                         lambda: (cp.ones((channels,), dtype), cp.zeros((channels,), dtype)),
                         ctx)
    return ones, zeros


def _ptr(a: Any) -> int:
    return a.data.ptr if a is not None else 0


def _scale_shift(weight: Any, bias: Any, g: BatchNormGeometry, cd: Any,
                 ctx: ExecContext) -> tuple[Any, Any]:  # pragma: gpu
    if weight is not None and bias is not None:  # affine: no cached buffer is needed
        return weight, bias
    import cupy as cp

    ones, zeros = _ones_zeros(cp, cd, g.channels, ctx)
    return (weight if weight is not None else ones), (bias if bias is not None else zeros)


def _where(plan: BatchNormPlan, what: str) -> str:
    return f"{what} for {plan.describe()}"


def _need_workspace(plan: BatchNormPlan, size: int, call: str) -> None:
    """A fused call cuDNN sizes at 0 bytes of workspace is taken as refused: cuDNN's
    reference says an Ex call given a NULL, zero-byte workspace runs as the non-extended
    call, which would silently leave out bnOps' add and activation."""
    if size == 0:
        lib = plan.lib
        status = int(lib.CUDNN_STATUS_NOT_SUPPORTED)
        raise CudnnError(status, f"cudnnGetBatchNormalization{call}WorkspaceSize",
                         lib.getErrorString(status),
                         detail=f"0 bytes of workspace for the fused {call} (taken as a "
                                "refusal: with no workspace it would run without its bnOps)")


def _warn_fallback(plan: BatchNormPlan, refusal: CudnnError, stage: str) -> None:
    # stacklevel 7: _warn_fallback < _fused_forward < training_forward (training_backward
    # < _training_backward) < engine < ops.validated < ops < caller
    if plan.refuse_fused(refusal):
        warnings.warn(
            f"cuDNN refused the fused batch normalization ({stage}) with "
            f"{refusal.status_name} ({refusal.status}) for {plan.describe()}; running plain "
            "batch normalization plus convfuse's add and ReLU kernels instead. This path "
            "launches extra kernels; the plan remembers the refusal and does not try again."
            + (f" cuDNN said: {refusal.detail}" if refusal.detail else ""),
            FusedFallbackWarning, stacklevel=7)


def _warn_out_of_memory(plan: BatchNormPlan, err: MemoryError, stage: str) -> None:
    if plan.fused_out_of_memory():
        warnings.warn(
            f"the fused batch normalization's {stage} could not be allocated now "
            f"({type(err).__name__}: {err}) for {plan.describe()}; running plain batch "
            "normalization plus convfuse's add and ReLU kernels instead. The fused calls are "
            "retried after a back-off, as memory may come back.",
            FusedFallbackWarning, stacklevel=8)  # one frame more: _allocate


def _allocate(plan: BatchNormPlan, sizes: list[tuple[str, int]],
              ctx: ExecContext) -> list[Workspace] | None:
    """Workspace objects for `sizes` ((what, bytes)), or None after an out-of-memory
    (recorded and warned once per plan)."""
    import cupy as cp

    out = []
    for what, nbytes in sizes:
        try:
            out.append(Workspace(nbytes, ctx))
        except cp.cuda.memory.OutOfMemoryError as err:
            _warn_out_of_memory(plan, err, what)
            return None
    return out


def _finish_forward(plan: BatchNormPlan, handle: Any, ctx: ExecContext, y: Any, residual: Any,
                    act: str) -> tuple[Any, Any]:  # pragma: gpu
    """Add the residual and apply the activation after a plain BN call; (y, saved)."""
    lib = plan.lib
    if residual is not None:
        with context(lambda: _where(plan, "batchnorm residual addTensor")):
            lib.addTensor(handle, 1.0, plan.x_desc, residual.data.ptr, 1.0, plan.x_desc,
                          y.data.ptr)
    need = activations.saves(act)
    if need == "none":
        return y, None
    if need == "output":
        elementwise.activation_forward(y, act, y)
        return y, y
    out = ctx.empty(tuple(y.shape), y.dtype)
    elementwise.activation_forward(y, act, out)
    return out, y


def batchnorm_forward_training(x: Any, weight: Any, bias: Any, running_mean: Any,
                               running_var: Any, g: BatchNormGeometry, eps: float,
                               factor: float, act: str,
                               residual: Any) -> tuple[Any, ...]:  # pragma: gpu
    ctx = context_of(x)
    handle = get_handle(ctx)
    plan = get_batchnorm_plan(g, x.dtype, act, residual is not None)
    return training_forward(plan, handle, ctx, x, weight, bias, running_mean, running_var,
                            eps, factor, act, residual)


def training_forward(plan: BatchNormPlan, handle: Any, ctx: ExecContext, x: Any, weight: Any,
                     bias: Any, running_mean: Any, running_var: Any, eps: float, factor: float,
                     act: str, residual: Any) -> tuple[Any, ...]:  # pragma: gpu
    """batchnorm_forward_training once its plan and handle are found (a bound call's too:
    Note [bound batch-norm calls] in bound_batchnorm.py)."""
    g: BatchNormGeometry = plan.key.geometry
    cd = compute_dtype(x.dtype)
    scale, shift = _scale_shift(weight, bias, g, cd, ctx)
    y = ctx.empty(g.shape, x.dtype)
    mean = ctx.empty((g.channels,), cd)
    invstd = ctx.empty((g.channels,), cd)
    if not plan.fused_off():
        reserve = _fused_forward(plan, handle, ctx, x, scale, shift, running_mean, running_var, eps,
                                 factor, residual, y, mean, invstd)
        if reserve is not None:
            return y, y, mean, invstd, EngineState(True, reserve, plan.fused_ops)
    with context(lambda: _where(plan, "batchNormalizationForwardTraining")):
        plan.lib.batchNormalizationForwardTraining(
            handle, plan.training_mode, 1.0, 0.0, plan.x_desc, x.data.ptr, plan.x_desc,
            y.data.ptr, plan.bn_desc_training, scale.data.ptr, shift.data.ptr, factor,
            _ptr(running_mean), _ptr(running_var), eps, mean.data.ptr, invstd.data.ptr)
    y, saved = _finish_forward(plan, handle, ctx, y, residual, act)
    return y, saved, mean, invstd, EngineState(False)


def _fused_forward(plan: BatchNormPlan, handle: Any, ctx: ExecContext, x: Any, scale: Any,
                   shift: Any,
                   running_mean: Any, running_var: Any, eps: float, factor: float,
                   residual: Any, y: Any, mean: Any, invstd: Any) -> Any:  # pragma: gpu
    """One ForwardTrainingEx; its reserve space, or None when the plain path must run
    (cuDNN refused, or memory is short; recorded and warned once per plan). A refusal
    returns before cuDNN writes anything, so y and the running statistics are untouched."""
    lib = plan.lib
    stage = "getBatchNormalization*Size"
    try:
        sizes = plan.sizes(handle, ctx.capture_stream)
        _need_workspace(plan, sizes.forward_workspace, "ForwardTrainingEx")
        got = _allocate(plan, [("forward workspace", sizes.forward_workspace),
                               ("reserve space", sizes.reserve)], ctx)
        if got is None:
            return None
        ws, reserve = got
        stage = "batchNormalizationForwardTrainingEx"
        z_desc = plan.x_desc if residual is not None else None
        lib.batchNormalizationForwardTrainingEx(
            handle, plan.training_mode, plan.fused_ops, 1.0, 0.0, plan.x_desc, x.data.ptr,
            z_desc, _ptr(residual), plan.x_desc, y.data.ptr, plan.bn_desc_training,
            scale.data.ptr, shift.data.ptr, factor, _ptr(running_mean), _ptr(running_var), eps,
            mean.data.ptr, invstd.data.ptr, plan.act_desc, ws.ptr, ws.size, reserve.ptr,
            reserve.size)
    except CudnnError as err:
        if not refused(err, lib):
            raise err.with_context(_where(plan, stage)) from None
        _warn_fallback(plan, err.with_context(_where(plan, stage)), stage)
        return None
    plan.fused_ran()
    return reserve


def batchnorm_forward_inference(x: Any, weight: Any, bias: Any, running_mean: Any,
                                running_var: Any, g: BatchNormGeometry, eps: float, act: str,
                                residual: Any,
                                stats: bool = True) -> tuple[Any, Any, Any, Any]:  # pragma: gpu
    """(y, saved, mean, invstd); mean and invstd None without `stats` (Note [inference
    without statistics])."""
    if stats and is_device_array(x):  # CuPy arithmetic below: Note [the pointer path]
        return on_cupy(batchnorm_forward_inference, x, weight, bias, running_mean,
                       running_var, g, eps, act, residual)
    ctx = context_of(x)
    handle = get_handle(ctx)
    plan = get_batchnorm_plan(g, x.dtype, act, residual is not None)
    y, saved = inference_forward(plan, handle, ctx, x, weight, bias, running_mean, running_var,
                                 eps, act, residual)
    if not stats:
        return y, saved, None, None
    import cupy as cp

    cd = compute_dtype(x.dtype)
    mean = running_mean.copy()
    invstd = 1.0 / cp.sqrt(running_var + cd.type(eps))
    return y, saved, mean, invstd.astype(cd, copy=False)


def inference_forward(plan: BatchNormPlan, handle: Any, ctx: ExecContext, x: Any, weight: Any,
                      bias: Any, running_mean: Any, running_var: Any, eps: float, act: str,
                      residual: Any) -> tuple[Any, Any]:  # pragma: gpu
    """(y, saved) of batchnorm_forward_inference once its plan and handle are found (a
    bound call's too)."""
    g: BatchNormGeometry = plan.key.geometry
    scale, shift = _scale_shift(weight, bias, g, compute_dtype(x.dtype), ctx)
    y = ctx.empty(g.shape, x.dtype)
    _inference_calls(plan, handle, x, y, scale, shift, running_mean, running_var, eps)
    return _finish_forward(plan, handle, ctx, y, residual, act)


#: The largest batch one cuDNN inference call gets (Note [cuDNN's inference batch]).
INFERENCE_BATCH = 65520


def _inference_calls(plan: BatchNormPlan, handle: Any, x: Any, y: Any, scale: Any, shift: Any,
                     running_mean: Any, running_var: Any, eps: float) -> None:  # pragma: gpu
    """y = batchnorm(x) with the running statistics, in cuDNN inference calls of at most
    INFERENCE_BATCH samples (Note [cuDNN's inference batch])."""
    g: BatchNormGeometry = plan.key.geometry
    n = g.shape[0]
    sample = x.size // n * x.dtype.itemsize  # bytes per sample, the same in y
    part = plan
    for start in range(0, n, INFERENCE_BATCH):
        count = min(INFERENCE_BATCH, n - start)
        if count != part.key.geometry.shape[0]:
            part = get_batchnorm_plan(BatchNormGeometry.create((count, *g.shape[1:]), g.layout),
                                      plan.key.dtype, plan.key.activation, plan.key.residual)
        offset = start * sample
        with context(functools.partial(_where, part, "batchNormalizationForwardInference")):
            part.lib.batchNormalizationForwardInference(
                handle, part.inference_mode, 1.0, 0.0, part.x_desc, x.data.ptr + offset,
                part.x_desc, y.data.ptr + offset, part.bn_desc_inference, scale.data.ptr,
                shift.data.ptr, running_mean.data.ptr, running_var.data.ptr, eps)


def batchnorm_backward(dy: Any, x: Any, weight: Any, bias: Any, saved: Any,
                       g: BatchNormGeometry, eps: float, act: str, residual: bool,
                       need_dx: bool, weight_grad: Any, bias_grad: Any,
                       beta: float) -> tuple[Any, Any, Any, Any]:  # pragma: gpu
    if not saved.training and is_device_array(dy):  # CuPy arithmetic: Note [the pointer path]
        return on_cupy(batchnorm_backward, dy, x, weight, bias, saved, g, eps, act, residual,
                       need_dx, weight_grad, bias_grad, beta)
    ctx = context_of(dy)
    cd = compute_dtype(x.dtype)
    if weight_grad is not None:
        dw, db, pbeta = weight_grad, bias_grad, beta
    else:
        dw, db, pbeta = ctx.empty((g.channels,), cd), ctx.empty((g.channels,), cd), 0.0
    if not saved.training:
        dx, dres = _eval_backward(dy, x, weight, saved, g, act, residual, need_dx, dw, db, pbeta)
    else:
        dx, dres = _training_backward(ctx, dy, x, weight, bias, saved, g, eps, act, residual,
                                      dw, db, pbeta)
    if weight is None:
        dw = db = None
    return (dx if need_dx else None), dw, db, dres


def _training_backward(ctx: ExecContext, dy: Any, x: Any, weight: Any, bias: Any, saved: Any,
                       g: BatchNormGeometry, eps: float, act: str, residual: bool, dw: Any,
                       db: Any, pbeta: float) -> tuple[Any, Any]:  # pragma: gpu
    handle = get_handle(ctx)
    plan = get_batchnorm_plan(g, x.dtype, act, residual)
    return training_backward(plan, handle, ctx, dy, x, weight, bias, saved, eps, act, residual,
                             dw, db, pbeta)


def training_backward(plan: BatchNormPlan, handle: Any, ctx: ExecContext, dy: Any, x: Any,
                      weight: Any, bias: Any, saved: Any, eps: float, act: str, residual: bool,
                      dw: Any, db: Any, pbeta: float) -> tuple[Any, Any]:  # pragma: gpu
    """(dx, dres) of a training-mode backward once its plan and handle are found (a bound
    call's too)."""
    g: BatchNormGeometry = plan.key.geometry
    lib = plan.lib
    cd = compute_dtype(x.dtype)
    scale, shift = _scale_shift(weight, bias, g, cd, ctx)
    dx = ctx.empty(g.shape, x.dtype)
    state = saved.engine_state
    # a backward whose residual flag differs from the forward's has another plan, whose
    # bnOps did not write this reserve space: the plain backward (Note [the fused backward
    # on the eager path] in convfuse/torch/_bn_plan.py)
    if (state is not None and state.fused and state.ops == plan.fused_ops
            and plan.fused_refusal is None):
        dres = ctx.empty(g.shape, x.dtype) if residual else None
        stage = "getBatchNormalizationBackwardExWorkspaceSize"
        try:
            size = plan.sizes(handle, ctx.capture_stream).backward_workspace
            _need_workspace(plan, size, "BackwardEx")
            got = _allocate(plan, [("backward workspace", size)], ctx)
            if got is not None:
                ws, = got
                stage = "batchNormalizationBackwardEx"
                lib.batchNormalizationBackwardEx(
                    handle, plan.training_mode, plan.fused_ops, 1.0, 0.0, 1.0, pbeta,
                    plan.x_desc, x.data.ptr, plan.x_desc, saved.saved.data.ptr, plan.x_desc,
                    dy.data.ptr, plan.x_desc if residual else None, _ptr(dres), plan.x_desc,
                    dx.data.ptr, plan.bn_desc_training, scale.data.ptr, shift.data.ptr,
                    dw.data.ptr, db.data.ptr, eps, saved.mean.data.ptr, saved.invstd.data.ptr,
                    plan.act_desc, ws.ptr, ws.size, state.reserve.ptr, state.reserve.size)
                return dx, dres
        except CudnnError as err:
            where = _where(plan, stage)
            if not refused(err, lib):
                raise err.with_context(where) from None
            _warn_fallback(plan, err.with_context(where), stage)
    dz = _activation_backward(ctx, dy, saved.saved, act)
    with context(lambda: _where(plan, "batchNormalizationBackward")):
        lib.batchNormalizationBackward(
            handle, plan.training_mode, 1.0, 0.0, 1.0, pbeta, plan.x_desc, x.data.ptr,
            plan.x_desc, dz.data.ptr, plan.x_desc, dx.data.ptr, plan.bn_desc_training,
            scale.data.ptr, dw.data.ptr, db.data.ptr, eps, saved.mean.data.ptr,
            saved.invstd.data.ptr)
    dres = (ctx.copy(dz) if dz is dy else dz) if residual else None
    return dx, dres


def _activation_backward(ctx: ExecContext, dy: Any, saved: Any, act: str) -> Any:  # pragma: gpu
    if act == "identity":
        return dy
    dz = ctx.empty(tuple(dy.shape), dy.dtype)
    elementwise.activation_backward(dy, saved, act, dz)
    return dz


def _eval_backward(dy: Any, x: Any, weight: Any, saved: Any, g: BatchNormGeometry, act: str,
                   residual: bool, need_dx: bool, dw: Any, db: Any,
                   pbeta: float) -> tuple[Any, Any]:  # pragma: gpu
    """Frozen statistics: dx = dz * weight * invstd; dweight = sum(dz * xhat); dbias = sum(dz)."""
    cd = compute_dtype(x.dtype)
    dz = _activation_backward(context_of(dy), dy, saved.saved, act)
    shape = [1] * g.ndim
    shape[g.channel_axis] = g.channels
    invstd = saved.invstd.reshape(shape)
    dzc = dz.astype(cd)
    xhat = (x.astype(cd) - saved.mean.reshape(shape)) * invstd
    dbias = dzc.sum(axis=g.reduce_axes)
    dweight = (dzc * xhat).sum(axis=g.reduce_axes)
    if pbeta != 0.0:
        dbias += cd.type(pbeta) * db
        dweight += cd.type(pbeta) * dw
    db[...] = dbias
    dw[...] = dweight
    dx = None
    if need_dx:
        w = weight.reshape(shape) if weight is not None else 1.0
        dx = (dzc * (w * invstd)).astype(x.dtype)
    dres = (dz.copy() if dz is dy else dz) if residual else None
    return dx, dres


def bind(name: str, geom: BatchNormGeometry, dtype: Any, ctx: ExecContext,
         act: str = "identity", bias: bool = False, residual: bool = False) -> Any:
    """A call of this module's <name> bound to one signature, for a caller that repeats it
    (Note [bound batch-norm calls] in bound_batchnorm.py); False for what is never bound.
    `bias` is not read (affine or not, the body decides); for batchnorm_backward
    `residual` is whether the residual's gradient is asked for."""
    from . import bound_batchnorm  # it checks this module's functions

    return bound_batchnorm.bind(sys.modules[__name__], name, geom, dtype, ctx, act, residual)


#: The functions a bound call stands for, as defined here: a bound call runs only while the
#: module attribute is still this one, so a spy sees every call.
AS_IMPORTED = {name: globals()[name] for name in (
    "batchnorm_forward_training", "batchnorm_forward_inference", "batchnorm_backward")}
