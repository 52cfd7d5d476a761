"""Conv1d, Conv2d, Conv3d as torch.nn.Modules running convfuse's fused convolution.

Parameters are created, named and initialised exactly as torch.nn.Conv{1,2,3}d's (same
shapes, same RNG draws in the same order), so state dicts are interchangeable and a seeded
construction gives the same numbers. The constructor takes torch.nn's arguments in
torch.nn's order; convfuse's additions (`activation`) are keyword-only.
`forward(x, residual=None)` is one call of the `convfuse::conv_bias_act` custom op
(see _ops.py; in plain eager mode its body inside one autograd.Function, Note [two call
paths] in _eager.py), its input checks made once per signature, after torch.nn's own
handling of what cuDNN cannot pad (Note [padding convfuse leaves to torch]).

Note [padding convfuse leaves to torch]
cuDNN pads with zeros, the same amount on both sides. torch.nn's conv does the rest by
padding explicitly first, and so does this layer, with the same calls: for
padding_mode 'reflect' | 'replicate' | 'circular', `F.pad(x, _reversed_padding_repeated_twice,
mode)` and a convolution without padding; for padding='same' with an even d*(k-1) (the
extra zero at the end, geometry.same_padding), a zero `F.pad` of the difference on the
right and the symmetric part in the convolution. The pad is a differentiable torch op, so
autograd carries the gradient back through it. Inputs whose pad torch refuses (reflect
wider than the input, circular wrapping more than once) are refused before it, naming the
layer and the argument.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..geometry import ConvGeometry, IntOrTuple, as_tuple, is_int, same_padding
from . import _autocast, _eager, _host_arrays, _ops  # _ops registers torch.ops.convfuse.*
from ._activation import FusedActivation
from ._arrays import SUPPORTED_DTYPES
from ._call_plan import FusedCall
from ._errors import InputDeviceError, InputShapeError, InputTypeError
from ._module_state import PlainClasses, once_per_call, parametrized
from ._signature import SignatureCache, lookup, tensor_key

#: Signatures whose checks passed -> their FusedCall, or GENERAL (Note [call plans]).
CALLS = SignatureCache()
GENERAL = "general"  # a call the layer's general path runs
_PLAIN = PlainClasses("weight", "bias")

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
_FUNCTIONAL = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@functools.lru_cache(maxsize=256)
def _zero_padding(pads: tuple[tuple[int, int], ...],
                  ) -> tuple[tuple[int, ...] | None, tuple[int, ...]]:
    """(F.pad's extra zeros on the right, or None; the symmetric part) of (left, right)
    zero padding per spatial dim (Note [padding convfuse leaves to torch]), once per value
    instead of at every call."""
    extra = tuple(p for left, right in reversed(pads) for p in (0, right - left))
    return (extra if any(extra) else None), tuple(left for left, _ in pads)


def _size(n: Any) -> Any:
    """A size as an int, or as the SymInt it is (int() would make a dynamic size a constant
    under a non-strict export)."""
    return n if isinstance(n, torch.SymInt) else int(n)


_INT32_MAX = 2**31 - 1  # cuDNN's sizes are ints; the CPU engine's arrays would not fit either


class _ConvLayer(FusedActivation, _host_arrays.HoldsViews):
    """What Conv*d and ConvTranspose*d share: torch.nn's checks of the channel arguments and
    the dtype, their parameters and initialisation, and the checks of an input."""

    _rank = 0

    def _hyper(self) -> tuple[Any, ...]:
        """Every attribute the input checks read (the cache key's hyperparameters)."""
        return (self.in_channels, self.out_channels, self.kernel_size, self.stride,
                self.padding, self.dilation, self.groups, self.padding_mode,
                self.output_padding)

    def _weight_bias(self) -> tuple[Any, Any]:
        """(weight, bias), read from `_parameters` where attribute access would return just
        that (Note [reading a layer's state] in _module_state.py); by attribute access
        under dynamo, whose guard on _PLAIN's dict would fail as it fills."""
        if not _eager._compiling() and type(self) in _PLAIN:
            try:
                p = self.__dict__["_parameters"]
                return p["weight"], p["bias"]
            except KeyError:  # moved out of the dict
                pass
        return self.weight, self.bias

    def _call_key(self, x: Any, weight: torch.Tensor, bias: torch.Tensor | None,
                  residual: Any, *extra: Any) -> Any:
        """The key of an eager call's FusedCall (Note [call plans]): all its plan and its
        checks read, strides included. Only for the eager path's arguments (plain tensors,
        no trace: _eager.takes_eager_path), whose sizes are concrete."""
        if x is None:  # the checks refuse it (the only non-tensor the eager path lets by)
            return None
        dev = x.device
        return (type(self), x.shape, x.stride(), x.dtype, dev, weight.shape, weight.stride(),
                weight.dtype, weight.device,
                None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
                None if residual is None else tensor_key(residual),
                _autocast.enabled(dev.type), self._hyper(), self.activation, extra)

    def _window(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(kernel, stride, dilation) as a call uses them, torch.nn's way: the kernel is the
        weight's (torch.nn's convolution reads the weight's shape; `kernel_size` only
        describes the layer, and a swapped weight may differ), stride and dilation the
        attributes as they are now, an int or a sequence (torch.nn takes either, assigned
        after construction too). Read where a signature is checked and planned, not per
        cached call (and remembered for the general path's calls); an invalid value is refused
        naming the layer."""
        d = self.__dict__
        key = (d.get("stride"), d.get("dilation"), self.weight.shape)
        memo = d.get("_window_memo")
        # stride and dilation by identity: `==` would compare a NumPy integer with a tuple
        # elementwise (and a stride of 2.0 equals 2: the checks must see it)
        if memo is not None and memo[0][0] is key[0] and memo[0][1] is key[1] \
                and memo[0][2] == key[2]:
            return memo[1]  # the general path asks at every call
        rank = self._rank
        try:
            stride = as_tuple(self.stride, rank, "stride")
            dilation = as_tuple(self.dilation, rank, "dilation")
        except ValueError as exc:
            raise ValueError(f"{type(self).__name__}: {exc}") from None
        if min(stride + dilation) < 1 or max(stride + dilation) > _INT32_MAX:
            raise ValueError(f"{type(self).__name__}: stride and dilation must be >= 1 and "
                             f"< 2**31, got {self.stride!r}, {self.dilation!r}")
        window = tuple(int(k) for k in self.weight.shape[2:]), stride, dilation
        if not isinstance(key[0], list) and not isinstance(key[1], list):
            d["_window_memo"] = (key, window)  # (a list could change in place, same key)
        return window

    def _weight_channels(self) -> tuple[Any, Any]:
        """(input, output) channels as the weight holds them: torch.nn's convolution reads
        them off the weight (a swapped one, say summed over RGB for grey images, may differ
        from in_channels and out_channels, which only describe the layer)."""
        shape, groups = self.weight.shape, self.__dict__["groups"]
        if self.transposed:
            return shape[0], shape[1] * groups
        return shape[1] * groups, shape[0]

    def _check_counts(self, in_channels: int, out_channels: int,
                      groups: int) -> tuple[int, int, int]:
        """The three counts as ints: each a positive Python or NumPy integer (a count read
        off an array's shape is a NumPy one; torch.nn takes it too), never a bool."""
        for what, value in (("in_channels", in_channels), ("out_channels", out_channels),
                            ("groups", groups)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{type(self).__name__}: {what} must be a positive int, got "
                                 f"{value!r}")
        return int(in_channels), int(out_channels), int(groups)

    def _factory(self, device: Any, dtype: torch.dtype | None) -> dict[str, Any]:
        """The parameters' factory arguments, in a dtype convfuse computes in."""
        factory = {"device": device, "dtype": dtype}
        wdtype = torch.empty(0, **factory).dtype
        if wdtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{type(self).__name__}: dtype {wdtype} is not supported; "
                            "convfuse computes in float32, float64, float16 or bfloat16")
        return factory

    def _set_window(self, kernel_size: IntOrTuple, stride: IntOrTuple, dilation: IntOrTuple,
                    op: str = "convolution") -> None:
        """torch.nn's kernel_size, stride and dilation tuples, each entry >= 1 (a ValueError
        the constructor prefixes with the layer's name otherwise)."""
        rank = self._rank
        self.kernel_size = as_tuple(kernel_size, rank, "kernel_size", op)
        self.stride = as_tuple(stride, rank, "stride", op)
        self.dilation = as_tuple(dilation, rank, "dilation", op)
        if any(v < 1 for v in (*self.kernel_size, *self.stride, *self.dilation)):
            raise ValueError(f"kernel_size, stride and dilation must be >= 1, got "
                             f"{self.kernel_size}, {self.stride}, {self.dilation}")

    def _make_parameters(self, weight_shape: tuple[int, ...], bias: bool, out_channels: int,
                         factory: dict[str, Any]) -> None:
        self.weight = nn.Parameter(torch.empty(weight_shape, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_channels, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torch.nn's initialisation of its convolutions, draw for draw."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = nn.init._calculate_fan_in_and_fan_out(self.weight)
            if fan_in != 0:
                bound = 1 / math.sqrt(fan_in)
                nn.init.uniform_(self.bias, -bound, bound)

    def _check_input(self, x: torch.Tensor) -> None:
        """x is a batched or unbatched input of the layer's channels, dtype and device (a
        dtype autocast casts to the weight's counts as the weight's)."""
        name, rank = type(self).__name__, self._rank
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: input must be a torch.Tensor, got {type(x).__name__}")
        if x.layout != torch.strided:
            raise InputTypeError(f"{name}: input has layout {x.layout}; convfuse takes dense "
                                 "(torch.strided) tensors")
        if x.dim() not in (rank + 1, rank + 2):
            raise InputShapeError(f"{name}: expected a {rank + 1}-d (unbatched) or "
                                  f"{rank + 2}-d (batched) input, got shape {tuple(x.shape)}")
        channels, expected = x.shape[-rank - 1], self._weight_channels()[0]
        if channels != expected:
            raise InputShapeError(f"{name}: input has {channels} channels, the layer expects "
                                  f"{expected}")
        if x.dtype != self.weight.dtype and not _autocast.casts(x, self.weight):
            raise InputTypeError(f"{name}: input dtype {x.dtype} differs from the weight's "
                                 f"{self.weight.dtype}")
        bias = self.bias
        if bias is not None and tuple(bias.shape) != (self._weight_channels()[1],):
            raise InputShapeError(f"{name}: bias has shape {tuple(bias.shape)}, the weight "
                                  f"{tuple(self.weight.shape)} gives "
                                  f"{self._weight_channels()[1]} output channels")
        if (bias is not None and bias.dtype != self.weight.dtype
                and not _autocast.casts(x, self.weight, bias)):  # torch.nn's RuntimeError
            raise InputTypeError(f"{name}: bias dtype {bias.dtype} differs from the "
                                 f"weight's {self.weight.dtype}")
        if x.device != self.weight.device:
            raise InputDeviceError(f"{name}: input is on {x.device}, the weight on "
                                   f"{self.weight.device}")


class _ConvNd(_ConvLayer):
    """The shared body of Conv1d/2d/3d; `_rank` is the number of spatial dims."""

    transposed = False

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
        padding_mode: str = "zeros",
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        activation: str | None = None,
    ) -> None:
        super().__init__()
        name, rank = type(self).__name__, self._rank
        in_channels, out_channels, groups = self._check_counts(in_channels, out_channels,
                                                               groups)
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"{name}: in_channels ({in_channels}) and out_channels ({out_channels}) must "
                f"both be divisible by groups ({groups})"
            )
        if padding_mode not in PADDING_MODES:
            raise ValueError(f"{name}: padding_mode must be one of {PADDING_MODES}, but got "
                             f"padding_mode={padding_mode!r}")
        factory = self._factory(device, dtype)
        try:
            self._set_window(kernel_size, stride, dilation)
            self.padding, pads = self._resolve_padding(padding)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        self.activation = activation
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.padding_mode = padding_mode
        self.output_padding = (0,) * rank
        # torch.nn's name and order: (left, right) per spatial dim, last dim first (F.pad's)
        # (a tuple for numeric padding, a list for a string, as torch.nn's)
        reversed_pads = [p for lr in reversed(pads) for p in lr]
        self._reversed_padding_repeated_twice = reversed_pads if isinstance(padding, str) \
            else tuple(reversed_pads)
        self._make_parameters((out_channels, in_channels // groups, *self.kernel_size), bias,
                              out_channels, factory)

    @property
    def _pads(self) -> tuple[tuple[int, int], ...]:
        """The (left, right) zeros per spatial dim of `padding` as it is now: torch.nn's
        convolution reads its padding at every call, so an assignment after construction
        takes effect (an invalid one is refused, naming the layer). With another
        padding_mode it pads by `_reversed_padding_repeated_twice` alone, as torch.nn does."""
        if self.padding_mode != "zeros":
            r, rank = self._reversed_padding_repeated_twice, self._rank
            return tuple((int(r[2 * (rank - 1 - d)]), int(r[2 * (rank - 1 - d) + 1]))
                         for d in range(rank))
        try:
            return self._resolve_padding(self.padding)[1]
        except ValueError as exc:
            raise ValueError(f"{type(self).__name__}: {exc}") from None

    def _resolve_padding(self, padding: IntOrTuple | str,
                         ) -> tuple[tuple[int, ...] | str, tuple[tuple[int, int], ...]]:
        """torch.nn's `padding` attribute and the (left, right) zeros per spatial dim."""
        rank = self._rank
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"invalid padding string {padding!r}, should be one of "
                                 "{'same', 'valid'}")
            kernel, stride, dilation = self._window() if "weight" in self._parameters else (
                self.kernel_size, self.stride, self.dilation)  # (the constructor's call)
            if padding == "same" and any(s != 1 for s in stride):
                raise ValueError("padding='same' is not supported for strided convolutions")
            if padding == "valid":
                return padding, ((0, 0),) * rank
            return padding, same_padding(kernel, dilation)
        pad = as_tuple(padding, rank, "padding")
        if any(p < 0 for p in pad):
            raise ValueError(f"padding must be >= 0, got {padding!r}")
        return pad, tuple((p, p) for p in pad)

    def _check(self, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        name, rank = type(self).__name__, self._rank
        self._check_input(x)
        # sizes as they are (no int(): under a non-strict export with dynamic shapes a
        # symbolic size must stay symbolic; these comparisons are guards, not constants)
        spatial = tuple(_size(n) for n in x.shape[-rank:])
        if any(n < 1 for n in spatial):
            raise InputShapeError(f"{name}: input shape {tuple(x.shape)} has an empty "
                                  "spatial dimension")
        for (left, right), n in zip(self._pads, spatial):
            if self.padding_mode == "reflect" and max(left, right) >= n:
                raise InputShapeError(
                    f"{name}: padding={self.padding!r} with padding_mode='reflect' needs "
                    f"padding smaller than the input's spatial size, got input shape "
                    f"{tuple(x.shape)} (as torch.nn.functional.pad)")
            if self.padding_mode == "circular" and max(left, right) > n:
                raise InputShapeError(
                    f"{name}: padding={self.padding!r} with padding_mode='circular' would wrap "
                    f"around more than once for input shape {tuple(x.shape)} (as "
                    "torch.nn.functional.pad)")
        out = self.output_shape(x.shape)
        if any(n + left + right > _INT32_MAX for n, (left, right) in zip(spatial, self._pads)) \
                or any(n > _INT32_MAX for n in out):
            raise InputShapeError(f"{name}: padding={self.padding!r} on input shape "
                                  f"{tuple(x.shape)} gives sizes beyond cuDNN's 32-bit ones")
        if any(n < 1 for n in out[-rank:]):
            kernel, _, dilation = self._window()
            raise InputShapeError(
                f"{name}: kernel larger than the padded input: input shape {tuple(x.shape)}, "
                f"kernel_size={kernel}, dilation={dilation}, padding={self.padding!r}")
        if residual is None:
            return
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"{name}: residual must be a torch.Tensor or None, got "
                            f"{type(residual).__name__}")
        if residual.layout != torch.strided:
            raise InputTypeError(f"{name}: residual has layout {residual.layout}; convfuse "
                                 "takes dense (torch.strided) tensors")
        if tuple(residual.shape) != out:
            raise ValueError(f"{name}: residual has shape {tuple(residual.shape)}, the output "
                             f"has shape {out}")
        if residual.device != x.device or (residual.dtype != x.dtype
                                           and not _autocast.casts(x, residual)):
            raise (InputDeviceError if residual.device != x.device else InputTypeError)(
                f"{name}: residual is {residual.dtype} on {residual.device}, the input "
                f"{x.dtype} on {x.device}")

    def output_shape(self, input_shape: Any) -> tuple[int, ...]:
        """The output's shape for an input of `input_shape`, batched or unbatched."""
        rank = self._rank
        kernel, stride, dilation = self._window()
        spatial = tuple(
            (_size(n) + left + right - d * (k - 1) - 1) // s + 1 for n, k, s, (left, right), d
            in zip(input_shape[-rank:], kernel, stride, self._pads, dilation))
        return (*(_size(n) for n in input_shape[:-rank - 1]), self._weight_channels()[1],
                *spatial)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """act(conv(x) + bias + residual), fused (one convfuse op; one cuDNN call for
        identity and relu on the GPU). x is (N, C, *spatial) or unbatched (C, *spatial)."""
        if parametrized(self):
            with once_per_call():  # Note [a parametrized weight, once per call]
                weight, bias = self._weight_bias()
                return self._conv_forward(x, weight, bias, residual)
        weight, bias = self._weight_bias()
        return self._conv_forward(x, weight, bias, residual)

    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
        """torch.nn's hook for subclasses that transform the weight (weight standardisation),
        plus the residual."""
        path = _eager.call_path(x, weight, bias, residual)
        if path == _eager.CUSTOM_OP:  # a tracer or transform: checked at every call
            self._check(x, residual)
        else:
            key = self._call_key(x, weight, bias, residual)
            call = lookup(CALLS, key)
            if call is None:
                self._check(x, residual)
                call = CALLS.remember(key, self._plan(x, weight, bias, residual))
            if call is not GENERAL:
                return call.run(path, x, weight, bias, residual, _host_arrays.of(self))
        batched = x.dim() == self._rank + 2
        if not batched:  # torch.nn's rule: run it as a batch of one, drop that dim again
            x = x.unsqueeze(0)
            residual = None if residual is None else residual.unsqueeze(0)
        x, padding = self._pad(x)
        if x.shape[0] == 0:
            y = self._empty_batch(x, weight, bias, padding, residual)
        else:
            _, stride, dilation = self._window()
            y, _ = _ops.conv_bias_act_call(
                x, weight, bias, residual, list(stride), padding, list(dilation),
                self.groups, self.activation)
        return y if batched else y.squeeze(0)

    def _plan(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor | None) -> Any:
        """A checked eager call's FusedCall, or GENERAL where the general path runs it
        (Note [call plans])."""
        if (self.padding_mode != "zeros" or x.dim() != self._rank + 2
                or x.shape[0] == 0 or _autocast.enabled(x.device.type)):
            return GENERAL
        extra, symmetric = _zero_padding(self._pads)
        if extra is not None:
            return GENERAL
        _, stride, dilation = self._window()
        hyper = (list(stride), list(symmetric), list(dilation), self.groups)
        prep = _ops.prepare(ConvGeometry, x, weight, hyper,
                            (tensor_key(bias), tensor_key(residual)))
        return FusedCall(prep, "conv_bias_act", _ops.CONV_BACKWARD, "conv_backward", hyper,
                         self.activation, (x, weight, bias, residual))

    def _pad(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """x padded as torch.nn pads it before the convolution, and the symmetric zero
        padding left for the convolution (Note [padding convfuse leaves to torch])."""
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            return x, [0] * self._rank
        # under dynamo the function itself: a call of the lru_cache wrapper makes dynamo
        # warn at every compile (the cache is for eager calls' host time)
        split = _zero_padding.__wrapped__ if _eager._compiling() else _zero_padding
        extra, symmetric = split(self._pads)
        if extra is not None:
            x = F.pad(x, list(extra))
        return x, list(symmetric)

    def _empty_batch(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     padding: list[int], residual: torch.Tensor | None) -> torch.Tensor:
        """N = 0: nothing to compute. torch's own convolution gives what torch.nn gives
        (the empty output in its memory format; zero weight and bias gradients)."""
        _, stride, dilation = self._window()
        y = _FUNCTIONAL[self._rank](x, weight, bias, stride, padding, dilation, self.groups)
        return y if residual is None else y + residual

    def extra_repr(self) -> str:
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
             f"stride={self.stride}")
        if self.padding != (0,) * len(self.padding):
            s += f", padding={self.padding}"
        if any(d != 1 for d in self.dilation):
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode}"
        return s + f", activation={self.activation!r}"


class Conv1d(_ConvNd):
    """torch.nn.Conv1d + fused bias, activation and residual; input (N, C, L) or (C, L)."""

    _rank = 1


class Conv2d(_ConvNd):
    """torch.nn.Conv2d + fused bias, activation and residual; input (N, C, H, W), contiguous
    or channels_last (which runs convfuse's NHWC layout with no copy), or (C, H, W)."""

    _rank = 2


class Conv3d(_ConvNd):
    """torch.nn.Conv3d + fused bias, activation and residual; input (N, C, D, H, W) or
    unbatched (C, D, H, W)."""

    _rank = 3
