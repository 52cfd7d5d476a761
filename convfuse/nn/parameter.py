"""Parameter: an array and its gradient, on one device."""

from __future__ import annotations

from typing import Any

from ..backend import array_module, device_of


def check_set_to_none(owner: str, set_to_none: Any) -> None:
    """zero_grad's `set_to_none`, PyTorch's argument: only a false value, since a convfuse
    gradient is always an array (the optimizers' flat buffer holds it as a view)."""
    if set_to_none:  # PyTorch's test: any false value zeroes
        raise ValueError(
            f"{owner}.zero_grad: set_to_none={set_to_none!r} is not supported: a convfuse "
            "gradient is always an array (a view of the optimizer's flat buffer), so "
            "zero_grad fills it with zeros; call zero_grad() or zero_grad(set_to_none=False)")


class Parameter:
    """A trainable array with a gradient of the same shape, dtype and device.

    Layers read `.data` and `.grad` at every call and never keep other references, so an
    optimizer may re-home both into views of one flat buffer (see convfuse.optim).

    `_version` counts writes convfuse knows about: assigning `.data`, an optimizer step
    and `load_state_dict` bump it (an optimizer taking the values over, `rehome`, does
    not). A layer records it at forward and its backward refuses to run if it changed
    (PyTorch's "modified by an inplace operation" check). Writes made directly into the
    array (`p.data[...] = v`) are not counted: nothing sees them without a copy or a
    device sync (README, "Behaviour worth knowing").
    """

    __slots__ = ("_data", "_version", "grad", "name")

    def __init__(self, data: Any, name: str = "") -> None:
        device_of(data)  # TypeError unless a NumPy or CuPy array
        self._version = 0
        self._data = data
        self.grad: Any = array_module(data).zeros_like(data)
        self.name = name

    @property
    def data(self) -> Any:
        return self._data

    @data.setter
    def data(self, value: Any) -> None:
        device_of(value)
        self._data = value
        self._version += 1

    def rehome(self, data: Any) -> None:
        """Point at `data`, another array holding the same values (an optimizer's flat
        buffer takes them over): not a write, so the version stays and a forward saved
        before still runs its backward."""
        if tuple(data.shape) != self.shape or data.dtype != self.dtype:
            raise ValueError(f"rehome: {data.dtype}{tuple(data.shape)} cannot stand for "
                             f"{self.dtype}{self.shape}")
        device_of(data)
        self._data = data

    def bump_version(self) -> None:
        """Record an in-place write to `.data` (optimizers and load_state_dict call it)."""
        self._version += 1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._data.shape)

    @property
    def dtype(self) -> Any:
        return self._data.dtype

    @property
    def device(self) -> str:
        return device_of(self._data)

    @property
    def size(self) -> int:
        return int(self._data.size)

    def zero_grad(self) -> None:
        """Zero the gradient in place; a gradient set to None is allocated again."""
        if self.grad is None:
            self.grad = array_module(self._data).zeros_like(self._data)
        else:
            self.grad.fill(0)

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"Parameter{label}(shape={self.shape}, dtype={self.dtype}, device={self.device!r})"
