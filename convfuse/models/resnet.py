"""ResNet-18/34 (torchvision's architecture and state_dict keys) and a small configurable ResNet.

`resnet18()` has exactly torchvision's parameters and buffers under exactly its keys
(conv1, bn1, layer1.0.conv1, ..., layer2.0.downsample.0/1, fc), in PyTorch's layouts, so
`model.load_state_dict({k: v.numpy() for k, v in tv_model.state_dict().items()})` loads
torchvision weights unchanged. What differs is only how it runs: each BatchNorm applies
its ReLU itself, and a block's `bn2` also adds the shortcut (Note [residual rides on the
last layer] in convfuse/nn/residual.py), so a BasicBlock is four fused calls and no
elementwise pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import dtypes
from ..backend import resolve_device, to_device
from ..nn.adaptive_pool import AdaptiveAvgPool2d
from ..nn.batchnorm import BatchNorm2d
from ..nn.container import Flatten, Sequential
from ..nn.conv import Conv2d, _ConvNd
from ..nn.fold import clone, fold_conv_bn, fold_layer, foldable
from ..nn.linear import Linear
from ..nn.module import Layer, forward_keeping_contexts
from ..nn.pooling import MaxPool2d
from ..nn.residual import ResidualBase, check_contexts
from ..nn.simple import Identity

STEMS = ("imagenet", "small")


class BasicBlock(ResidualBase):
    """torchvision's BasicBlock: relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)).

    conv1 is 3x3 with `stride`, conv2 3x3, both without bias; `downsample` (a Sequential of
    a 1x1/stride conv and a BatchNorm, or None for the identity) is the shortcut. bn1 applies
    the ReLU; bn2 takes the shortcut as `residual=` and applies the block's ReLU, fused.
    """

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: Layer | None = None, *, layout: str = "NCHW",
                 dtype: Any = "float32", device: str | None = None,
                 seed: int | None = None) -> None:
        device = resolve_device(device)
        rng = np.random.default_rng(seed)
        self.conv1 = _conv(inplanes, planes, 3, stride, 1, layout, dtype, device, rng)
        self.bn1 = BatchNorm2d(planes, activation="relu", layout=layout, dtype=dtype,
                               device=device)
        self.conv2 = _conv(planes, planes, 3, 1, 1, layout, dtype, device, rng)
        self.bn2 = BatchNorm2d(planes, activation="relu", layout=layout, dtype=dtype,
                               device=device)
        self.downsample = downsample
        self.stride = stride
        self.device = device
        self._ctx = None

    def _body_layers(self) -> list[Layer]:
        return [self.conv1, self.bn1, self.conv2, self.bn2]

    def _shortcut(self) -> Layer | None:
        return self.downsample


class ResNet(Layer):
    """A ResNet of BasicBlocks, keyed as torchvision's.

    `block_counts[i]` blocks of width `widths[i]` form stage `layer{i+1}`; every stage but
    the first halves the resolution in its first block (with a 1x1/2 conv + BatchNorm
    shortcut). `stem="imagenet"` is torchvision's 7x7/2 conv + BatchNorm + ReLU + 3x3/2
    max-pool; `stem="small"` is a 3x3/1 conv + BatchNorm + ReLU and no pool, for tiny images
    (8x8 digits, 32x32 CIFAR). Then a global average pool and the fully connected `fc`.

    `model(x)` returns logits; `model.backward(dlogits)` accumulates every gradient. The stem
    conv computes no input gradient (its input is data): `needs_input_grad` is False and
    backward returns None; set it True to get dx. Initialisation follows torchvision
    (kaiming normal, fan_out, for convs; BatchNorm weight 1, bias 0; PyTorch's Linear).
    """

    # _fold() swaps the stem for the fused conv and an Identity.
    conv1: _ConvNd
    bn1: BatchNorm2d | Identity

    def __init__(self, block_counts: Sequence[int], widths: Sequence[int] = (64, 128, 256, 512),
                 num_classes: int = 1000, in_channels: int = 3, stem: str = "imagenet",
                 layout: str = "NCHW", dtype: Any = "float32", device: str | None = None,
                 seed: int | None = None) -> None:
        counts, widths = _stage_spec(block_counts, widths)
        for what, v in (("num_classes", num_classes), ("in_channels", in_channels)):
            # NumPy ints as block_counts takes them (and torchvision's resnet18)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ResNet: {what} must be a positive int, got {v!r}")
        num_classes, in_channels = int(num_classes), int(in_channels)
        if stem not in STEMS:
            raise ValueError(f"ResNet: stem must be one of {STEMS}, got {stem!r}")
        if not isinstance(layout, str) or layout.upper() not in ("NCHW", "NHWC"):
            raise ValueError(f"ResNet: layout must be 'NCHW' or 'NHWC', got {layout!r}")
        layout = layout.upper()
        self.dtype = dtypes.canonical(dtype)
        self.device = resolve_device(device)
        self.layout, self.stem, self.num_classes = layout, stem, num_classes
        rng = np.random.default_rng(seed)
        kw: dict[str, Any] = {"layout": layout, "dtype": self.dtype, "device": self.device}
        if stem == "imagenet":
            self.conv1 = _conv(in_channels, widths[0], 7, 2, 3, layout, dtype, self.device, rng)
        else:
            self.conv1 = _conv(in_channels, widths[0], 3, 1, 1, layout, dtype, self.device, rng)
        self.bn1 = BatchNorm2d(widths[0], activation="relu", **kw)
        self.maxpool = MaxPool2d(3, 2, 1, layout=layout) if stem == "imagenet" else Identity()
        inplanes = widths[0]
        self._stages: list[str] = []
        for i, (count, planes) in enumerate(zip(counts, widths)):
            stride = 1 if i == 0 else 2
            blocks: list[Layer] = []
            for j in range(count):
                s = stride if j == 0 else 1
                down = None
                if s != 1 or inplanes != planes:
                    down = Sequential(
                        _conv(inplanes, planes, 1, s, 0, layout, dtype, self.device, rng),
                        BatchNorm2d(planes, **kw))
                blocks.append(BasicBlock(inplanes, planes, s, down,
                                         seed=int(rng.integers(2**31)), **kw))
                inplanes = planes
            name = f"layer{i + 1}"
            setattr(self, name, Sequential(*blocks))
            self._stages.append(name)
        self.avgpool = AdaptiveAvgPool2d(1, layout=layout)
        self.flatten = Flatten()
        self.fc = Linear(inplanes, num_classes, dtype=self.dtype, device=self.device,
                         seed=int(rng.integers(2**31)))
        self.conv1.needs_input_grad = False
        self._ctx = None

    @property
    def needs_input_grad(self) -> bool:
        return self.conv1.needs_input_grad

    @needs_input_grad.setter
    def needs_input_grad(self, value: bool) -> None:
        self.conv1.needs_input_grad = bool(value)

    def _chain(self) -> list[Layer]:
        return [self.conv1, self.bn1, self.maxpool, *(getattr(self, s) for s in self._stages),
                self.avgpool, self.flatten, self.fc]

    def __call__(self, x: Any) -> Any:
        return forward_keeping_contexts(self, self._forward, x)

    def _forward(self, x: Any) -> Any:
        self._check_input(x)
        if x.ndim != 4:
            raise ValueError(f"ResNet expects a 4-d input ({self.layout}), got shape "
                             f"{tuple(x.shape)}")
        for layer in self._chain():
            x = layer(x)
        self._ctx = (tuple(x.shape), x.dtype)
        return x

    forward = __call__

    def backward(self, dlogits: Any) -> Any:
        """Gradients of every parameter (accumulated); returns dx, or None while
        `needs_input_grad` is False (the default)."""
        ctx = self._check_backward()
        self._check_input(dlogits, "dlogits")
        if tuple(dlogits.shape) != ctx[0] or dlogits.dtype != ctx[1]:
            raise ValueError(
                f"ResNet: dlogits has shape {tuple(dlogits.shape)} and dtype "
                f"{dlogits.dtype}, but the logits had shape {ctx[0]} and dtype {ctx[1]}")
        self._ctx = None  # everything checkable was, before any layer runs
        g = dlogits
        for layer in reversed(self._chain()):
            g = layer.backward(g)
        return g

    def _check_backward(self) -> Any:
        """The model's context and every layer's below it."""
        ctx = self._peek_ctx()
        check_contexts(self)
        return ctx

    def _fold(self) -> ResNet:
        """The evaluation ResNet with stem conv + bn1 and every block folded
        (convfuse.nn.fold_batchnorm); bn1 becomes an Identity."""
        new = clone(self)
        if isinstance(self.bn1, BatchNorm2d) and foldable(self.conv1, self.bn1):
            new.conv1 = fold_conv_bn(self.conv1, self.bn1)
            new.bn1 = Identity()
        for name in self._stages:
            setattr(new, name, fold_layer(getattr(self, name)))
        new.eval()
        return new

    def extra_repr(self) -> str:
        return (f"stem={self.stem!r}, layout={self.layout!r}, dtype={self.dtype}, "
                f"device={self.device!r}")


def resnet18(num_classes: int = 1000, in_channels: int = 3, layout: str = "NCHW",
             dtype: Any = "float32", device: str | None = None,
             seed: int | None = None) -> ResNet:
    """torchvision's resnet18 (BasicBlocks 2-2-2-2, widths 64-512), same state_dict keys."""
    return ResNet((2, 2, 2, 2), (64, 128, 256, 512), num_classes, in_channels, "imagenet",
                  layout, dtype, device, seed)


def resnet34(num_classes: int = 1000, in_channels: int = 3, layout: str = "NCHW",
             dtype: Any = "float32", device: str | None = None,
             seed: int | None = None) -> ResNet:
    """torchvision's resnet34 (BasicBlocks 3-4-6-3, widths 64-512), same state_dict keys."""
    return ResNet((3, 4, 6, 3), (64, 128, 256, 512), num_classes, in_channels, "imagenet",
                  layout, dtype, device, seed)


def _stage_spec(block_counts: Any, widths: Any) -> tuple[list[int], list[int]]:
    try:
        counts, ws = list(block_counts), list(widths)
    except TypeError:
        raise TypeError("ResNet: block_counts and widths must be sequences of ints") from None
    if not counts or len(counts) != len(ws):
        raise ValueError(f"ResNet: block_counts ({counts}) and widths ({ws}) must be non-empty "
                         "and of the same length (one entry per stage)")
    for what, seq in (("block_counts", counts), ("widths", ws)):
        for v in seq:
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ResNet: {what} entries must be positive ints, got {seq}")
    return [int(c) for c in counts], [int(w) for w in ws]


def _conv(cin: int, cout: int, k: int, stride: int, pad: int, layout: str, dtype: Any,
          device: str, rng: np.random.Generator) -> Conv2d:
    """A bias-free conv with torchvision's init: kaiming_normal_(mode="fan_out", relu)."""
    conv = Conv2d(cin, cout, k, stride=stride, padding=pad, bias=False, layout=layout,
                  dtype=dtype, device=device, seed=0)
    std = math.sqrt(2.0 / (cout * k * k))
    w = rng.normal(0.0, std, size=(cout, cin, k, k))
    local = conv._param_from_state("weight", w)
    conv.weight.data[...] = to_device(np.ascontiguousarray(local).astype(conv.dtype), device)
    return conv
