"""Conv1d, Conv2d, Conv3d as torch.nn.Modules running convfuse's fused convolution.

Parameters are created, named and initialised exactly as torch.nn.Conv{1,2,3}d's (same
shapes, same RNG draws in the same order), so state dicts are interchangeable and a seeded
construction gives the same numbers. `forward(x, residual=None)` is one call of the
`convfuse::conv_bias_act` custom op (see _ops.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .. import activations
from ..geometry import IntOrTuple, as_tuple, conv_output_size, resolve_padding
from . import _autocast, _ops  # noqa: F401  (_ops registers torch.ops.convfuse.*)
from ._arrays import SUPPORTED_DTYPES


class _ConvNd(nn.Module):
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
        device: Any = None,
        dtype: torch.dtype | None = None,
        padding_mode: str = "zeros",
    ) -> None:
        super().__init__()
        name, rank = type(self).__name__, self._rank
        for what, value in (("in_channels", in_channels), ("out_channels", out_channels),
                            ("groups", groups)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: {what} must be a positive int, got {value!r}")
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"{name}: in_channels ({in_channels}) and out_channels ({out_channels}) must "
                f"both be divisible by groups ({groups})"
            )
        if padding_mode != "zeros":
            raise ValueError(
                f"{name}: padding_mode={padding_mode!r} is not supported; convfuse pads with "
                "zeros (cuDNN's only padding). Keep torch.nn's layer for other padding modes."
            )
        factory = {"device": device, "dtype": dtype}
        wdtype = torch.empty(0, **factory).dtype
        if wdtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: dtype {wdtype} is not supported; convfuse computes in "
                            "float32, float64, float16 or bfloat16")
        try:
            self.kernel_size = as_tuple(kernel_size, rank, "kernel_size")
            self.stride = as_tuple(stride, rank, "stride")
            self.dilation = as_tuple(dilation, rank, "dilation")
            if any(v < 1 for v in (*self.kernel_size, *self.stride, *self.dilation)):
                raise ValueError(f"kernel_size, stride and dilation must be >= 1, got "
                                 f"{self.kernel_size}, {self.stride}, {self.dilation}")
            self.padding = resolve_padding(padding, self.kernel_size, self.dilation, self.stride)
            if any(p < 0 for p in self.padding):
                raise ValueError(f"padding must be >= 0, got {padding!r}")
            self.activation = activations.normalize(activation)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.padding_mode = padding_mode
        self.weight = nn.Parameter(
            torch.empty((out_channels, in_channels // groups, *self.kernel_size), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_channels, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torch.nn.Conv*d's initialisation, draw for draw."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = nn.init._calculate_fan_in_and_fan_out(self.weight)
            if fan_in != 0:
                bound = 1 / math.sqrt(fan_in)
                nn.init.uniform_(self.bias, -bound, bound)

    def _check(self, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        name, rank = type(self).__name__, self._rank
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != rank + 2:
            raise ValueError(f"{name}: expected a {rank + 2}-d input (N, C, ...), got shape "
                             f"{tuple(x.shape)}")
        if x.shape[1] != self.in_channels:
            raise ValueError(f"{name}: input has {x.shape[1]} channels, the layer expects "
                             f"{self.in_channels}")
        if x.dtype != self.weight.dtype and not _autocast.casts(x, self.weight):
            raise TypeError(f"{name}: input dtype {x.dtype} differs from the weight's "
                            f"{self.weight.dtype}")
        if x.device != self.weight.device:
            raise ValueError(f"{name}: input is on {x.device}, the weight on "
                             f"{self.weight.device}")
        if residual is None:
            return
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"{name}: residual must be a torch.Tensor or None, got "
                            f"{type(residual).__name__}")
        out = self.output_shape(x.shape)
        if tuple(residual.shape) != out:
            raise ValueError(f"{name}: residual has shape {tuple(residual.shape)}, the output "
                             f"has shape {out}")
        if residual.device != x.device or (residual.dtype != x.dtype
                                           and not _autocast.casts(x, residual)):
            raise TypeError(f"{name}: residual is {residual.dtype} on {residual.device}, the "
                            f"input {x.dtype} on {x.device}")

    def output_shape(self, input_shape: Any) -> tuple[int, ...]:
        spatial = tuple(
            conv_output_size(int(n), k, s, p, d) for n, k, s, p, d in
            zip(input_shape[2:], self.kernel_size, self.stride, self.padding, self.dilation))
        return (int(input_shape[0]), self.out_channels, *spatial)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """act(conv(x) + bias + residual), fused (one convfuse op; one cuDNN call for
        identity and relu on the GPU)."""
        self._check(x, residual)
        y, _ = torch.ops.convfuse.conv_bias_act(
            x, self.weight, self.bias, residual, list(self.stride), list(self.padding),
            list(self.dilation), self.groups, self.activation)
        return y

    def extra_repr(self) -> str:
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
             f"stride={self.stride}")
        if any(self.padding):
            s += f", padding={self.padding}"
        if any(d != 1 for d in self.dilation):
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        return s + f", activation={self.activation!r}"


class Conv1d(_ConvNd):
    """torch.nn.Conv1d + fused bias, activation and residual; input (N, C, L)."""

    _rank = 1


class Conv2d(_ConvNd):
    """torch.nn.Conv2d + fused bias, activation and residual; input (N, C, H, W), contiguous
    or channels_last (which runs convfuse's NHWC layout with no copy)."""

    _rank = 2


class Conv3d(_ConvNd):
    """torch.nn.Conv3d + fused bias, activation and residual; input (N, C, D, H, W)."""

    _rank = 3
