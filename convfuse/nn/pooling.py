"""MaxPool2d and AvgPool2d through cuDNN pooling (GPU) or the reference engine (CPU).

Hyperparameters after construction: `kernel_size`, `stride`, `padding` and `layout` may be
assigned; each assignment is validated together with the others (padding at most half
the kernel, as PyTorch) and clears the per-shape geometry cache, so the next call uses it.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

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

    # torch.nn's other arguments and the one value of each that convfuse computes
    _fixed: ClassVar[dict[str, Any]] = {}

    def _init(self, kernel_size: IntOrTuple, stride: IntOrTuple | None, padding: IntOrTuple,
              layout: str, fixed: dict[str, Any]) -> None:
        for name, value in fixed.items():
            self._check_fixed(name, value)
        # A layer without parameters follows its input unless .to() pins a device.
        self.device: str | None = None  # type: ignore[assignment]
        self._ctx = None
        self._configure(kernel_size, stride, padding, layout)

    def _check_fixed(self, name: str, value: Any) -> None:
        """torch.nn's argument `name` at the value convfuse computes, or a ValueError naming
        it (its truth value for the flags, as torch.nn reads them)."""
        want = self._fixed[name]
        if name == "dilation":
            try:
                ok = _hyper.int_tuple(value, 2, "dilation", 1, "pooling") == (1, 1)
            except USER_ERRORS:
                ok = False
        elif want is None:
            ok = value is None
        else:
            ok = bool(value) == want
        if not ok:
            supported = ", ".join(f"{k}={v!r}" for k, v in self._fixed.items())
            raise ValueError(f"{type(self).__name__}: {name}={value!r} is not supported; "
                             f"convfuse's pools compute {supported}")

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


def _fixed_property(name: str) -> property:
    """torch.nn's attribute `name`: its one supported value; an assignment is checked."""
    return property(lambda self: self._fixed[name],
                    lambda self, v: self._check_fixed(name, v),
                    doc=f"torch.nn's `{name}`, at the one value convfuse computes.")


class MaxPool2d(_Pool2d):
    """Max over each window; padding counts as -inf (never selected). torch.nn's arguments,
    in its order; `dilation`, `return_indices` and `ceil_mode` only at their defaults."""

    _mode = "max"
    _fixed: ClassVar[dict[str, Any]] = {"dilation": 1, "return_indices": False, "ceil_mode": False}
    dilation = _fixed_property("dilation")
    return_indices = _fixed_property("return_indices")
    ceil_mode = _fixed_property("ceil_mode")

    def __init__(self, kernel_size: IntOrTuple, stride: IntOrTuple | None = None,
                 padding: IntOrTuple = 0, dilation: IntOrTuple = 1,
                 return_indices: bool = False, ceil_mode: bool = False, *,
                 layout: str = "NCHW") -> None:
        self._init(kernel_size, stride, padding, layout,
                   {"dilation": dilation, "return_indices": return_indices,
                    "ceil_mode": ceil_mode})


class AvgPool2d(_Pool2d):
    """Mean over each window, padding included in the divisor (PyTorch's default). torch.nn's
    arguments, in its order; `ceil_mode`, `count_include_pad` and `divisor_override` only at
    their defaults."""

    _mode = "avg"
    _fixed: ClassVar[dict[str, Any]] = {"ceil_mode": False, "count_include_pad": True,
                                        "divisor_override": None}
    ceil_mode = _fixed_property("ceil_mode")
    count_include_pad = _fixed_property("count_include_pad")
    divisor_override = _fixed_property("divisor_override")

    def __init__(self, kernel_size: IntOrTuple, stride: IntOrTuple | None = None,
                 padding: IntOrTuple = 0, ceil_mode: bool = False,
                 count_include_pad: bool = True, divisor_override: int | None = None, *,
                 layout: str = "NCHW") -> None:
        self._init(kernel_size, stride, padding, layout,
                   {"ceil_mode": ceil_mode, "count_include_pad": count_include_pad,
                    "divisor_override": divisor_override})
