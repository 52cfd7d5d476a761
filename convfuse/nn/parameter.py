"""Parameter: an array and its gradient, on one device."""

from __future__ import annotations

from typing import Any

from ..backend import array_module, device_of


class Parameter:
    """A trainable array with a gradient of the same shape, dtype and device.

    Layers read `.data` and `.grad` at every call and never keep other references, so an
    optimizer may re-home both into views of one flat buffer (see convfuse.optim).
    """

    __slots__ = ("data", "grad", "name")

    def __init__(self, data: Any, name: str = "") -> None:
        self.data = data
        self.grad = array_module(data).zeros_like(data)
        self.name = name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    @property
    def device(self) -> str:
        return device_of(self.data)

    @property
    def size(self) -> int:
        return int(self.data.size)

    def zero_grad(self) -> None:
        self.grad.fill(0)

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"Parameter{label}(shape={self.shape}, dtype={self.dtype}, device={self.device!r})"
