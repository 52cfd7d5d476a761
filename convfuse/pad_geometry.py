"""One validated explicit padding: torch.nn's Conv `padding_mode`s, and the extra end zero
of an asymmetric padding='same'.

A convolution whose padding cuDNN cannot express (it pads symmetrically with zeros) pads
its input with `convfuse.ops.pad_forward` first and convolves the padded input;
`pad_backward` folds the padded input's gradient back (Note [pad backward]). Pads are
(begin, end) pairs per spatial dim, in the spatial order of the input's layout. Modes,
with the rules torch.nn.functional.pad enforces:
- zeros: zeros (torch's 'constant' with value 0); any pad;
- reflect: mirrored, the edge not repeated (x[1], x[0], x[1], ...): pad < size;
- replicate: the edge repeated; any pad;
- circular: wrapped (x[n-1], x[0], ..., x[n-1], x[0]): pad <= size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .geometry import (
    ConvGeometry,
    IntOrTuple,
    LayoutShapes,
    as_tuple,
    is_int,
    parse_layout,
    resolve_padding,
    same_padding,
    to_channels_first,
)

#: torch.nn's Conv padding modes; the first is what cuDNN's own (symmetric) padding does.
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def split_padding(padding: IntOrTuple | str, padding_mode: str, kernel: Sequence[int],
                  dilation: Sequence[int], stride: Sequence[int]
                  ) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """(explicit (begin, end) pads per spatial dim, the convolution's symmetric padding).

    Like torch.nn's Conv: a mode other than 'zeros' pads explicitly by its
    `_reversed_padding_repeated_twice` ('same' included) and convolves with no padding;
    'zeros' leaves symmetric padding to cuDNN and pads explicitly only the extra end zero
    an asymmetric 'same' needs (an even kernel, or an odd dilation * (kernel - 1)).
    """
    if not isinstance(padding_mode, str):
        raise TypeError(f"padding_mode must be a str, got {type(padding_mode).__name__} "
                        f"{padding_mode!r}")
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode must be one of {', '.join(map(repr, PADDING_MODES))}, "
                         f"got {padding_mode!r}")
    rank = len(kernel)
    if padding == "same":
        if any(s != 1 for s in stride):
            raise ValueError("padding='same' needs stride 1 (as in PyTorch)")
        pairs = same_padding(kernel, dilation)
    else:
        pairs = tuple((p, p) for p in resolve_padding(padding, kernel, dilation, stride))
    if padding_mode != "zeros":
        return pairs, (0,) * rank
    return tuple((0, hi - lo) for lo, hi in pairs), tuple(lo for lo, _ in pairs)


@dataclass(frozen=True)
class PadGeometry(LayoutShapes):
    """A validated explicit padding of an N-d input (N = 1, 2, 3). Build it with `create`."""

    input_shape: tuple[int, ...]
    pads: tuple[tuple[int, int], ...]
    mode: str
    channels_last: bool

    @classmethod
    def create(cls, input_shape: Sequence[int], pads: Sequence[Sequence[int]],
               mode: str = "zeros", layout: str = "NCHW") -> PadGeometry:
        """Validate; ValueError names the mode, the dim and both numbers."""
        if isinstance(input_shape, (str, bytes)) or not isinstance(input_shape, Sequence) \
                or not all(is_int(d) for d in input_shape):
            raise TypeError(f"input_shape must be a sequence of ints, got {input_shape!r}")
        shape = tuple(int(d) for d in input_shape)
        if len(shape) not in (3, 4, 5):
            raise ValueError(f"padded input must have 3, 4 or 5 dims (batch, channels and 1-3 "
                             f"spatial), got shape {shape}")
        rank = len(shape) - 2
        channels_last = parse_layout(layout, rank)
        if not isinstance(mode, str) or mode not in PADDING_MODES:
            raise ValueError(f"padding_mode must be one of {', '.join(map(repr, PADDING_MODES))}"
                             f", got {mode!r}")
        pairs = tuple(tuple(p) for p in pads) if isinstance(pads, (tuple, list)) else ()
        if len(pairs) != rank or not all(len(p) == 2 and all(is_int(v) for v in p)
                                         for p in pairs):
            raise ValueError(f"pads must be {rank} (begin, end) pairs of ints, got {pads!r}")
        geom = cls(shape, tuple((int(a), int(b)) for a, b in pairs), mode, channels_last)
        geom._validate()
        return geom

    def _validate(self) -> None:
        if any(d < 0 for d in self.input_shape):
            raise ValueError(f"input shape {self.input_shape} has a negative dimension")
        for i, ((lo, hi), n) in enumerate(zip(self.pads, self.spatial)):
            if lo < 0 or hi < 0:
                raise ValueError(f"padding must be >= 0, got {(lo, hi)} along spatial dim {i}")
            if n < 1:
                raise ValueError(f"input shape {self.input_shape} has an empty spatial dim {i}")
            big = max(lo, hi)
            if self.mode == "reflect" and big >= n:
                raise ValueError(
                    f"padding_mode='reflect' needs padding < input size along each spatial "
                    f"dim: padding {big} vs. size {n} along spatial dim {i} "
                    f"(input shape {self.input_shape}, {self.layout})"
                )
            if self.mode == "circular" and big > n:
                raise ValueError(
                    f"padding_mode='circular' needs padding <= input size along each spatial "
                    f"dim (it wraps around once): padding {big} vs. size {n} along spatial "
                    f"dim {i} (input shape {self.input_shape}, {self.layout})"
                )

    @property
    def rank(self) -> int:
        return len(self.pads)

    @property
    def spatial(self) -> tuple[int, ...]:
        return self.input_shape_cf[2:]

    @property
    def spatial_axes(self) -> tuple[int, ...]:
        """Axes of the spatial dims in input/output arrays of this layout."""
        first = 1 if self.channels_last else 2
        return tuple(range(first, first + self.rank))

    @property
    def output_shape_cf(self) -> tuple[int, ...]:
        s = self.input_shape_cf
        return (s[0], s[1], *(n + lo + hi for n, (lo, hi) in zip(s[2:], self.pads)))

    @property
    def is_identity(self) -> bool:
        return all(p == (0, 0) for p in self.pads)

    def describe(self) -> str:
        return (f"x{list(self.input_shape)} {self.layout} pads={[list(p) for p in self.pads]} "
                f"mode={self.mode!r}")


def padded_conv(input_shape: Sequence[int], weight_shape: Sequence[int],
                stride: IntOrTuple = 1, padding: IntOrTuple | str = 0,
                dilation: IntOrTuple = 1, groups: int = 1, layout: str = "NCHW",
                padding_mode: str = "zeros") -> tuple[PadGeometry | None, ConvGeometry]:
    """(the explicit padding, or None when cuDNN's symmetric zeros do it all, and the
    convolution of the padded input): convfuse.geometry.split_padding's plan, validated."""
    x_shape, w_shape = tuple(input_shape), tuple(weight_shape)
    rank = len(w_shape) - 2
    if rank not in (1, 2, 3) or len(x_shape) != rank + 2:
        # ConvGeometry names what is wrong with the shapes
        return None, ConvGeometry.create(x_shape, w_shape, stride, padding, dilation, groups,
                                         layout)
    channels_last = parse_layout(layout, rank)
    stride_t = as_tuple(stride, rank, "stride")
    dilation_t = as_tuple(dilation, rank, "dilation")
    kernel = to_channels_first(w_shape, channels_last)[2:]
    pairs, conv_pad = split_padding(padding, padding_mode, kernel, dilation_t, stride_t)
    if all(p == (0, 0) for p in pairs):
        return None, ConvGeometry.create(x_shape, w_shape, stride_t, conv_pad, dilation_t,
                                         groups, layout)
    pad = PadGeometry.create(x_shape, pairs, padding_mode, layout)
    geom = ConvGeometry.create(pad.output_shape, w_shape, stride_t, conv_pad, dilation_t,
                               groups, layout)
    return pad, geom
