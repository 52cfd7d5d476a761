"""What every convfuse layer shares: parameters, device moves, and input checks."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import dtypes
from ..backend import device_of, resolve_device, to_device
from ..errors import BackwardBeforeForwardError, DeviceMismatchError
from .parameter import Parameter


class Layer:
    """Base of convfuse layers: `__call__`, `backward`, `parameters()`, `zero_grad()`, `to()`.

    Subclasses keep what backward needs in `self._ctx` between the two calls; backward
    consumes it (like PyTorch freeing the graph), so a second backward needs a new forward.
    """

    device: str

    def parameters(self) -> list[Parameter]:
        return [p for p in vars(self).values() if isinstance(p, Parameter)]

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.zero_grad()

    def to(self, device: str) -> Layer:
        """Move parameters (and their gradients) to 'cuda' or 'cpu'; returns self."""
        target = resolve_device(device)
        for p in self.parameters():
            p.data = to_device(p.data, target)
            p.grad = to_device(p.grad, target)
        self.device = target
        self._ctx = None
        return self

    def _check_input(self, x: Any, name: str = "input") -> None:
        try:
            where = device_of(x)
        except TypeError:
            kind = type(x).__name__
            raise TypeError(
                f"{type(self).__name__} {name} must be a NumPy or CuPy array, got {kind}"
            ) from None
        if where != self.device:
            raise DeviceMismatchError(
                f"{type(self).__name__} is on {self.device!r} but its {name} is on {where!r}; "
                f"move one of them (layer.to({where!r}) or convert the array)"
            )

    def _take_ctx(self) -> Any:
        ctx = getattr(self, "_ctx", None)
        if ctx is None:
            raise BackwardBeforeForwardError(
                f"{type(self).__name__}.backward() called without a preceding forward "
                "(each forward supports one backward)"
            )
        self._ctx = None
        return ctx

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"

    def extra_repr(self) -> str:
        return ""


def init_parameter(values: np.ndarray, dtype: Any, device: str, name: str) -> Parameter:
    """A Parameter from host values drawn in float64, cast once, then moved (seed-stable)."""
    return Parameter(to_device(values.astype(dtypes.canonical(dtype)), device), name)
