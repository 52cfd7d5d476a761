"""convfuse's fused convolution as two opaque PyTorch custom ops, with autograd.

`torch.ops.convfuse.conv_bias_act` (forward) and `torch.ops.convfuse.conv_bias_act_backward`
are `torch.library.custom_op`s with fake (meta) implementations, and the forward's
gradient is registered with `register_autograd`. So `torch.compile(model, fullgraph=True)`
sees each layer as one op in the forward graph and one in the backward graph, with no graph
break, and never traces into NumPy or CuPy. In plain eager mode the layers skip the
dispatcher and run the same bodies inside one autograd.Function, `ConvBiasAct` (Note [two
call paths] in _eager.py); what a body decides from its signature is decided once (Note
[per-signature decisions] in _signature.py).

Both ops work on the tensors' memory through convfuse's stateless ops (convfuse.ops), with
the layout rules of Note [layouts across the bridge] and, on CUDA, PyTorch's stream and
allocator (Note [CUDA streams and memory]). The backward is convfuse's own: the bias
gradient comes from cudnnConvolutionBackwardBias or the fused activation-backward + bias
kernel (never a PyTorch reduction), and only the gradients autograd asks for are computed
(`ctx.needs_input_grad`): the first layer of a network computes no dx.

Custom ops may return neither None nor an input, so gradients that were not asked for come
back as empty tensors (never read), and the residual's gradient for an identity activation
(which is dy itself) is handed out by the autograd formula, not by the op.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from .. import activations
from ..geometry import ConvGeometry, from_channels_first
from ..ops._checks import ALIGNMENT
from . import _autocast, _bound, _double, _eager, _functorch
from ._arrays import (
    conv_channels_last,
    empty_in_layout,
    geometry,
    logical,
    physical,
    tensor_context,
    to_array,
    to_tensor,
)
from ._grad_ops import conv_output_shape  # and registers the differentiable ops
from ._signature import Prepared, SignatureCache, op, tensor_key

_PREPARED = SignatureCache()


def _array_or_none(t: torch.Tensor | None, channels_last: bool) -> object:
    return None if t is None else to_array(physical(t, channels_last))


def context(t: torch.Tensor) -> Any:
    """engine_context(t.device), following PyTorch's cuDNN switches; nothing to enter off
    CUDA (_arrays.tensor_context)."""
    return tensor_context(t)


def device_type(t: torch.Tensor) -> str:
    """What convfuse's engine choice reads of t.device.type ("cuda" runs cuDNN, anything
    else the NumPy engine), without building a torch.device (t.device costs more)."""
    return "cuda" if t.is_cuda else "cpu"


def aligned(t: torch.Tensor | None) -> bool:
    """Whether a tensor handed to convfuse without physical() (a bias) is at an address
    convfuse's GPU ops accept; convfuse.ops checks it where this is False."""
    return t is None or not t.is_cuda or t.data_ptr() % ALIGNMENT == 0


def prepare(kind: type, x: torch.Tensor, weight: torch.Tensor, hyper: tuple[Any, ...],
            others: tuple[Any, ...], output_padding: Sequence[int] | None = None) -> Prepared:
    """The layout and geometry of a convolution (`kind` ConvGeometry) or transposed one
    (ConvTransposeGeometry, with `output_padding`), once per signature (Note
    [per-signature decisions] in _signature.py); `hyper` is (stride, padding, dilation,
    groups), `others` the keys of the op's other tensors."""
    stride, padding, dilation, groups = hyper
    opad = None if output_padding is None else tuple(output_padding)
    key = (kind, tensor_key(x), tensor_key(weight), tuple(stride), tuple(padding),
           tuple(dilation), groups, opad, others)
    prep = _PREPARED.get(key)
    if prep is None:
        cl = conv_channels_last(x, weight, stride, padding, dilation, groups, output_padding)
        args: tuple[Any, ...] = (stride, padding, dilation, groups) if opad is None \
            else (stride, padding, output_padding, dilation, groups)
        geom: Any = geometry(kind, from_channels_first(x.shape, cl),
                        from_channels_first(weight.shape, cl), cl, *args)
        prep = _PREPARED.remember(key, Prepared(cl, geom))
    return prep


def fused_forward(name: str, prep: Prepared, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None, residual: torch.Tensor | None,
                  activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The body of a fused forward op (conv_bias_act's or conv_transpose_bias_act's): (y, z)
    from convfuse.ops.<name>, in the layout `prep` decided; z empty where the activation
    saves no pre-activation (a custom op returns no None)."""
    yt, zt = forward_parts(name, prep, x, weight, bias, residual, activation)
    return yt, zt if zt is not None else x.new_empty(0)


def forward_parts(name: str, prep: Prepared, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None, residual: torch.Tensor | None,
                  activation: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`fused_forward`'s (y, z) with z None where there is none: the eager path's, which
    makes no placeholder tensor per call."""
    cl = prep.cl
    xp, wp = physical(x, cl), physical(weight, cl)
    # the bias too: a view at an odd offset (a flattened parameter buffer) is copied once,
    # as x and the weight are, where convfuse's GPU ops would refuse it
    bp = None if bias is None else physical(bias, False)
    rp = None if residual is None else physical(residual, cl)
    with context(x):
        ctx = _bound.context(x) if name in _bound.BINDS and _bound.on_pointer_path(x) \
            else None
        if ctx is not None:  # Note [bound calls]: nothing bound keeps a pre-activation z
            y = _bound.forward(prep, name, activation, ctx, xp, wp, bp, rp)
            if y is not None:
                return logical(y, cl), None
        y, z = op(prep, device_type(x), name, to_array(xp), to_array(wp),
                  None if bp is None else to_array(bp), prep.geom, activation,
                  None if rp is None else to_array(rp))
        if ctx is not None:
            _bound.arm(prep, name, activation, ctx, x.dtype, bias is not None,
                       residual is not None)
        return logical(to_tensor(y), cl), None if z is None else logical(to_tensor(z), cl)


def _conv_bias_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   residual: torch.Tensor | None, stride: Sequence[int], padding: Sequence[int],
                   dilation: Sequence[int], groups: int,
                   activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, z): y = act(conv(x, weight) + bias + residual); z is the pre-activation when the
    activation's backward needs it (elu, silu, gelu), else an empty tensor. Both are in the
    memory format torch.nn's convolution returns (Note [layouts across the bridge])."""
    prep = prepare(ConvGeometry, x, weight, (stride, padding, dilation, groups),
                   (tensor_key(bias), tensor_key(residual)))
    return fused_forward("conv_bias_act", prep, x, weight, bias, residual, activation)


conv_bias_act = torch.library.custom_op("convfuse::conv_bias_act", _conv_bias_act,
                                        mutates_args=())


@conv_bias_act.register_fake
def _(x, weight, bias, residual, stride, padding, dilation, groups, activation):
    cl = conv_channels_last(x, weight, stride, padding, dilation, groups)
    shape = conv_output_shape(x.shape, weight.shape, stride, padding, dilation)
    y = empty_in_layout(x, shape, cl)
    if activations.saves(activation) == "preactivation":
        return y, empty_in_layout(x, y.shape, cl)
    return y, x.new_empty(0)


def _conv_bias_act_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, saved: torch.Tensor | None,
    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], groups: int,
    activation: str, need_dx: bool, need_dw: bool, need_db: bool, need_dz: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db, dz) of conv_bias_act, each computed only when its `need_*` is set
    (else an empty tensor). dz is the pre-activation's gradient, which is the residual's;
    for identity it is dy itself, so the op never returns it then."""
    prep = prepare(ConvGeometry, x, weight, (stride, padding, dilation, groups),
                   (tensor_key(dy), tensor_key(saved)))
    return fused_backward(dy, x, weight, saved, prep, activation,
                          (need_dx, need_dw, need_db, need_dz), CONV_BACKWARD)


conv_bias_act_backward = torch.library.custom_op(
    "convfuse::conv_bias_act_backward", _conv_bias_act_backward, mutates_args=())


#: The convfuse.ops functions a fused backward calls, by name (looked up at each call):
#: bias gradient, activation backward + bias gradient, filter gradient, data gradient.
CONV_BACKWARD = ("conv_backward_bias", "activation_backward_bias", "conv_backward_filter",
                 "conv_backward_data")


def fused_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   saved: torch.Tensor | None, prep: Prepared, activation: str,
                   needs: tuple[bool, bool, bool, bool], names: tuple[str, str, str, str],
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The body of a fused backward op (conv_bias_act's or conv_transpose_bias_act's):
    (dx, dw, db, dz), each only when asked (else an empty tensor: a custom op returns no
    None), from `backward_parts`."""
    parts = backward_parts(dy, x, weight, saved, prep, activations.normalize(activation),
                           needs, names)
    # one new empty tensor per unused output (outputs may not alias; new_empty costs less
    # than a clone)
    return tuple(t if t is not None else dy.new_empty(0) for t in parts)  # type: ignore


def backward_parts(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   saved: torch.Tensor | None, prep: Prepared, act: str,
                   needs: tuple[bool, bool, bool, bool], names: tuple[str, str, str, str],
                   ) -> tuple[torch.Tensor | None, ...]:
    """(dx, dw, db, dz) of a fused forward, each only when asked (else None), with
    convfuse's fused activation-backward + bias-gradient kernel; `act` is a normalized
    activation name and `names` the convfuse.ops to call (bias gradient, activation
    backward + bias gradient, filter gradient, data gradient)."""
    bias_grad, _, filter_grad, data_grad = names
    need_dx, need_dw, need_db, need_dz = needs
    cl, geom, dev = prep.cl, prep.geom, device_type(x)
    # Outputs PyTorch owns: allocated here in the forward's layout (ordinary tensors, not
    # views), written by convfuse through `out=` on their physical views.
    dx_t = empty_in_layout(x, x.shape, cl) if need_dx else None
    dw_t = empty_in_layout(weight, weight.shape, cl) if need_dw else None
    db_t = torch.empty(geom.out_channels, dtype=x.dtype, device=x.device) if need_db else None
    with context(x):
        dy_p = physical(dy, cl)
        ctx = _bound.context(x) if filter_grad in _bound.BINDS and _bound.on_pointer_path(x) \
            else None
        if (ctx is not None and act == "identity" and db_t is not None
                and _bound.backward(prep, bias_grad, ctx, dy_p.data_ptr(), db_t.data_ptr())):
            dz = to_array(dy_p)  # Note [bound calls]
        else:
            dz, _ = activation_grads(
                functools.partial(op, prep, dev), to_array(dy_p), _array_or_none(saved, cl),
                act, geom, need_db, None if db_t is None else to_array(db_t), names)
            if ctx is not None and act == "identity" and db_t is not None:
                _bound.arm(prep, bias_grad, None, ctx, dy.dtype)
        if dw_t is not None:  # need_dw
            xp = physical(x, cl)
            if ctx is None or not _bound.backward(prep, filter_grad, ctx, xp.data_ptr(), dz.ptr,
                                                  dw_t.data_ptr()):
                op(prep, dev, filter_grad, to_array(xp), dz, geom, to_array(physical(dw_t, cl)))
                if ctx is not None:
                    _bound.arm(prep, filter_grad, None, ctx, x.dtype)
        if dx_t is not None:  # need_dx
            wp = physical(weight, cl)
            if ctx is None or not _bound.backward(prep, data_grad, ctx, dz.ptr, wp.data_ptr(),
                                                  dx_t.data_ptr()):
                op(prep, dev, data_grad, dz, to_array(wp), geom, to_array(physical(dx_t, cl)))
                if ctx is not None:
                    _bound.arm(prep, data_grad, None, ctx, dy.dtype)
        dz_t = logical(to_tensor(dz), cl) if (need_dz and act != "identity") else None
    return dx_t, dw_t, db_t, dz_t


def activation_grads(run: Any, dy: Any, saved: Any, act: str, geom: Any, need_db: bool,
                     db_out: Any, names: tuple[str, str, str, str]) -> tuple[Any, Any]:
    """(dz, db) of a fused backward on arrays, through `run(name, *args)` (a convfuse.ops
    call): dz is dy itself for identity, else the activation's gradient; db (into
    `db_out` where given) only with `need_db`, from the fused activation-backward + bias
    kernel, never a separate reduction of dz. `names` are the op's backward ops."""
    bias_grad, act_bias_grad = names[:2]
    if act == "identity":
        return dy, (run(bias_grad, dy, geom, db_out) if need_db else None)
    if need_db:
        dz, db = run(act_bias_grad, dy, saved, act, geom, db_out)
        return dz, db
    return run("activation_backward", dy, saved, act), None


@conv_bias_act_backward.register_fake
def _(dy, x, weight, saved, stride, padding, dilation, groups, activation, need_dx, need_dw,
      need_db, need_dz):
    cl = conv_channels_last(x, weight, stride, padding, dilation, groups)
    return empty_backward(dy, x, weight, cl, activation, weight.shape[0],
                          (need_dx, need_dw, need_db, need_dz))


def empty_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, cl: bool,
                   activation: str, out_channels: int, needs: tuple[bool, bool, bool, bool],
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `fused_backward` returns, unwritten: the fake implementations' outputs."""
    need_dx, need_dw, need_db, need_dz = needs
    act = activations.normalize(activation)
    dx = empty_in_layout(x, x.shape, cl) if need_dx else dy.new_empty(0)
    dw = empty_in_layout(weight, weight.shape, cl) if need_dw else dy.new_empty(0)
    db = dy.new_empty(out_channels) if need_db else dy.new_empty(0)
    dz = empty_in_layout(dy, dy.shape, cl) if (need_dz and act != "identity") \
        else dy.new_empty(0)
    return dx, dw, db, dz


def fused_autograd(backward_op: Any, recorded: str) -> tuple[Any, Any]:
    """(setup_context, backward) of a fused forward `forward(x, weight, bias, residual,
    *hyper, activation) -> (y, z)` (conv_bias_act, conv_transpose_bias_act): its fused
    backward `backward_op(dy, x, weight, saved, *hyper, activation, need_dx, need_dw,
    need_db, need_dz)` (the custom op, or its body on the eager path), or _double's
    function named `recorded`, (ctx, dy, dz, x, weight, saved, *hyper, activation), when
    the backward itself is recorded (Note [two backward paths] in _double.py)."""

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, weight, bias, _residual, *hyper, activation = inputs
        y, z = output
        kind = activations.saves(activation)
        saved = None if kind == "none" else y if kind == "output" else z
        ctx.save_for_backward(x, weight, saved)
        ctx.hyper = [list(h) if isinstance(h, (list, tuple)) else int(h) for h in hyper]
        ctx.activation = activation
        ctx.has_bias = bias is not None
        # z stays differentiable where it is saved (Note [two backward paths] in
        # _double.py), and an unused z must not look like a gradient.
        if kind != "preactivation":
            ctx.mark_non_differentiable(z)
        ctx.set_materialize_grads(False)

    def backward(ctx: Any, dy: torch.Tensor | None,
                 dz_output: torch.Tensor | None) -> tuple[Any, ...]:
        x, weight, saved = ctx.saved_tensors
        activation, rest = ctx.activation, (None,) * (len(ctx.hyper) + 1)
        if _double.takes_recorded_path(dz_output, dy):
            return getattr(_double, recorded)(ctx, dy, dz_output, x, weight, saved,
                                              *ctx.hyper, activation)
        need_dx, need_dw, need_db, need_dres = ctx.needs_input_grad[:4]
        need_db = bool(need_db and ctx.has_bias)
        identity = activations.normalize(activation) == "identity"
        if dy is None:  # y itself fed nothing that needs a gradient
            return (None,) * 4 + rest
        dx, dw, db, dz = backward_op(dy, x, weight, saved, *ctx.hyper, activation,
                                     bool(need_dx), bool(need_dw), need_db,
                                     bool(need_dres) and not identity)
        dres = (dy if identity else dz) if need_dres else None
        return (dx if need_dx else None, dw if need_dw else None, db if need_db else None,
                dres, *rest)

    return setup_context, backward


def register_fused_autograd(forward: Any, backward_op: Any, recorded: str) -> None:
    """Autograd for the fused forward custom op `forward` (fused_autograd's)."""
    setup_context, backward = fused_autograd(backward_op, recorded)
    forward.register_autograd(backward, setup_context=setup_context)


def eager_function(name: str, forward_body: Any, backward_body: Any,
                   recorded: str) -> type[torch.autograd.Function]:
    """The eager path's autograd.Function of a fused op (Note [two call paths] in
    _eager.py): the custom op's body as forward, its setup_context, and its backward
    formula calling the backward op's body."""
    setup_context, backward = fused_autograd(backward_body, recorded)

    # forward(ctx, ...) calling setup_context itself: a Function with a separate
    # setup_context makes `apply` bind the arguments with inspect.signature at every call.
    def forward(ctx: Any, *args: Any) -> Any:
        output = forward_body(*args)
        setup_context(ctx, args, output)
        return output

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward),
        "__module__": __name__,
        "__doc__": f"{forward_body.__name__.lstrip('_')} as one autograd node (eager path)."})


def call_fused(custom_op: Any, function: Any, body: Any, args: tuple[Any, ...],
               transformed: Any) -> Any:
    """A fused forward `(x, weight, bias, residual, *rest)`: the custom op where a tracer
    or transform must see it, else the eager path (Note [two call paths] in _eager.py);
    under torch.func's autodiff transforms or forward AD, the Function `transformed` (Note
    [a fused convolution under torch.func] in _functorch.py)."""
    x, weight, bias, residual = args[:4]
    if not _eager.takes_eager_path(x, weight, bias, residual):
        if _eager.differentiating():
            x, weight, bias, residual, *hyper, act = _autocast.cast_args(device_type(x), args)
            return transformed.apply(x, weight, bias, residual, _functorch.Hyper(tuple(hyper)),
                                     act)
        return custom_op(*args)
    args = _autocast.cast_args(device_type(x), args)
    if _eager.needs_graph(*args[:4]):
        return function.apply(*args)
    return body(*args)


register_fused_autograd(conv_bias_act, torch.ops.convfuse.conv_bias_act_backward,
                        "conv_backward")
_autocast.register_conv(conv_bias_act)

ConvBiasAct = eager_function("ConvBiasAct", _conv_bias_act, _conv_bias_act_backward,
                             "conv_backward")
TransformedConvBiasAct = _functorch.function(
    "TransformedConvBiasAct", torch.ops.convfuse.conv_bias_act,
    torch.ops.convfuse.conv_bias_act_backward,
    *fused_autograd(torch.ops.convfuse.conv_bias_act_backward, "conv_backward"))


def conv_bias_act_call(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.ops.convfuse.conv_bias_act(*args), taking the eager path where it may."""
    return call_fused(torch.ops.convfuse.conv_bias_act, ConvBiasAct, _conv_bias_act, args,
                      TransformedConvBiasAct)
