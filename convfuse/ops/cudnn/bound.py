"""Convolution calls bound to one signature's plan, for a caller that repeats a call (the
torch bridge's pointer path).

Note [bound calls]
Once a convolution of one signature has run through the engine, every later call of that
signature makes the same cuDNN call: the same descriptors, algorithm, workspace size and
scaling factors; only the pointers differ. Going through the engine rediscovers all that
at each call (the layout rule, the handle, the plan lookup, the ranked walk and its lock,
the workspace bookkeeping, a closure): several microseconds of host time per cuDNN call,
four calls per training step of a layer. A bound call holds what the engine found and
asks at each call only whether the engine would still decide the same:
- the same ExecContext (device and stream), the same flags object, and the plan still
  cached under its key (PlanCache.touch, which refreshes it as get_plan's hit would, so a
  plan in use is never the least recently used): get_plan would return this plan;
- the plan's slot still holds the bound candidate with no memory back-off pending
  (Chosen.holds): choice() would return it without changing anything;
- the fused call: still recorded as the path, with no fallback state (fused_settled); a
  bias-free one is bound only once the cached zero bias is complete for every stream
  (Note [cached constants across streams] in constants.py: there is no wait to add, and
  a constant never becomes incomplete again);
- the bias gradient: config bias_grad is "cudnn" (the flags object) and no refusal;
- the engine function it stands for is the one conv.py defined (AS_IMPORTED): a test's
  spy, installed before or after the first call, sees every call.
Where any of that fails, or cuDNN refuses the call, or the workspace cannot be allocated,
it returns None having kept nothing (its outputs are written with beta = 0, so a later
call rewrites them whole) and the caller runs the engine's call, which decides, warns,
falls back and raises as it always does; the caller may bind again after it. Any other
cuDNN error is raised at once, named with the plan and algorithm as the engine names it
(run again, a device failure would only fail twice). Where the
plan has decided for good against what a bound call does (the bias gradient refused,
config bias_grad "fused"), bind answers a Declined that holds until the flags or the plan
change, so the engine path pays no binding attempt per call; a plan whose fused call was
refused or timed slower for good is bound to its unfused path instead.
It binds only what it reproduces exactly: conv_bias_act with relu or identity (the fused
call, Note [nothing to fuse]'s convolutionForward, or for a plan unfused for good Note
[unfused fallback]'s convolutionForward and bias + activation pass) and the three
convolution backwards; conv_transpose_bias_act (G's data gradient, then the engine's bias +
activation pass) and the transposed data and filter gradients, where G's output is the
transposed one's (not windowed) and no pre-activation is kept; all with beta = 0, on a
layout cuDNN runs directly (not Note [float64 runs channels-first]), in one call (not
Note [batch split]).
"""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any

from ... import activations, config
from ..._binding import cudnn
from ...dtypes import name as dtype_name
from ...errors import CudnnError
from ...plan import ConvPlan, conv_plan_cached, get_plan, get_transpose_plan, touch_conv_plan
from ...plan.choice import Chosen
from .. import elementwise
from . import fused, layout
from .device import DeviceArray, ExecContext
from .handle import Workspace, _bound_handle
from .ranked import refused, where
from .split import parts

#: bind's answer for a signature it never binds (another activation, a channels-first
#: run, another op); None means "not now" (the plan is still deciding).
NEVER = False


class Declined:
    """bind's answer where the plan decided against the bound call for good: falsy, and
    `stale` once the flags object changed or the plan left the cache (then bind may answer
    otherwise)."""

    __slots__ = ("flags", "plan")

    def __init__(self, plan: ConvPlan) -> None:
        self.flags, self.plan = config.get(), weakref.ref(plan)

    def __bool__(self) -> bool:
        return False

    def stale(self) -> bool:
        plan = self.plan()
        return config.get() is not self.flags or plan is None or not conv_plan_cached(plan)


def _unless_refused(err: CudnnError, plan: ConvPlan, what: str, cand: Any = None) -> None:
    """A refusal returns: the engine's call walks down the ranking as it always does. Any
    other error is raised here, named as the engine names it: run again by the engine, a
    device failure would only fail twice (and lose the first failure's detail)."""
    if not refused(err, cudnn()):
        raise err.with_context(where(plan, what, cand)) from None


class _Bound:
    """What every bound call checks (Note [bound calls]) and runs with. The plan is held
    weakly: one the cache let go takes its descriptors with it, and the call declines."""

    __slots__ = ("algo", "chosen", "ctx", "eng", "flags", "plan", "stands_for", "what", "ws")

    def __init__(self, eng: ModuleType, plan: ConvPlan, chosen: Chosen, ctx: ExecContext,
                 what: str) -> None:
        self.eng, self.chosen, self.ctx, self.what = eng, chosen, ctx, what
        self.plan = weakref.ref(plan)
        cand = chosen.candidate
        self.algo, self.ws = cand, cand.workspace
        plan.conv_desc_for(cand)  # made now, so desc_for finds it
        self.flags = config.get()
        self.stands_for = eng.AS_IMPORTED[what]

    def current(self, ctx: ExecContext) -> ConvPlan | None:
        """The plan, where the engine would still make this call; else None."""
        plan = self.plan()
        if (plan is not None and ctx is self.ctx and self.chosen.holds(self.algo)
                and config.get() is self.flags
                and getattr(self.eng, self.what) is self.stands_for
                and self.still(plan) and touch_conv_plan(plan)):
            return plan
        return None

    def still(self, plan: ConvPlan) -> bool:
        """What else the engine decides per plan for this call (nothing, here)."""
        return True

    def unless_refused(self, err: CudnnError, plan: ConvPlan) -> None:
        _unless_refused(err, plan, self.what, self.algo)

    def ready(self, ctx: ExecContext) -> tuple[ConvPlan, Workspace, Any, Any] | None:
        """(plan, workspace, handle, convolution descriptor) for this call, or None where
        the engine would decide otherwise (`current`) or the workspace cannot be allocated
        now (the engine's walk down the ranking decides)."""
        plan = self.current(ctx)
        if plan is None:
            return None
        try:
            ws = Workspace(self.ws, ctx)
        except MemoryError:
            return None
        return plan, ws, _bound_handle(ctx), plan.desc_for(self.algo)


class BoundForward(_Bound):
    """conv_bias_act's cuDNN call for one signature, with residual_scale 1 (the torch
    bridge's): (x, w, b, residual) pointers -> y, a new array of the context's (0 for a
    missing bias or residual), or None."""

    __slots__ = ("dtype", "fused", "path", "shape", "zero")

    def __init__(self, eng: ModuleType, plan: ConvPlan, chosen: Chosen, ctx: ExecContext,
                 dtype: Any, fused_call: bool, zero: Any) -> None:
        super().__init__(eng, plan, chosen, ctx, "conv_bias_act")
        self.fused, self.path, self.zero = fused_call, plan.forward_path, zero
        self.shape, self.dtype = plan.key.geometry.output_shape, dtype

    def still(self, plan: ConvPlan) -> bool:
        """The fused call: still the path, with no fallback state."""
        return not self.fused or (plan.forward_path is self.path and plan.fused_settled())

    def __call__(self, ctx: ExecContext, x: int, w: int, b: int, residual: int) -> Any:
        # y before the workspace, as the engine allocates them: short of memory, the engine
        # walks down to a smaller workspace after y, where this order would fail on y
        y = ctx.empty(self.shape, self.dtype)
        got = self.ready(ctx)
        if got is None:
            return None
        plan, ws, handle, desc = got
        cand = self.algo
        try:
            if self.fused:
                bias = b if b else self.zero.arrays[0].data.ptr
                z, alpha2 = (residual, 1.0) if residual else (y.ptr, 0.0)  # Note [z = y ...]
                cudnn().convolutionBiasActivationForward(
                    handle, 1.0, plan.x_desc, x, plan.w_desc, w, desc, cand.algo, ws.ptr,
                    ws.size, alpha2, plan.y_desc, z, plan.bias_desc, bias, plan.act_desc,
                    plan.y_desc, y.ptr)
            else:  # Note [nothing to fuse]
                cudnn().convolutionForward(
                    handle, 1.0, plan.x_desc, x, plan.w_desc, w, desc, cand.algo, ws.ptr,
                    ws.size, 0.0, plan.y_desc, y.ptr)
        except CudnnError as err:
            self.unless_refused(err, plan)
            return None
        return y


class _PassedForward(_Bound):
    """A forward bound to one cuDNN call into a new y (`_run`), then, with a bias, a
    residual or an activation, the engine's bias + activation pass over y (`epilogue`: a
    geometry whose output is y); (x, w, b, residual) pointers -> y, or None."""

    __slots__ = ("act", "dtype", "epilogue", "shape")
    act: str
    dtype: Any
    epilogue: Any  # a ConvGeometry
    shape: tuple[int, ...]

    def _run(self, plan: ConvPlan, ws: Workspace, handle: Any, desc: Any, x: int, w: int,
             y: int) -> None:
        raise NotImplementedError

    def __call__(self, ctx: ExecContext, x: int, w: int, b: int, residual: int) -> Any:
        y = ctx.empty(self.shape, self.dtype)  # before the workspace: BoundForward's order
        got = self.ready(ctx)
        if got is None:
            return None
        plan, ws, handle, desc = got
        try:
            self._run(plan, ws, handle, desc, x, w, y.ptr)
        except CudnnError as err:
            self.unless_refused(err, plan)
            return None
        if b or residual or self.act != "identity":
            epi = self.epilogue
            bias = DeviceArray(b, epi.bias_shape, self.dtype, ctx, None) if b else None
            res = DeviceArray(residual, self.shape, self.dtype, ctx, None) if residual \
                else None
            elementwise.bias_act_forward(y, bias, res, 1.0, self.act, epi)
        return y


class BoundUnfusedForward(_PassedForward):
    """conv_bias_act for one signature whose plan runs unfused for good (cuDNN refused the
    fused call, or timing found it slower: Note [unfused fallback] in fused.py), as the
    engine runs it: convolutionForward with the plain plan's choice, then the bias +
    activation pass (relu or identity). It holds the plain plan (whose call it makes) and
    checks the fused plan's decision at each call."""

    __slots__ = ("fused_plan", "path")

    def __init__(self, eng: ModuleType, plain: ConvPlan, chosen: Chosen, ctx: ExecContext,
                 dtype: Any, fused_plan: ConvPlan) -> None:
        super().__init__(eng, plain, chosen, ctx, "conv_bias_act")
        self.fused_plan, self.path = weakref.ref(fused_plan), fused_plan.forward_path
        geom = fused_plan.key.geometry
        self.act, self.dtype, self.epilogue = fused_plan.key.activation, dtype, geom
        self.shape = geom.output_shape

    def still(self, plan: ConvPlan) -> bool:
        """The fused plan: still cached (refreshed as get_plan's hit would), still unfused."""
        fused_plan = self.fused_plan()
        return (fused_plan is not None and fused_plan.forward_path is self.path
                and touch_conv_plan(fused_plan))

    def _run(self, plan: ConvPlan, ws: Workspace, handle: Any, desc: Any, x: int, w: int,
             y: int) -> None:
        cudnn().convolutionForward(handle, 1.0, plan.x_desc, x, plan.w_desc, w, desc,
                                   self.algo.algo, ws.ptr, ws.size, 0.0, plan.y_desc, y)


class BoundBackward(_Bound):
    """A gradient's cuDNN call into a caller's output, beta = 0, with pointers (a, b, out):
    conv_backward_data's (dz, w, dx), conv_backward_filter's (x, dz, dw), and a transposed
    convolution's through its G, where dz is G's output gradient itself (not windowed):
    conv_transpose_backward_data's (dz, w, dx) is G's forward, _filter's (x, dz, dw) G's
    filter gradient with the roles of x and dz swapped. True when it ran."""

    __slots__ = ()

    def __call__(self, ctx: ExecContext, a: int, b: int, out: int) -> bool:
        got = self.ready(ctx)
        if got is None:
            return False
        plan, ws, handle, desc = got
        what, algo, lib = self.what, self.algo.algo, cudnn()
        try:
            if what == "conv_backward_data":
                lib.convolutionBackwardData(handle, 1.0, plan.w_desc, b, plan.y_desc, a, desc,
                                            algo, ws.ptr, ws.size, 0.0, plan.x_desc, out)
            elif what == "conv_transpose_backward_data":
                lib.convolutionForward(handle, 1.0, plan.x_desc, a, plan.w_desc, b, desc, algo,
                                       ws.ptr, ws.size, 0.0, plan.y_desc, out)
            else:  # the filter gradient: G's x is the transposed convolution's dz
                x, dz = (a, b) if what == "conv_backward_filter" else (b, a)
                lib.convolutionBackwardFilter(handle, 1.0, plan.x_desc, x, plan.y_desc, dz,
                                              desc, algo, ws.ptr, ws.size, 0.0, plan.w_desc,
                                              out)
        except CudnnError as err:
            self.unless_refused(err, plan)
            return False
        return True


class BoundBias:
    """conv_backward_bias's cudnnConvolutionBackwardBias (dz -> db), beta = 0: True when
    it ran."""

    __slots__ = ("ctx", "eng", "flags", "plan", "stands_for")

    def __init__(self, eng: ModuleType, plan: ConvPlan, ctx: ExecContext) -> None:
        self.eng, self.plan, self.ctx = eng, weakref.ref(plan), ctx
        self.flags = config.get()
        self.stands_for = eng.AS_IMPORTED["conv_backward_bias"]

    def __call__(self, ctx: ExecContext, dz: int, out: int) -> bool:
        plan = self.plan()
        if (plan is None or ctx is not self.ctx or config.get() is not self.flags
                or plan.bias_grad_refusal is not None
                or self.eng.conv_backward_bias is not self.stands_for
                or not touch_conv_plan(plan)):
            return False
        try:
            cudnn().convolutionBackwardBias(_bound_handle(ctx), 1.0, plan.y_desc, dz, 0.0,
                                            plan.bias_desc, out)
        except CudnnError as err:
            _unless_refused(err, plan, "conv_backward_bias")
            return False
        return True


class BoundTransposeForward(_PassedForward):
    """conv_transpose_bias_act's call for one signature, with residual_scale 1: G's data
    gradient (cudnnConvolutionBackwardData) into a new y, then the engine's bias +
    activation pass as conv_transpose_bias_act runs it. Only where y is G's output itself
    (not windowed)."""

    __slots__ = ()

    def __init__(self, eng: ModuleType, plan: ConvPlan, chosen: Chosen, ctx: ExecContext,
                 dtype: Any, tgeom: Any, act: str) -> None:
        super().__init__(eng, plan, chosen, ctx, "conv_transpose_bias_act")
        self.act, self.dtype, self.epilogue = act, dtype, tgeom.epilogue
        self.shape = tgeom.conv.input_shape

    def _run(self, plan: ConvPlan, ws: Workspace, handle: Any, desc: Any, x: int, w: int,
             y: int) -> None:
        cudnn().convolutionBackwardData(handle, 1.0, plan.w_desc, w, plan.y_desc, x, desc,
                                        self.algo.algo, ws.ptr, ws.size, 0.0, plan.x_desc, y)


#: A transposed op's bound class and the slot of its plan (G's) it runs.
_TRANSPOSED = {"conv_transpose_bias_act": "bwd_data", "conv_transpose_backward_data": "fwd",
               "conv_transpose_backward_filter": "bwd_filter"}


def bind_transpose(eng: ModuleType, name: str, tgeom: Any, dtype: Any, ctx: ExecContext,
                   act: str = "identity") -> Any:
    """bind's answer for a transposed convolution's op (ops/cudnn/conv_transpose.py's):
    NEVER where the engine slices G's output (windowed), runs channels-first, or keeps a
    pre-activation (elu, silu, gelu: two outputs)."""
    slot = _TRANSPOSED.get(name)
    if (slot is None or tgeom.windowed or layout.runs_channels_first(tgeom, dtype)
            or name not in eng.AS_IMPORTED or parts(tgeom) is not None):
        return NEVER
    act = activations.normalize(act)
    if activations.saves(act) == "preactivation":
        return NEVER
    plan = get_transpose_plan(tgeom, dtype)
    chosen = plan.settled(slot)
    if chosen is None:
        return None
    if name == "conv_transpose_bias_act":
        return BoundTransposeForward(eng, plan, chosen, ctx, dtype, tgeom, act)
    return BoundBackward(eng, plan, chosen, ctx, name)


def bind(eng: ModuleType, name: str, geom: Any, dtype: Any, ctx: ExecContext,
         act: str = "identity", bias: bool = False, residual: bool = False) -> Any:
    """A bound call of the engine module `eng`'s <name> (ops/cudnn/conv.py's) for this
    signature (Note [bound calls]), right after the engine ran it with these arguments:
    None while the plan is still deciding (ask again after a later engine call), NEVER for
    what is not bound."""
    if layout.runs_channels_first(geom, dtype):  # Note [float64 runs channels-first]
        return NEVER
    if name not in eng.AS_IMPORTED or parts(geom) is not None:  # Note [batch split]
        return NEVER
    if name == "conv_bias_act":
        return _bind_forward(eng, geom, dtype, ctx, activations.normalize(act), bias,
                             residual)
    if name == "conv_backward_bias":
        plan = get_plan(geom, dtype)
        if config.get().bias_grad == "fused" or plan.bias_grad_refusal is not None:
            return Declined(plan)  # the engine's kernel computes it
        return BoundBias(eng, plan, ctx)
    plan = get_plan(geom, dtype)
    chosen = plan.settled("bwd_data" if name == "conv_backward_data" else "bwd_filter")
    return None if chosen is None else BoundBackward(eng, plan, chosen, ctx, name)


def _bind_forward(eng: ModuleType, geom: Any, dtype: Any, ctx: ExecContext, act: str,
                  bias: bool, residual: bool) -> Any:
    if act not in activations.FUSED_IN_CUDNN:  # the engine adds an activation kernel
        return NEVER
    plan = get_plan(geom, dtype, act, residual)
    if not bias and not residual and plan.key.activation == "identity":
        chosen = plan.settled("fwd")  # Note [nothing to fuse]
        return None if chosen is None else BoundForward(eng, plan, chosen, ctx, dtype, False,
                                                           None)
    path = plan.forward_path
    if path is not None and path.path != "fused":  # refused, or timed slower: for good
        plain = get_plan(geom, dtype)  # the plan fused._unfused_forward runs
        chosen = plain.settled("fwd")
        return None if chosen is None else BoundUnfusedForward(eng, plain, chosen, ctx, dtype,
                                                                plan)
    if path is None or not plan.fused_settled():
        return None
    chosen = plan.settled("fwd", fused=True)
    zero = None
    if not bias:
        zero = fused._zero_bias.get((ctx.device, dtype_name(dtype), geom.out_channels))
        if zero is None or not zero.complete:
            return None
    return None if chosen is None else BoundForward(eng, plan, chosen, ctx, dtype, True, zero)
