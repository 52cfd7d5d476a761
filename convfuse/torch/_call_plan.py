"""A layer call's decisions, made once per signature and shared by the layer and the bridge
(Note [call plans]).

Note [call plans]
A fused convolution's eager call used to decide the same things twice per call: the layer
keyed its input checks, then the bridge keyed the layout and geometry again from the
padded tensors, and each autograd node carried its hyperparameters as lists to re-key in
its backward. On a GPU host time per call is what a small or medium batch waits on, so a
layer call now goes:
1. `_eager.call_path` first: under a tracer or transform (Note [two call paths] in
   _eager.py) the layer checks its input and calls the custom op as before, remembering
   nothing (sizes may be symbolic there);
2. otherwise one key of everything a decision below reads: the tensors' shapes, strides,
   dtypes and devices (bias and residual included), the layer's hyperparameters, its
   activation and whether autocast is on. Its `FusedCall` holds the bridge's Prepared
   (layout, geometry, the convfuse.ops it validated), the hyperparameters in the custom
   op's form and the normalized activation;
3. with autograd recording, one node (`apply`, Note [applying the node]) whose backward
   goes straight to the plan's `backward`; else the forward alone.
On the CPU the plan hands the engine NumPy views directly (`.numpy()` where the key says
every tensor is contiguous, channels-first and not bfloat16; the weight's and bias's are
the layer's kept views, Note [a layer's host arrays] in _host_arrays.py), calls the op's
validated entry once the op has validated the signature, and wraps the engine's own fresh
results.
Once validated, a tiny float32/float64 conv with relu or identity and no residual runs the
engine's runner (convfuse.ops.validated.conv_bias_act_runner: TinyConv.bias_act with
nothing decided per call), but only while convfuse.ops.conv_bias_act, its validated entry
and the engine's function are the ones imported: a replaced one (a test's spy) is called,
as every call reaches it. CUDA calls keep the bodies (`_ops.forward_parts`,
`_ops.backward_parts`), whose pointer path never ran on a GPU here; from a signature's
second call on, their convolutions run the calls the engine bound to the signature
(Note [bound calls] in convfuse/ops/cudnn/bound.py, _bound.py).
The numbers are bit for bit those of the custom ops, whose bodies run the same
convfuse.ops through the same Prepared. Where a call needs what a plan does not hold (an
unbatched input, padding torch must add first, an empty batch, autocast) the layer keeps
its general path. A key that cannot be hashed (a list assigned to a hyperparameter) or a
call that fails leaves nothing behind (Note [per-signature decisions] in _signature.py):
a failed op has validated nothing, so the next call goes through the op's checks again.

Note [applying the node]
torch.autograd.Function.apply is a Python wrapper around the C++ apply of its base class:
with no setup_context and no functorch transform active it only unwraps functorch's dead
wrappers, then calls the C++ apply. The eager path runs only where no transform is
active and no argument is a functorch wrapper (_eager.takes_eager_path), so there is
nothing to unwrap, and the plan binds the C++ apply itself (`super(Function, cls).apply`,
what the wrapper calls): a few microseconds per call, the same node.

The forward returns y alone unless the activation saves its pre-activation z (elu, silu,
gelu): z is then the node's second output, differentiable for a recorded backward (Note
[two backward paths] in _double.py), and otherwise there is nothing to hand back.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import activations, ops
from ..ops import validated
from . import _double, _eager
from ._arrays import host_array, logical, strided_like, to_tensor
from ._host_arrays import HostArrays
from ._ops import activation_grads, backward_parts, forward_parts
from ._signature import Prepared, engine, op, validated_engine

# What a runner stands for (FusedCall._runnable): the functions as imported, before any
# test could replace one.
_CONV_BIAS_ACT = (ops.conv_bias_act, validated.conv_bias_act,
                  engine("cpu", "conv").conv_bias_act)


class FusedCall:
    """One signature of a fused convolution layer's call (Note [call plans]): `name` is the
    convfuse.ops forward (conv_bias_act, conv_transpose_bias_act), `names` its backward ops
    (_ops.CONV_BACKWARD's order), `recorded` _double's recorded backward, `hyper` the
    custom op's non-tensor arguments before the activation."""

    __slots__ = (
        "act",
        "apply",
        "dw_restride",
        "hyper",
        "identity",
        "name",
        "names",
        "plain",
        "prep",
        "recorded",
        "runner",
        "same_dtype",
        "saves",
    )

    def __init__(self, prep: Prepared, name: str, names: tuple[str, str, str, str],
                 recorded: str, hyper: tuple[Any, ...], activation: str,
                 tensors: tuple[torch.Tensor | None, ...]) -> None:
        self.prep, self.name, self.names = prep, name, names
        # The key holds every forward tensor's strides and dtype: where all are
        # contiguous, channels-first and not bfloat16 each crosses as its own .numpy().
        self.plain = not prep.cl and all(
            t is None or (t.is_contiguous() and t.dtype != torch.bfloat16) for t in tensors)
        dtypes = {t.dtype for t in tensors if t is not None}
        self.same_dtype = len(dtypes) == 1
        self.runner: Any = None  # once the op validated the signature: a runner or False
        # whether dweight needs the weight's strides (strided_like): the signature fixes
        # both, so the first backward decides it (None until then)
        self.dw_restride: bool | None = None
        self.recorded, self.hyper = recorded, hyper
        self.act = activations.normalize(activation)
        self.saves = activations.saves(self.act)
        self.identity = self.act == "identity"
        # Note [applying the node]
        self.apply = _node_apply(_FUNCTIONS[name])

    def run(self, path: int, x: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None, residual: torch.Tensor | None,
            held: HostArrays | None = None) -> torch.Tensor:
        """y for an eager call on `path` (_eager.call_path's GRAPH or BODY); `held` is the
        layer's views of its weight and bias (Note [a layer's host arrays])."""
        if path == _eager.BODY:
            return self.forward(x, weight, bias, residual, held)[0]
        out = self.apply(x, weight, bias, residual, self, held)
        return out[0] if self.saves == "preactivation" else out

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                residual: torch.Tensor | None, held: HostArrays | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y, z) as the forward custom op's body computes them (z None where the
        activation saves no pre-activation)."""
        if not x.is_cpu:  # CUDA (and a device convfuse refuses, which the op says)
            return forward_parts(self.name, self.prep, x, weight, bias, residual, self.act)
        cl = self.prep.cl
        if self.plain:
            if held is not None:
                wa, ba = held.views(self, (weight, bias))
            else:
                wa = weight.numpy(force=True)
                ba = None if bias is None else bias.numpy(force=True)
            runner = self.runner
            if runner and self._runnable():
                y = runner(x.numpy(force=True), wa, ba)
                if y is not None:
                    return torch.from_numpy(y), None
                self.runner = runner = None  # the engine dropped it: armed again below
            y, z = self._run(self.name, x.numpy(force=True), wa, ba, self.prep.geom, self.act,
                             None if residual is None else residual.numpy(force=True))
            if runner is None:
                self._arm(x, residual is not None)
            return to_tensor(y), None if z is None else to_tensor(z)
        y, z = self._run(self.name, host_array(x, cl), host_array(weight, cl),
                         None if bias is None else host_array(bias, False), self.prep.geom,
                         self.act, None if residual is None else host_array(residual, cl))
        return logical(to_tensor(y), cl), None if z is None else logical(to_tensor(z), cl)

    def backward(self, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 saved: torch.Tensor | None, needs: tuple[bool, bool, bool, bool],
                 ) -> tuple[torch.Tensor | None, ...]:
        """(dx, dw, db, dz) as the backward custom op's body computes them, None where not
        asked for."""
        if not x.is_cpu:
            return backward_parts(dy, x, weight, saved, self.prep, self.act, needs,
                                  self.names)
        _, _, filter_grad, data_grad = self.names
        need_dx, need_dw, need_db, need_dz = needs
        cl, geom, run = self.prep.cl, self.prep.geom, self._run
        sa = None if saved is None else host_array(saved, cl)  # saved but for identity
        dz, db = activation_grads(run, host_array(dy, cl), sa, self.act, geom, need_db, None,
                                  self.names)
        dw = run(filter_grad, host_array(x, cl), dz, geom, None) if need_dw else None
        dx = run(data_grad, dz, host_array(weight, cl), geom, None) if need_dx else None
        return (None if dx is None else logical(to_tensor(dx), cl),
                None if dw is None else logical(to_tensor(dw), cl),
                None if db is None else to_tensor(db),
                logical(to_tensor(dz), cl) if need_dz and not self.identity else None)

    def _arm(self, x: torch.Tensor, residual: bool) -> None:
        """After a call the op validated: the engine's runner for this signature, where it
        has one (convfuse.ops.validated.conv_bias_act_runner)."""
        eng = validated_engine(self.prep, "cpu", self.name)
        if eng is None or self.name != "conv_bias_act" or not self.same_dtype:
            return
        self.runner = validated.conv_bias_act_runner(eng, self.prep.geom,
                                                     x.detach().numpy().dtype,
                                                     self.act, residual) or False

    def _runnable(self) -> bool:
        """Whether the runner computes what the validated entry would: neither convfuse.ops'
        op, nor its validated entry, nor the engine's function was replaced."""
        op_fn, entry, eng_fn = _CONV_BIAS_ACT
        return (ops.conv_bias_act is op_fn and validated.conv_bias_act is entry
                and engine("cpu", "conv").conv_bias_act is eng_fn)

    def _run(self, name: str, *args: Any) -> Any:
        """convfuse.ops.<name>(*args) on CPU arrays: through `op` until it has validated
        this signature, then its convfuse.ops.validated entry on the engine directly
        (Note [per-signature decisions] in _signature.py); the engine allocates the
        results (fresh, C-contiguous: what `to_tensor` takes without a copy)."""
        eng = validated_engine(self.prep, "cpu", name)
        if eng is None:
            return op(self.prep, "cpu", name, *args)
        return getattr(validated, name)(eng, *args)


class _FusedFunction(torch.autograd.Function):
    """A FusedCall as one autograd node: the formula of _ops.fused_autograd, with the
    plan in place of the hyperparameters. Subclassed once per op, so a node is named as
    the general path's (ConvBiasActBackward, ...)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                residual: torch.Tensor | None, call: FusedCall, held: HostArrays | None) -> Any:
        y, z = call.forward(x, weight, bias, residual, held)
        kind = call.saves
        ctx.save_for_backward(x, weight, None if kind == "none" else y if kind == "output"
                              else z)
        ctx.call, ctx.has_bias = call, bias is not None
        ctx.set_materialize_grads(False)
        return (y, z) if kind == "preactivation" else y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor | None,
                 dz_output: torch.Tensor | None = None) -> tuple[Any, ...]:
        x, weight, saved = ctx.saved_tensors
        call: FusedCall = ctx.call
        if _double.takes_recorded_path(dz_output):
            return _recorded(ctx, dy, dz_output, x, weight, saved, call)
        if dy is None:  # y itself fed nothing that needs a gradient
            return None, None, None, None, None, None
        need_dx, need_dw, need_db, need_dres = ctx.needs_input_grad[:4]
        need_db = bool(need_db and ctx.has_bias)
        identity = call.identity
        try:
            dx, dw, db, dz = call.backward(dy, x, weight, saved,
                                           (need_dx, need_dw, need_db,
                                            need_dres and not identity))
        except Exception:  # reading dy failed before any engine ran
            if not _double.batched(dy):
                raise
            return _recorded(ctx, dy, dz_output, x, weight, saved, call)
        if dw is not None:
            restride = call.dw_restride
            if restride is None:
                restride = call.dw_restride = dw.stride() != weight.stride()
            if restride:
                dw = strided_like(dw, weight)
        return (dx, dw, db, (dy if identity else dz) if need_dres else None, None, None)


def _recorded(ctx: Any, dy: Any, dz_output: Any, x: torch.Tensor, weight: torch.Tensor,
              saved: torch.Tensor | None, call: FusedCall) -> tuple[Any, ...]:
    """_FusedFunction.backward on the recorded path (Note [two backward paths])."""
    grads = getattr(_double, call.recorded)(ctx, dy, dz_output, x, weight, saved,
                                            *call.hyper, call.act)
    return (*grads[:4], None, None)


class ConvBiasAct(_FusedFunction):
    """conv_bias_act's FusedCall as one autograd node."""


class ConvTransposeBiasAct(_FusedFunction):
    """conv_transpose_bias_act's FusedCall as one autograd node."""


def _node_apply(function: type[torch.autograd.Function]) -> Any:
    """`function`'s C++ apply (Note [applying the node])."""
    base: Any = super(torch.autograd.Function, function)
    return base.apply


_FUNCTIONS = {"conv_bias_act": ConvBiasAct, "conv_transpose_bias_act": ConvTransposeBiasAct}
