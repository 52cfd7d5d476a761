"""The geometry of a transposed convolution, and the forward convolution it is the
data gradient of.

Note [transposed convolution as a swapped convolution]
ConvTranspose(x, w) with stride s, padding p, dilation d and groups g is the data gradient
of the forward convolution G that maps an array shaped like its output y back to x's shape,
with the same weight, stride, padding, dilation and groups. So every cuDNN call of a
transposed convolution is one of G's calls with the roles of x and y swapped:
- forward:          y  = convolutionBackwardData(G, dy=x, w)
- data gradient:    dx = convolutionForward(G, x=dy, w)
- filter gradient:  dw = convolutionBackwardFilter(G, x=dy, dy=x)
and G's ConvPlan (descriptors, algorithms, workspace, fallbacks) is the transposed plan
(convfuse/plan/conv_transpose.py). The weight is PyTorch's (in, out/groups, *kernel), which
is exactly G's (K, C/groups, *kernel) with K = in: no copy, no flip.

output_padding adds rows at the high end of each spatial dim (PyTorch crops `padding` rows
from the low end and `padding - output_padding` from the high end of the full transposed
output). G maps n output rows to floor((n - core) / s) + in rows, core being the size
without output_padding, so G describes outputs up to core + s - 1: an output_padding below
the stride is G's own output. PyTorch also accepts an output_padding below the dilation but
not below the stride. Along such a dim cuDNN cannot crop asymmetrically, so G pads
symmetrically by max(0, padding - output_padding), a larger output, and the ops take the
window the transposed convolution wants from it (rows past its end are zeros) and, going
back, place the output gradient into a zero array of G's size: one copy each way, in that
rare case only (`windowed`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .geometry import (
    ConvGeometry,
    ConvShapes,
    IntOrTuple,
    as_tuple,
    cached_hash,
    check_conv_ranks,
    from_channels_first,
    is_int,
    parse_layout,
    to_channels_first,
)


def transpose_output_size(size: int, kernel: int, stride: int, padding: int, dilation: int,
                          output_padding: int) -> int:
    """PyTorch's rule: (size - 1) * s - 2p + d(k - 1) + output_padding + 1."""
    return (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1


def output_padding_for(input_spatial: Sequence[int], output_size: Sequence[int],
                       stride: Sequence[int], padding: Sequence[int], kernel: Sequence[int],
                       dilation: Sequence[int], non_spatial: int = 2) -> tuple[int, ...]:
    """The output_padding that gives `output_size` (torch.nn's `_output_padding`).

    `output_size` may name only the spatial sizes or also the `non_spatial` leading ones
    (batch and channels, or channels only for an unbatched input), as in PyTorch.
    """
    rank = len(kernel)
    if isinstance(output_size, (str, bytes)) or not isinstance(output_size, Sequence):
        raise TypeError(f"output_size must be a sequence of ints, got "
                        f"{type(output_size).__name__} {output_size!r}")
    sizes = list(output_size)
    if len(sizes) == non_spatial + rank:
        sizes = sizes[non_spatial:]
    if len(sizes) != rank or not all(is_int(v) for v in sizes):
        raise ValueError(f"output_size must have {rank} or {non_spatial + rank} ints for a "
                         f"{rank}-d transposed convolution, got {tuple(output_size)!r}")
    lows = [transpose_output_size(n, k, s, p, d, 0)
            for n, k, s, p, d in zip(input_spatial, kernel, stride, padding, dilation)]
    highs = [lo + s - 1 for lo, s in zip(lows, stride)]
    if any(not lo <= int(v) <= hi for v, lo, hi in zip(sizes, lows, highs)):
        raise ValueError(f"requested an output size of {tuple(int(v) for v in sizes)}, but "
                         f"valid sizes range from {tuple(lows)} to {tuple(highs)} (for an "
                         f"input of {tuple(input_spatial)})")
    return tuple(int(v) - lo for v, lo in zip(sizes, lows))


@dataclass(frozen=True)
class ConvTransposeGeometry(ConvShapes):
    """A validated N-d transposed convolution (N = 1, 2, 3); build it with `create`.

    `weight_shape` is as stored: (in, out/groups, *kernel) channels-first, and
    (in, *kernel, out/groups) channels-last (cuDNN's NHWC filter format for G).
    """

    input_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    output_padding: tuple[int, ...]
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
        padding: IntOrTuple = 0,
        output_padding: IntOrTuple = 0,
        dilation: IntOrTuple = 1,
        groups: int = 1,
        layout: str = "NCHW",
        output_size: Sequence[int] | None = None,
    ) -> ConvTransposeGeometry:
        """Validate everything; ValueError names what is wrong. `output_size` (spatial, or
        a full shape in `layout`'s order) replaces output_padding as in PyTorch."""
        x_shape = tuple(int(v) for v in input_shape)
        w_shape = tuple(int(v) for v in weight_shape)
        rank = check_conv_ranks(x_shape, w_shape, "in_channels, out_channels/groups, *kernel",
                                "transposed convolution")
        channels_last = parse_layout(layout, rank)
        if isinstance(padding, str):
            raise ValueError(f"padding must be an int or {rank} ints for a transposed "
                             f"convolution (PyTorch has no {padding!r} here), got {padding!r}")
        op = "transposed convolution"
        stride_t = as_tuple(stride, rank, "stride", op)
        pad_t = as_tuple(padding, rank, "padding", op)
        dil_t = as_tuple(dilation, rank, "dilation", op)
        if not is_int(groups):
            raise ValueError(f"groups must be an int, got {groups!r}")
        if output_size is not None:
            kernel = to_channels_first(w_shape, channels_last)[2:]
            spatial = to_channels_first(x_shape, channels_last)[2:]
            for name, t in (("stride", stride_t), ("dilation", dil_t)):
                if any(v < 1 for v in t):
                    raise ValueError(f"{name} must be >= 1, got {t}")
            if (channels_last and isinstance(output_size, Sequence)
                    and not isinstance(output_size, (str, bytes))
                    and len(output_size) == rank + 2):
                # a full shape is in the layer's layout: a skip connection's shape, the
                # U-Net idiom `up(x, output_size=skip.shape)`, is (N, *spatial, C)
                output_size = to_channels_first(output_size, True)
            opad_t = output_padding_for(spatial, output_size, stride_t, pad_t, kernel, dil_t)
        else:
            opad_t = as_tuple(output_padding, rank, "output_padding", op)
        geom = cls(x_shape, w_shape, stride_t, pad_t, opad_t, dil_t, int(groups), channels_last)
        geom._validate()
        return geom

    def _validate(self) -> None:
        x, w = self.input_shape_cf, self.weight_shape_cf
        # An empty batch is allowed, as in torch.nn: the ops return empty outputs and zero
        # weight gradients without any engine call (`conv` needs a batch).
        if self.input_shape[0] < 0 or any(v <= 0 for v in x[1:]):
            raise ValueError(f"input shape {self.input_shape} has a non-positive dimension")
        self._check_window()
        if any(p < 0 for p in self.output_padding):
            raise ValueError(f"output_padding must be >= 0, got {self.output_padding}")
        if self.groups < 1:
            raise ValueError(f"groups must be >= 1, got {self.groups}")
        for op, s, d in zip(self.output_padding, self.stride, self.dilation):
            if op >= s and op >= d:  # PyTorch's rule
                raise ValueError(
                    f"output_padding must be smaller than either stride or dilation, got "
                    f"output_padding={self.output_padding}, stride={self.stride}, "
                    f"dilation={self.dilation}")
        if w[0] % self.groups:
            raise ValueError(f"in_channels ({w[0]}) must be divisible by groups ({self.groups})")
        if x[1] != w[0]:
            raise ValueError(
                f"input channels must match the weight: {x[1]} vs. {w[0]} (weight "
                f"(in_channels, out_channels/groups, *kernel) = {w}; layout {self.layout})")
        if any(n < 1 for n in self.output_spatial):
            raise ValueError(
                f"the output would be empty: input spatial size {x[2:]} gives output size "
                f"{self.output_spatial} with kernel {self.kernel_size}, stride {self.stride}, "
                f"padding {self.padding}, dilation {self.dilation}, output_padding "
                f"{self.output_padding}")

    @property
    def out_channels(self) -> int:
        return self.weight_shape_cf[1] * self.groups

    @functools.cached_property
    def output_spatial(self) -> tuple[int, ...]:
        return tuple(
            transpose_output_size(n, k, s, p, d, op) for n, k, s, p, d, op in zip(
                self.input_shape_cf[2:], self.kernel_size, self.stride, self.padding,
                self.dilation, self.output_padding))

    @functools.cached_property
    def _window(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(G's padding, G's output sizes, offset of this output inside G's) per dim."""
        pads, sizes, offsets = [], [], []
        for n, k, s, p, d, op, out in zip(
                self.input_shape_cf[2:], self.kernel_size, self.stride, self.padding,
                self.dilation, self.output_padding, self.output_spatial):
            q = p if op < s else max(0, p - op)
            pads.append(q)
            # op < s: G's own output, core + op rows with op <= s - 1
            sizes.append(out if op < s else transpose_output_size(n, k, s, q, d, 0))
            offsets.append(p - q)
        return tuple(pads), tuple(sizes), tuple(offsets)

    @functools.cached_property
    def windowed(self) -> bool:
        """Whether G's output differs from this one's (Note [transposed convolution as a
        swapped convolution]); only with an output_padding >= stride."""
        return any(op >= s for op, s in zip(self.output_padding, self.stride))

    @functools.cached_property
    def conv(self) -> ConvGeometry:
        """The forward convolution G whose data gradient this is (same weight array)."""
        pads, sizes, _ = self._window
        y_shape = from_channels_first((self.batch, self.out_channels, *sizes),
                                      self.channels_last)
        geom = ConvGeometry.create(y_shape, self.weight_shape, self.stride, pads,
                                   self.dilation, self.groups, self.layout)
        if geom.output_shape != self.input_shape:  # pragma: no cover - an internal invariant
            raise RuntimeError(f"internal error: G of {self.describe()} maps back to "
                               f"{geom.output_shape}, not the input shape")
        return geom

    def _slices(self, spatial: Sequence[slice]) -> tuple[slice, ...]:
        if self.channels_last:
            return (slice(None), *spatial, slice(None))
        return (slice(None), slice(None), *spatial)

    @functools.cached_property
    def window_slices(self) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
        """(part of this output, the same part of G's output) that G computes."""
        _, sizes, offsets = self._window
        mine, theirs = [], []
        for out, g, off in zip(self.output_spatial, sizes, offsets):
            m = min(out, g - off)
            mine.append(slice(0, m))
            theirs.append(slice(off, off + m))
        return self._slices(mine), self._slices(theirs)

    def from_conv_output(self, g_out: Any, xp: Any) -> Any:
        """This output from G's (the array itself unless `windowed`)."""
        if not self.windowed:
            return g_out
        y = xp.zeros(self.output_shape, g_out.dtype)
        mine, theirs = self.window_slices
        y[mine] = g_out[theirs]
        return y

    def to_conv_output(self, dy: Any, xp: Any) -> Any:
        """An output gradient as G's output gradient (dy itself unless `windowed`)."""
        if not self.windowed:
            return dy
        g = xp.zeros(self.conv.input_shape, dy.dtype)
        mine, theirs = self.window_slices
        g[theirs] = dy[mine]
        return g

    @functools.cached_property
    def epilogue(self) -> ConvGeometry:
        """A geometry whose output is this one's output: a depthwise 1x1 convolution of it.

        convfuse's bias + activation pass and its activation-backward + bias-gradient
        kernel take a ConvGeometry and use only its output shape and layout; this one has
        exactly this transposed convolution's output shape and channels.
        """
        c = self.out_channels
        w = (c, *([1] * (self.rank + 1)))
        return ConvGeometry.create(self.output_shape, w, 1, 0, 1, c, self.layout)

    def flops(self) -> int:
        """Multiply-adds x 2 (that of G's forward)."""
        return self.conv.flops()

    def describe(self) -> str:
        return (
            f"transposed x{list(self.input_shape)} w{list(self.weight_shape)} {self.layout} "
            f"stride={list(self.stride)} padding={list(self.padding)} "
            f"output_padding={list(self.output_padding)} dilation={list(self.dilation)} "
            f"groups={self.groups}"
        )
