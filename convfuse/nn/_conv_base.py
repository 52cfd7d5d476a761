"""What Conv*d and ConvTranspose*d layers share: channel and layout validation, the weight's
initialisation and state_dict order, the assignable and read-only hyperparameters, and the
forward/backward bookkeeping around one fused op call.

Each subclass names its fused ops (`_forward_op`, `_backward_op`), the hyperparameters its
`_set_geometry` takes (`_geometry_args`, each stored as `_<name>`), and returns the geometry
keywords of its op from `_geometry_kwargs`.

Note [layer call cache]
At a 1x1x4x4 input the engine's work is a few microseconds, and a call's checks (types,
dtypes, shapes against the geometry, the memory cap, the activation's name) cost several
times that. Everything they look at is the call's signature: each array's class, shape,
dtype and contiguity (x, residual, weight, bias), the layer's device, the extra arguments
(output_size), the activation and residual scale, and the config flags in force. The first
call of a signature runs every check, as before; once it has succeeded, the signature maps
to its checked arguments (geometry, canonical activation, scale), and later calls with it go
straight to `_known_op`: the layer's and the functional's checks are skipped; on NumPy the
op's own (cheap there: _checks.validate's fast lane) still run; on device arrays a Conv's
or Linear's op's validated entry runs after a check of each array's address and device
(Note [a known signature on the device] in convfuse/functional.py; a ConvTranspose's op
still checks), and where a test or
convfuse.selfcheck replaced the op, the op runs, as ops are the one entry to the engines.
Bad input has a signature no good call had, so it still takes the checked path and gets the
same error before any engine call.
Assigning stride, padding, dilation (any `_geometry_args`) clears the cache; activation and
residual_scale are in the key; config flags are compared by identity (config.get() is a new
object after each change), and a change also redoes the geometries' memory checks (Note
[geometry memos] in _memo.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import config, dtypes
from .._memory import check_bytes
from ..geometry import parse_layout
from . import _hyper
from .module import USER_ERRORS, Layer, contiguous, init_parameter, renamed
from .parameter import Parameter


def assignable(name: str, doc: str = "Validated on assignment.") -> property:
    """A hyperparameter that `_set_geometry` validates (with the others) on assignment."""
    attr = "_" + name
    return property(lambda self: self.__dict__[attr],
                    lambda self, v: self._assign(**{name: v}), doc=doc)


def _checkpoint_axes(ndim: int) -> tuple[int, ...]:
    """A channels-last weight's (A, *kernel, B) axes in PyTorch's (A, B, *kernel) order."""
    return (0, ndim - 1, *range(1, ndim - 1))


class _WeightInLayout:
    """A conv layer's `weight`: assigning a Parameter tells it the checkpoint layout
    (`Parameter.state_axes`), since optimizers see only the Parameter and must save its
    state as `state_dict` saves the weight. No __get__: reads go straight to the instance
    __dict__, so a call pays nothing for it. Copies and pickles restore the __dict__ and
    the Parameter's own slot, not through here."""

    def __set__(self, layer: _FusedConvLayer, value: Any) -> None:
        if isinstance(value, Parameter):
            ndim = len(value.shape)
            value.state_axes = (_checkpoint_axes(ndim) if layer.__dict__.get("_channels_last")
                                and ndim >= 3 else None)
        layer.__dict__["weight"] = value

    def __delete__(self, layer: _FusedConvLayer) -> None:
        del layer.__dict__["weight"]


# signatures remembered per layer (Note [layer call cache]); a model fed ever new shapes
# starts over rather than growing without bound
_MAX_SIGNATURES = 64


class _FusedConvLayer(Layer):
    """The shared body of the fused convolution layers; `_rank` is the number of spatial
    dims. The weight is stored (A, B, *kernel) channels-first and (A, *kernel, B)
    channels-last; state_dict always holds the channels-first (PyTorch's) order."""

    _rank = 0
    # Stored in __dict__ (properties below guard the public names).
    _in: int
    _out: int
    _groups: int
    _kernel: tuple[int, ...]
    _layout: str
    _channels_last: bool
    _dtype: np.dtype
    _geometry_args: tuple[str, ...] = ()
    _forward_op: Callable[..., Any]
    _backward_op: Callable[..., Any]
    # (x, weight, bias, residual, activation, scale, **geometry) -> (y, ctx) for a signature
    # _forward_op accepted before (Note [layer call cache])
    _known_op: Callable[..., Any]
    if TYPE_CHECKING:
        weight: Parameter
    else:
        weight = _WeightInLayout()
    # (values of _geometry_args) -> None, validating them together and clearing the cache
    _set_geometry: Callable[..., None]
    # (contiguous input, *the call's extra arguments) -> the geometry keywords of _forward_op
    _geometry_kwargs: Callable[..., dict[str, Any]]

    def __setstate__(self, state: dict[str, Any]) -> None:
        # pickle and deepcopy restore __dict__ without the weight's descriptor; a Parameter
        # pickled before Parameter.state_axes existed comes back without it, and a
        # channels-last weight's optimizer state would then be saved in storage order
        self.__dict__.update(state)
        weight = state.get("weight")
        if isinstance(weight, Parameter):
            self.weight = weight

    # -- construction --------------------------------------------------------------------
    def _set_channels(self, in_channels: Any, out_channels: Any, groups: Any) -> None:
        d = self.__dict__
        d["_in"] = _hyper.positive_int(in_channels, "in_channels")
        d["_out"] = _hyper.positive_int(out_channels, "out_channels")
        d["_groups"] = _hyper.positive_int(groups, "groups")

    def _set_storage(self, layout: Any, dtype: Any) -> None:
        if not isinstance(layout, str):
            raise TypeError(f"layout must be a str such as 'NCHW' or 'NHWC', got "
                            f"{type(layout).__name__} {layout!r}")
        d = self.__dict__
        d["_channels_last"] = parse_layout(layout, self._rank)
        d["_layout"] = layout.upper()
        d["_dtype"] = dtypes.canonical(dtype)

    def _init_parameters(self, shape_cf: tuple[int, ...], fan_in: int, has_bias: bool,
                         seed: Any) -> None:
        """torch.nn's default init: kaiming_uniform_(a=sqrt(5)) gives
        U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for the weight, and the bias uses the same bound."""
        rng = np.random.default_rng(_hyper.seed(seed))
        self._ctx = None
        check_bytes(shape_cf, np.float64, "cpu", "weight (drawn in float64 on the host)")
        check_bytes(shape_cf, self._dtype, self.device, "weight")
        bound = 1.0 / math.sqrt(fan_in)
        w = rng.uniform(-bound, bound, size=shape_cf)
        if self._channels_last:
            w = np.ascontiguousarray(np.moveaxis(w, 1, -1))
        self.weight = init_parameter(w, self._dtype, self.device, "weight")
        b = rng.uniform(-bound, bound, self._out)
        self.bias = init_parameter(b, self._dtype, self.device, "bias") if has_bias else None

    # -- hyperparameters -----------------------------------------------------------------
    def _assign(self, **change: Any) -> None:
        now = {name: self.__dict__["_" + name] for name in self._geometry_args}
        now.update(change)
        try:
            self._set_geometry(**now)
        except USER_ERRORS as exc:
            raise renamed(exc, type(self).__name__) from None
        self.__dict__["_calls"] = {}  # Note [layer call cache]

    activation = _hyper.activation_property()

    @property
    def residual_scale(self) -> float:
        return self.__dict__["_residual_scale"]

    @residual_scale.setter
    def residual_scale(self, value: Any) -> None:
        try:
            self.__dict__["_residual_scale"] = _hyper.finite_real(value, "residual_scale")
        except USER_ERRORS as exc:
            raise renamed(exc, type(self).__name__) from None

    def _fixed(name: str, attr: str, why: str) -> property:  # type: ignore[misc]
        def setter(self: _FusedConvLayer, value: Any) -> None:
            raise _hyper.read_only(type(self).__name__, name, why)

        return property(lambda self: self.__dict__[attr], setter)

    in_channels = _fixed("in_channels", "_in", "it sets the weight's shape")
    out_channels = _fixed("out_channels", "_out", "it sets the weight's shape")
    kernel_size = _fixed("kernel_size", "_kernel", "it sets the weight's shape")
    groups = _fixed("groups", "_groups", "it sets the weight's shape")
    layout = _fixed("layout", "_layout", "it sets the weight's storage order")
    channels_last = _fixed("channels_last", "_channels_last", "it sets the weight's storage order")
    dtype = _fixed("dtype", "_dtype", "it is the parameters' dtype")
    del _fixed

    # -- calls ---------------------------------------------------------------------------
    def _apply(self, x: Any, residual: Any, *where: Any) -> Any:
        """act(op(x) + bias + residual_scale * residual). A non-C-contiguous x or residual
        is copied once into a contiguous array (the caller's is never modified)."""
        d = self.__dict__
        w = self.weight.data
        b = None if self.bias is None else self.bias.data
        try:
            key: Any = (x.__class__, x.shape, x.dtype, x.flags.c_contiguous,
                        w.__class__, w.shape, w.dtype, w.flags.c_contiguous,
                        None if b is None else (b.__class__, b.shape, b.dtype,
                                                b.flags.c_contiguous),
                        None if residual is None else (residual.__class__, residual.shape,
                                                       residual.dtype,
                                                       residual.flags.c_contiguous),
                        where, d["_activation"], d["_residual_scale"], self.device)
            calls = d.get("_calls")
            # hashed either way, so an unhashable argument runs uncached from the first call
            known = calls.get(key) if calls else (hash(key), None)[1]
        except (AttributeError, TypeError):  # not arrays, or an unhashable argument
            key = known = None
        if known is not None and known[0] is config.get():
            try:
                y, ctx = type(self)._known_op(
                    contiguous(x), w, b, None if residual is None else contiguous(residual),
                    known[1], known[2], **known[3])
            except USER_ERRORS as exc:
                raise self._renamed(exc) from None
            self._ctx = ctx
            return y
        return self._checked_apply(x, residual, *where, key=key)

    def _checked_apply(self, x: Any, residual: Any, *where: Any, key: Any) -> Any:
        try:
            self._check_input(x)
            if residual is not None:
                self._check_input(residual, "residual")
            if x.dtype != self._dtype:
                raise ValueError(f"has dtype {self._dtype} but its input has dtype {x.dtype}; "
                                 + _hyper.dtype_hint(self._dtype, x.dtype))
            x = contiguous(x)
            if residual is not None:
                residual = contiguous(residual)
            flags = config.get()
            geometry = self._geometry_kwargs(x, *where)
            bias = None if self.bias is None else self.bias.data
            y, ctx = type(self)._forward_op(
                x, self.weight.data, bias, activation=self.activation, residual=residual,
                residual_scale=self.residual_scale, **geometry)
        except USER_ERRORS as exc:
            raise self._renamed(exc) from None
        self._ctx = ctx
        if key is not None:
            calls = self.__dict__.setdefault("_calls", {})
            if len(calls) >= _MAX_SIGNATURES:
                calls.clear()
            calls[key] = (flags, ctx.activation, ctx.residual_scale, geometry)
        return y

    def backward(self, dy: Any) -> Any:
        """dx (and dresidual when the forward took one); accumulates into .grad.
        Atomic and repeatable: see Layer's backward rule."""
        return self._backward_with(dy, self._backward)

    def _backward(self, ctx: Any, dy: Any) -> Any:
        self._check_input(dy, "dy")
        grads = type(self)._backward_op(
            dy, ctx, need_dx=self.needs_input_grad, dweight=self.weight.grad,
            dbias=None if self.bias is None else self.bias.grad, accumulate=True)
        return (grads.dx, grads.dresidual) if ctx.has_residual else grads.dx

    def _repr_tail(self) -> str:
        return (f"activation={self.activation!r}, layout={self._layout!r}, dtype={self._dtype}, "
                f"device={self.device!r}")

    def _param_to_state(self, name: str, value: Any) -> Any:
        # channels-last stores (A, *kernel, B); PyTorch's checkpoints hold (A, B, *kernel).
        if name == "weight" and self._channels_last:
            return value.transpose(_checkpoint_axes(value.ndim))
        return value

    def _param_from_state(self, name: str, value: Any) -> Any:
        if name == "weight" and self._channels_last:
            return value.transpose(0, *range(2, value.ndim), 1)
        return value
