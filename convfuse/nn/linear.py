"""Linear: a fully connected layer run as a 1x1 convolution over a 1x1 image.

Going through the same fused cuDNN call as Conv2d keeps the bias and activation fused,
uses no cuBLAS (whose CuPy wrapper raises during graph capture), and so stays capturable.

Hyperparameters after construction: `activation` may be assigned (validated);
`in_features`, `out_features` and `dtype` fix the weight and are read-only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import config, dtypes
from .._memory import check_bytes
from ..backend import resolve_device
from ..functional import conv_bias_act_backward, conv_bias_act_forward, conv_bias_act_known
from ..geometry import ConvGeometry
from . import _hyper
from ._memo import checked_geometry
from .module import USER_ERRORS, Layer, contiguous, init_parameter, renamed


class Linear(Layer):
    """y = act(x @ weight.T + bias), with x of shape (*, in_features), as torch.nn.Linear:
    the leading dims are one batch of rows for the fused call (N-d input costs a reshape)."""

    _in: int
    _out: int
    _dtype: np.dtype

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str | None = None,
        dtype: Any = "float32",
        device: str | None = None,
        seed: int | None = None,
    ) -> None:
        try:
            d = self.__dict__
            d["_in"] = _hyper.positive_int(in_features, "in_features")
            d["_out"] = _hyper.positive_int(out_features, "out_features")
            has_bias = _hyper.flag(bias, "bias")
            self.activation = activation
            d["_dtype"] = dtypes.canonical(dtype)
            self.device = resolve_device(device)
            seed = _hyper.seed(seed)
            shape = (self._out, self._in)
            check_bytes(shape, np.float64, "cpu", "weight (drawn in float64 on the host)")
            check_bytes(shape, self._dtype, self.device, "weight")
        except USER_ERRORS as exc:
            raise renamed(exc, "Linear") from None
        self._ctx = None
        # PyTorch's default init: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias alike.
        rng = np.random.default_rng(seed)
        bound = 1.0 / math.sqrt(self._in)
        w = rng.uniform(-bound, bound, size=shape)
        self.weight = init_parameter(w, self._dtype, self.device, "weight")
        b = rng.uniform(-bound, bound, self._out)
        self.bias = init_parameter(b, self._dtype, self.device, "bias") if has_bias else None

    activation = _hyper.activation_property()

    def _fixed(name: str, attr: str) -> property:  # type: ignore[misc]
        def setter(self: Linear, value: Any) -> None:
            raise _hyper.read_only("Linear", name, "it sets the weight's shape and storage")

        return property(lambda self: self.__dict__[attr], setter)

    in_features = _fixed("in_features", "_in")
    out_features = _fixed("out_features", "_out")
    dtype = _fixed("dtype", "_dtype")
    del _fixed

    def _checked_geometry(self, n: int) -> ConvGeometry:
        geom = ConvGeometry.create((n, self._in, 1, 1), (self._out, self._in, 1, 1))
        check_bytes((n, self._out), self._dtype, self.device, "output")
        return geom

    def _as_conv(self, a: Any) -> Any:
        return a.reshape(*a.shape, 1, 1)

    def __call__(self, x: Any) -> Any:
        """A non-C-contiguous x is copied once (the caller's array is never modified)."""
        try:
            self._check_input(x)
            if x.ndim < 1 or x.shape[-1] != self._in:
                raise ValueError(
                    f"expects input of shape (*, {self._in}), got {tuple(x.shape)}"
                )
            if x.dtype != self._dtype:
                raise ValueError(f"has dtype {self._dtype} but its input has dtype {x.dtype}; "
                                 + _hyper.dtype_hint(self._dtype, x.dtype))
            x = contiguous(x)
            lead = None  # the usual (N, in_features): nothing to reshape, nothing kept
            if x.ndim == 2:
                n = int(x.shape[0])
            else:
                lead = tuple(x.shape[:-1])
                n = math.prod(lead)
                x = x.reshape(n, self._in)
            geom = checked_geometry(self, n, lambda: self._checked_geometry(n))
            bias = None if self.bias is None else self.bias.data
            w = self.weight.data
            # Note [layer call cache] (_conv_base.py): x was checked above; what the op
            # checks besides is the parameters' kind, shape, dtype and contiguity, the
            # activation and the config flags
            key = (n, x.__class__, w.__class__, w.shape, w.dtype, w.flags.c_contiguous,
                   None if bias is None else (bias.__class__, bias.shape, bias.dtype,
                                              bias.flags.c_contiguous), self.activation)
            calls = self.__dict__.setdefault("_calls", {})
            known = calls.get(key)
            if known is not None and known is config.get():
                y, ctx = conv_bias_act_known(self._as_conv(x), self._as_conv(w), bias, None,
                                             self.activation, 1.0, geom)
            else:
                flags = config.get()
                y, ctx = conv_bias_act_forward(
                    self._as_conv(x), self._as_conv(w), bias, activation=self.activation,
                    geom=geom,
                )
                if len(calls) >= 64:
                    calls.clear()
                calls[key] = flags
        except USER_ERRORS as exc:
            raise self._renamed(exc) from None
        if lead is None:
            self._ctx = ctx
            return y.reshape(n, self._out)
        self._ctx = (ctx, lead)  # an N-d input's leading dims, for dy and dx
        return y.reshape(*lead, self._out)

    forward = __call__

    def backward(self, dy: Any) -> Any:
        """dx; accumulates into .grad. Atomic and repeatable: see Layer's backward rule."""
        return self._backward_with(dy, self._backward)

    def _backward(self, saved: Any, dy: Any) -> Any:
        if type(saved) is tuple:  # an N-d input's (context, leading dims)
            ctx, lead = saved
            dy = self._check_dy(dy, (*lead, self._out), ctx.x.dtype)
            dy = dy.reshape(ctx.geom.batch, self._out)
        else:
            ctx, lead = saved, None
            dy = self._check_dy(dy, (ctx.geom.batch, self._out), ctx.x.dtype)
        grads = conv_bias_act_backward(
            self._as_conv(dy), ctx, need_dx=self.needs_input_grad,
            dweight=self._as_conv(self.weight.grad),
            dbias=None if self.bias is None else self.bias.grad, accumulate=True,
        )
        if grads.dx is None:
            return None
        return grads.dx.reshape(ctx.geom.batch, self._in) if lead is None else \
            grads.dx.reshape(*lead, self._in)

    def extra_repr(self) -> str:
        return (
            f"in_features={self._in}, out_features={self._out}, "
            f"bias={self.bias is not None}, activation={self.activation!r}, dtype={self._dtype}, "
            f"device={self.device!r}"
        )
