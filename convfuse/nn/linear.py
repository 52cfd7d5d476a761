"""Linear: a fully connected layer run as a 1x1 convolution over a 1x1 image.

Going through the same fused cuDNN call as Conv2d keeps the bias and activation fused,
uses no cuBLAS (whose CuPy wrapper raises during graph capture), and so stays capturable.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import activations, dtypes
from ..backend import resolve_device
from ..functional import conv_bias_act_backward, conv_bias_act_forward
from ..geometry import ConvGeometry
from .module import Layer, init_parameter


class Linear(Layer):
    """y = act(x @ weight.T + bias), with x of shape (N, in_features)."""

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
        for what, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{what} must be a positive int, got {value!r}")
        self.in_features, self.out_features = in_features, out_features
        self.activation = activations.normalize(activation)
        self.dtype = dtypes.canonical(dtype)
        self.device = resolve_device(device)
        self._geoms: dict[int, ConvGeometry] = {}
        self._ctx = None
        # PyTorch's default init: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias alike.
        rng = np.random.default_rng(seed)
        bound = 1.0 / math.sqrt(in_features)
        w = rng.uniform(-bound, bound, size=(out_features, in_features))
        self.weight = init_parameter(w, self.dtype, self.device, "weight")
        b = rng.uniform(-bound, bound, out_features)
        self.bias = init_parameter(b, self.dtype, self.device, "bias") if bias else None

    def _as_conv(self, a: Any) -> Any:
        return a.reshape(*a.shape, 1, 1)

    def __call__(self, x: Any) -> Any:
        self._check_input(x)
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"Linear expects input of shape (N, {self.in_features}), got {tuple(x.shape)}"
            )
        if x.dtype != self.dtype:
            raise ValueError(f"Linear has dtype {self.dtype} but its input has dtype {x.dtype}")
        n = int(x.shape[0])
        geom = self._geoms.get(n)
        if geom is None:
            geom = ConvGeometry.create((n, self.in_features, 1, 1),
                                       (self.out_features, self.in_features, 1, 1))
            self._geoms[n] = geom
        bias = None if self.bias is None else self.bias.data
        y, self._ctx = conv_bias_act_forward(
            self._as_conv(x), self._as_conv(self.weight.data), bias,
            activation=self.activation, geom=geom,
        )
        return y.reshape(n, self.out_features)

    forward = __call__

    def backward(self, dy: Any) -> Any:
        ctx = self._take_ctx()
        self._check_input(dy, "dy")
        if tuple(dy.shape) != (ctx.geom.batch, self.out_features):
            self._ctx = ctx
            raise ValueError(
                f"dy has shape {tuple(dy.shape)}, but the forward's output has shape "
                f"{(ctx.geom.batch, self.out_features)}"
            )
        try:
            grads = conv_bias_act_backward(
                self._as_conv(dy), ctx, need_dx=self.needs_input_grad,
                dweight=self._as_conv(self.weight.grad),
                dbias=None if self.bias is None else self.bias.grad, accumulate=True,
            )
        except Exception:
            self._ctx = ctx
            raise
        if grads.dx is None:
            return None
        return grads.dx.reshape(ctx.geom.batch, self.in_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, activation={self.activation!r}, dtype={self.dtype}, "
            f"device={self.device!r}"
        )
