"""Identity, ReLU (and any convfuse activation) and Dropout: the small layers users expect
in a Sequential. Where a ReLU follows a Conv or BatchNorm, prefer `activation="relu"` on
that layer: it is fused there and costs nothing; a standalone ReLU is one more pass."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import activations, ops
from ..backend import array_module
from .module import Layer


class _Stateless(Layer):
    """A parameter-free layer that follows its input's device unless `.to()` pins one."""

    def __init__(self) -> None:
        self.device: str | None = None  # type: ignore[assignment]
        self._ctx = None

    def _check_input(self, x: Any, name: str = "input") -> None:
        if self.device is None:
            try:
                array_module(x)
            except TypeError:
                raise TypeError(f"{type(self).__name__} {name} must be a NumPy or CuPy "
                                f"array, got {type(x).__name__}") from None
            return
        super()._check_input(x, name)

    def _check_dy(self, dy: Any, like: Any) -> None:
        self._check_input(dy, "dy")
        if tuple(dy.shape) != tuple(like.shape) or dy.dtype != like.dtype:
            raise ValueError(
                f"{type(self).__name__}: dy has shape {tuple(dy.shape)} and dtype {dy.dtype}, "
                f"but the forward's output has shape {tuple(like.shape)} and dtype {like.dtype}"
            )


class Identity(_Stateless):
    """Returns its input; accepts and ignores any constructor arguments, as PyTorch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def __call__(self, x: Any) -> Any:
        self._check_input(x)
        self._ctx = x
        return x

    forward = __call__

    def backward(self, dy: Any) -> Any:
        x = self._take_ctx()
        try:
            self._check_dy(dy, x)
        except Exception:
            self._ctx = x
            raise
        return dy if self.needs_input_grad else None


class Activation(_Stateless):
    """One of convfuse's activations as a layer (`Activation("gelu")`)."""

    def __init__(self, activation: str | None = "relu") -> None:
        super().__init__()
        self.activation = activations.normalize(activation)

    def __call__(self, x: Any) -> Any:
        self._check_input(x)
        y = ops.activation_forward(x, self.activation)
        kind = activations.saves(self.activation)
        self._ctx = (y, {"none": None, "output": y, "preactivation": x}[kind])
        return y

    forward = __call__

    def backward(self, dy: Any) -> Any:
        y, saved = self._take_ctx()
        try:
            self._check_dy(dy, y)
            if not self.needs_input_grad:
                return None
            return ops.activation_backward(dy, saved, self.activation)
        except Exception:
            self._ctx = (y, saved)
            raise

    def extra_repr(self) -> str:
        return repr(self.activation)


class ReLU(Activation):
    """max(x, 0); `inplace` is accepted for PyTorch compatibility and ignored (never in place:
    convfuse never modifies its inputs)."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__("relu")

    def extra_repr(self) -> str:
        return ""


class Dropout(_Stateless):
    """Zeroes each element with probability p in training mode and scales the rest by
    1/(1-p); the identity in eval mode. PyTorch's `Dropout(p=0.5)`. The mask is drawn on the
    input's device (CuPy's generator on the GPU: no host round trip)."""

    def __init__(self, p: float = 0.5, inplace: bool = False, seed: int | None = None) -> None:
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, (int, float, np.floating, np.integer)):
            raise TypeError(f"Dropout: p must be a number, got {type(p).__name__}")
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1], got {p}")
        self.p = float(p)
        self._rng = np.random.default_rng(seed)

    def __call__(self, x: Any) -> Any:
        self._check_input(x)
        if not self.training or self.p == 0.0:
            self._ctx = (None, x)
            return x
        xp = array_module(x)
        if self.p == 1.0:
            scale = xp.zeros(x.shape, dtype=x.dtype)
        elif xp is np:
            keep = self._rng.random(x.shape, dtype=np.float32) >= self.p
            scale = keep.astype(x.dtype) * x.dtype.type(1.0 / (1.0 - self.p))
        else:  # pragma: gpu
            keep = xp.random.random(x.shape, dtype=xp.float32) >= self.p
            scale = keep.astype(x.dtype) * x.dtype.type(1.0 / (1.0 - self.p))
        self._ctx = (scale, x)
        return x * scale

    forward = __call__

    def backward(self, dy: Any) -> Any:
        scale, x = self._take_ctx()
        try:
            self._check_dy(dy, x)
        except Exception:
            self._ctx = (scale, x)
            raise
        if not self.needs_input_grad:
            return None
        return dy if scale is None else dy * scale

    def extra_repr(self) -> str:
        return f"p={self.p}"
