"""ConvTranspose1d, ConvTranspose2d, ConvTranspose3d: fused transposed convolution + bias +
activation (+ residual) layers, the decoder half of U-Nets and GAN generators.

Arguments are torch.nn.ConvTranspose*d's, in its order (`in_channels, out_channels,
kernel_size, stride, padding, output_padding, groups, bias, dilation, padding_mode, device,
dtype`); convfuse's additions (`activation`, `layout`, `seed`) are keyword-only. The call is
`layer(x, residual=None, output_size=None)`, output_size choosing among the output sizes a
stride allows, as in PyTorch. `stride`, `padding`, `output_padding`, `dilation`,
`activation` and `residual_scale` may be assigned (validated, and the per-shape geometry
cache cleared); the others fix the weight's shape or storage and are read-only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import dtypes
from .._memory import check_bytes, check_conv
from ..backend import resolve_device
from ..functional_transpose import (
    conv_transpose_bias_act_backward,
    conv_transpose_bias_act_forward,
)
from ..geometry import IntOrTuple, is_int, parse_layout
from ..transpose_geometry import ConvTransposeGeometry
from . import _hyper
from .module import USER_ERRORS, Layer, contiguous, init_parameter, renamed


class _ConvTransposeNd(Layer):
    """The shared body of ConvTranspose1d/2d/3d; `_rank` is the number of spatial dims.

    The weight is PyTorch's (in, out/groups, *kernel) in NCHW layout and (in, *kernel,
    out/groups) in NHWC layout, the cuDNN filter format of the forward convolution this
    is the data gradient of; state_dict always holds PyTorch's order.
    """

    _rank = 0
    _in: int
    _out: int
    _groups: int
    _kernel: tuple[int, ...]
    _stride: tuple[int, ...]
    _padding: tuple[int, ...]
    _output_padding: tuple[int, ...]
    _dilation: tuple[int, ...]
    _layout: str
    _channels_last: bool
    _dtype: np.dtype
    _geoms: dict[Any, ConvTransposeGeometry]

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntOrTuple,
        stride: IntOrTuple = 1,
        padding: IntOrTuple = 0,
        output_padding: IntOrTuple = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: IntOrTuple = 1,
        padding_mode: str = "zeros",
        device: str | None = None,
        dtype: Any = None,
        *,
        activation: str | None = None,
        layout: str = "NCHW",
        seed: int | None = None,
    ) -> None:
        try:
            self._init(in_channels, out_channels, kernel_size, stride, padding, output_padding,
                       groups, bias, dilation, padding_mode, device, dtype, activation, layout,
                       seed)
        except USER_ERRORS as exc:
            raise renamed(exc, type(self).__name__) from None

    def _init(self, in_channels: Any, out_channels: Any, kernel_size: Any, stride: Any,
              padding: Any, output_padding: Any, groups: Any, bias: Any, dilation: Any,
              padding_mode: Any, device: Any, dtype: Any, activation: Any, layout: Any,
              seed: Any) -> None:
        rank = self._rank
        d = self.__dict__
        d["_in"] = _hyper.positive_int(in_channels, "in_channels")
        d["_out"] = _hyper.positive_int(out_channels, "out_channels")
        d["_groups"] = _hyper.positive_int(groups, "groups")
        if d["_in"] % d["_groups"]:
            raise ValueError("in_channels must be divisible by groups")
        if d["_out"] % d["_groups"]:
            raise ValueError("out_channels must be divisible by groups")
        if padding_mode != "zeros":  # torch.nn's check and words
            raise ValueError(
                f"Only \"zeros\" padding mode is supported for {type(self).__name__}")
        d["_kernel"] = _hyper.int_tuple(kernel_size, rank, "kernel_size", 1,
                                        "transposed convolution")
        has_bias = _hyper.flag(bias, "bias")
        if not isinstance(layout, str):
            raise TypeError(f"layout must be a str such as 'NCHW' or 'NHWC', got "
                            f"{type(layout).__name__} {layout!r}")
        d["_channels_last"] = parse_layout(layout, rank)
        d["_layout"] = layout.upper()
        d["_dtype"] = dtypes.canonical("float32" if dtype is None else dtype)
        self._set_geometry(stride, padding, output_padding, dilation)
        self.activation = activation
        self.device = resolve_device(device)
        self.residual_scale = 1.0
        rng = np.random.default_rng(_hyper.seed(seed))
        self._ctx = None

        shape_cf = (self._in, self._out // self._groups, *self._kernel)
        check_bytes(shape_cf, np.float64, "cpu", "weight (drawn in float64 on the host)")
        check_bytes(shape_cf, self._dtype, self.device, "weight")
        # torch.nn's default: kaiming_uniform_(a=sqrt(5)) with fan_in = weight.size(1) *
        # prod(kernel) = out/groups * prod(kernel), the bias with the same bound.
        bound = 1.0 / math.sqrt((self._out // self._groups) * math.prod(self._kernel))
        w = rng.uniform(-bound, bound, size=shape_cf)
        if self._channels_last:
            w = np.ascontiguousarray(np.moveaxis(w, 1, -1))
        self.weight = init_parameter(w, self._dtype, self.device, "weight")
        b = rng.uniform(-bound, bound, self._out)
        self.bias = init_parameter(b, self._dtype, self.device, "bias") if has_bias else None

    # -- hyperparameters -----------------------------------------------------------------
    def _set_geometry(self, stride: Any, padding: Any, output_padding: Any,
                      dilation: Any) -> None:
        rank, op = self._rank, "transposed convolution"
        if isinstance(padding, str):
            raise ValueError(f"padding must be an int or {rank} ints (a transposed "
                             f"convolution has no {padding!r} padding), got {padding!r}")
        s = _hyper.int_tuple(stride, rank, "stride", 1, op)
        dl = _hyper.int_tuple(dilation, rank, "dilation", 1, op)
        p = _hyper.int_tuple(padding, rank, "padding", 0, op)
        o = _hyper.int_tuple(output_padding, rank, "output_padding", 0, op)
        if any(v >= si and v >= di for v, si, di in zip(o, s, dl)):
            raise ValueError(f"output_padding must be smaller than either stride or "
                             f"dilation, got output_padding={o}, stride={s}, dilation={dl}")
        d = self.__dict__
        d["_stride"], d["_padding"], d["_output_padding"], d["_dilation"] = s, p, o, dl
        d["_geoms"] = {}

    def _assign(self, **change: Any) -> None:
        now = {"stride": self._stride, "padding": self._padding,
               "output_padding": self._output_padding, "dilation": self._dilation}
        now.update(change)
        try:
            self._set_geometry(now["stride"], now["padding"], now["output_padding"],
                               now["dilation"])
        except USER_ERRORS as exc:
            raise renamed(exc, type(self).__name__) from None

    stride = property(lambda self: self._stride,
                      lambda self, v: self._assign(stride=v), doc="Validated on assignment.")
    padding = property(lambda self: self._padding,
                       lambda self, v: self._assign(padding=v), doc="Validated on assignment.")
    output_padding = property(lambda self: self._output_padding,
                              lambda self, v: self._assign(output_padding=v),
                              doc="Validated on assignment.")
    dilation = property(lambda self: self._dilation,
                        lambda self, v: self._assign(dilation=v), doc="Validated on assignment.")

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
        def setter(self: _ConvTransposeNd, value: Any) -> None:
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

    @property
    def padding_mode(self) -> str:
        return "zeros"

    # -- calls ---------------------------------------------------------------------------
    def _geometry(self, x: Any, output_size: Sequence[int] | None) -> ConvTransposeGeometry:
        if output_size is not None:
            if isinstance(output_size, (str, bytes)) or not isinstance(output_size, Sequence) \
                    or not all(is_int(v) for v in output_size):
                raise TypeError(f"output_size must be a sequence of ints or None, got "
                                f"{output_size!r}")
            key: Any = (tuple(x.shape), tuple(int(v) for v in output_size))
        else:
            key = tuple(x.shape)
        geom = self._geoms.get(key)
        if geom is None:
            if x.ndim != self._rank + 2:
                raise ValueError(f"expects a {self._rank + 2}-d input ({self._layout}), got "
                                 f"shape {tuple(x.shape)}")
            geom = ConvTransposeGeometry.create(
                x.shape, self.weight.shape, self._stride, self._padding, self._output_padding,
                self._dilation, self._groups, self._layout, output_size)
            check_bytes(geom.output_shape, self._dtype, self.device, "output")
            if geom.batch:
                check_conv(geom.conv, self._dtype, self.device)
            self._geoms[key] = geom
        return geom

    def output_shape(self, input_shape: Sequence[int],
                     output_size: Sequence[int] | None = None) -> tuple[int, ...]:
        """The output's shape (in the layer's layout) for an input of `input_shape`."""
        probe = np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), tuple(input_shape),
                                                (0,) * len(input_shape))
        try:
            return self._geometry(probe, output_size).output_shape
        except USER_ERRORS as exc:
            raise self._renamed(exc) from None

    def __call__(self, x: Any, residual: Any = None,
                 output_size: Sequence[int] | None = None) -> Any:
        """act(conv_transpose(x) + bias + residual_scale * residual). A non-C-contiguous x
        or residual is copied once into a contiguous array (the caller's is never modified)."""
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
            geom = self._geometry(x, output_size)
            bias = None if self.bias is None else self.bias.data
            y, ctx = conv_transpose_bias_act_forward(
                x, self.weight.data, bias, activation=self.activation, residual=residual,
                residual_scale=self.residual_scale, geom=geom)
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
        grads = conv_transpose_bias_act_backward(
            dy, ctx, need_dx=self.needs_input_grad, dweight=self.weight.grad,
            dbias=None if self.bias is None else self.bias.grad, accumulate=True)
        return (grads.dx, grads.dresidual) if ctx.has_residual else grads.dx

    def _param_to_state(self, name: str, value: Any) -> Any:
        # channels-last stores (in, *kernel, out/groups); PyTorch's holds (in, out/g, *k).
        if name == "weight" and self._channels_last:
            return value.transpose(0, value.ndim - 1, *range(1, value.ndim - 1))
        return value

    def _param_from_state(self, name: str, value: Any) -> Any:
        if name == "weight" and self._channels_last:
            return value.transpose(0, *range(2, value.ndim), 1)
        return value

    def extra_repr(self) -> str:
        return (
            f"{self._in}, {self._out}, kernel_size={self._kernel}, stride={self._stride}, "
            f"padding={self._padding}, output_padding={self._output_padding}, "
            f"dilation={self._dilation}, groups={self._groups}, bias={self.bias is not None}, "
            f"activation={self.activation!r}, layout={self._layout!r}, dtype={self._dtype}, "
            f"device={self.device!r}"
        )


class ConvTranspose1d(_ConvTransposeNd):
    """1-d fused transposed convolution; input (N, C, L) in NCW, (N, L, C) in NWC."""

    _rank = 1


class ConvTranspose2d(_ConvTransposeNd):
    """2-d fused transposed convolution; input (N, C, H, W) in NCHW, (N, H, W, C) in NHWC."""

    _rank = 2


class ConvTranspose3d(_ConvTransposeNd):
    """3-d fused transposed convolution; input (N, C, D, H, W) in NCDHW, (N, D, H, W, C) in
    NDHWC."""

    _rank = 3
