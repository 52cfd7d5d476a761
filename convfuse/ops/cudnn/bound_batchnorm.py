"""Batch-norm calls bound to one signature's plan, for a caller that repeats a call (the
torch bridge's pointer path).

Note [bound batch-norm calls]
Note [bound calls] in bound.py, for batch normalization. A batch-norm call decides nothing
per call that its plan does not decide and record itself: the fused bnOps or the plain
call, a refusal, a memory back-off are the plan's state, read by the engine's body at each
call. So a bound call runs the engine's own body (batchnorm.py's training_forward,
inference_forward and training_backward) with the plan and handle it found, and asks at
each call only whether the engine would find the same ones:
- the same ExecContext (device and stream: the handle _bound_handle gives for it);
- the plan still cached under its key (touch_batchnorm_plan, refreshed as a hit);
- the engine function it stands for is the one batchnorm.py defined (AS_IMPORTED): a
  test's spy, installed before or after the first call, sees every call.
What it saves is the finding: the caller's DeviceArray per tensor (a bound call wraps the
pointers in the shapes and dtypes its signature fixes), the op dispatch, the plan lookup,
the handle's device check. Decisions, warnings, fallbacks and errors are the body's,
word for word, and an error the body raises reaches the caller as on the engine path: a
bound call never declines after the body started (it may have written the running
statistics), only before, returning None having run nothing; the caller then runs the
op. Bound: the training forward, the evaluation forward without statistics (Note
[inference without statistics] in batchnorm.py; with statistics it is CuPy arithmetic),
and the training-mode backward (the evaluation-mode one is CuPy arithmetic too).
"""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any

from ...dtypes import compute_dtype
from ...plan.batchnorm import BatchNormGeometry, BatchNormPlan, get_batchnorm_plan
from ...plan.batchnorm import touch_batchnorm_plan as _touch
from ..validated import BatchNormSaved
from .device import DeviceArray, ExecContext
from .handle import _bound_handle

#: bind's answer for an op it never binds.
NEVER = False


class _BoundBatchNorm:
    """What every bound batch-norm call checks (Note [bound batch-norm calls]) and the
    shapes it wraps pointers in. The plan is held weakly: one the cache let go takes its
    descriptors with it, and the call declines."""

    __slots__ = ("act", "cd", "channels", "ctx", "dtype", "eng", "plan", "residual", "shape",
                 "stands_for", "what")

    def __init__(self, eng: ModuleType, plan: BatchNormPlan, ctx: ExecContext, what: str,
                 dtype: Any) -> None:
        self.eng, self.ctx, self.what = eng, ctx, what
        self.plan = weakref.ref(plan)
        key = plan.key
        geom: BatchNormGeometry = key.geometry
        self.act, self.residual = key.activation, key.residual
        self.shape, self.channels = geom.shape, geom.channels
        self.dtype, self.cd = dtype, compute_dtype(dtype)
        self.stands_for = eng.AS_IMPORTED[what]

    def ready(self, ctx: ExecContext) -> tuple[BatchNormPlan, Any] | None:
        """(plan, handle) where the engine would find them, else None."""
        plan = self.plan()
        if (plan is None or ctx is not self.ctx
                or getattr(self.eng, self.what) is not self.stands_for or not _touch(plan)):
            return None
        return plan, _bound_handle(ctx)

    def array(self, ptr: int, ctx: ExecContext) -> DeviceArray | None:
        """The data-shaped array at `ptr` (x, y, a residual, dy), None for 0."""
        return DeviceArray(ptr, self.shape, self.dtype, ctx, None) if ptr else None

    def channel(self, ptr: int, ctx: ExecContext) -> DeviceArray | None:
        """The (C,) compute-dtype array at `ptr` (weight, bias, a statistic), None for 0."""
        return DeviceArray(ptr, (self.channels,), self.cd, ctx, None) if ptr else None


class BoundTraining(_BoundBatchNorm):
    """batchnorm_forward_training: (x, weight, bias, running_mean, running_var, residual)
    pointers (0 for a missing one), eps and the update factor -> (y, BatchNormSaved) as
    ops.validated returns them, or None."""

    __slots__ = ()

    def __call__(self, ctx: ExecContext, x: int, w: int, b: int, rm: int, rv: int,
                 residual: int, eps: float, factor: float) -> Any:
        got = self.ready(ctx)
        if got is None or bool(residual) is not self.residual:
            return None
        plan, handle = got
        ch = self.channel
        y, saved, mean, invstd, state = self.eng.training_forward(
            plan, handle, ctx, self.array(x, ctx), ch(w, ctx), ch(b, ctx), ch(rm, ctx),
            ch(rv, ctx), eps, factor, self.act, self.array(residual, ctx))
        return y, BatchNormSaved(mean, invstd, saved, True, state)


class BoundInference(_BoundBatchNorm):
    """batchnorm_forward_inference without statistics: (x, weight, bias, running_mean,
    running_var, residual) pointers and eps -> (y, BatchNormSaved) as ops.validated returns
    them (no mean, no invstd), or None."""

    __slots__ = ()

    def __call__(self, ctx: ExecContext, x: int, w: int, b: int, rm: int, rv: int,
                 residual: int, eps: float) -> Any:
        got = self.ready(ctx)
        if got is None or bool(residual) is not self.residual or not (rm and rv):
            return None
        plan, handle = got
        ch = self.channel
        y, saved = self.eng.inference_forward(
            plan, handle, ctx, self.array(x, ctx), ch(w, ctx), ch(b, ctx), ch(rm, ctx),
            ch(rv, ctx), eps, self.act, self.array(residual, ctx))
        return y, BatchNormSaved(None, None, saved, False)


class BoundBackward(_BoundBatchNorm):
    """batchnorm_backward after a training forward, beta = 0: (dy, x, weight, bias, the
    activation's saved tensor) pointers, the forward's mean and invstd (its arrays) and
    engine state (a fused forward's, for BackwardEx; or None), the dweight and dbias
    outputs' pointers (0 without weight: scratch then, as the engine) and eps -> (dx, dres)
    (dres None unless the plan's residual asks), or None. The plan's `residual` is the
    caller's need for the residual's gradient."""

    __slots__ = ()

    def __call__(self, ctx: ExecContext, dy: int, x: int, w: int, b: int, saved: int,
                 mean: Any, invstd: Any, state: Any, dw: int, db: int, eps: float) -> Any:
        got = self.ready(ctx)
        if got is None:
            return None
        plan, handle = got
        ch = self.channel
        if dw:
            dwa, dba = ch(dw, ctx), ch(db, ctx)
        else:
            dwa, dba = ctx.empty((self.channels,), self.cd), ctx.empty((self.channels,), self.cd)
        kept = BatchNormSaved(mean, invstd, self.array(saved, ctx), True, state)
        return self.eng.training_backward(
            plan, handle, ctx, self.array(dy, ctx), self.array(x, ctx), ch(w, ctx), ch(b, ctx),
            kept, eps, self.act, self.residual, dwa, dba, 0.0)


_CLASSES = {"batchnorm_forward_training": BoundTraining,
            "batchnorm_forward_inference": BoundInference,
            "batchnorm_backward": BoundBackward}


def bind(eng: ModuleType, name: str, geom: BatchNormGeometry, dtype: Any, ctx: ExecContext,
         act: str, residual: bool) -> Any:
    """A bound call of the engine module `eng`'s <name> (batchnorm.py's) for this signature
    (Note [bound batch-norm calls]), right after the engine ran it with these arguments;
    NEVER for what is not bound. batchnorm_forward_inference is bound for calls without
    statistics, batchnorm_backward for the training-mode backward: the caller asks only
    for those."""
    cls = _CLASSES.get(name)
    if cls is None or name not in eng.AS_IMPORTED:
        return NEVER
    return cls(eng, get_batchnorm_plan(geom, dtype, act, residual), ctx, name, dtype)
