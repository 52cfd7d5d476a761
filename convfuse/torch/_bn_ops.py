"""convfuse's batch normalization as opaque PyTorch custom ops, with autograd.

`torch.ops.convfuse.batchnorm_training` (batch statistics; updates the running statistics
in place, declared in its schema as mutated arguments), `batchnorm_inference` (running
statistics) and `batchnorm_backward` are `torch.library.custom_op`s with fake
implementations, so torch.compile(fullgraph=True) sees each as one op and functionalizes
the running-statistics update itself.

Note [autograd for a mutating custom op]
PyTorch refuses `register_autograd` on a custom op that mutates its arguments ("create a
functional operator"), and the training forward must mutate running_mean/var (that is
where convfuse's ops, and cuDNN, write them). So the gradient is attached one level up, by
`BatchNormFunction` (a torch.autograd.Function), which dynamo traces with fullgraph=True:
the forward and backward graphs still hold one opaque op each. Returning the new
statistics from a functional op and copying them back instead would cost two extra
copies per layer and step in eager mode.

Note [what the backward reuses]
The forward returns the per-channel mean and 1/sqrt(var + eps) it normalised with (batch
or running statistics) and, as the activation needs, its output or pre-activation; the
backward op hands them back to convfuse.ops.batchnorm_backward, so no statistic is
recomputed. The cuDNN engine's private state of a fused forward (its reserve space) is
not carried across: it is no tensor of a size known before the call, which a fake
implementation must give. The backward then takes cuDNN's plain path, which is exact after
a fused forward too (Note [BatchNorm fallback] in convfuse/ops/cudnn/batchnorm.py). The
eager path's autograd node, which is no custom op, carries it (Note [the fused backward on
the eager path] in _bn_plan.py).

Note [the cumulative average on the device]
With momentum=None, PyTorch's running statistics are the cumulative average, factor
1/num_batches_tracked. The count is a tensor on the layer's device (incremented there by
the layer, `num_batches_tracked.add_(1)` as torch.nn does), and convfuse's ops take the
factor as a host float: reading the count would cost a device-to-host sync per layer and
step, and break CUDA-graph capture. So the op runs with factor 1 into fresh statistics
(which become the batch's mean and unbiased variance) and blends them into the running ones
with 1/count computed on the device. With a float momentum nothing is read at all.

Per-channel arrays cross in convfuse's compute dtype (float32 for float32/float16/
bfloat16 data, float64 for float64). PyTorch keeps a float16/bfloat16 layer's parameters
and statistics in its own dtype, so those are cast on the way in (C values) and the
statistics copied back after the update.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import activations, ops
from ..geometry import from_channels_first
from ..ops._checks import ALIGNMENT
from ..ops.batchnorm import as_factor
from ..plan.batchnorm import BatchNormGeometry
from . import _double, _eager
from ._arrays import (
    batchnorm_channels_last,
    empty_in_layout,
    logical,
    physical,
    to_array,
    to_tensor,
)
from ._ops import aligned, context, device_type
from ._signature import Prepared, SignatureCache, lookup, op, tensor_key


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _usable(t: torch.Tensor, cd: torch.dtype) -> bool:
    """Whether convfuse can take the (C,) tensor `t` as it is: compute dtype, contiguous,
    and on CUDA at an aligned address (a view into a flat buffer may not be)."""
    return t.dtype == cd and t.is_contiguous() and (
        not t.is_cuda or t.data_ptr() % ALIGNMENT == 0)


def _channel(t: torch.Tensor | None, cd: torch.dtype) -> torch.Tensor | None:
    """A (C,) tensor as convfuse takes it: itself when usable as is, else a copy of C
    values in the compute dtype."""
    if t is None or _usable(t, cd):  # its address is all convfuse reads of it
        return t
    return t.detach().to(cd, copy=True).contiguous()


def _per_channel(t: torch.Tensor | None, cd: torch.dtype) -> Any:
    """`_channel(t, cd)` as a convfuse array."""
    c = _channel(t, cd)
    return None if c is None else to_array(c.detach())


def _layout(cl: bool) -> str:
    return "NHWC" if cl else "NCHW"


_PREPARED = SignatureCache()


def _prepare(name: str, x: torch.Tensor, tensors: tuple[torch.Tensor | None, ...],
             scalars: tuple[Any, ...]) -> Prepared:
    """The layout and geometry of convfuse.ops.<name> for this signature, once (Note
    [per-signature decisions] in _signature.py)."""
    key = (name, tensor_key(x), *(tensor_key(t) for t in tensors), scalars)
    prep = lookup(_PREPARED, key)
    if prep is None:
        cl = batchnorm_channels_last(x)
        try:
            geom = BatchNormGeometry.create(from_channels_first(x.shape, cl), _layout(cl), name)
        except (TypeError, ValueError):  # the op refuses it, with its own words
            geom = None
        prep = _PREPARED.remember(key, Prepared(cl, geom, direct=geom is not None))
    return prep


def _apart(outputs: list[torch.Tensor], inputs: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether the contiguous `outputs` share no byte with each other or with `inputs` (the
    overlap convfuse.ops refuses, which depends on addresses, not on the signature)."""
    spans = []
    for t in outputs:
        p = t.data_ptr()
        spans.append((p, p + t.nbytes))
    for k, (lo, hi) in enumerate(spans):
        for lo2, hi2 in spans[k + 1:]:
            if lo < hi2 and lo2 < hi:
                return False
    for i in inputs:
        if i is not None:
            p = i.data_ptr()
            end = p + i.nbytes
            for lo, hi in spans:
                if lo < end and p < hi:
                    return False
    return True


def _result(y: Any, saved: Any, cl: bool, x: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    yt = logical(to_tensor(y), cl)
    mean, invstd = to_tensor(saved.mean), to_tensor(saved.invstd)
    # Outputs may not alias each other: y is handed to the backward by the autograd
    # Function, the op returns only a separate pre-activation.
    z = saved.saved
    zt = logical(to_tensor(z), cl) if z is not None and z is not y else x.new_empty(0)
    return yt, mean, invstd, zt


def _batchnorm_training(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
    running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
    residual: torch.Tensor | None, num_batches_tracked: torch.Tensor | None,
    momentum: float | None, eps: float, activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, invstd, z): y = act(batchnorm(x) + residual) with the batch's statistics.

    running_mean/var (when given) take the update with factor `momentum`, or
    1/num_batches_tracked (already incremented by the caller, as PyTorch does) for
    momentum=None (Note [the cumulative average on the device]). z is the pre-activation
    when the activation's backward needs it."""
    cd = _compute_dtype(x)
    cumulative = running_mean is not None and momentum is None \
        and num_batches_tracked is not None
    # nothing to update / fresh statistics to fill / momentum (or 1 with no count, as torch)
    factor = 0.0 if running_mean is None else 1.0 if cumulative else as_factor(momentum, 1)
    prep = _prepare("batchnorm_forward_training", x, (weight, bias, running_mean,
                                                      running_var, residual),
                    (factor, eps, activation))
    cl = prep.cl
    # Statistics not already contiguous in the compute dtype run on a copy, written back;
    # for the cumulative average the op writes the batch's statistics into fresh ones.
    stats = [s if s is None or (_usable(s, cd) and not cumulative)
             else torch.zeros(s.shape, dtype=cd, device=s.device) if cumulative
             else s.to(cd, copy=True).contiguous()
             for s in (running_mean, running_var)]
    xp, rp = physical(x, cl), None if residual is None else physical(residual, cl)
    written = [s for s, t in zip(stats, (running_mean, running_var)) if s is not None and s is t]
    with context(x):
        y, saved = op(
            prep, device_type(x), "batchnorm_forward_training", to_array(xp),
            _per_channel(weight, cd), _per_channel(bias, cd),
            None if stats[0] is None else to_array(stats[0]),
            None if stats[1] is None else to_array(stats[1]), _layout(cl), eps, factor,
            activation, None if rp is None else to_array(rp),
            aligned=not written or _apart(written, (xp, rp, weight, bias)))
        out = _result(y, saved, cl, x)
    if cumulative:
        assert num_batches_tracked is not None  # part of `cumulative`
        f = 1.0 / num_batches_tracked.clamp(min=1).to(cd)
        for target, batch in zip((running_mean, running_var), stats):
            assert target is not None and batch is not None  # both, checked by the op above
            target.copy_(target.to(cd) * (1 - f) + batch * f)
        return out
    for target, s in zip((running_mean, running_var), stats):
        if target is not None and s is not None and s is not target:
            target.copy_(s)
    return out


batchnorm_training = torch.library.custom_op(
    "convfuse::batchnorm_training", _batchnorm_training,
    mutates_args=("running_mean", "running_var"))


def _batchnorm_inference(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
    running_mean: torch.Tensor, running_var: torch.Tensor, residual: torch.Tensor | None,
    eps: float, activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, invstd, z) as batchnorm_training, with the running statistics."""
    cd = _compute_dtype(x)
    prep = _prepare("batchnorm_forward_inference", x, (weight, bias, running_mean,
                                                       running_var, residual),
                    (eps, activation))
    cl = prep.cl
    with context(x):
        y, saved = op(
            prep, device_type(x), "batchnorm_forward_inference", to_array(physical(x, cl)),
            _per_channel(weight, cd), _per_channel(bias, cd), _per_channel(running_mean, cd),
            _per_channel(running_var, cd), _layout(cl), eps, activation,
            None if residual is None else to_array(physical(residual, cl)))
        return _result(y, saved, cl, x)


batchnorm_inference = torch.library.custom_op(
    "convfuse::batchnorm_inference", _batchnorm_inference, mutates_args=())


def _fake_forward(x: torch.Tensor, activation: str) -> tuple[torch.Tensor, ...]:
    cl = batchnorm_channels_last(x)
    c = x.shape[1]
    cd = _compute_dtype(x)
    y = empty_in_layout(x, x.shape, cl)
    z = empty_in_layout(x, x.shape, cl) \
        if activations.saves(activation) == "preactivation" else x.new_empty(0)
    return y, x.new_empty(c, dtype=cd), x.new_empty(c, dtype=cd), z


@batchnorm_training.register_fake
def _(x, weight, bias, running_mean, running_var, residual, num_batches_tracked, momentum,
      eps, activation):
    return _fake_forward(x, activation)


@batchnorm_inference.register_fake
def _(x, weight, bias, running_mean, running_var, residual, eps, activation):
    return _fake_forward(x, activation)


def _batchnorm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
    saved: torch.Tensor | None, mean: torch.Tensor, invstd: torch.Tensor, training: bool,
    eps: float, activation: str, need_dx: bool, need_dres: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias, dres) of the forward (Note [what the backward reuses]); dx and
    dres only when asked for, else empty. dweight/dbias (in the parameters' dtype) come
    from the same pass whenever weight is given (cuDNN computes them together with dx);
    empty for affine=False."""
    cd = _compute_dtype(x)
    prep = _prepare("batchnorm_backward", x, (dy, weight, bias, saved, mean, invstd),
                    (training, eps, activation))
    cl = prep.cl
    xp = physical(x, cl)
    # Outputs PyTorch owns, written by convfuse through weight_grad/bias_grad (affine only).
    dw = torch.empty(weight.shape, dtype=cd, device=x.device) if weight is not None else None
    db = torch.empty(weight.shape, dtype=cd, device=x.device) if weight is not None else None
    with context(x):
        state = ops.BatchNormSaved(
            to_array(mean), to_array(invstd),
            None if saved is None else to_array(physical(saved, cl)), training)
        dx, _, _, dres = op(
            prep, device_type(x), "batchnorm_backward", to_array(physical(dy, cl)),
            to_array(xp), _per_channel(weight, cd), _per_channel(bias, cd), state,
            _layout(cl), eps, activation, need_dres, need_dx,
            None if dw is None else to_array(dw), None if db is None else to_array(db), 0.0,
            aligned=aligned(mean) and aligned(invstd))
        return (  # a new empty tensor per unused output (outputs may not alias)
            logical(to_tensor(dx), cl) if dx is not None else dy.new_empty(0),
            dw.to(weight.dtype) if dw is not None and weight is not None else dy.new_empty(0),
            db.to(weight.dtype) if db is not None and weight is not None else dy.new_empty(0),
            logical(to_tensor(dres), cl) if dres is not None else dy.new_empty(0),
        )


batchnorm_backward = torch.library.custom_op(
    "convfuse::batchnorm_backward", _batchnorm_backward, mutates_args=())


@batchnorm_backward.register_fake
def _(dy, x, weight, bias, saved, mean, invstd, training, eps, activation, need_dx,
      need_dres):
    cl = batchnorm_channels_last(x)
    empty = dy.new_empty(0)
    return (
        empty_in_layout(x, x.shape, cl) if need_dx else empty,
        weight.new_empty(weight.shape) if weight is not None else empty.clone(),
        weight.new_empty(weight.shape) if weight is not None else empty.clone(),
        empty_in_layout(x, x.shape, cl) if need_dres else empty.clone(),
    )


def _bump(*stats: torch.Tensor | None) -> None:
    """What the custom op's ADInplaceOrView kernel does for its mutated arguments (outside
    inference mode): the running statistics' version counters move on."""
    if not torch.is_inference_mode_enabled():
        torch.autograd.graph.increment_version([t for t in stats if t is not None])


def _forward(eager: bool, x: torch.Tensor, weight: torch.Tensor | None,
             bias: torch.Tensor | None, residual: torch.Tensor | None,
             running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
             num_batches_tracked: torch.Tensor | None, use_batch_stats: bool,
             momentum: float | None, eps: float, activation: str) -> tuple[torch.Tensor, ...]:
    """(y, mean, invstd, z) from the custom op, or on the eager path its body (Note [two
    call paths] in _eager.py)."""
    if use_batch_stats:
        if not eager:
            return torch.ops.convfuse.batchnorm_training(
                x, weight, bias, running_mean, running_var, residual, num_batches_tracked,
                momentum, eps, activation)
        _bump(running_mean, running_var)
        return _batchnorm_training(x, weight, bias, running_mean, running_var, residual,
                                   num_batches_tracked, momentum, eps, activation)
    infer: Any = _batchnorm_inference if eager else torch.ops.convfuse.batchnorm_inference
    return infer(x, weight, bias, running_mean, running_var, residual, eps, activation)


def _save(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
          output: tuple[torch.Tensor, ...], hyper: tuple[bool, float, str, bool]) -> None:
    """What BatchNormFunction.backward reads of a forward's (x, weight, bias) and output
    (y, mean, invstd, z); `hyper` is (training, eps, activation, eager)."""
    y, mean, invstd, z = output
    kind = activations.saves(hyper[2])
    ctx.save_for_backward(x, weight, bias, None if kind == "none" else y if kind == "output"
                          else z, mean, invstd)
    ctx.hyper = hyper
    # z stays differentiable where it is saved (Note [two backward paths] in _double.py).
    ctx.mark_non_differentiable(mean, invstd, *([z] if kind != "preactivation" else []))
    ctx.set_materialize_grads(False)


class BatchNormFunction(torch.autograd.Function):
    """act(batchnorm(x) + residual) through the ops above (Note [autograd for a mutating
    custom op]), or in plain eager mode through their bodies (Note [two call paths] in
    _eager.py). `use_batch_stats` picks batchnorm_training; running_mean/var are then
    updated when given."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, running_mean, running_var,
                num_batches_tracked, use_batch_stats, momentum, eps, activation):
        eager = _eager.takes_eager_path(x, weight, bias, residual, running_mean, running_var,
                                        num_batches_tracked)
        output = _forward(eager, x, weight, bias, residual, running_mean, running_var,
                          num_batches_tracked, use_batch_stats, momentum, eps, activation)
        _save(ctx, x, weight, bias, output, (bool(use_batch_stats), float(eps), activation,
                                             eager))
        return output

    @staticmethod
    def backward(ctx, dy, _dmean, _dinvstd, dz_output):
        x, weight, bias, saved, mean, invstd = ctx.saved_tensors
        training, eps, activation, eager = ctx.hyper
        need_dx, need_dw, need_db, need_dres = ctx.needs_input_grad[:4]
        none7 = (None,) * 7
        if _double.takes_recorded_path(dz_output, dy):
            # Recorded backward (create_graph=True): Note [two backward paths] in _double.py.
            g = _double.preactivation_grad(dy, dz_output, saved, activation)
            if g is None:
                return (None,) * 4 + none7
            dx, dw, db = _double.batchnorm_backward(
                g, x, weight, mean, invstd, training, eps, (need_dx, need_dw, need_db))
            return (dx, dw, db, g if need_dres else None, *none7)
        identity = activations.normalize(activation) == "identity"
        if dy is None:
            return (None,) * 4 + none7
        dx = dw = db = dres = None
        if need_dx or need_dw or need_db or (need_dres and not identity):
            op = _batchnorm_backward if eager and _eager.takes_eager_path(dy) \
                else torch.ops.convfuse.batchnorm_backward
            dx, dw, db, dres = op(dy, x, weight, bias, saved, mean, invstd, training, eps,
                                  activation, bool(need_dx), bool(need_dres) and not identity)
        if need_dres and identity:
            dres = dy  # the gradient at the sum is dy itself: no copy, no op
        return (dx if need_dx else None, dw if need_dw else None, db if need_db else None,
                dres if need_dres else None, *none7)


class _InferenceCtx:
    """batchnorm_inference's autograd context as BatchNormFunction.backward reads it: its
    needs_input_grad in the Function's order (x, weight, bias, residual)."""

    def __init__(self, ctx: Any) -> None:
        self.saved_tensors, self.hyper = ctx.saved_tensors, ctx.hyper
        need = ctx.needs_input_grad
        self.needs_input_grad = (need[0], need[1], need[2], need[5])


def _inference_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weight, bias, _mean, _var, _residual, eps, activation = inputs
    _save(ctx, x, weight, bias, output, (False, float(eps), activation, False))


def _inference_backward(ctx: Any, dy: Any, dmean: Any, dinvstd: Any, dz: Any) -> Any:
    dx, dw, db, dres, *_ = BatchNormFunction.backward(_InferenceCtx(ctx), dy, dmean, dinvstd,
                                                       dz)
    return dx, dw, db, None, None, dres, None, None


# The evaluation op mutates nothing, so it takes an autograd formula of its own (the
# Function's backward): a torch.jit.trace records it alone, differentiable and savable.
batchnorm_inference.register_autograd(_inference_backward, setup_context=_inference_setup)


def refuse_a_training_trace(use_batch_stats: bool, *tensors: Any) -> None:
    """Under torch.jit.trace, a batch norm normalising with the batch's statistics while
    autograd records: its op, which updates the statistics, has no autograd formula (a
    mutating custom op takes none), and the Function would be replayed with its ops."""
    if use_batch_stats and torch.jit.is_tracing() and _eager.needs_graph(*tensors):
        raise NotImplementedError(
            "convfuse.torch: torch.jit.trace of a batch norm in training mode with "
            "gradients is not supported (a replay would update its running statistics "
            "twice): trace in eval mode or under torch.no_grad(), or use torch.export or "
            "torch.compile")


def batchnorm_call(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   residual: torch.Tensor | None, running_mean: torch.Tensor | None,
                   running_var: torch.Tensor | None, num_batches_tracked: torch.Tensor | None,
                   use_batch_stats: bool, momentum: float | None, eps: float,
                   activation: str) -> torch.Tensor:
    """A batch-norm layer's call: BatchNormFunction, or its forward alone where autograd
    records nothing on the eager path (Note [two call paths] in _eager.py)."""
    args = (x, weight, bias, residual, running_mean, running_var, num_batches_tracked)
    if not _eager.needs_graph(x, weight, bias, residual) and _eager.takes_eager_path(*args):
        return _forward(True, *args, use_batch_stats, momentum, eps, activation)[0]
    if torch.jit.is_tracing():
        # torch.jit.trace records a Python Function as an opaque node beside the ops its
        # forward calls, and replays both: the statistics would be updated twice, and
        # jit.save cannot write the Function. The custom op alone is one node of each.
        refuse_a_training_trace(use_batch_stats, x, weight, bias, residual)
        return _forward(False, *args, use_batch_stats, momentum, eps, activation)[0]
    return BatchNormFunction.apply(*args, use_batch_stats, momentum, eps, activation)[0]
