"""One validated convolution geometry that answers every shape question.

Like NNlib's DenseConvDims: forward, data gradient and filter gradient all take the same
`ConvGeometry`, built once per (input shape, weight shape, hyperparameters, layout).
Shapes are stored as the user gives them (in `layout`); the `*_cf` properties give the
channels-first forms the reference engine and cuDNN's descriptors use.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

IntOrTuple = int | Sequence[int]

_INT32_MAX = 2**31 - 1

_LAYOUT_NAMES = {
    # name -> (channels_last, rank or None for "any rank")
    "NCHW": (False, None), "NHWC": (True, None),
    "NCW": (False, 1), "NWC": (True, 1),
    "NCDHW": (False, 3), "NDHWC": (True, 3),
}


def conv_output_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """PyTorch's and cuDNN's rule: floor((size + 2p - d(k-1) - 1) / s) + 1."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def parse_layout(layout: str, rank: int | None = None) -> bool:
    """True for channels-last. NCHW/NHWC name the two orders for every rank."""
    if not isinstance(layout, str) or layout.upper() not in _LAYOUT_NAMES:
        raise ValueError(f"unknown layout {layout!r}: expected one of {', '.join(_LAYOUT_NAMES)}")
    channels_last, fixed_rank = _LAYOUT_NAMES[layout.upper()]
    if rank is not None and fixed_rank is not None and fixed_rank != rank:
        raise ValueError(f"layout {layout!r} is for {fixed_rank}-d convolutions, not {rank}-d")
    return channels_last


def layout_name(channels_last: bool, rank: int) -> str:
    names = {1: ("NCW", "NWC"), 2: ("NCHW", "NHWC"), 3: ("NCDHW", "NDHWC")}
    return names[rank][int(channels_last)]


def as_tuple(value: IntOrTuple, rank: int, what: str, op: str = "convolution") -> tuple[int, ...]:
    """Expand an int to `rank` copies; check a sequence has `rank` integer entries."""
    if is_int(value):
        items: tuple = (value,) * rank
    elif isinstance(value, (tuple, list)):
        items = tuple(value)
    else:
        items = ()
    if len(items) != rank or not all(is_int(v) for v in items):
        raise ValueError(f"{what} must be an int or {rank} ints for a {rank}-d {op}, got {value!r}")
    return tuple(int(v) for v in items)


def is_int(v: object) -> bool:
    """A Python or NumPy integer, but not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def to_channels_first(shape: Sequence[int], channels_last: bool) -> tuple[int, ...]:
    s = tuple(shape)
    return (s[0], s[-1], *s[1:-1]) if channels_last else s


def from_channels_first(shape: Sequence[int], channels_last: bool) -> tuple[int, ...]:
    s = tuple(shape)
    return (s[0], *s[2:], s[1]) if channels_last else s


def resolve_padding(padding: IntOrTuple | str, kernel: Sequence[int], dilation: Sequence[int],
                    stride: Sequence[int]) -> tuple[int, ...]:
    """Accept ints and PyTorch's 'valid' and 'same' (symmetric padding only, as cuDNN's)."""
    rank = len(kernel)
    if isinstance(padding, str):
        if padding == "valid":
            return (0,) * rank
        if padding != "same":
            raise ValueError(
                f"padding must be an int, {rank} ints, 'valid' or 'same', got {padding!r}"
            )
        if any(s != 1 for s in stride):
            raise ValueError("padding='same' needs stride 1 (as in PyTorch)")
        totals = [d * (k - 1) for k, d in zip(kernel, dilation)]
        if any(t % 2 for t in totals):
            raise ValueError(
                "padding='same' would need asymmetric padding for kernel "
                f"{tuple(kernel)} with dilation {tuple(dilation)}; cuDNN pads symmetrically"
            )
        return tuple(t // 2 for t in totals)
    return as_tuple(padding, rank, "padding")


def same_padding(kernel: Sequence[int], dilation: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """PyTorch's padding='same': d*(k-1) zeros per dim, the odd one at the end (right/bottom)."""
    return tuple((d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2)
                 for k, d in zip(kernel, dilation))


def cached_hash(self: Any) -> int:
    """A frozen dataclass's field hash, computed once: a geometry's `__hash__` (a frozen
    dataclass generates its own unless the class body names one, so each assigns this)."""
    h = self.__dict__.get("_hash")
    if h is None:
        h = self.__dict__["_hash"] = hash(tuple(getattr(self, f.name) for f in fields(self)))
    return int(h)


class LayoutShapes:
    """Shape answers shared by ConvGeometry and PoolGeometry, which both hold the user's
    `input_shape` in their layout, `channels_last`, and define `rank` and `output_shape_cf`."""

    input_shape: tuple[int, ...]
    channels_last: bool

    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def output_shape_cf(self) -> tuple[int, ...]:
        raise NotImplementedError

    @functools.cached_property
    def layout(self) -> str:
        return layout_name(self.channels_last, self.rank)

    @property
    def batch(self) -> int:
        return self.input_shape[0]

    # Cached: geometries are immutable, and the ops ask these shapes many times per call.
    @functools.cached_property
    def input_shape_cf(self) -> tuple[int, ...]:
        return to_channels_first(self.input_shape, self.channels_last)

    @functools.cached_property
    def output_shape(self) -> tuple[int, ...]:
        return from_channels_first(self.output_shape_cf, self.channels_last)

    @property
    def channel_axis(self) -> int:
        """Axis of channels in input/output arrays of this layout."""
        return self.rank + 1 if self.channels_last else 1


def check_conv_ranks(x_shape: tuple[int, ...], w_shape: tuple[int, ...], weight_dims: str,
                     op: str) -> int:
    """The spatial rank of a (transposed) convolution of these input and weight shapes;
    ValueError unless the weight has 3 to 5 dims and the input as many. `weight_dims` names
    the weight's dims for the message."""
    if len(w_shape) not in (3, 4, 5):
        raise ValueError(
            f"weight must have 3, 4 or 5 dims ({weight_dims}), got shape {w_shape}")
    rank = len(w_shape) - 2
    if len(x_shape) != rank + 2:
        raise ValueError(
            f"input must have {rank + 2} dims for a {rank}-d {op} (weight {w_shape}), "
            f"got shape {x_shape}")
    return rank


class ConvShapes(LayoutShapes):
    """What ConvGeometry and ConvTransposeGeometry answer alike; each holds `weight_shape`
    in its layout, `stride`, `padding`, `dilation` and `groups`, and defines `out_channels`
    and `output_spatial`."""

    weight_shape: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    @property
    def out_channels(self) -> int:
        raise NotImplementedError

    @property
    def output_spatial(self) -> tuple[int, ...]:
        raise NotImplementedError

    def _check_window(self) -> None:
        """The checks both make after the input's: weight dims, stride, dilation, padding."""
        if any(d <= 0 for d in self.weight_shape):
            raise ValueError(f"weight shape {self.weight_shape} has a non-positive dimension")
        if any(s < 1 for s in self.stride):
            raise ValueError(f"stride must be >= 1, got {self.stride}")
        if any(d < 1 for d in self.dilation):
            raise ValueError(f"dilation must be >= 1, got {self.dilation}")
        if max(self.stride + self.dilation) > _INT32_MAX:  # cuDNN's descriptors take ints
            raise ValueError(f"stride and dilation must be < 2**31, got {self.stride}, "
                             f"{self.dilation}")
        if any(p < 0 for p in self.padding):
            raise ValueError(f"padding must be >= 0, got {self.padding}")

    @property
    def rank(self) -> int:
        return len(self.stride)

    @property
    def in_channels(self) -> int:
        return self.input_shape_cf[1]

    @property
    def kernel_size(self) -> tuple[int, ...]:
        return self.weight_shape_cf[2:]

    @functools.cached_property
    def weight_shape_cf(self) -> tuple[int, ...]:
        return to_channels_first(self.weight_shape, self.channels_last)

    @functools.cached_property
    def output_shape_cf(self) -> tuple[int, ...]:
        return (self.batch, self.out_channels, *self.output_spatial)

    @property
    def bias_shape(self) -> tuple[int, ...]:
        return (self.out_channels,)


@dataclass(frozen=True)
class ConvGeometry(ConvShapes):
    """A validated N-d convolution (N = 1, 2, 3). Build it with `ConvGeometry.create`."""

    input_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    channels_last: bool

    # Cached: every engine cache looks a geometry up by it, several times a call.
    __hash__ = cached_hash

    @classmethod
    def create(
        cls,
        input_shape: Sequence[int],
        weight_shape: Sequence[int],
        stride: IntOrTuple = 1,
        padding: IntOrTuple | str = 0,
        dilation: IntOrTuple = 1,
        groups: int = 1,
        layout: str = "NCHW",
    ) -> ConvGeometry:
        """Validate everything a convolution needs; ValueError names what is wrong."""
        x_shape, w_shape = tuple(int(d) for d in input_shape), tuple(int(d) for d in weight_shape)
        rank = check_conv_ranks(x_shape, w_shape, "out_channels, in_channels/groups, *kernel",
                                "convolution")
        channels_last = parse_layout(layout, rank)
        stride_t = as_tuple(stride, rank, "stride")
        dilation_t = as_tuple(dilation, rank, "dilation")
        w_cf = to_channels_first(w_shape, channels_last)
        pad_t = resolve_padding(padding, w_cf[2:], dilation_t, stride_t)
        # an integer (a torch SymInt or an integer tensor too: operator.index), never a
        # bool: int() would truncate 2.9 (also a float tensor's) or parse "2"
        try:
            if isinstance(groups, (bool, np.bool_)):
                raise TypeError
            groups = operator.index(groups)
        except TypeError:
            raise ValueError(f"groups must be an int, got {groups!r}") from None  # as_tuple's
        geom = cls(x_shape, w_shape, stride_t, pad_t, dilation_t, groups, channels_last)
        geom._validate()
        return geom

    def _validate(self) -> None:
        x, w = self.input_shape_cf, self.weight_shape_cf
        # An empty batch is allowed, as in torch.nn: the ops return empty outputs and zero
        # weight gradients without any engine call.
        if x[0] < 0 or any(v <= 0 for v in x[1:]):
            raise ValueError(f"input shape {self.input_shape} has a non-positive dimension")
        self._check_window()
        if self.groups < 1:
            raise ValueError(f"groups must be >= 1, got {self.groups}")
        if x[1] % self.groups:
            raise ValueError(f"in_channels ({x[1]}) must be divisible by groups ({self.groups})")
        if w[0] % self.groups:
            raise ValueError(f"out_channels ({w[0]}) must be divisible by groups ({self.groups})")
        if x[1] != w[1] * self.groups:
            raise ValueError(
                f"input channels must match the weight: {x[1]} vs. {w[1] * self.groups} "
                f"(weight has {w[1]} channels per group, groups={self.groups}; "
                f"layout {self.layout})"
            )
        for i, (n, k, p, d) in enumerate(zip(x[2:], w[2:], self.padding, self.dilation)):
            span = d * (k - 1) + 1
            if span > n + 2 * p:
                raise ValueError(
                    f"kernel larger than the padded input along spatial dim {i}: "
                    f"dilated kernel {span} (k={k}, dilation={d}) vs. padded size {n + 2 * p} "
                    f"(size {n}, padding {p})"
                )

    @property
    def out_channels(self) -> int:
        return self.weight_shape_cf[0]

    @functools.cached_property
    def output_spatial(self) -> tuple[int, ...]:
        return tuple(
            conv_output_size(n, k, s, p, d)
            for n, k, s, p, d in zip(
                self.input_shape_cf[2:], self.kernel_size, self.stride, self.padding, self.dilation
            )
        )

    @property
    def reduce_axes(self) -> tuple[int, ...]:
        """Axes a bias gradient sums over: all but the channel axis."""
        return tuple(a for a in range(self.rank + 2) if a != self.channel_axis)

    def flops(self) -> int:
        """Multiply-adds x 2 of the forward convolution."""
        n_out = 1
        for d in self.output_shape_cf:
            n_out *= d
        per_out = self.in_channels // self.groups
        for k in self.kernel_size:
            per_out *= k
        return 2 * n_out * per_out

    def describe(self) -> str:
        return (
            f"x{list(self.input_shape)} w{list(self.weight_shape)} {self.layout} "
            f"stride={list(self.stride)} padding={list(self.padding)} "
            f"dilation={list(self.dilation)} groups={self.groups}"
        )
