"""The fused forward: one convolutionBiasActivationForward per call, and the paths taken
when it cannot run or is slower.

Note [unfused fallback]
The fused call may be impossible for a plan: cuDNN refuses it (any NOT_SUPPORTED code, see
`refused`) for every algorithm the plan may use, or, for IDENTITY, whose algorithm is forced
(Note [IDENTITY needs IMPLICIT_PRECOMP_GEMM]), cuDNN refuses to size that algorithm's
workspace, the workspace exceeds config.workspace_limit, or it cannot be allocated now.
A slow path warns rather than fails, so the plan warns once (FusedFallbackWarning) and runs
  convolutionForward into y, with conv_forward's plan and its best-ranked algorithm;
  then one pass of convfuse's kernel y = act(y + bias + residual_scale * residual)
    (Note [bias + activation pass] in kernels/activation.cu), act being the plan's fused
    mode (relu or identity; other activations are applied by the caller as after the
    fused call), skipped when there is no bias, no residual and no activation.
Refusals and a too-small workspace_limit are for good; an out-of-memory is retried after a
back-off (Note [transient out-of-memory] in plan/choice.py). Results differ from the fused
call's by rounding only: y is rounded to the data's dtype after the convolution and again
after the pass. The kernel's ReLU propagates NaN (as the reference engine and PyTorch do),
where cuDNN's fused ReLU is NOT_PROPAGATE_NAN.

Note [z = y with alpha2 = 0]
Without a residual the fused call gets z = y, a fresh and unwritten output, with
alpha2 = 0. If cuDNN read z, 0 * NaN would be NaN; it does not: its rule for blending
factors is that a zero factor leaves the blended tensor unread ("When beta is zero, the
output is not read and may contain uninitialized data (including NaN)", cuDNN developer
guide, Scaling Parameters), and the two largest users of this call rely on the same for
alpha2: PyTorch's cudnn_convolution_relu passes its uninitialised output (empty_cuda) as
z with alpha 0 ("use output_t as z to satisfy CUDNN API", aten/src/ATen/native/cudnn/
ConvShared.cpp), and XLA's legacy fused convolution passes the output buffer as the side
input when side_input_scale == 0 (tensorflow/compiler/mlir/tfrt/transforms/lmhlo_to_gpu/
convolution_pattern.cc). So y is not zeroed first (a memset would cost a pass over y per
call); tests/gpu poison y with NaN before every such call, so a cuDNN that read it fails
there.

Note [forced algorithm versus speed]
IDENTITY's forced IMPLICIT_PRECOMP_GEMM can be slower than the best-ranked algorithm plus
one bias pass (PaddlePaddle #14744, dlib #2656). With config.benchmark, an identity plan
times both paths on its first call and keeps the faster; with heuristics it keeps the fused
call. plan.forward_path records the choice (ForwardPath), for the selfcheck and benchmarks.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

from ..._binding import cudnn
from ...dtypes import name as dtype_name
from ...errors import CudnnError
from ...plan import (
    ConvPlan,
    ForwardPath,
    FusedFallbackWarning,
    NoAlgorithmError,
    WorkspaceUnavailableError,
    get_plan,
)
from ...plan.capture import refuse_in_capture
from .. import elementwise
from .constants import DeviceConstant, cached
from .device import ExecContext, cupy_context
from .ranked import algorithm_and_workspace, forward_into, refused, where

_zero_bias: dict[tuple[int, str, int], DeviceConstant] = {}
_zero_bias_lock = threading.Lock()


def zero_bias(cp: Any, dtype: Any, channels: int,
              ctx: ExecContext | None = None) -> Any:  # pragma: gpu
    """The fused call needs a bias pointer (FACTS), so a bias-free layer passes zeros:
    cached per device, dtype and channel count, and ordered before this call's stream
    reads them (Note [cached constants across streams] in constants.py). `ctx`: the call's
    (default: CuPy's current device and stream)."""
    ctx = ctx if ctx is not None else cupy_context()
    key = (ctx.device, dtype_name(dtype), int(channels))
    bias, = cached(cp, _zero_bias, _zero_bias_lock, key,
                   f"the cached zero bias ({channels} x {key[1]})",
                   lambda: (cp.zeros((channels,), dtype=dtype),), ctx)
    return bias


def fused_forward(plan: ConvPlan, handle: Any, ctx: ExecContext, x: Any, w: Any, b: Any,
                  residual: Any, residual_scale: float, y: Any) -> None:  # pragma: gpu
    """y = act(conv(x, w) + b + residual_scale * residual), act being the plan's fused mode
    (relu or identity); b and residual may be None.

    One convolutionBiasActivationForward with the plan's fused forward algorithm. The
    heuristics rank algorithms for convolutionForward; should cuDNN refuse one for the
    fused call, the plan moves to the next ranked one for good. When the fused call is
    impossible (Note [unfused fallback]) this and later calls run the unfused path.
    Any other error is raised with context.
    """
    if (plan.key.benchmark and plan.key.activation == "identity"
            and plan.forward_path is None and plan.fused_refusal is None):
        _time_forward_paths(plan, handle, ctx, x, w, b, residual, residual_scale, y)
        return
    args = (plan, handle, ctx, x, w, b, residual, residual_scale, y)
    if plan.fused_off() or not _try_fused(*args):
        _unfused_forward(*args)


def _try_fused(plan: ConvPlan, handle: Any, ctx: ExecContext, x: Any, w: Any, b: Any,
               residual: Any, residual_scale: float, y: Any) -> bool:  # pragma: gpu
    """Run the fused call; False (after recording why, and warning once per plan) when
    the caller must take the unfused path instead."""
    import cupy as cp

    lib = cudnn()
    forced = plan.key.activation == "identity"  # Note [IDENTITY needs IMPLICIT_PRECOMP_GEMM]
    bias = b if b is not None else zero_bias(cp, x.dtype, plan.key.geometry.out_channels, ctx)
    if residual is not None:
        z_ptr, alpha2 = residual.data.ptr, residual_scale
    else:
        # FACTS: z may not be NULL. Note [z = y with alpha2 = 0]
        z_ptr, alpha2 = y.data.ptr, 0.0
    while True:
        try:
            cand, ws = algorithm_and_workspace(plan, "fwd", handle, (x.data.ptr, w.data.ptr),
                                                ctx, fused=True)
        except CudnnError as err:  # the forced algorithm's workspace query
            if not (forced and refused(err, lib)):
                raise
            return _fall_back(plan, err, permanent=True)
        except WorkspaceUnavailableError as err:
            if not forced:
                raise
            return _fall_back(plan, err, permanent=False)
        except NoAlgorithmError as err:  # the forced workspace exceeds workspace_limit
            if not forced:
                raise
            return _fall_back(plan, err, permanent=True)
        try:
            lib.convolutionBiasActivationForward(
                handle, 1.0, plan.x_desc, x.data.ptr, plan.w_desc, w.data.ptr,
                plan.conv_desc_for(cand), cand.algo, ws.ptr, ws.size, alpha2,
                plan.y_desc, z_ptr, plan.bias_desc, bias.data.ptr, plan.act_desc,
                plan.y_desc, y.data.ptr)
        except CudnnError as err:
            about = where(plan, "convolutionBiasActivationForward", cand)
            if not refused(err, lib):
                raise err.with_context(about) from None
            if plan.reject("fwd", cand, fused=True, allocate=ctx.choice_allocator):
                continue
            return _fall_back(plan, err.with_context(about), permanent=True)
        plan.fused_ran()
        if plan.forward_path is None and not (forced and plan.key.benchmark):  # else timed
            plan.set_forward_path(ForwardPath("fused", "heuristics"))
        return True


def _fall_back(plan: ConvPlan, reason: Exception, permanent: bool) -> bool:  # pragma: gpu
    if permanent:
        warn = plan.refuse_fused(reason)
        plan.set_forward_path(ForwardPath("unfused", "refused"), replace=True)
    else:
        warn = plan.fused_out_of_memory()
    if warn:
        # _fall_back < _try_fused < fused_forward < conv._fused_into < conv._conv_bias_act
        # < engine < ops.validated < ops dispatch < the caller
        warnings.warn(_fallback_message(plan, reason, permanent), FusedFallbackWarning,
                      stacklevel=9)
    return False


def _time_forward_paths(plan: ConvPlan, handle: Any, ctx: ExecContext, x: Any, w: Any, b: Any,
                        residual: Any, residual_scale: float, y: Any,
                        reps: int = 3) -> None:  # pragma: gpu
    """Note [forced algorithm versus speed]: time the fused call against the unfused path
    on this call's arrays and keep the faster; y holds the result either way."""
    import cupy as cp

    refuse_in_capture(f"timing the fused and unfused forward of {plan.describe()}",
                      ctx.capture_stream)
    args = (plan, handle, ctx, x, w, b, residual, residual_scale, y)

    def elapsed(run: Any) -> float | None:
        if not run(*args):  # the first run chooses algorithms and compiles kernels
            return None
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(ctx.stream)
        for _ in range(reps):
            run(*args)
        end.record(ctx.stream)
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) / reps

    fused_ms = elapsed(_try_fused)
    if fused_ms is None:  # the fused call fell back: the plan recorded why
        _unfused_forward(*args)
        return
    def unfused(*a: Any) -> bool:
        _unfused_forward(*a)
        return True  # the unfused path has no refusal to fall back from

    unfused_ms = elapsed(unfused)
    assert unfused_ms is not None  # elapsed gives None only for a refused first run
    path = "fused" if fused_ms <= unfused_ms else "unfused"
    plan.set_forward_path(ForwardPath(path, "timed", fused_ms, unfused_ms))
    if path == "fused":  # y last held the unfused result; equal up to rounding, but keep
        _try_fused(*args)  # the call's result the path later calls will give


def _fallback_message(plan: ConvPlan, reason: Exception, permanent: bool) -> str:
    steps = ["convolutionForward", "one bias + activation pass"]
    if plan.key.residual:
        steps[-1] = "one bias + residual + activation pass"
    if isinstance(reason, CudnnError):
        why = (f"cuDNN refused {reason.function} with {reason.status_name} ({reason.status})"
               + (" for every algorithm it may use" if reason.function.endswith(
                   "BiasActivationForward") else " for the fused call's forced algorithm"))
    else:
        why = f"the fused call cannot run ({type(reason).__name__}: {reason})"
    later = ("the plan remembers this and does not try the fused call again" if permanent
             else "the fused call is retried after a back-off, as memory may come back")
    said = getattr(reason, "detail", "")  # cuDNN's own message (CudnnError.detail)
    return (
        f"{why}, for {plan.describe()} residual={plan.key.residual}; running it unfused "
        f"instead ({', '.join(steps)}). This path launches extra kernels and is slower; "
        f"{later}." + (f" cuDNN said: {said}" if said else "")
    )


def _unfused_forward(plan: ConvPlan, handle: Any, ctx: ExecContext, x: Any, w: Any, b: Any,
                     residual: Any, residual_scale: float, y: Any) -> None:  # pragma: gpu
    """The fused call's result in two steps: Note [unfused fallback]."""
    fwd = get_plan(plan.key.geometry, plan.key.dtype)
    forward_into(fwd, handle, ctx, x, w, y, "conv_bias_act unfused convolutionForward", plan)
    if b is not None or residual is not None or plan.key.activation == "relu":
        elementwise.bias_act_forward(y, b, residual, residual_scale, plan.key.activation,
                                     plan.key.geometry)
