"""convfuse layers for the model zoos' own conv and batch-norm classes (timm's), which
`convert()` builds on the original module's Parameters and buffers.

Each computes what timm's class computes, with the same state-dict keys, and runs the
convolution or the batch norm through convfuse's fused op:
- `Conv2dSame`: TensorFlow's 'SAME' padding, worked out per input size and possibly one
  more at the end than at the start (timm's `pad_same`), then the convolution;
- `StdConv2d`: timm's StdConv2d, ScaledStdConv2d and their Same variants, the weight
  standardised by torch ops under autograd exactly as timm does it, then the convolution
  with that weight;
- `BatchNormAct2d`: timm's BatchNormAct2d, batch norm then its `drop` then its `act`
  submodules.
Nothing here imports timm.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .batchnorm import BatchNorm2d
from .conv import Conv2d


def _same_pad(size: int, k: int, s: int, d: int) -> int:
    """timm's get_same_padding, in integers: the total zero padding for 'SAME'."""
    return max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)


def pad_same(x: torch.Tensor, kernel_size: tuple[int, ...], stride: tuple[int, ...],
             dilation: tuple[int, ...]) -> torch.Tensor:
    """timm's pad_same: x zero-padded for 'SAME' on its last two dims, the odd one of each
    pair at the end (F.pad, so autograd carries the gradient back); x itself when no
    padding is needed."""
    ih, iw = x.shape[-2:]
    ph = _same_pad(ih, kernel_size[0], stride[0], dilation[0])
    pw = _same_pad(iw, kernel_size[1], stride[1], dilation[1])
    if not (ph or pw):
        return x
    return F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))


class Conv2dSame(Conv2d):
    """timm's Conv2dSame: the input padded as pad_same pads it, then the fused convolution
    (act(conv + bias + residual)) with no padding of its own."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        x = pad_same(x, self.kernel_size, self.stride, self.dilation)
        return self._conv_forward(x, self.weight, self.bias, residual)


class StdConv2d(Conv2d):
    """A weight-standardised Conv2d: timm's StdConv2d (`scale=None`, no gain), and
    ScaledStdConv2d (a `gain` Parameter of shape (out, 1, 1, 1), multiplied by `scale`);
    `same_pad=True` is their 'Same' variants' dynamic padding (pad_same). Each call
    standardises the weight per output channel with timm's own op (F.batch_norm in training
    mode with `eps`), so the gradient reaches weight and gain through autograd, and runs the
    fused convolution with it."""

    def __init__(self, *args: Any, eps: float = 1e-6, scale: float | None = None,
                 same_pad: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.eps, self.scale, self.same_pad = eps, scale, same_pad
        if scale is None:
            self.register_parameter("gain", None)
        else:
            self.gain = nn.Parameter(torch.ones(
                (self.out_channels, 1, 1, 1), device=self.weight.device,
                dtype=self.weight.dtype))

    def standardized_weight(self) -> torch.Tensor:
        """The weight as timm's forward computes it."""
        gain = None
        if self.gain is not None and self.scale is not None:
            gain = (self.gain * self.scale).view(-1)
        return F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None,
                            weight=gain, training=True, momentum=0.0,
                            eps=self.eps).reshape_as(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.same_pad:
            x = pad_same(x, self.kernel_size, self.stride, self.dilation)
        return self._conv_forward(x, self.standardized_weight(), self.bias, residual)

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", eps={self.eps}, scale={self.scale}, "
                f"same_pad={self.same_pad}")


class BatchNormAct2d(BatchNorm2d):
    """timm's BatchNormAct2d: act(drop(batchnorm(x) + residual)), with `drop` and `act` the
    submodules timm names so (state-dict keys included). convert() folds an activation
    convfuse has into the batch norm's `activation` when `drop` is nn.Identity, and leaves
    `act` an nn.Identity then (the way it folds an activation in nn.Sequential); any other
    drop or act runs after the fused batch norm, as in timm."""

    def __init__(self, *args: Any, drop: nn.Module | None = None, act: nn.Module | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drop = nn.Identity() if drop is None else drop
        self.act = nn.Identity() if act is None else act

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = super().forward(x, residual)
        drop, act = self._modules["drop"], self._modules["act"]
        if type(drop) is not nn.Identity:
            y = drop(y)  # type: ignore[misc]
        if type(act) is not nn.Identity:
            y = act(y)  # type: ignore[misc]
        return y
