"""Conv1d, Conv2d, Conv3d: fused convolution + bias + activation (+ residual) layers."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import activations, dtypes
from ..backend import resolve_device
from ..functional import conv_bias_act_backward, conv_bias_act_forward
from ..geometry import ConvGeometry, IntOrTuple, as_tuple, parse_layout
from .module import Layer, init_parameter


class _ConvNd(Layer):
    """The shared body of Conv1d/2d/3d; `_rank` is the number of spatial dims."""

    _rank = 0

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
    ) -> None:
        rank = self._rank
        for what, value in (("in_channels", in_channels), ("out_channels", out_channels),
                            ("groups", groups)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{what} must be a positive int, got {value!r}")
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"in_channels ({in_channels}) and out_channels ({out_channels}) must both be "
                f"divisible by groups ({groups})"
            )
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size = as_tuple(kernel_size, rank, "kernel_size")
        if any(k < 1 for k in self.kernel_size):
            raise ValueError(f"kernel_size must be >= 1, got {self.kernel_size}")
        self.stride = as_tuple(stride, rank, "stride")
        self.padding = padding if isinstance(padding, str) else as_tuple(padding, rank, "padding")
        self.dilation = as_tuple(dilation, rank, "dilation")
        self.activation = activations.normalize(activation)
        self.channels_last = parse_layout(layout, rank)
        self.layout = layout.upper()
        self.dtype = dtypes.canonical(dtype)
        self.device = resolve_device(device)
        self.residual_scale = 1.0
        self._geoms: dict[tuple[int, ...], ConvGeometry] = {}
        self._ctx = None

        # PyTorch's default: kaiming_uniform_(a=sqrt(5)) gives U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
        # and the bias uses the same bound.
        rng = np.random.default_rng(seed)
        fan_in = (in_channels // groups) * math.prod(self.kernel_size)
        bound = 1.0 / math.sqrt(fan_in)
        shape_cf = (out_channels, in_channels // groups, *self.kernel_size)
        w = rng.uniform(-bound, bound, size=shape_cf)
        if self.channels_last:
            w = np.ascontiguousarray(np.moveaxis(w, 1, -1))
        self.weight = init_parameter(w, self.dtype, self.device, "weight")
        b = rng.uniform(-bound, bound, out_channels)
        self.bias = init_parameter(b, self.dtype, self.device, "bias") if bias else None

    def _geometry(self, x: Any) -> ConvGeometry:
        geom = self._geoms.get(tuple(x.shape))
        if geom is None:
            if x.ndim != self._rank + 2:
                raise ValueError(
                    f"{type(self).__name__} expects a {self._rank + 2}-d input "
                    f"({self.layout}), got shape {tuple(x.shape)}"
                )
            geom = ConvGeometry.create(
                x.shape, self.weight.shape, self.stride, self.padding, self.dilation,
                self.groups, self.layout,
            )
            self._geoms[tuple(x.shape)] = geom
        return geom

    def __call__(self, x: Any, residual: Any = None) -> Any:
        self._check_input(x)
        if residual is not None:
            self._check_input(residual, "residual")
        if x.dtype != self.dtype:
            raise ValueError(
                f"{type(self).__name__} has dtype {self.dtype} but its input has dtype {x.dtype}; "
                f"cast the input (x.astype('{self.dtype}')) or build the layer with dtype={x.dtype}"
            )
        geom = self._geometry(x)
        bias = None if self.bias is None else self.bias.data
        y, self._ctx = conv_bias_act_forward(
            x, self.weight.data, bias, activation=self.activation, residual=residual,
            residual_scale=self.residual_scale, geom=geom,
        )
        return y

    forward = __call__

    def backward(self, dy: Any) -> Any:
        """dx (and dresidual when the forward took one); accumulates into .grad."""
        ctx = self._take_ctx()
        self._check_input(dy, "dy")
        try:
            grads = conv_bias_act_backward(
                dy, ctx, need_dx=self.needs_input_grad, dweight=self.weight.grad,
                dbias=None if self.bias is None else self.bias.grad, accumulate=True,
            )
        except Exception:
            self._ctx = ctx  # a rejected dy must not cost the user their forward
            raise
        return (grads.dx, grads.dresidual) if ctx.has_residual else grads.dx

    def _param_to_state(self, name: str, value: Any) -> Any:
        # channels-last stores (K, *kernel, C/groups); PyTorch's checkpoints hold (K, C/g, *k).
        if name == "weight" and self.channels_last:
            return value.transpose(0, value.ndim - 1, *range(1, value.ndim - 1))
        return value

    def _param_from_state(self, name: str, value: Any) -> Any:
        if name == "weight" and self.channels_last:
            return value.transpose(0, *range(2, value.ndim), 1)
        return value

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, "
            f"groups={self.groups}, bias={self.bias is not None}, "
            f"activation={self.activation!r}, layout={self.layout!r}, dtype={self.dtype}, "
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
