"""ConvTranspose1d, ConvTranspose2d, ConvTranspose3d: fused transposed convolution + bias +
activation (+ residual) layers, the decoder half of U-Nets and GAN generators.

Arguments are torch.nn.ConvTranspose*d's, in its order (`in_channels, out_channels,
kernel_size, stride, padding, output_padding, groups, bias, dilation, padding_mode, device,
dtype`); convfuse's additions (`activation`, `layout`, `seed`) are keyword-only. The call is
`layer(x, residual=None, output_size=None)`, output_size choosing among the output sizes a
stride allows, as in PyTorch: the spatial sizes, or a full shape in the layer's layout (a
channels-last skip connection's `skip.shape` is (N, *spatial, C)). `stride`, `padding`,
`output_padding`, `dilation`, `activation` and `residual_scale` may be assigned (validated,
and the per-shape geometry cache cleared); the others fix the weight's shape or storage and
are read-only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._memory import check_bytes, check_conv
from ..backend import resolve_device
from ..functional_transpose import (
    conv_transpose_bias_act_backward,
    conv_transpose_bias_act_forward,
    conv_transpose_bias_act_known,
)
from ..geometry import IntOrTuple, is_int
from ..transpose_geometry import ConvTransposeGeometry
from . import _hyper
from ._conv_base import _FusedConvLayer, assignable
from ._memo import checked_geometry, forget_geometries
from .module import USER_ERRORS, renamed


class _ConvTransposeNd(_FusedConvLayer):
    """The shared body of ConvTranspose1d/2d/3d; `_rank` is the number of spatial dims.

    The weight is PyTorch's (in, out/groups, *kernel) in NCHW layout and (in, *kernel,
    out/groups) in NHWC layout, the cuDNN filter format of the forward convolution this
    is the data gradient of; state_dict always holds PyTorch's order.
    """

    _stride: tuple[int, ...]
    _padding: tuple[int, ...]
    _output_padding: tuple[int, ...]
    _dilation: tuple[int, ...]
    _geometry_args = ("stride", "padding", "output_padding", "dilation")
    _forward_op = conv_transpose_bias_act_forward
    _backward_op = conv_transpose_bias_act_backward
    _known_op = conv_transpose_bias_act_known

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
        self._set_channels(in_channels, out_channels, groups)
        d = self.__dict__
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
        self._set_storage(layout, "float32" if dtype is None else dtype)
        self._set_geometry(stride, padding, output_padding, dilation)
        self.activation = activation
        self.device = resolve_device(device)
        self.residual_scale = 1.0
        # torch.nn's fan_in is weight.size(1) * prod(kernel) = out/groups * prod(kernel).
        self._init_parameters((self._in, self._out // self._groups, *self._kernel),
                              (self._out // self._groups) * math.prod(self._kernel), has_bias,
                              seed)

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
        forget_geometries(self)  # every remembered geometry was for the old values

    stride = assignable("stride")
    padding = assignable("padding")
    output_padding = assignable("output_padding")
    dilation = assignable("dilation")

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
            size: tuple[int, ...] | None = tuple(int(v) for v in output_size)
        else:
            size = None
        w_shape = tuple(self.weight.shape)

        def make() -> ConvTransposeGeometry:
            if x.ndim != self._rank + 2:
                raise ValueError(f"expects a {self._rank + 2}-d input ({self._layout}), got "
                                 f"shape {tuple(x.shape)}")
            geom = ConvTransposeGeometry.create(
                x.shape, w_shape, self._stride, self._padding, self._output_padding,
                self._dilation, self._groups, self._layout, size)
            check_bytes(geom.output_shape, self._dtype, self.device, "output")
            if geom.batch:
                check_conv(geom.conv, self._dtype, self.device)
            return geom

        # Note [geometry memos]: the weight's shape too, which may be swapped
        return checked_geometry(self, (tuple(x.shape), size, w_shape), make)

    def output_shape(self, input_shape: Sequence[int],
                     output_size: Sequence[int] | None = None) -> tuple[int, ...]:
        """The output's shape (in the layer's layout) for an input of `input_shape`."""
        name = type(self).__name__
        if isinstance(input_shape, (str, bytes)) or not isinstance(input_shape, Sequence) \
                or not all(is_int(v) for v in input_shape):
            raise TypeError(f"{name}.output_shape: input_shape must be a sequence of ints, "
                            f"got {input_shape!r}")
        if any(v < 0 for v in input_shape):
            raise ValueError(f"{name}.output_shape: input_shape must not be negative, got "
                             f"{tuple(input_shape)}")
        probe = np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), tuple(input_shape),
                                                (0,) * len(input_shape))
        try:
            return self._geometry(probe, output_size).output_shape
        except USER_ERRORS as exc:
            raise self._renamed(exc) from None

    def _geometry_kwargs(self, x: Any, output_size: Sequence[int] | None) -> dict[str, Any]:
        return {"geom": self._geometry(x, output_size)}

    def __call__(self, x: Any, residual: Any = None,
                 output_size: Sequence[int] | None = None) -> Any:
        """act(conv_transpose(x) + bias + residual_scale * residual). A non-C-contiguous x
        or residual is copied once into a contiguous array (the caller's is never modified)."""
        if isinstance(output_size, list):  # torch.nn's common spelling; a key needs a tuple
            output_size = tuple(output_size)
        if isinstance(output_size, tuple) and any(type(v) is not int for v in output_size):
            # 10.0 == 10 (and hashes alike): a float would hit an int's call key and skip
            # the check that refuses it; NumPy ints become ints
            if not all(is_int(v) for v in output_size):
                raise TypeError(f"{type(self).__name__}: output_size must be a sequence of "
                                f"ints or None, got {output_size!r}")
            output_size = tuple(int(v) for v in output_size)
        return self._apply(x, residual, output_size)

    forward = __call__

    def extra_repr(self) -> str:
        return (
            f"{self._in}, {self._out}, kernel_size={self._kernel}, stride={self._stride}, "
            f"padding={self._padding}, output_padding={self._output_padding}, "
            f"dilation={self._dilation}, groups={self._groups}, bias={self.bias is not None}, "
            f"{self._repr_tail()}"
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
