"""A batch-norm layer call's decisions, made once per signature (Note [batch-norm call
plans]).

Note [batch-norm call plans]
Note [call plans] in _call_plan.py, for BatchNorm. A layer's eager call used to key its
input checks, then key the layout and geometry again from six tensors in the forward body
and again in the backward, and carry its hyperparameters through an eleven-argument
autograd node to re-key them there. At the sizes where host time decides a step those keys
cost more than the arithmetic. So the layer keys one `BatchNormCall` per signature: the
input's and residual's shapes, strides, dtypes and devices, the same of the parameters and
running statistics (`module.half()` changes a buffer's dtype behind the same object),
whether a count exists, and every hyperparameter a decision reads (eps, momentum,
activation, training, track_running_stats). The plan holds what the custom ops' bodies
decide per call: the Prepared (layout, geometry, the convfuse.ops it validated), the
compute dtype, the update factor (momentum, or 1 into fresh statistics for the cumulative
average: Note [the cumulative average on the device] in _bn_ops.py), whether the layer
counts the batch and passes its statistics, and the normalized activation. A call is then:
- under a tracer or transform (Note [two call paths] in _eager.py): the layer's general
  path, `batchnorm_call`, the custom ops as before;
- on the eager path when autograd records the call: this module's `BatchNormFunction`, one
  node named as the general path's, whose backward goes straight to the plan (or to the
  backward custom op where dy is a subclass);
- otherwise the forward body alone.
The bodies call the same convfuse.ops entries, in the same order, on the same values as
_bn_ops' `_batchnorm_training`, `_inference` and `_backward`, so the numbers are theirs
bit for bit. The node takes the running statistics and the count as one non-tensor
argument (autograd never differentiates them; their version counters move as the custom
op's do, `_bump`). Whatever a plan does not hold (an empty batch; an activation or
momentum the ops refuse, in the ops' words) takes the general path; a key that cannot be
made or a call that fails leaves nothing behind (Note [per-signature decisions] in
_signature.py).

Note [the host path]
On the CPU, data in a NumPy dtype (not bfloat16, Note [bfloat16 on the CPU] in _arrays.py)
crosses as `numpy(force=True)` views (the parameters' and running statistics' are the
layer's kept views where all four cross: Note [a layer's host arrays] in _host_arrays.py)
and comes back through `torch.from_numpy` (the engine's results are C-contiguous): the
checks `to_array`/`to_tensor` make per call are answered by the key (device, dtype,
strides), and so are whether x, weight, bias and the running statistics go to the engine as
they are (the statistics are then written in place, nothing copied back). The forward keeps
for the backward the arrays it handed over (x's only where they are x's own memory, not a
copy the backward would keep alive), and mean and invstd as the engine returned them: the
backward's x, weight, bias and saved output come out of ctx.saved_tensors, whose version
checks then passed, so those arrays still hold what the tensors hold. The engine returns
dweight and dbias itself, where on CUDA they are written into tensors allocated first
(cuDNN accumulates into given outputs), and CUDA keeps _bn_ops' conversions, bound to the
stream current at each call; on CUDA's pointer path a training forward, its backward and
an evaluation forward without statistics hand the engine's bound call addresses instead
from the signature's second call (`_on_pointers`, `_backward_on_pointers`: Note [bound
batch-norm calls] in convfuse/ops/cudnn/bound_batchnorm.py).

Note [the fused backward on the eager path]
The custom ops cannot carry a fused forward's engine state to their backward (Note [what
the backward reuses] in _bn_ops.py), but this module's BatchNormFunction is no custom op:
a forward that ran cuDNN's fused bnOps (fp16 channels-last relu, Note [BatchNorm in cuDNN])
keeps its engine state, the reserve space with it, in `kept`, and the backward hands it on,
so the engine runs cudnnBatchNormalizationBackwardEx: dx, dweight, dbias and the
residual's gradient in one call, where the plain backward launches the ReLU kernel's
backward first (one more pass over the tensor). Only where the backward's plan is the
forward's: its residual flag is whether the residual's gradient is asked for, so a forward
with a residual whose gradient is not wanted takes the plain backward (BN_ADD_ACTIVATION's
reserve space is not BN_ACTIVATION's; the engine checks this too). The backward lets the
reserve space go, as autograd frees PyTorch's own cuDNN batch norm's saved reserve after
the backward, rather than with the graph (which a training loop's `loss` keeps alive into
the next step's forward); a second backward of a retained graph takes the plain one. A refusal
or an out-of-memory of the fused backward falls back to the plain one within the step
(Note [BatchNorm fallback] in convfuse/ops/cudnn/batchnorm.py).
`apply` is the autograd Function's C apply: outside functorch transforms, which the eager
path excludes, Function.apply's Python wrapper only unwraps dead functorch wrappers, which
the eager path does not take either (_eager.takes_eager_path).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import activations, ops
from ..geometry import from_channels_first
from ..ops import validated
from ..ops.batchnorm import as_factor
from ..plan.batchnorm import BatchNormGeometry
from . import _bound, _double, _eager
from ._arrays import (
    batchnorm_channels_last,
    host_array,
    logical,
    physical,
    to_array,
    to_tensor,
)
from ._bn_ops import _apart, _bump, _channel, _layout, _per_channel, _usable
from ._host_arrays import HostArrays
from ._ops import aligned, context, device_type
from ._signature import Prepared, op, validated_engine

_TRAINING, _BACKWARD = "batchnorm_forward_training", "batchnorm_backward"
_INFERENCE = "batchnorm_forward_inference"

#: What a forward keeps for its backward: mean and invstd (the engine's arrays); on the
#: CPU the arrays of x (or None), weight, bias and the saved tensor it handed over; on
#: CUDA the engine's state of a fused forward (Note [the fused backward on the eager path]).
Kept = tuple[Any, Any, Any, Any]


class BatchNormCall:
    """One signature of a batch-norm layer's call (Note [batch-norm call plans]).
    `training`: normalise with the batch's statistics (batchnorm_training); `factor`: the
    update factor handed to the op (0 with nothing to update); `cumulative`: momentum=None
    with a count, the op filling fresh statistics blended on the device afterwards."""

    __slots__ = ("act", "cd", "cl", "count", "cumulative", "eps", "factor", "has_residual",
                 "host", "identity", "layout", "nbytes", "params", "prep", "reads", "saves",
                 "stats_as_is", "training", "viewed", "x_as_is")

    def __init__(self, x: torch.Tensor, training: bool, eps: float, act: str,
                 factor: float, cumulative: bool, weight: torch.Tensor | None,
                 bias: torch.Tensor | None, residual: torch.Tensor | None,
                 running_mean: torch.Tensor | None, running_var: torch.Tensor | None) -> None:
        self.cl = cl = batchnorm_channels_last(x)
        self.layout = _layout(cl)
        name = "batchnorm_forward_training" if training else "batchnorm_forward_inference"
        try:
            geom = BatchNormGeometry.create(from_channels_first(x.shape, cl), self.layout,
                                            name)
        except (TypeError, ValueError):  # the op refuses it, with its own words
            geom = None
        self.prep = Prepared(cl, geom, direct=geom is not None)
        self.cd = torch.float64 if x.dtype == torch.float64 else torch.float32
        self.training, self.eps, self.act = training, eps, act
        self.factor, self.cumulative = factor, cumulative
        self.saves = activations.saves(act)
        self.identity = act == "identity"
        # Note [the host path]: what crosses as plain NumPy views, decided on what the key
        # holds (device, dtype, strides)
        self.host = host = not x.is_cuda and x.dtype != torch.bfloat16
        self.x_as_is = host and not cl and x.is_contiguous()
        self.params = host and all(t is None or _usable(t, self.cd) for t in (weight, bias))
        self.stats_as_is = (host and training and not cumulative
                            and running_mean is not None and running_var is not None
                            and _usable(running_mean, self.cd)
                            and _usable(running_var, self.cd))
        # the parameters and statistics all cross as views: the layer's kept ones (Note [a
        # layer's host arrays] in _host_arrays.py)
        self.viewed = self.params and self.stats_as_is
        # the sizes _stats_apart compares (in the key: shapes and dtypes)
        self.nbytes = tuple(0 if t is None else t.numel() * t.element_size()
                            for t in (running_mean, running_var, x, residual, weight, bias))
        self.has_residual = residual is not None
        # the layer's: whether it counts the batch, and passes its running statistics
        self.count, self.reads = False, True

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None,
                 bias: torch.Tensor | None, residual: torch.Tensor | None,
                 stats: tuple[Any, Any, Any], held: HostArrays | None = None) -> torch.Tensor:
        """y; `stats` is (running_mean, running_var, num_batches_tracked) as the op takes
        them (the count already incremented by the layer), `held` the layer's views."""
        if _eager.needs_graph(x, weight, bias, residual):
            out = _apply(x, weight, bias, residual, self, stats, held)
            return out[0] if self.saves == "preactivation" else out
        # nothing will differentiate it: no statistics for a backward (Note [inference
        # without statistics] in convfuse/ops/cudnn/batchnorm.py)
        return self.forward(x, weight, bias, residual, stats, held, keep=False)[0]

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, residual: torch.Tensor | None,
                stats: tuple[Any, Any, Any], held: HostArrays | None = None,
                keep: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, Kept]:
        """(y, z, kept) as _bn_ops' forward bodies compute y and z (z, the pre-activation,
        only where the activation saves it); `kept` is what the backward reuses (in
        evaluation, without `keep`, no statistics: nothing differentiates the call)."""
        running_mean, running_var, nbt = stats
        cd, cl, prep, host = self.cd, self.cl, self.prep, self.host
        xp = x if self.x_as_is else physical(x, cl)
        rp = None if residual is None else physical(residual, cl)
        training, cumulative = self.training, self.cumulative
        m = v = None
        written: list[torch.Tensor] = []
        if training and self.stats_as_is:  # written in place
            m, v, written = running_mean, running_var, [running_mean, running_var]
            if not torch.is_inference_mode_enabled():  # _bump's
                torch.autograd.graph.increment_version(written)
        elif training:
            _bump(running_mean, running_var)
            # _batchnorm_training's choice, statistic by statistic: in place when usable
            # (dtype and contiguity are in the key, a CUDA address is not), else a copy
            # written back, or fresh statistics for the cumulative average.
            m = _statistic(running_mean, cd, cumulative)
            v = _statistic(running_var, cd, cumulative)
            written = [s for s, t in ((m, running_mean), (v, running_var))
                       if s is not None and s is t]
        if not host and (training or not keep) and _bound.on_pointer_path(x):
            with context(x):  # Note [bound batch-norm calls]
                y, saved = self._on_pointers(_bound.context(x), x.dtype, xp, rp, weight, bias,
                                             m, v, running_mean, running_var, written)
                out = self._result(y, saved, x, xp, None, None, None)
            return self._written_back(out, running_mean, running_var, m, v, nbt)
        dev = "cpu" if host else device_type(x)
        with context(x):
            if host:  # Note [the host path]
                xa = xp.numpy(force=True)
                ra = None if rp is None else rp.numpy(force=True)
            else:
                xa = to_array(xp)
                ra = None if rp is None else to_array(rp)
            views = held.views(self, (weight, bias, running_mean, running_var)) \
                if self.viewed and held is not None else None
            if views is not None:
                wa, ba = views[0], views[1]
            elif self.params:
                wa = None if weight is None else weight.numpy(force=True)
                ba = None if bias is None else bias.numpy(force=True)
            else:
                wa, ba = _per_channel(weight, cd), _per_channel(bias, cd)
            if not training:
                y, saved = op(prep, dev, "batchnorm_forward_inference", xa, wa, ba,
                              _per_channel(running_mean, cd), _per_channel(running_var, cd),
                              self.layout, self.eps, self.act, ra, keep)
                return self._result(y, saved, x, xp, xa, wa, ba)
            if self.stats_as_is:
                ma, va = (views[2], views[3]) if views is not None else \
                    (running_mean.numpy(force=True), running_var.numpy(force=True))
                apart = self._stats_apart(running_mean, running_var, xp, rp, weight, bias)
            else:
                ma = None if m is None else to_array(m)
                va = None if v is None else to_array(v)
                apart = not written or _apart(written, (xp, rp, weight, bias))
            eng = validated_engine(prep, dev, _TRAINING) if apart else None
            if eng is not None:
                y, saved = validated.batchnorm_forward_training(
                    eng, xa, wa, ba, ma, va, prep.geom, self.eps, self.factor, self.act, ra)
            else:  # the first call of the signature, or outputs overlapping inputs
                y, saved = op(prep, dev, _TRAINING, xa, wa, ba, ma, va, self.layout, self.eps,
                              self.factor, self.act, ra, aligned=False)
            out = self._result(y, saved, x, xp, xa, wa, ba)
        return self._written_back(out, running_mean, running_var, m, v, nbt)

    def _written_back(self, out: Any, running_mean: torch.Tensor | None,
                      running_var: torch.Tensor | None, m: torch.Tensor | None,
                      v: torch.Tensor | None, nbt: Any) -> Any:
        """`out`, once the batch's statistics `m`, `v` the op wrote are in the running
        ones: blended (the cumulative average) or copied back, unless written in place."""
        if self.stats_as_is:
            return out
        if self.cumulative:
            cd = self.cd
            f = 1.0 / nbt.clamp(min=1).to(cd)
            for target, batch in ((running_mean, m), (running_var, v)):
                assert target is not None and batch is not None  # part of `cumulative`
                target.copy_(target.to(cd) * (1 - f) + batch * f)
        else:
            for target, s in ((running_mean, m), (running_var, v)):
                if target is not None and s is not None and s is not target:
                    target.copy_(s)
        return out

    def _on_pointers(self, ctx: Any, dtype: torch.dtype, xp: torch.Tensor,
                     rp: torch.Tensor | None, weight: torch.Tensor | None,
                     bias: torch.Tensor | None, m: torch.Tensor | None, v: torch.Tensor | None,
                     running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                     written: list[torch.Tensor]) -> tuple[Any, Any]:
        """(y, saved) of a training forward, or of an evaluation one without statistics,
        on CUDA's pointer path: the signature's bound call (Note [bound batch-norm calls]
        in convfuse/ops/cudnn/bound_batchnorm.py) from its second call, else `op` (then
        bound for the next call). `m`, `v` are the statistics the training op writes."""
        cd, prep, act, eps = self.cd, self.prep, self.act, self.eps
        wt, bt = _channel(weight, cd), _channel(bias, cd)
        residual = rp is not None
        if self.training:
            name, stats = _TRAINING, (m, v)
            apart = not written or _apart(written, (xp, rp, weight, bias))
            last: tuple[Any, ...] = (eps, self.factor)
        else:
            name, apart = _INFERENCE, True
            stats = (_channel(running_mean, cd), _channel(running_var, cd))
            last = (eps,)
        if apart:
            got = _bound.call(prep, (name, act, residual, ctx), ctx, xp.data_ptr(), _ptr(wt),
                              _ptr(bt), _ptr(stats[0]), _ptr(stats[1]), _ptr(rp), *last)
            if got is not None:
                return got
        arrays = [None if t is None else to_array(t) for t in (xp, wt, bt, *stats, rp)]
        if self.training:
            y, saved = op(prep, "cuda", name, *arrays[:5], self.layout, eps, self.factor, act,
                          arrays[5], aligned=apart)
        else:
            y, saved = op(prep, "cuda", name, *arrays[:5], self.layout, eps, act, arrays[5],
                          False)
        if apart:
            _bound.arm(prep, name, act, ctx, dtype, weight is not None, residual)
        return y, saved

    def _stats_apart(self, running_mean: torch.Tensor, running_var: torch.Tensor,
                     *inputs: torch.Tensor | None) -> bool:
        """_bn_ops._apart for the running statistics written in place, with the sizes the
        key fixes: whether they overlap each other or x, residual, weight, bias."""
        m, v, *sizes = self.nbytes
        a0 = running_mean.data_ptr()
        b0 = running_var.data_ptr()
        a1, b1 = a0 + m, b0 + v
        if a0 < b1 and b0 < a1:
            return False
        for t, size in zip(inputs, sizes):
            if t is not None:
                p = t.data_ptr()
                e = p + size
                if (a0 < e and p < a1) or (b0 < e and p < b1):
                    return False
        return True

    def _result(self, y: Any, saved: Any, x: torch.Tensor, xp: torch.Tensor, xa: Any,
                wa: Any, ba: Any) -> tuple[torch.Tensor, torch.Tensor | None, Kept]:
        """_bn_ops._result's y and z, and what the backward reuses: mean and invstd as the
        engine returned them and, on the CPU, the arrays this forward handed it (x's only
        where it is x's own memory, not a copy the backward would keep alive)."""
        cl = self.cl
        # the engine's results are C-contiguous: to_tensor's checks are for other arrays
        yt = logical(torch.from_numpy(y) if self.host else to_tensor(y), cl)
        zt = None  # returned (and saved) for a pre-activation only
        if self.saves == "preactivation":
            z = saved.saved
            zt = logical(to_tensor(z), cl) if z is not None and z is not y \
                else x.new_empty(0)
        arrays = state = None
        if not x.is_cuda:  # CUDA arrays are bound to the stream current when made
            own = xp is x or xp.data_ptr() == x.data_ptr()
            arrays = (xa if own else None, wa, ba,
                      None if self.saves == "none" else saved.saved)
        else:
            state = saved.engine_state
            if state is not None and not state.fused:
                state = None
        return yt, zt, (saved.mean, saved.invstd, arrays, state)

    def backward(self, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                 bias: torch.Tensor | None, saved: torch.Tensor | None, kept: Kept,
                 need_dx: bool, need_dres: bool) -> tuple[Any, Any, Any, Any]:
        """(dx, dweight, dbias, dres) as _bn_ops._batchnorm_backward computes them (None
        where that returns an empty tensor). `x`, `weight`, `bias` and `saved` come from
        ctx.saved_tensors, whose version checks passed: the forward's arrays of them in
        `kept` still hold their values."""
        cd, cl, prep = self.cd, self.cl, self.prep
        mean, invstd, arrays, engine_state = kept
        dyp = physical(dy, cl)
        if arrays is not None:  # the CPU: the engine returns dweight and dbias itself
            dya = dyp.numpy(force=True) if self.host else to_array(dyp)
            xa, wa, ba, sa = arrays
            if xa is None:  # Note [what a batch norm keeps]
                xa = host_array(x, cl) if self.host else to_array(physical(x, cl))
            if sa is None and saved is not None:
                sa = host_array(saved, cl) if self.host else to_array(physical(saved, cl))
            state = ops.BatchNormSaved(mean, invstd, sa, self.training)
            eng = validated_engine(prep, "cpu", _BACKWARD)
            if eng is not None:
                dx, dw, db, dres = validated.batchnorm_backward(
                    eng, dya, xa, wa, ba, state, prep.geom, self.eps, self.act, need_dres,
                    need_dx)
            else:
                dx, dw, db, dres = op(prep, "cpu", _BACKWARD, dya, xa, wa, ba, state,
                                      self.layout, self.eps, self.act, need_dres, need_dx,
                                      None, None, 0.0)
            if weight is not None:  # the parameters' dtype (a copy only for half ones)
                dw, db = torch.from_numpy(dw), torch.from_numpy(db)  # the compute dtype
                if dw.dtype != weight.dtype:
                    dw, db = dw.to(weight.dtype), db.to(weight.dtype)
            # from_numpy: the engine's results are C-contiguous
            out = torch.from_numpy if self.host else to_tensor
            if dx is not None:
                dx = out(dx) if not cl else logical(out(dx), cl)
            return dx, dw, db, None if dres is None else logical(out(dres), cl)
        dw_t = db_t = None  # CUDA from here on, as _batchnorm_backward
        if weight is not None:  # written by convfuse through weight_grad/bias_grad
            dw_t = torch.empty(weight.shape, dtype=cd, device=x.device)
            db_t = torch.empty(weight.shape, dtype=cd, device=x.device)
        # Note [the fused backward on the eager path]: only with the forward's own bnOps
        fused = engine_state if need_dres == self.has_residual else None
        with context(x):
            if self.training and _bound.on_pointer_path(x):
                dx, dres = self._backward_on_pointers(_bound.context(x), dyp, x, weight, bias,
                                                      saved, mean, invstd, fused, dw_t, db_t,
                                                      need_dres)
                dx = dx if need_dx else None
            else:
                state = ops.BatchNormSaved(
                    mean, invstd, None if saved is None else to_array(physical(saved, cl)),
                    self.training, fused)
                dx, _, _, dres = op(
                    prep, device_type(x), _BACKWARD, to_array(dyp),
                    to_array(physical(x, cl)), _per_channel(weight, cd),
                    _per_channel(bias, cd), state, self.layout, self.eps, self.act,
                    need_dres, need_dx, None if dw_t is None else to_array(dw_t),
                    None if db_t is None else to_array(db_t), 0.0,
                    aligned=_aligned_stats((mean, invstd)))
            return (logical(to_tensor(dx), cl) if dx is not None else None,
                    None if dw_t is None or weight is None else dw_t.to(weight.dtype),
                    None if db_t is None or weight is None else db_t.to(weight.dtype),
                    logical(to_tensor(dres), cl) if dres is not None else None)

    def _backward_on_pointers(self, ctx: Any, dyp: torch.Tensor, x: torch.Tensor,
                              weight: torch.Tensor | None, bias: torch.Tensor | None,
                              saved: torch.Tensor | None, mean: Any, invstd: Any,
                              fused: Any, dw_t: torch.Tensor | None,
                              db_t: torch.Tensor | None, need_dres: bool) -> tuple[Any, Any]:
        """(dx, dres) of a training-mode backward on CUDA's pointer path, dweight and dbias
        written into dw_t and db_t: the bound call (Note [bound batch-norm calls]) from the
        signature's second backward, else `op` (then bound for the next one). dx is
        computed whether asked or not, as cuDNN computes it. `fused`: the fused forward's
        engine state, or None."""
        cd, cl, prep, act = self.cd, self.cl, self.prep, self.act
        xp = physical(x, cl)
        sp = None if saved is None else physical(saved, cl)
        wt, bt = _channel(weight, cd), _channel(bias, cd)
        got = _bound.call(prep, (_BACKWARD, act, need_dres, ctx), ctx, dyp.data_ptr(),
                          xp.data_ptr(), _ptr(wt), _ptr(bt), _ptr(sp), mean, invstd, fused,
                          _ptr(dw_t), _ptr(db_t), self.eps)
        if got is not None:
            return got
        state = ops.BatchNormSaved(mean, invstd, None if sp is None else to_array(sp), True,
                                   fused)
        dx, _, _, dres = op(
            prep, "cuda", _BACKWARD, to_array(dyp), to_array(xp),
            None if wt is None else to_array(wt), None if bt is None else to_array(bt), state,
            self.layout, self.eps, act, need_dres, True,
            None if dw_t is None else to_array(dw_t), None if db_t is None else to_array(db_t),
            0.0, aligned=_aligned_stats((mean, invstd)))
        _bound.arm(prep, _BACKWARD, act, ctx, x.dtype, weight is not None, need_dres)
        return dx, dres


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _statistic(s: torch.Tensor | None, cd: torch.dtype, cumulative: bool) -> Any:
    if s is None or (not cumulative and _usable(s, cd)):
        return s
    if cumulative:
        return torch.zeros(s.shape, dtype=cd, device=s.device)
    return s.to(cd, copy=True).contiguous()


def _aligned_stats(stats: tuple[Any, Any]) -> bool:  # pragma: gpu
    """_batchnorm_backward's `aligned(mean) and aligned(invstd)`, on the engine's arrays."""
    return all(aligned(to_tensor(a)) for a in stats)


def plan(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
         residual: torch.Tensor | None, use_batch_stats: bool, eps: float, momentum: Any,
         activation: Any, running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
         num_batches_tracked: torch.Tensor | None) -> BatchNormCall | None:
    """The checked call's BatchNormCall, or None where the layer's general path runs it
    (Note [batch-norm call plans]); `momentum` is the layer's factor_momentum and
    `running_mean` what it passes to the op."""
    if x.numel() == 0:
        return None
    try:
        act = activations.normalize(activation)
        cumulative = (use_batch_stats and running_mean is not None and momentum is None
                      and num_batches_tracked is not None)
        factor = 0.0 if running_mean is None or not use_batch_stats else 1.0 if cumulative \
            else as_factor(momentum, 1)
    except (TypeError, ValueError):  # refused by the op, in its words, on the general path
        return None
    if not 0.0 <= factor <= 1.0:
        return None
    return BatchNormCall(x, use_batch_stats, eps, act, factor, cumulative, weight, bias,
                         residual, running_mean, running_var)


# Note [what a batch norm keeps]
# On the CPU the forward keeps on ctx the arrays it handed the engine (x's, the saved
# output's, the batch statistics): the backward then converts nothing back (each
# conversion is about a microsecond of host time). Under saved-tensor hooks
# (torch.utils.checkpoint, offloading), which own what autograd saves, that would keep x
# alive past a checkpoint and pair a recomputed x with the first run's statistics; there
# x, the output and the statistics are autograd's saved tensors only, read back in the
# backward (the parameters' arrays in the compute dtype stay on ctx: the parameters are
# alive anyway). Asking for the hooks costs about 40 ns. On CUDA the statistics and the
# fused forward's reserve space are still kept on ctx (not yet run on a GPU): a
# checkpointed forward whose recompute differs from the first run (a spectral norm's
# power iteration) would mix the two there.

_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks


class BatchNormFunction(torch.autograd.Function):
    """A BatchNormCall as one autograd node: _bn_ops.BatchNormFunction's formula with the
    plan in place of the hyperparameters, and of the same name."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, residual: torch.Tensor | None,
                call: BatchNormCall, stats: tuple[Any, Any, Any],
                held: HostArrays | None) -> Any:
        y, z, kept = call.forward(x, weight, bias, residual, stats, held)
        kind = call.saves
        out = None if kind == "none" else y if kind == "output" else z
        arrays = kept[2]
        if arrays is not None and _saved_tensors_hooks(False) is not None:
            # the CPU under saved-tensor hooks: Note [what a batch norm keeps]
            mean, invstd = torch.from_numpy(kept[0]), torch.from_numpy(kept[1])
            ctx.save_for_backward(x, weight, bias, out, mean, invstd)
            kept = (None, None, (None, arrays[1], arrays[2], None), kept[3])
        else:
            ctx.save_for_backward(x, weight, bias, out)
        ctx.call, ctx.kept = call, kept
        ctx.set_materialize_grads(False)
        if kind != "preactivation":
            return y
        return y, z  # z stays differentiable (Note [two backward paths] in _double.py)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor | None,
                 dz_output: torch.Tensor | None = None) -> tuple[Any, ...]:
        x, weight, bias, saved, *stats = ctx.saved_tensors
        if stats:  # the CPU: the statistics as saved (recomputed under a checkpoint)
            ctx.kept = (stats[0].numpy(), stats[1].numpy(), *ctx.kept[2:])
        call: BatchNormCall = ctx.call
        need_dx, need_dw, need_db, need_dres, _, _, _ = ctx.needs_input_grad
        none3 = (None, None, None)
        if _double.takes_recorded_path(dz_output):
            return _recorded(ctx, dy, dz_output, x, weight, saved, call)
        if dy is None:
            return (None,) * 4 + none3
        identity = call.identity
        dx = dw = db = dres = None
        if need_dx or need_dw or need_db or (need_dres and not identity):
            want_dres = bool(need_dres) and not identity
            if _eager.takes_eager_path(dy):
                kept = ctx.kept
                try:
                    dx, dw, db, dres = call.backward(dy, x, weight, bias, saved, kept,
                                                     bool(need_dx), want_dres)
                except Exception:  # reading dy failed before any engine ran
                    if not _double.batched(dy):
                        raise
                    return _recorded(ctx, dy, dz_output, x, weight, saved, call)
                arrays = kept[2]
                if arrays is not None or kept[3] is not None:
                    # the fused forward's reserve space (CUDA) goes when autograd frees
                    # the saved tensors, not when the graph goes (retain_graph: the next
                    # backward takes the plain backward)
                    ctx.kept = (kept[0], kept[1], None if arrays is None else
                                (None, arrays[1], arrays[2], None), None)
            else:  # a subclass gradient: the op, as _bn_ops.BatchNormFunction does
                mean, invstd = (to_tensor(a) for a in ctx.kept[:2])
                dx, dw, db, dres = torch.ops.convfuse.batchnorm_backward(
                    dy, x, weight, bias, saved, mean, invstd, call.training, call.eps,
                    call.act, bool(need_dx), want_dres)
        if need_dres and identity:
            dres = dy  # the gradient at the sum is dy itself: no copy, no op
        return (dx if need_dx else None, dw if need_dw else None, db if need_db else None,
                dres if need_dres else None, *none3)


def _recorded(ctx: Any, dy: Any, dz_output: Any, x: torch.Tensor,
              weight: torch.Tensor | None, saved: torch.Tensor | None,
              call: BatchNormCall) -> tuple[Any, ...]:
    """BatchNormFunction.backward on the recorded path (create_graph=True, or a batched
    dy): Note [two backward paths] in _double.py."""
    need_dx, need_dw, need_db, need_dres = ctx.needs_input_grad[:4]
    g = _double.preactivation_grad(dy, dz_output, saved, call.act)
    if g is None:
        return (None,) * 7
    mean, invstd = (to_tensor(a) for a in ctx.kept[:2])
    dx, dw, db = _double.batchnorm_backward(g, x, weight, mean, invstd, call.training,
                                            call.eps, (need_dx, need_dw, need_db))
    return (dx, dw, db, g if need_dres else None, None, None, None)


#: BatchNormFunction.apply less its Python wrapper (Note [the host path]).
_apply = super(torch.autograd.Function, BatchNormFunction).apply
