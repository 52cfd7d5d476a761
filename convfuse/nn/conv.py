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

from .._memory import check_conv
from ..backend import resolve_device
from ..functional import conv_bias_act_backward, conv_bias_act_forward, conv_bias_act_known
from ..geometry import ConvGeometry, IntOrTuple
from ..pad_geometry import PadGeometry, padded_conv
from . import _hyper
from ._conv_base import _FusedConvLayer, assignable
from ._memo import checked_geometry, forget_geometries
from .module import USER_ERRORS, renamed


class _ConvNd(_FusedConvLayer):
    """The shared body of Conv1d/2d/3d; `_rank` is the number of spatial dims.

    The weight is stored (K, C/groups, *kernel) in NCHW layout and (K, *kernel, C/groups)
    in NHWC layout (state_dict always holds PyTorch's (K, C/groups, *kernel)).
    """

    _stride: tuple[int, ...]
    _padding: tuple[int, ...] | str
    _padding_mode: str
    _dilation: tuple[int, ...]
    _geometry_args = ("stride", "padding", "dilation", "padding_mode")
    _forward_op = conv_bias_act_forward
    _backward_op = conv_bias_act_backward
    _known_op = conv_bias_act_known

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
        self._set_channels(in_channels, out_channels, groups)
        d = self.__dict__
        if d["_in"] % d["_groups"] or d["_out"] % d["_groups"]:
            raise ValueError(
                f"in_channels ({d['_in']}) and out_channels ({d['_out']}) must both be "
                f"divisible by groups ({d['_groups']})"
            )
        d["_kernel"] = _hyper.int_tuple(kernel_size, rank, "kernel_size", 1)
        has_bias = _hyper.flag(bias, "bias")
        self._set_storage(layout, dtype)
        self._set_geometry(stride, padding, dilation, padding_mode)
        self.activation = activation
        self.device = resolve_device(device)
        self.residual_scale = 1.0
        self._init_parameters((self._out, self._in // self._groups, *self._kernel),
                              (self._in // self._groups) * math.prod(self._kernel), has_bias,
                              seed)

    # -- hyperparameters -----------------------------------------------------------------
    def _set_geometry(self, stride: Any, padding: Any, dilation: Any, padding_mode: Any) -> None:
        rank = self._rank
        s = _hyper.int_tuple(stride, rank, "stride", 1)
        dl = _hyper.int_tuple(dilation, rank, "dilation", 1)
        p = _hyper.padding(padding, rank, self._kernel, s, dl)
        mode = _hyper.padding_mode(padding_mode)
        d = self.__dict__
        d["_stride"], d["_padding"], d["_dilation"], d["_padding_mode"] = s, p, dl, mode
        forget_geometries(self)  # every remembered geometry was for the old values

    stride = assignable("stride")
    padding = assignable("padding")
    dilation = assignable("dilation")
    padding_mode = assignable("padding_mode", "torch.nn's padding_mode; validated on assignment.")

    # -- calls ---------------------------------------------------------------------------
    def _geometry(self, x: Any) -> tuple[PadGeometry | None, ConvGeometry]:
        """(explicit padding or None, the convolution), validated once per input shape:
        a padding the input cannot take (reflect needs padding < size) raises here, before
        any engine runs."""
        w_shape = tuple(self.weight.shape)

        def make() -> tuple[PadGeometry | None, ConvGeometry]:
            if x.ndim != self._rank + 2:
                raise ValueError(
                    f"expects a {self._rank + 2}-d input ({self._layout}), got shape "
                    f"{tuple(x.shape)}"
                )
            found = padded_conv(
                x.shape, w_shape, self._stride, self._padding, self._dilation,
                self._groups, self._layout, self._padding_mode,
            )
            check_conv(found[1], self._dtype, self.device)
            return found

        # Note [geometry memos]: the weight's shape too, which may be swapped
        return checked_geometry(self, (tuple(x.shape), w_shape), make)

    def _geometry_kwargs(self, x: Any) -> dict[str, Any]:
        pad, geom = self._geometry(x)
        return {"geom": geom, "pad": pad}

    def __call__(self, x: Any, residual: Any = None) -> Any:
        """act(conv(x) + bias + residual_scale * residual). A non-C-contiguous x or residual
        is copied once into a contiguous array (the caller's is never modified)."""
        return self._apply(x, residual)

    forward = __call__

    def extra_repr(self) -> str:
        # like torch.nn's, padding_mode shows only when it is not the default
        mode = f"padding_mode={self._padding_mode!r}, " if self._padding_mode != "zeros" else ""
        return (
            f"{self._in}, {self._out}, kernel_size={self._kernel}, "
            f"stride={self._stride}, padding={self._padding}, dilation={self._dilation}, "
            f"groups={self._groups}, bias={self.bias is not None}, {mode}{self._repr_tail()}"
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
