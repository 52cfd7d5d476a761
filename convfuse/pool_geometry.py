"""One validated pooling geometry (max or average), the pooling twin of `ConvGeometry`.

Rules follow PyTorch's MaxPool/AvgPool with `ceil_mode=False` and cuDNN's pooling
descriptor, which agree:
- output size floor((n + 2p - k) / s) + 1, so every window starts inside the padded input;
- padding at most half the kernel (p <= k // 2), so every window holds a real element;
- average pooling divides by the full window, padding included (PyTorch's
  `count_include_pad=True`, cuDNN's `CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING`);
- max pooling never picks padding (it behaves as -inf).
The rank (1, 2 or 3) comes from the input's number of dims; `layout` is NCHW (channels
first) or NHWC (channels last) for every rank, or a rank-specific name such as NCW/NDHWC.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .geometry import (
    IntOrTuple,
    LayoutShapes,
    as_tuple,
    is_int,
    parse_layout,
)

POOL_MODES = ("max", "avg")


def pool_output_size(size: int, kernel: int, stride: int, padding: int) -> int:
    """PyTorch's (ceil_mode=False) and cuDNN's rule: floor((n + 2p - k) / s) + 1."""
    return (size + 2 * padding - kernel) // stride + 1


@dataclass(frozen=True)
class PoolGeometry(LayoutShapes):
    """A validated N-d pooling (N = 1, 2, 3). Build it with `PoolGeometry.create`."""

    input_shape: tuple[int, ...]
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    mode: str
    channels_last: bool

    @classmethod
    def create(
        cls,
        input_shape: Sequence[int],
        kernel_size: IntOrTuple,
        stride: IntOrTuple | None = None,
        padding: IntOrTuple = 0,
        mode: str = "max",
        layout: str = "NCHW",
    ) -> PoolGeometry:
        """Validate a pooling; stride defaults to the kernel size (as in PyTorch)."""
        if isinstance(input_shape, (str, bytes)) or not isinstance(input_shape, Sequence):
            raise TypeError(f"input_shape must be a sequence of ints, got {input_shape!r}")
        if not all(is_int(d) for d in input_shape):
            raise TypeError(f"input_shape must hold ints, got {tuple(input_shape)!r}")
        shape = tuple(int(d) for d in input_shape)
        if len(shape) not in (3, 4, 5):
            raise ValueError(
                f"pooling input must have 3, 4 or 5 dims (batch, channels and 1-3 spatial), "
                f"got shape {shape}"
            )
        rank = len(shape) - 2
        channels_last = parse_layout(layout, rank)
        kernel = as_tuple(kernel_size, rank, "kernel_size", "pooling")
        stride_t = kernel if stride is None else as_tuple(stride, rank, "stride", "pooling")
        pad = as_tuple(padding, rank, "padding", "pooling")
        if not isinstance(mode, str) or mode.lower() not in POOL_MODES:
            raise ValueError(f"pooling mode must be one of {', '.join(POOL_MODES)}, got {mode!r}")
        geom = cls(shape, kernel, stride_t, pad, mode.lower(), channels_last)
        geom._validate()
        return geom

    def _validate(self) -> None:
        # an empty batch is allowed, as in torch.nn: the ops return it without an engine call
        x = self.input_shape_cf
        if x[0] < 0 or any(d <= 0 for d in x[1:]):
            raise ValueError(f"input shape {self.input_shape} has a non-positive dimension")
        if any(k < 1 for k in self.kernel_size):
            raise ValueError(f"kernel_size must be >= 1, got {self.kernel_size}")
        if any(s < 1 for s in self.stride):
            raise ValueError(f"stride must be >= 1, got {self.stride}")
        if any(p < 0 for p in self.padding):
            raise ValueError(f"padding must be >= 0, got {self.padding}")
        sizes = self.input_shape_cf[2:]
        for i, (n, k, p) in enumerate(zip(sizes, self.kernel_size, self.padding, strict=True)):
            if p > k // 2:
                raise ValueError(
                    f"padding must be at most half the kernel along spatial dim {i} "
                    f"(as in PyTorch): padding {p} vs. kernel {k}"
                )
            if k > n + 2 * p:
                raise ValueError(
                    f"kernel larger than the padded input along spatial dim {i}: "
                    f"kernel {k} vs. padded size {n + 2 * p} (size {n}, padding {p})"
                )

    @property
    def rank(self) -> int:
        return len(self.kernel_size)

    @property
    def channels(self) -> int:
        return self.input_shape_cf[1]

    @property
    def window_size(self) -> int:
        """Elements per window, padding included: the divisor of average pooling."""
        size = 1
        for k in self.kernel_size:
            size *= k
        return size

    @property
    def output_spatial(self) -> tuple[int, ...]:
        return tuple(
            pool_output_size(n, k, s, p)
            for n, k, s, p in zip(
                self.input_shape_cf[2:], self.kernel_size, self.stride, self.padding, strict=True
            )
        )

    @property
    def output_shape_cf(self) -> tuple[int, ...]:
        return (self.batch, self.channels, *self.output_spatial)

    def describe(self) -> str:
        return (
            f"{self.mode}-pool x{list(self.input_shape)} {self.layout} "
            f"kernel={list(self.kernel_size)} stride={list(self.stride)} "
            f"padding={list(self.padding)}"
        )
