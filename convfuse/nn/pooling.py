"""MaxPool2d and AvgPool2d through cuDNN pooling (GPU) or the reference engine (CPU).

Hyperparameters after construction: `kernel_size`, `stride`, `padding` and `layout` may be
assigned; each assignment is validated together with the others (padding at most half
the kernel, as PyTorch) and clears the per-shape geometry cache, so the next call uses it.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

from .. import ops
from .._memory import check_bytes
from ..backend import device_of
from ..errors import DeviceMismatchError
from ..geometry import IntOrTuple, parse_layout
from ..pool_geometry import PoolGeometry
from . import _hyper
from ._memo import checked_geometry, forget_geometries
from .module import USER_ERRORS, Layer, contiguous, renamed

_P = TypeVar("_P", bound="_Pool2d")


class _Pool2d(Layer):
    _mode = ""
    _kernel: tuple[int, ...]
    _stride: tuple[int, ...]
    _padding: tuple[int, ...]
    _layout: str

    def __init__(
        self,
        kernel_size: IntOrTuple,
        stride: IntOrTuple | None = None,
        padding: IntOrTuple = 0,
        layout: str = "NCHW",
    ) -> None:
        # A layer without parameters follows its input unless .to() pins a device.
        self.device: str | None = None  # type: ignore[assignment]
        self._ctx = None
        self._configure(kernel_size, stride, padding, layout)

    def _configure(self, kernel_size: Any, stride: Any, padding: Any, layout: Any) -> None:
        """Validate all four on a shape they must fit, then store them (or change nothing)."""
        try:
            kernel = _hyper.int_tuple(kernel_size, 2, "kernel_size", 1, "pooling")
            stride_t = kernel if stride is None else _hyper.int_tuple(stride, 2, "stride", 1,
                                                                      "pooling")
            pad = _hyper.int_tuple(padding, 2, "padding", 0, "pooling")
            if not isinstance(layout, str):
                raise TypeError(f"layout must be a str such as 'NCHW' or 'NHWC', got "
                                f"{type(layout).__name__} {layout!r}")
            parse_layout(layout, 2)
            probe = tuple(k + 2 * p for k, p in zip(kernel, pad))
            PoolGeometry.create((1, 1, *probe), kernel, stride_t, pad, self._mode, "NCHW")
        except USER_ERRORS as exc:
            raise renamed(exc, type(self).__name__) from None
        d = self.__dict__
        d["_kernel"], d["_stride"], d["_padding"] = kernel, stride_t, pad
        d["_layout"] = layout.upper()
        forget_geometries(self)  # every remembered geometry was for the old values

    def _checked_geometry(self, x: Any) -> PoolGeometry:
        geom = PoolGeometry.create(x.shape, self._kernel, self._stride, self._padding,
                                   self._mode, self._layout)
        check_bytes(geom.output_shape, x.dtype, device_of(x), "output")
        return geom

    def _now(self) -> dict[str, Any]:
        return {"kernel_size": self._kernel, "stride": self._stride, "padding": self._padding,
                "layout": self._layout}

    def _assign(self, name: str, value: Any) -> None:
        now = self._now()
        now[name] = value
        self._configure(**now)

    kernel_size = property(lambda self: self._kernel,
                           lambda self, v: self._assign("kernel_size", v))
    stride = property(lambda self: self._stride, lambda self, v: self._assign("stride", v))
    padding = property(lambda self: self._padding, lambda self, v: self._assign("padding", v))
    layout = property(lambda self: self._layout, lambda self, v: self._assign("layout", v))

    def to(self: _P, device: str) -> _P:
        super().to(device)
        return self

    def __call__(self, x: Any) -> Any:
        """A non-C-contiguous x is copied once (the caller's array is never modified)."""
        try:
            self._check_input(x)
            if x.ndim != 4:
                raise ValueError(f"expects a 4-d input ({self._layout}), got shape "
                                 f"{tuple(x.shape)}")
            x = contiguous(x)
            geom = checked_geometry(self, (tuple(x.shape), x.dtype, device_of(x)),
                                    lambda: self._checked_geometry(x))
            y = ops.pool_forward(x, geom)
        except USER_ERRORS as exc:
            raise self._renamed(exc) from None
        if isinstance(y, np.ndarray):
            y.flags.writeable = False  # saved for backward: an in-place write would corrupt dx
        self._ctx = (x, y, geom)
        return y

    forward = __call__

    def backward(self, dy: Any) -> Any:
        """dx. Atomic and repeatable: see Layer's backward rule."""
        return self._backward_with(dy, self._backward)

    def _backward(self, ctx: Any, dy: Any) -> Any:
        x, y, geom = ctx
        dy = self._check_dy(dy, y.shape, y.dtype)
        if device_of(dy) != device_of(x):
            raise DeviceMismatchError(f"dy is on {device_of(dy)!r} but the forward ran on "
                             f"{device_of(x)!r}")
        if not self.needs_input_grad:
            return None
        return ops.pool_backward(dy, x, y, geom)

    def extra_repr(self) -> str:
        return (f"kernel_size={self._kernel}, stride={self._stride}, "
                f"padding={self._padding}, layout={self._layout!r}")


class MaxPool2d(_Pool2d):
    """Max over each window; padding counts as -inf (never selected)."""

    _mode = "max"


class AvgPool2d(_Pool2d):
    """Mean over each window, padding included in the divisor (PyTorch's default)."""

    _mode = "avg"
