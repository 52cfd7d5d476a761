"""MaxPool2d and AvgPool2d through cuDNN pooling (GPU) or the reference engine (CPU)."""

from __future__ import annotations

from typing import Any

from .. import ops
from ..backend import array_module
from ..geometry import IntOrTuple, as_tuple
from ..pool_geometry import PoolGeometry
from .module import Layer


class _Pool2d(Layer):
    _mode = ""

    def __init__(
        self,
        kernel_size: IntOrTuple,
        stride: IntOrTuple | None = None,
        padding: IntOrTuple = 0,
        layout: str = "NCHW",
    ) -> None:
        self.kernel_size = as_tuple(kernel_size, 2, "kernel_size")
        self.stride = self.kernel_size if stride is None else as_tuple(stride, 2, "stride")
        self.padding = as_tuple(padding, 2, "padding")
        self.layout = layout.upper()
        # A layer without parameters follows its input unless .to() pins a device.
        self.device: str | None = None  # type: ignore[assignment]
        self._geoms: dict[tuple[int, ...], PoolGeometry] = {}
        self._ctx = None
        # Validate the hyperparameters now, on a shape they must fit.
        probe = tuple(k + 2 * p for k, p in zip(self.kernel_size, self.padding))
        PoolGeometry.create((1, 1, *probe), self.kernel_size, self.stride, self.padding,
                            self._mode, "NCHW")

    def to(self, device: str) -> _Pool2d:
        super().to(device)
        return self

    def _check_input(self, x: Any, name: str = "input") -> None:
        if self.device is None:
            array_module(x)  # type check only
            return
        super()._check_input(x, name)

    def __call__(self, x: Any) -> Any:
        self._check_input(x)
        if x.ndim != 4:
            raise ValueError(f"{type(self).__name__} expects a 4-d input ({self.layout}), "
                             f"got shape {tuple(x.shape)}")
        geom = self._geoms.get(tuple(x.shape))
        if geom is None:
            geom = PoolGeometry.create(x.shape, self.kernel_size, self.stride, self.padding,
                                       self._mode, self.layout)
            self._geoms[tuple(x.shape)] = geom
        y = ops.pool_forward(x, geom)
        self._ctx = (x, y, geom)
        return y

    forward = __call__

    def backward(self, dy: Any) -> Any:
        x, y, geom = self._take_ctx()
        if tuple(dy.shape) != tuple(y.shape):
            self._ctx = (x, y, geom)
            raise ValueError(f"dy has shape {tuple(dy.shape)}, but the forward's output has "
                             f"shape {tuple(y.shape)}")
        if not self.needs_input_grad:
            return None
        return ops.pool_backward(dy, x, y, geom)

    def extra_repr(self) -> str:
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, layout={self.layout!r}")


class MaxPool2d(_Pool2d):
    """Max over each window; padding counts as -inf (never selected)."""

    _mode = "max"


class AvgPool2d(_Pool2d):
    """Mean over each window, padding included in the divisor (PyTorch's default)."""

    _mode = "avg"
