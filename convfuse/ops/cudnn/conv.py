"""The convolution ops on CuPy arrays: one cuDNN call each, through a cached ConvPlan.

Outputs and workspace come from CuPy's pool; nothing else is allocated per call (the
zero bias for bias-free layers is cached per device, dtype and channel count).

Note [unfused fallback]
cuDNN may refuse convolutionBiasActivationForward (any NOT_SUPPORTED code, see `refused`)
for every algorithm a plan may use: IDENTITY has one forced algorithm (Note [IDENTITY needs
IMPLICIT_PRECOMP_GEMM]), so one refusal ends it. A slow path warns rather than fails, so
the plan records the refusal, warns once (FusedFallbackWarning) and from then on runs
  convolutionForward into y, with conv_forward's plan and algorithm choice (a relu plan's
    forward ranking is shared with its fused call, which walked it to the last entry);
  addTensor(1, bias, 1, y) when the layer has a bias (the zero bias is never added);
  addTensor(residual_scale, residual, 1, y) when a residual is given;
  for a relu plan, one in-place ReLU kernel (ops/elementwise.py); other activations are
    applied by the caller as after the fused call.
Each step rounds to the data's dtype, so float16/bfloat16 results may differ from the fused
call's (which rounds once) by a few units in the last place; the ReLU kernel propagates
NaN (as the reference engine and PyTorch do), where cuDNN's fused ReLU is NOT_PROPAGATE_NAN.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

from ... import activations, config
from ..._binding import cudnn
from ...errors import CudnnError
from ...plan import Candidate, ConvPlan, FusedFallbackWarning, WorkspaceFallbackWarning, get_plan
from .. import elementwise
from .handle import Workspace, context, get_handle

_zero_bias: dict[tuple[int, str, int], Any] = {}
_zero_bias_lock = threading.Lock()


def zero_bias(cp: Any, dtype: Any, channels: int) -> Any:  # pragma: gpu
    """The fused call needs a bias pointer (FACTS), so a bias-free layer passes zeros.

    The cached array outlives the call that creates it, so it must own its memory: it is
    taken with CuPy's raw allocator, never the current one. The current allocator may be
    a private pool (convfuse.graph.capture's warm-up runs under one), and a pooled array
    does not keep its pool alive: when the pool goes, it frees the block under the cached
    array, and later calls would read whatever is allocated there next.
    """
    key = (int(cp.cuda.runtime.getDevice()), cp.dtype(dtype).name, int(channels))
    with _zero_bias_lock:
        bias = _zero_bias.get(key)
        if bias is None:
            with cp.cuda.using_allocator():  # None: raw cudaMalloc, owned by the array
                bias = _zero_bias[key] = cp.zeros((channels,), dtype=dtype)
        return bias


def _where(plan: ConvPlan, what: str, cand: Candidate | None = None) -> str:
    algo = f" algo={cand.algo} workspace={cand.workspace}" if cand is not None else ""
    return f"{what} for {plan.describe()}{algo}"


def conv_bias_act(x: Any, w: Any, b: Any, geom: Any, activation: str = "identity",
                  residual: Any = None,
                  residual_scale: float = 1.0) -> tuple[Any, Any]:  # pragma: gpu
    """y = act(conv(x, w) + b + residual_scale * residual) in one fused cuDNN call, plus one
    activation kernel when cuDNN cannot apply the activation itself (or the unfused path
    of Note [unfused fallback] when cuDNN refuses the fused call)."""
    import cupy as cp

    act = activations.normalize(activation)
    handle = get_handle()
    plan = get_plan(geom, x.dtype, act, residual is not None)
    conv_out = cp.empty(geom.output_shape, dtype=x.dtype)
    _fused_forward(plan, handle, x, w, b, residual, float(residual_scale), conv_out)
    if act in activations.FUSED_IN_CUDNN:
        return conv_out, None
    if activations.saves(act) == "preactivation":
        y = cp.empty_like(conv_out)
        elementwise.activation_forward(conv_out, act, y)
        return y, conv_out
    elementwise.activation_forward(conv_out, act, conv_out)
    return conv_out, None


def refused(err: CudnnError, lib: Any) -> bool:
    """Whether cuDNN refused a call as not supported. cuDNN 9's statuses are categories
    with specific codes (CUDNN_STATUS_NOT_SUPPORTED = 3000, ..._SHAPE = 3002,
    ..._LAYOUT = 3004, ...); cudnn_graph.h's CUDNN_STATUS_CATEGORY(s) is s / 1000 * 1000,
    so every 3xxx code is a refusal, not just 3000."""
    return err.status // 1000 * 1000 == lib.CUDNN_STATUS_NOT_SUPPORTED


def _fused_forward(plan: ConvPlan, handle: Any, x: Any, w: Any, b: Any, residual: Any,
                   residual_scale: float, y: Any) -> None:  # pragma: gpu
    """y = act(conv(x, w) + b + residual_scale * residual), act being the plan's fused mode
    (relu or identity); b and residual may be None.

    One convolutionBiasActivationForward with the plan's fused forward algorithm. The
    heuristics rank algorithms for convolutionForward; should cuDNN refuse one for the
    fused call (any NOT_SUPPORTED code, see `refused`), the plan moves to the next ranked
    one for good. When none is left (at once for IDENTITY, whose algorithm is forced:
    Note [IDENTITY needs IMPLICIT_PRECOMP_GEMM]), the plan records the refusal, warns
    once with FusedFallbackWarning, and this and every later call run the unfused path of
    Note [unfused fallback] without retrying. Any other error is raised with context.
    """
    if plan.fused_refusal is not None:
        _unfused_forward(plan, handle, x, w, b, residual, residual_scale, y)
        return
    import cupy as cp

    lib = cudnn()
    bias = b if b is not None else zero_bias(cp, x.dtype, plan.key.geometry.out_channels)
    if residual is not None:
        z_ptr, alpha2 = residual.data.ptr, residual_scale
    else:
        # FACTS: z may not be NULL; z = y with alpha2 = 0 adds nothing.
        z_ptr, alpha2 = y.data.ptr, 0.0
    refusal: CudnnError | None = None
    while refusal is None:
        cand, ws = _algorithm_and_workspace(plan, "fwd", handle, (x.data.ptr, w.data.ptr),
                                            fused=True)
        try:
            lib.convolutionBiasActivationForward(
                handle, 1.0, plan.x_desc, x.data.ptr, plan.w_desc, w.data.ptr,
                plan.conv_desc_for(cand), cand.algo, ws.ptr, ws.size, alpha2,
                plan.y_desc, z_ptr, plan.bias_desc, bias.data.ptr, plan.act_desc,
                plan.y_desc, y.data.ptr)
            return
        except CudnnError as err:
            where = _where(plan, "convolutionBiasActivationForward", cand)
            if not refused(err, lib):
                raise err.with_context(where) from None
            if plan.reject("fwd", cand, fused=True):
                continue
            refusal = err.with_context(where)
    if plan.refuse_fused(refusal):
        warnings.warn(_fallback_message(plan, refusal), FusedFallbackWarning, stacklevel=4)
    _unfused_forward(plan, handle, x, w, b, residual, residual_scale, y)


def _algorithm_and_workspace(plan: ConvPlan, direction: str, handle: Any,
                             inputs: tuple[int, int],
                             fused: bool = False) -> tuple[Candidate, Workspace]:  # pragma: gpu
    """The plan's algorithm for `direction` and its workspace for this call.

    The plan chose an algorithm whose workspace could be allocated then; memory may be
    scarcer now. Rather than fail, drop that algorithm for the next ranked one, as the
    choice itself does (a forced algorithm has no next one, so its error stands).
    """
    import cupy

    while True:
        cand = plan.choice(direction, handle, inputs, fused=fused)
        try:
            return cand, Workspace(cand.workspace)
        except cupy.cuda.memory.OutOfMemoryError:
            if not plan.reject(direction, cand, fused=fused):
                raise
            warnings.warn(
                f"{direction} algorithm {cand.algo} needs {cand.workspace} bytes of workspace "
                f"that could not be allocated now, for {plan.describe()}; using the next "
                "ranked algorithm from here on", WorkspaceFallbackWarning, stacklevel=4,
            )


def _fallback_message(plan: ConvPlan, refusal: CudnnError) -> str:
    steps = ["convolutionForward", "addTensor for the bias (if any)"]
    if plan.key.residual:
        steps.append("addTensor for the residual")
    if plan.key.activation == "relu":
        steps.append("a ReLU kernel")
    return (
        f"cuDNN refused convolutionBiasActivationForward with {refusal.status_name} "
        f"({refusal.status}) for every algorithm it may use, for {plan.describe()} "
        f"residual={plan.key.residual}; running it unfused instead ({', '.join(steps)}). "
        "This path launches extra kernels and is slower; the plan remembers the refusal "
        "and does not try the fused call again."
    )


def _unfused_forward(plan: ConvPlan, handle: Any, x: Any, w: Any, b: Any, residual: Any,
                     residual_scale: float, y: Any) -> None:  # pragma: gpu
    """The fused call's result in separate calls: Note [unfused fallback]."""
    lib = cudnn()
    fwd = get_plan(plan.key.geometry, plan.key.dtype)
    _forward_into(fwd, handle, x, w, y, "conv_bias_act unfused convolutionForward", plan)
    if b is not None:
        with context(lambda: _where(plan, "conv_bias_act unfused bias addTensor")):
            lib.addTensor(handle, 1.0, fwd.bias_desc, b.data.ptr, 1.0, fwd.y_desc, y.data.ptr)
    if residual is not None:
        with context(lambda: _where(plan, "conv_bias_act unfused residual addTensor")):
            lib.addTensor(handle, residual_scale, fwd.y_desc, residual.data.ptr, 1.0,
                          fwd.y_desc, y.data.ptr)
    if plan.key.activation == "relu":
        elementwise.activation_forward(y, "relu", y)


def _forward_into(plan: ConvPlan, handle: Any, x: Any, w: Any, y: Any, what: str,
                  about: ConvPlan | None = None) -> None:  # pragma: gpu
    """convolutionForward of x and w into y (beta = 0) with the plan's forward algorithm;
    errors name `what` and the plan `about` (default: this one)."""
    cand, ws = _algorithm_and_workspace(plan, "fwd", handle, (x.data.ptr, w.data.ptr))
    with context(lambda: _where(about or plan, what, cand)):
        cudnn().convolutionForward(
            handle, 1.0, plan.x_desc, x.data.ptr, plan.w_desc, w.data.ptr,
            plan.conv_desc_for(cand), cand.algo, ws.ptr, ws.size, 0.0, plan.y_desc, y.data.ptr)


def conv_forward(x: Any, w: Any, geom: Any) -> Any:  # pragma: gpu
    import cupy as cp

    handle = get_handle()
    plan = get_plan(geom, x.dtype)
    y = cp.empty(geom.output_shape, dtype=x.dtype)
    _forward_into(plan, handle, x, w, y, "conv_forward")
    return y


def conv_backward_data(dz: Any, w: Any, geom: Any, out: Any = None,
                       beta: float = 0.0) -> Any:  # pragma: gpu
    import cupy as cp

    handle = get_handle()
    plan = get_plan(geom, dz.dtype)
    dx = out if out is not None else cp.empty(geom.input_shape, dtype=dz.dtype)
    beta = float(beta) if out is not None else 0.0
    cand, ws = _algorithm_and_workspace(plan, "bwd_data", handle, (w.data.ptr, dz.data.ptr))
    with context(lambda: _where(plan, "conv_backward_data", cand)):
        cudnn().convolutionBackwardData(
            handle, 1.0, plan.w_desc, w.data.ptr, plan.y_desc, dz.data.ptr,
            plan.conv_desc_for(cand), cand.algo, ws.ptr, ws.size, beta, plan.x_desc, dx.data.ptr)
    return dx


def conv_backward_filter(x: Any, dz: Any, geom: Any, out: Any = None,
                         beta: float = 0.0) -> Any:  # pragma: gpu
    import cupy as cp

    handle = get_handle()
    plan = get_plan(geom, x.dtype)
    dw = out if out is not None else cp.empty(geom.weight_shape, dtype=x.dtype)
    beta = float(beta) if out is not None else 0.0
    cand, ws = _algorithm_and_workspace(plan, "bwd_filter", handle, (x.data.ptr, dz.data.ptr))
    with context(lambda: _where(plan, "conv_backward_filter", cand)):
        cudnn().convolutionBackwardFilter(
            handle, 1.0, plan.x_desc, x.data.ptr, plan.y_desc, dz.data.ptr,
            plan.conv_desc_for(cand), cand.algo, ws.ptr, ws.size, beta, plan.w_desc, dw.data.ptr)
    return dw


def conv_backward_bias(dz: Any, geom: Any, out: Any = None,
                       beta: float = 0.0) -> Any:  # pragma: gpu
    """db of shape (K,): cudnnConvolutionBackwardBias through the plan's 1xKx1x1 bias
    descriptor (same bytes), or the bias-only mode of the fused kernel when
    config bias_grad == "fused"; never a generic reduction."""
    import cupy as cp

    db = out if out is not None else cp.empty(geom.bias_shape, dtype=dz.dtype)
    beta = float(beta) if out is not None else 0.0
    if config.get().bias_grad == "fused":
        elementwise.activation_backward_bias(dz, None, "identity", geom, None, db, beta)
        return db
    handle = get_handle()
    plan = get_plan(geom, dz.dtype)
    with context(lambda: _where(plan, "conv_backward_bias")):
        cudnn().convolutionBackwardBias(
            handle, 1.0, plan.y_desc, dz.data.ptr, beta, plan.bias_desc, db.data.ptr)
    return db
