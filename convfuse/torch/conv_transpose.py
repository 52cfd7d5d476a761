"""ConvTranspose1d, ConvTranspose2d, ConvTranspose3d as torch.nn.Modules running convfuse's
fused transposed convolution (one `convfuse::conv_transpose_bias_act` custom op per call,
see _transpose_ops.py, or in plain eager mode its body inside one autograd.Function, Note
[two call paths] in _eager.py).

Constructor arguments are torch.nn.ConvTranspose*d's, in its order, plus keyword-only
`activation=`; parameters are created, named and initialised as torch.nn's (weight
(in, out/groups, *kernel), same RNG draws), so state dicts are interchangeable.
`forward(input, output_size=None, residual=None)` keeps torch.nn's positional
`output_size`; `residual` is convfuse's addition, act(conv_transpose(x) + bias +
residual). Unbatched inputs (C, *spatial) give unbatched outputs, as in torch.nn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..geometry import IntOrTuple, as_tuple, is_int
from ..transpose_geometry import ConvTransposeGeometry, output_padding_for
from . import (
    _autocast,
    _eager,
    _host_arrays,
    _transpose_ops,  # registers torch.ops.convfuse.conv_transpose_*
)
from ._call_plan import FusedCall
from ._errors import InputDeviceError, InputShapeError, InputTypeError
from ._module_state import once_per_call, parametrized
from ._signature import lookup, tensor_key
from .conv import _INT32_MAX, CALLS, _ConvLayer

# N = 0 runs these (the empty output in torch.nn's memory format, zero parameter gradients):
# the engine's empty-batch op would make CuPy arrays where the pointer path makes none
_FUNCTIONAL = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


class _ConvTransposeNd(_ConvLayer):
    """The shared body of ConvTranspose1d/2d/3d; `_rank` is the number of spatial dims."""

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
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        activation: str | None = None,
    ) -> None:
        super().__init__()
        name, rank = type(self).__name__, self._rank
        if padding_mode != "zeros":  # torch.nn's check and words
            raise ValueError(f'Only "zeros" padding mode is supported for {name}')
        in_channels, out_channels, groups = self._check_counts(in_channels, out_channels,
                                                               groups)
        if in_channels % groups:
            raise ValueError(f"{name}: in_channels must be divisible by groups")
        if out_channels % groups:
            raise ValueError(f"{name}: out_channels must be divisible by groups")
        factory = self._factory(device, dtype)
        try:
            op = "transposed convolution"
            if isinstance(padding, str):
                raise ValueError(f"padding must be an int or {rank} ints, got {padding!r}")
            self._set_window(kernel_size, stride, dilation, op)
            self.padding = as_tuple(padding, rank, "padding", op)
            self.output_padding = as_tuple(output_padding, rank, "output_padding", op)
            if any(v < 0 for v in (*self.padding, *self.output_padding)):
                raise ValueError(f"padding and output_padding must be >= 0, got "
                                 f"{self.padding}, {self.output_padding}")
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        self.activation = activation
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.padding_mode = padding_mode
        self.transposed = True
        self._reversed_padding_repeated_twice = tuple(  # torch.nn's, read by code that pads
            p for v in reversed(self.padding) for p in (v, v))
        self._make_parameters((in_channels, out_channels // groups, *self.kernel_size), bias,
                              out_channels, factory)

    def _pads(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(padding, output_padding) as they are now, an int or a sequence each (torch.nn
        takes either, assigned after construction too), refused naming the layer when
        invalid (as _window's stride and dilation)."""
        d = self.__dict__
        key = (d.get("padding"), d.get("output_padding"))
        memo = d.get("_pads_memo")
        # by identity: `==` would compare a NumPy integer with a tuple elementwise
        if memo is not None and memo[0][0] is key[0] and memo[0][1] is key[1]:
            return memo[1]  # the general path asks at every call
        rank, op = self._rank, "transposed convolution"
        try:
            padding = as_tuple(self.padding, rank, "padding", op)
            output_padding = as_tuple(self.output_padding, rank, "output_padding", op)
        except ValueError as exc:
            raise ValueError(f"{type(self).__name__}: {exc}") from None
        if min(padding + output_padding) < 0:
            raise ValueError(f"{type(self).__name__}: padding and output_padding must be >= 0, "
                             f"got {self.padding!r}, {self.output_padding!r}")
        if not isinstance(key[0], list) and not isinstance(key[1], list):
            d["_pads_memo"] = (key, (padding, output_padding))  # (a list could change)
        return padding, output_padding

    def _output_padding(self, x: torch.Tensor,
                        output_size: Sequence[int] | None) -> tuple[int, ...]:
        padding, output_padding = self._pads()
        if output_size is None:
            return output_padding
        kernel, stride, dilation = self._window()
        if any(not (is_int(v) or (isinstance(v, torch.Tensor) and v.dim() == 0
                                  and not v.is_floating_point() and not v.is_complex()))
               for v in output_size):  # torch.nn's TypeError for floats, never truncated
            raise TypeError(f"output_size must hold ints, got {list(output_size)!r}")
        sizes = [int(v) for v in output_size]
        return output_padding_for(x.shape[-self._rank:], sizes, stride, padding, kernel,
                                  dilation, non_spatial=x.dim() - self._rank)

    def forward(self, input: torch.Tensor, output_size: Sequence[int] | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """act(conv_transpose(input) + bias + residual), fused; `output_size` picks the
        output's size among those the stride allows, as in torch.nn. Under torch.autocast
        it runs in the autocast dtype, a residual cast too (Note [autocast])."""
        if parametrized(self):
            with once_per_call():  # Note [a parametrized weight, once per call]
                return self._forward(input, output_size, residual)
        return self._forward(input, output_size, residual)

    def _forward(self, input: torch.Tensor, output_size: Sequence[int] | None,
                 residual: torch.Tensor | None) -> torch.Tensor:
        weight, bias = self._weight_bias()
        path = _eager.call_path(input, weight, bias, residual)
        if path == _eager.CUSTOM_OP:  # a tracer or transform: checked at every call
            call: Any = self._check(input, output_size, residual)
        else:
            try:
                sizes = None if output_size is None else tuple(_size_key(v)
                                                               for v in output_size)
            except TypeError:  # torch.nn's TypeError too, in words naming neither
                raise TypeError(f"{type(self).__name__}: output_size must be a sequence of "
                                f"ints, got {output_size!r}") from None
            key = self._call_key(input, weight, bias, residual, sizes)
            call = lookup(CALLS, key)
            if call is None:
                opad = self._check(input, output_size, residual)
                call = CALLS.remember(key, self._plan(input, weight, bias, residual, opad))
            if type(call) is FusedCall:
                return call.run(path, input, weight, bias, residual,
                                _host_arrays.of(self))
        opad = call  # the general path's output_padding
        unbatched = input.dim() == self._rank + 1
        x = input.unsqueeze(0) if unbatched else input
        res = residual
        if res is not None and unbatched:
            res = res.unsqueeze(0)
        _, stride, dilation = self._window()
        padding, _ = self._pads()
        if x.shape[0] == 0:  # nothing to compute: torch's own op, as Conv's _empty_batch
            y = _FUNCTIONAL[self._rank](x, weight, bias, stride, padding, opad, self.groups,
                                        dilation)
            y = y if res is None else y + res
        else:
            y, _ = _transpose_ops.conv_transpose_bias_act_call(
                x, weight, bias, res, list(stride), list(padding), list(opad),
                list(dilation), self.groups, self.activation)
        return y.squeeze(0) if unbatched else y

    def _plan(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor | None, opad: tuple[int, ...]) -> Any:
        """A checked call's FusedCall, or where the general path runs it, the output_padding
        it runs with (Note [call plans] in _call_plan.py)."""
        if (x.dim() != self._rank + 2 or x.shape[0] == 0
                or _autocast.enabled(x.device.type)):
            return opad
        _, stride, dilation = self._window()
        hyper = (list(stride), list(self._pads()[0]), list(opad), list(dilation), self.groups)
        prep = _transpose_ops.prepare(ConvTransposeGeometry, x, weight,
                                      (hyper[0], hyper[1], hyper[3], hyper[4]),
                                      (tensor_key(bias), tensor_key(residual)), hyper[2])
        return FusedCall(prep, "conv_transpose_bias_act", _transpose_ops.BACKWARD,
                         "conv_transpose_backward", hyper, self.activation,
                         (x, weight, bias, residual))

    def _check(self, input: torch.Tensor, output_size: Sequence[int] | None,
               residual: torch.Tensor | None) -> tuple[int, ...]:
        """The checks of a call (input, output_size, residual), refusing bad input before
        anything runs; returns the output_padding the call runs with."""
        name = type(self).__name__
        self._check_input(input)
        if any(n < 1 for n in input.shape[-self._rank:]):  # torch.nn: a RuntimeError
            raise InputShapeError(f"{name}: input shape {tuple(input.shape)} has an empty "
                                  "spatial dimension")
        if residual is not None and not isinstance(residual, torch.Tensor):
            raise TypeError(f"{name}: residual must be a torch.Tensor or None, got "
                            f"{type(residual).__name__}")
        if residual is not None and residual.layout != torch.strided:
            raise InputTypeError(f"{name}: residual has layout {residual.layout}; convfuse "
                                 "takes dense (torch.strided) tensors")
        try:
            opad = self._output_padding(input, output_size)
        except (TypeError, ValueError) as exc:
            msg = str(exc)  # _pads' and _window's errors name the layer already
            raise type(exc)(msg if msg.startswith(f"{name}: ") else f"{name}: {msg}") from None
        unbatched = input.dim() == self._rank + 1
        x = input.unsqueeze(0) if unbatched else input
        _, stride, dilation = self._window()
        shape = _transpose_ops.output_shape(x.shape, self.weight.shape, stride,
                                            self._pads()[0], opad, dilation, self.groups)
        if any(n > _INT32_MAX for n in shape):
            raise InputShapeError(f"{name}: the output's shape {tuple(shape)} is beyond "
                                  "cuDNN's 32-bit sizes")
        if any(n < 1 for n in shape[2:]):  # torch.nn's RuntimeError ("... too small")
            raise InputShapeError(f"{name}: the output would be empty: input "
                                  f"{tuple(input.shape)} gives "
                                  f"{tuple(shape[1:] if unbatched else shape)}")
        if any(o >= s and o >= d for o, s, d in zip(opad, stride, dilation)):
            raise InputShapeError(f"{name}: output_padding must be smaller than either stride "
                                  f"or dilation, got output_padding={tuple(opad)}, stride="
                                  f"{stride}, dilation={dilation}")
        res = residual
        if res is not None:
            given = tuple(res.shape)
            res = res.unsqueeze(0) if unbatched else res
            if tuple(res.shape) != tuple(shape):
                raise ValueError(f"{name}: residual has shape {given}, the "
                                 f"output has shape {tuple(shape[1:] if unbatched else shape)}")
            if res.device != x.device or (res.dtype != x.dtype
                                          and not _autocast.casts(x, res)):
                raise (InputDeviceError if res.device != x.device else InputTypeError)(
                    f"{name}: residual is {res.dtype} on {res.device}, the input {x.dtype} on "
                    f"{x.device}")
        return tuple(opad)

    def extra_repr(self) -> str:
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
             f"stride={self.stride}")
        if any(self.padding):  # torch.nn's order (_ConvNd.extra_repr)
            s += f", padding={self.padding}"
        if any(d != 1 for d in self.dilation):
            s += f", dilation={self.dilation}"
        if any(self.output_padding):
            s += f", output_padding={self.output_padding}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        return s + f", activation={self.activation!r}"


class ConvTranspose1d(_ConvTransposeNd):
    """torch.nn.ConvTranspose1d + fused bias, activation and residual; input (N, C, L)."""

    _rank = 1


class ConvTranspose2d(_ConvTransposeNd):
    """torch.nn.ConvTranspose2d + fused bias, activation and residual; input (N, C, H, W),
    contiguous or channels_last (convfuse's NHWC layout, no copy)."""

    _rank = 2


class ConvTranspose3d(_ConvTransposeNd):
    """torch.nn.ConvTranspose3d + fused bias, activation and residual; input
    (N, C, D, H, W)."""

    _rank = 3


def _size_key(v: Any) -> Any:
    """An output_size entry as a call key holds it: a 0-d integer tensor by its value (a
    tensor hashes by identity, and one filled in place would hit the key of its old value),
    anything else with its type (the checks refuse what is not an int)."""
    if type(v) is int:
        return v
    if (isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_floating_point()
            and not v.is_complex()):
        return int(v)
    # with its type: 10.0 == 10 (and hashes alike), so a float would hit an int's key and
    # skip the check that refuses it
    return (type(v), v)
