"""Conv1d, Conv2d, Conv3d: fused convolution + bias + activation (+ residual) layers.

Hyperparameters after construction: `stride`, `padding`, `dilation`, `padding_mode`,
`activation` and `residual_scale` may be assigned; each assignment is validated (with the
others, e.g. padding='same' needs stride 1) and clears the per-shape geometry cache, so the
next call uses it. `in_channels`, `out_channels`, `kernel_size`, `groups`, `layout` and
`dtype` fix the weight's shape or storage and are read-only (AttributeError saying so).

`padding_mode` ('zeros', 'reflect', 'replicate', 'circular') and padding='same' with an
even kernel (or an odd dilation * (kernel - 1)) follow torch.nn's Conv: what cuDNN's
symmetric zero padding cannot do is padded explicitly (convfuse.ops.pad_forward, on either
engine) before the convolution, and the backward folds the gradient back
(convfuse.functional; convfuse.pad_geometry.split_padding says which is which). torch.nn takes
padding_mode 9th, where convfuse's Conv takes `activation`, so it is keyword-only here.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import dtypes
from .._memory import check_bytes, check_conv
from ..backend import resolve_device
from ..functional import conv_bias_act_backward, conv_bias_act_forward
from ..geometry import ConvGeometry, IntOrTuple, parse_layout
from ..pad_geometry import PadGeometry, padded_conv
from . import _hyper
from .module import USER_ERRORS, Layer, contiguous, init_parameter, renamed


class _ConvNd(Layer):
    """The shared body of Conv1d/2d/3d; `_rank` is the number of spatial dims.

    The weight is stored (K, C/groups, *kernel) in NCHW layout and (K, *kernel, C/groups)
    in NHWC layout (state_dict always holds PyTorch's (K, C/groups, *kernel)).
    """

    _rank = 0
    # Stored in __dict__ (properties below guard the public names).
    _in: int
    _out: int
    _groups: int
    _kernel: tuple[int, ...]
    _stride: tuple[int, ...]
    _padding: tuple[int, ...] | str
    _padding_mode: str
    _dilation: tuple[int, ...]
    _layout: str
    _channels_last: bool
    _dtype: np.dtype
    _geoms: dict[tuple[int, ...], tuple[PadGeometry | None, ConvGeometry]]

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntOrTuple,
        stride: IntOrTuple = 1,
        padding: IntOrTuple | str = 0,
        dilation: IntOrTuple = 1,
        groups: int = 1,
        bias: bool = True,
        activation: str | None = None,
        layout: str = "NCHW",
        dtype: Any = "float32",
        device: str | None = None,
        seed: int | None = None,
        *,
        padding_mode: str = "zeros",
    ) -> None:
        try:
            self._init(in_channels, out_channels, kernel_size, stride, padding, dilation,
                       groups, bias, activation, layout, dtype, device, seed, padding_mode)
        except USER_ERRORS as exc:
            raise renamed(exc, type(self).__name__) from None

    def _init(self, in_channels: Any, out_channels: Any, kernel_size: Any, stride: Any,
              padding: Any, dilation: Any, groups: Any, bias: Any, activation: Any,
              layout: Any, dtype: Any, device: Any, seed: Any, padding_mode: Any) -> None:
        rank = self._rank
        d = self.__dict__
        d["_in"] = _hyper.positive_int(in_channels, "in_channels")
        d["_out"] = _hyper.positive_int(out_channels, "out_channels")
        d["_groups"] = _hyper.positive_int(groups, "groups")
        if d["_in"] % d["_groups"] or d["_out"] % d["_groups"]:
            raise ValueError(
                f"in_channels ({d['_in']}) and out_channels ({d['_out']}) must both be "
                f"divisible by groups ({d['_groups']})"
            )
        d["_kernel"] = _hyper.int_tuple(kernel_size, rank, "kernel_size", 1)
        has_bias = _hyper.flag(bias, "bias")
        if not isinstance(layout, str):
            raise TypeError(f"layout must be a str such as 'NCHW' or 'NHWC', got "
                            f"{type(layout).__name__} {layout!r}")
        d["_channels_last"] = parse_layout(layout, rank)
        d["_layout"] = layout.upper()
        d["_dtype"] = dtypes.canonical(dtype)
        self._set_geometry(stride, padding, dilation, padding_mode)
        self.activation = activation
        self.device = resolve_device(device)
        self.residual_scale = 1.0
        seed = _hyper.seed(seed)
        self._ctx = None

        shape_cf = (self._out, self._in // self._groups, *self._kernel)
        check_bytes(shape_cf, np.float64, "cpu", "weight (drawn in float64 on the host)")
        check_bytes(shape_cf, self._dtype, self.device, "weight")
        # PyTorch's default: kaiming_uniform_(a=sqrt(5)) gives U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
        # and the bias uses the same bound.
        rng = np.random.default_rng(seed)
        fan_in = (self._in // self._groups) * math.prod(self._kernel)
        bound = 1.0 / math.sqrt(fan_in)
        w = rng.uniform(-bound, bound, size=shape_cf)
        if self._channels_last:
            w = np.ascontiguousarray(np.moveaxis(w, 1, -1))
        self.weight = init_parameter(w, self._dtype, self.device, "weight")
        b = rng.uniform(-bound, bound, self._out)
        self.bias = init_parameter(b, self._dtype, self.device, "bias") if has_bias else None

    # -- hyperparameters -----------------------------------------------------------------
    def _set_geometry(self, stride: Any, padding: Any, dilation: Any, padding_mode: Any) -> None:
        rank = self._rank
        s = _hyper.int_tuple(stride, rank, "stride", 1)
        dl = _hyper.int_tuple(dilation, rank, "dilation", 1)
        p = _hyper.padding(padding, rank, self._kernel, s, dl)
        mode = _hyper.padding_mode(padding_mode)
        d = self.__dict__
        d["_stride"], d["_padding"], d["_dilation"], d["_padding_mode"] = s, p, dl, mode
        d["_geoms"] = {}  # every cached geometry was for the old values

    def _assign(self, **change: Any) -> None:
        now = {"stride": self._stride, "padding": self._padding, "dilation": self._dilation,
               "padding_mode": self._padding_mode}
        now.update(change)
        try:
            self._set_geometry(now["stride"], now["padding"], now["dilation"],
                               now["padding_mode"])
        except USER_ERRORS as exc:
            raise renamed(exc, type(self).__name__) from None

    stride = property(lambda self: self._stride,
                      lambda self, v: self._assign(stride=v), doc="Validated on assignment.")
    padding = property(lambda self: self._padding,
                       lambda self, v: self._assign(padding=v), doc="Validated on assignment.")
    dilation = property(lambda self: self._dilation,
                        lambda self, v: self._assign(dilation=v), doc="Validated on assignment.")
    padding_mode = property(lambda self: self._padding_mode,
                            lambda self, v: self._assign(padding_mode=v),
                            doc="torch.nn's padding_mode; validated on assignment.")

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
        def setter(self: _ConvNd, value: Any) -> None:
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
    def _geometry(self, x: Any) -> tuple[PadGeometry | None, ConvGeometry]:
        """(explicit padding or None, the convolution), validated once per input shape:
        a padding the input cannot take (reflect needs padding < size) raises here, before
        any engine runs."""
        found = self._geoms.get(tuple(x.shape))
        if found is None:
            if x.ndim != self._rank + 2:
                raise ValueError(
                    f"expects a {self._rank + 2}-d input ({self._layout}), got shape "
                    f"{tuple(x.shape)}"
                )
            found = padded_conv(
                x.shape, self.weight.shape, self._stride, self._padding, self._dilation,
                self._groups, self._layout, self._padding_mode,
            )
            check_conv(found[1], self._dtype, self.device)
            self._geoms[tuple(x.shape)] = found
        return found

    def __call__(self, x: Any, residual: Any = None) -> Any:
        """act(conv(x) + bias + residual_scale * residual). A non-C-contiguous x or residual
        is copied once into a contiguous array (the caller's is never modified)."""
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
            pad, geom = self._geometry(x)
            bias = None if self.bias is None else self.bias.data
            y, ctx = conv_bias_act_forward(
                x, self.weight.data, bias, activation=self.activation, residual=residual,
                residual_scale=self.residual_scale, geom=geom, pad=pad,
            )
        except USER_ERRORS as exc:
            raise self._renamed(exc) from None
        self._ctx = ctx
        return y

    forward = __call__

    def backward(self, dy: Any) -> Any:
        """dx (and dresidual when the forward took one); accumulates into .grad.
        Atomic and repeatable: see Layer's backward rule."""
        return self._backward_with(dy, self._backward)

    def _backward(self, ctx: Any, dy: Any) -> Any:
        self._check_input(dy, "dy")
        grads = conv_bias_act_backward(
            dy, ctx, need_dx=self.needs_input_grad, dweight=self.weight.grad,
            dbias=None if self.bias is None else self.bias.grad, accumulate=True,
        )
        return (grads.dx, grads.dresidual) if ctx.has_residual else grads.dx

    def _param_to_state(self, name: str, value: Any) -> Any:
        # channels-last stores (K, *kernel, C/groups); PyTorch's checkpoints hold (K, C/g, *k).
        if name == "weight" and self._channels_last:
            return value.transpose(0, value.ndim - 1, *range(1, value.ndim - 1))
        return value

    def _param_from_state(self, name: str, value: Any) -> Any:
        if name == "weight" and self._channels_last:
            return value.transpose(0, *range(2, value.ndim), 1)
        return value

    def extra_repr(self) -> str:
        # like torch.nn's, padding_mode shows only when it is not the default
        mode = f"padding_mode={self._padding_mode!r}, " if self._padding_mode != "zeros" else ""
        return (
            f"{self._in}, {self._out}, kernel_size={self._kernel}, "
            f"stride={self._stride}, padding={self._padding}, dilation={self._dilation}, "
            f"groups={self._groups}, bias={self.bias is not None}, {mode}"
            f"activation={self.activation!r}, layout={self._layout!r}, dtype={self._dtype}, "
            f"device={self.device!r}"
        )


class Conv1d(_ConvNd):
    """1-d fused convolution; input (N, C, L) in NCHW/NCW, (N, L, C) in NHWC/NWC."""

    _rank = 1


class Conv2d(_ConvNd):
    """2-d fused convolution; input (N, C, H, W) in NCHW, (N, H, W, C) in NHWC."""

    _rank = 2


class Conv3d(_ConvNd):
    """3-d fused convolution; input (N, C, D, H, W) in NCHW/NCDHW, (N, D, H, W, C) in NHWC."""

    _rank = 3
