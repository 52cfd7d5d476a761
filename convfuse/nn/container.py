"""Flatten and Sequential."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .module import Layer


class Flatten(Layer):
    """(N, ...) -> (N, prod(...)); a view, so it costs nothing."""

    def __init__(self) -> None:
        self.device: str | None = None  # type: ignore[assignment]
        self._ctx = None

    def __call__(self, x: Any) -> Any:
        if self.device is not None:
            self._check_input(x)
        if x.ndim < 2:
            raise ValueError(
                f"Flatten expects at least 2 dims (N, ...), got shape {tuple(x.shape)}"
            )
        self._ctx = tuple(x.shape)
        return x.reshape(x.shape[0], -1)

    forward = __call__

    def backward(self, dy: Any) -> Any:
        shape = self._take_ctx()
        return dy.reshape(shape)


class Sequential(Layer):
    """Layers applied in order; backward runs them in reverse.

    Children are registered as "0", "1", ... so state_dict keys match torch.nn.Sequential.
    `seq(x, residual=r)` hands `r` to the last layer (which must take `residual=`, like
    Conv2d or BatchNorm2d), so `act(body(x) + r)` costs no extra pass; backward then returns
    `(dx, dresidual)`. `needs_input_grad` flows to the first layer: the others always need
    their input gradient, since it is the previous layer's output gradient.
    """

    def __init__(self, *layers: Layer) -> None:
        for i, layer in enumerate(layers):
            if not isinstance(layer, Layer):
                raise TypeError(f"Sequential item {i} ({type(layer).__name__}) is not a layer "
                                "(a convfuse.nn.Module)")
        devices = {getattr(lyr, "device", None) for lyr in layers} - {None}
        if len(devices) > 1:
            raise ValueError(f"Sequential layers are on different devices: {sorted(devices)}")
        for i, layer in enumerate(layers):
            self.add_module(str(i), layer)
        self.device = devices.pop() if devices else None  # type: ignore[assignment]
        self._ctx = None

    @property
    def layers(self) -> list[Layer]:
        return list(self.children())

    @property  # type: ignore[override]
    def needs_input_grad(self) -> bool:
        return self.__dict__.get("_needs_input_grad", True)

    @needs_input_grad.setter
    def needs_input_grad(self, value: bool) -> None:
        self.__dict__["_needs_input_grad"] = bool(value)
        layers = self.layers
        if layers:
            layers[0].needs_input_grad = bool(value)

    def append(self, layer: Layer) -> Sequential:
        if not isinstance(layer, Layer):
            raise TypeError(f"Sequential.append: {type(layer).__name__} is not a convfuse layer")
        self.add_module(str(len(self)), layer)
        return self

    def __call__(self, x: Any, residual: Any = None) -> Any:
        layers = self.layers
        if residual is not None and not layers:
            raise ValueError("an empty Sequential cannot take a residual")
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            if i == last and residual is not None:
                try:
                    x = layer(x, residual=residual)
                except TypeError as exc:
                    if "residual" not in str(exc):
                        raise
                    raise TypeError(
                        f"Sequential: residual= goes to the last layer, but "
                        f"{type(layer).__name__} takes no residual (end the Sequential with a "
                        "Conv or BatchNorm layer)"
                    ) from None
            else:
                x = layer(x)
        self._ctx = residual is not None
        return x

    forward = __call__

    def backward(self, dy: Any) -> Any:
        had_residual = bool(self._ctx)
        dres = None
        for i, layer in enumerate(reversed(self.layers)):
            out = layer.backward(dy)
            if i == 0 and had_residual:
                dy, dres = out
            else:
                dy = out
        return (dy, dres) if had_residual else dy

    def __len__(self) -> int:
        return len(self.__dict__.get("_module_names", ()))

    def __getitem__(self, i: int) -> Layer:
        layers = self.layers
        if isinstance(i, slice):
            return Sequential(*layers[i])  # type: ignore[return-value]
        return layers[i]

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.layers)
