"""Flatten and Sequential."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..backend import resolve_device
from .module import Layer
from .parameter import Parameter


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
    """Layers applied in order; backward runs them in reverse."""

    def __init__(self, *layers: Layer) -> None:
        for i, layer in enumerate(layers):
            if not (callable(layer) and hasattr(layer, "backward")):
                raise TypeError(f"Sequential item {i} ({type(layer).__name__}) is not a layer")
        self.layers = list(layers)
        devices = {getattr(lyr, "device", None) for lyr in self.layers} - {None}
        if len(devices) > 1:
            raise ValueError(f"Sequential layers are on different devices: {sorted(devices)}")
        self.device = devices.pop() if devices else None  # type: ignore[assignment]

    def __call__(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x

    forward = __call__

    def backward(self, dy: Any) -> Any:
        for layer in reversed(self.layers):
            dy = layer.backward(dy)
        return dy

    def parameters(self) -> list[Parameter]:
        return [p for layer in self.layers for p in layer.parameters()]

    def zero_grad(self) -> None:
        for layer in self.layers:
            layer.zero_grad()

    def to(self, device: str) -> Sequential:
        target = resolve_device(device)
        for layer in self.layers:
            layer.to(target)
        self.device = target
        return self

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> Layer:
        return self.layers[i]

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.layers)

    def __repr__(self) -> str:
        inner = "\n".join(f"  ({i}): {layer!r}" for i, layer in enumerate(self.layers))
        return f"Sequential(\n{inner}\n)"
