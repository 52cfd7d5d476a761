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

    `state_axes` is the order a checkpoint holds the array in, as axes of the stored one
    (None: as stored). A channels-last conv stores its weight (K, *kernel, C) and
    `state_dict` saves it (K, C, *kernel); the layer sets `state_axes` to say so, because
    an optimizer sees only Parameters and must save its per-parameter state (momentum,
    Adam's moments) in that same order, or a checkpoint moved between layouts would load
    it transposed.
    """

    __slots__ = ("_data", "_state_axes", "_version", "grad", "name")

    def __init__(self, data: Any, name: str = "") -> None:
        device_of(data)  # TypeError unless a NumPy or CuPy array
        self._version = 0
        self._data = data
        # C order whatever the data's: backward accumulates into a contiguous gradient
        self.grad: Any = array_module(data).zeros_like(data, order="C")
        self.name = name
        self._state_axes: tuple[int, ...] | None = None

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

    @property
    def state_axes(self) -> tuple[int, ...] | None:
        """The checkpoint's axis order, as a permutation of the stored array's axes; None
        when a checkpoint holds the array as stored."""
        # a Parameter pickled before this slot existed has it unset: it meant "as stored"
        return getattr(self, "_state_axes", None)

    @state_axes.setter
    def state_axes(self, axes: tuple[int, ...] | None) -> None:
        n = len(self.shape)
        if axes is not None and not (isinstance(axes, tuple) and all(
                isinstance(a, int) and not isinstance(a, bool) for a in axes)):
            raise TypeError(f"Parameter.state_axes must be None or a tuple of int axes, got "
                            f"{type(axes).__name__} {axes!r}")
        if axes is not None and sorted(axes) != list(range(n)):
            raise ValueError(f"Parameter.state_axes must be None or a permutation of "
                             f"range({n}), got {axes!r}")
        # the identity is stored as None, so "as stored" has one spelling
        self._state_axes = None if axes is None or axes == tuple(range(n)) else axes

    def to_state_layout(self, array: Any) -> Any:
        """`array` (shaped as `.data`) as a checkpoint holds it: a view, transposed."""
        axes = self.state_axes
        return array if axes is None else array.transpose(axes)

    def from_state_layout(self, array: Any) -> Any:
        """Inverse of `to_state_layout`: a checkpoint's array in the stored order (a view)."""
        axes = self.state_axes
        if axes is None:
            return array
        return array.transpose(tuple(sorted(range(len(axes)), key=axes.__getitem__)))

    @property
    def state_shape(self) -> tuple[int, ...]:
        """The shape a checkpoint holds this parameter (and its optimizer state) in."""
        axes = self.state_axes
        shape = self.shape
        return shape if axes is None else tuple(shape[a] for a in axes)

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
            self.grad = array_module(self._data).zeros_like(self._data, order="C")
        else:
            self.grad.fill(0)

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"Parameter{label}(shape={self.shape}, dtype={self.dtype}, device={self.device!r})"
