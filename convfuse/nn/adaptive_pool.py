"""AdaptiveAvgPool2d: PyTorch's adaptive average pooling, with its own backward.

Output cell i of an axis of length L pooled to O cells averages the input indices
[floor(i * L / O), ceil((i + 1) * L / O)), exactly as torch.nn.functional.adaptive_avg_pool2d.
A window is a product of one interval per axis and its divisor the product of their
lengths, so the pool is separable: y = Ph @ x @ Pw^T with per-axis averaging matrices.

Note [adaptive pooling without cuBLAS]: CuPy's matmul goes through cuBLAS, whose CuPy
wrapper raises during graph capture. So the common cases (a global pool, and any size that
divides the input) are one reshape + mean reduction, and the general case on CuPy sums each
window's slice, one axis at a time (slicing, reduction and elementwise kernels, all
capturable). NumPy takes the matmul for the general case.

Note [non-finite values in adaptive pooling]: a matrix product multiplies every input by
every row's weight, zeros included, so one inf or NaN made 0 * inf = NaN in every output
cell (and in every input gradient), where torch's windows keep it to their own cells. The
window sums are exact in that respect: CuPy always takes them (checking the product's
result would be a host sync), NumPy when its product's result is not all finite (one
check of the small output, no cost to finite data).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import dtypes
from .._memory import check_bytes
from ..backend import array_module, device_of
from ..errors import ArrayTooLargeError
from .module import Layer, renamed


def _as_output_size(output_size: Any) -> tuple[int | None, int | None]:
    items = (output_size, output_size) if not isinstance(output_size, (tuple, list)) \
        else tuple(output_size)
    if len(items) != 2:
        raise ValueError(f"AdaptiveAvgPool2d: output_size must be an int or a pair, "
                         f"got {output_size!r}")
    for v in items:
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"AdaptiveAvgPool2d: output_size entries must be ints or None, "
                            f"got {output_size!r}")
        if v < 1:
            raise ValueError(f"AdaptiveAvgPool2d: output_size entries must be >= 1, "
                             f"got {output_size!r}")
    return tuple(None if v is None else int(v) for v in items)  # type: ignore[return-value]


def windows(length: int, out: int) -> list[tuple[int, int]]:
    """PyTorch's adaptive windows [start, end) of an axis of `length` pooled to `out`."""
    return [((i * length) // out, -((-(i + 1) * length) // out)) for i in range(out)]


def pooling_matrix(length: int, out: int) -> np.ndarray:
    """(out, length) float64 matrix whose row i averages PyTorch's i-th adaptive window."""
    m = np.zeros((out, length))
    for i, (start, end) in enumerate(windows(length, out)):
        m[i, start:end] = 1.0 / (end - start)
    return m


class AdaptiveAvgPool2d(Layer):
    """Average pooling to a fixed output size (PyTorch's `AdaptiveAvgPool2d(output_size)`).

    `output_size` is an int or a pair (None keeps that input dimension). 1 gives the global
    average pool that ends a ResNet. Input (N, C, H, W) in NCHW, (N, H, W, C) in NHWC. Like
    the other pools it has no parameters and follows its input's device unless `.to()` pins
    one. float16/bfloat16 accumulate in float32.
    """

    def __init__(self, output_size: Any, layout: str = "NCHW") -> None:
        self.output_size = output_size
        self.layout = layout
        self.device: str | None = None  # type: ignore[assignment]
        self._ctx = None

    @property
    def output_size(self) -> tuple[int | None, int | None]:
        """(oh, ow), None keeping that input size; assignable as an int or a pair
        (validated)."""
        return self.__dict__["_output_size"]

    @output_size.setter
    def output_size(self, value: Any) -> None:
        self.__dict__["_output_size"] = _as_output_size(value)

    @property
    def layout(self) -> str:
        """'NCHW' or 'NHWC'; assignable (validated, either case)."""
        return self.__dict__["_layout"]

    @layout.setter
    def layout(self, value: Any) -> None:
        if not isinstance(value, str) or value.upper() not in ("NCHW", "NHWC"):
            raise ValueError(f"AdaptiveAvgPool2d: layout must be 'NCHW' or 'NHWC', "
                             f"got {value!r}")
        self.__dict__["_layout"] = value.upper()

    def _check_input(self, x: Any, name: str = "input") -> None:
        if self.device is None:
            try:
                array_module(x)
            except TypeError:
                raise TypeError(f"AdaptiveAvgPool2d: {name} must be a NumPy or CuPy array, "
                                f"got {type(x).__name__}") from None
            return
        super()._check_input(x, name)

    def _axes(self) -> tuple[int, int]:
        return (2, 3) if self.layout == "NCHW" else (1, 2)

    def _out_hw(self, h: int, w: int) -> tuple[int, int]:
        oh, ow = self.output_size
        return (h if oh is None else oh), (w if ow is None else ow)

    def __call__(self, x: Any) -> Any:
        self._check_input(x)
        if x.ndim != 4:
            raise ValueError(f"AdaptiveAvgPool2d expects a 4-d input ({self.layout}), "
                             f"got shape {tuple(x.shape)}")
        try:
            dt = dtypes.canonical(x.dtype)
        except ValueError:
            raise ValueError(f"AdaptiveAvgPool2d: input dtype {x.dtype} is not supported "
                             f"({', '.join(dtypes.SUPPORTED)})") from None
        ah, aw = self._axes()
        h, w = int(x.shape[ah]), int(x.shape[aw])
        if h < 1 or w < 1:
            raise ValueError(f"AdaptiveAvgPool2d: input has an empty spatial dim, "
                             f"shape {tuple(x.shape)}")
        oh, ow = self._out_hw(h, w)
        out = list(x.shape)
        out[ah], out[aw] = oh, ow
        try:  # it may be far larger than x
            check_bytes(out, x.dtype, device_of(x), "output")
        except ArrayTooLargeError as exc:
            raise renamed(exc, "AdaptiveAvgPool2d") from None
        y = _pool(x, h, w, oh, ow, ah, aw, dtypes.compute_dtype(dt))
        self._ctx = (tuple(x.shape), x.dtype, y.shape, (h, w, oh, ow))
        return y

    forward = __call__

    def backward(self, dy: Any) -> Any:
        x_shape, x_dtype, y_shape, (h, w, oh, ow) = self._peek_ctx()
        self._check_input(dy, "dy")
        if tuple(dy.shape) != tuple(y_shape) or dy.dtype != x_dtype:
            raise ValueError(  # a rejected dy keeps the forward's context
                f"AdaptiveAvgPool2d: dy has shape {tuple(dy.shape)} and dtype {dy.dtype}, "
                f"but the forward's output has shape {tuple(y_shape)} and dtype {x_dtype}"
            )
        self._ctx = None
        if not self.needs_input_grad:
            return None
        ah, aw = self._axes()
        return _unpool(dy, x_shape, h, w, oh, ow, ah, aw, dtypes.compute_dtype(x_dtype))

    def extra_repr(self) -> str:
        size = self.output_size
        shown = size[0] if size[0] == size[1] else size
        return f"output_size={shown}" + (", layout='NHWC'" if self.layout == "NHWC" else "")


def _split_shape(shape: tuple[int, ...], ah: int, aw: int, oh: int, ow: int
                 ) -> tuple[int, ...]:
    """The input shape with H -> (oh, H/oh) and W -> (ow, W/ow): one axis per window."""
    out: list[int] = []
    for axis, n in enumerate(shape):
        if axis == ah:
            out += [oh, n // oh]
        elif axis == aw:
            out += [ow, n // ow]
        else:
            out.append(n)
    return tuple(out)


def _pool(x: Any, h: int, w: int, oh: int, ow: int, ah: int, aw: int, acc: np.dtype) -> Any:
    if h % oh == 0 and w % ow == 0:
        # Windows tile the input: one reshape and one mean reduction (capturable on CuPy).
        split = x.reshape(_split_shape(tuple(x.shape), ah, aw, oh, ow))
        y = split.mean(axis=(ah + 1, aw + 2), dtype=acc)
        return y.astype(x.dtype, copy=False)
    return _separable(x, (h, oh), (w, ow), ah, aw, acc, adjoint=False).astype(x.dtype,
                                                                              copy=False)


def _unpool(dy: Any, x_shape: tuple[int, ...], h: int, w: int, oh: int, ow: int, ah: int,
            aw: int, acc: np.dtype) -> Any:
    xp = array_module(dy)
    if h % oh == 0 and w % ow == 0:
        kh, kw = h // oh, w // ow
        scaled = dy.astype(acc) * acc.type(1.0 / (kh * kw))
        expanded = xp.expand_dims(xp.expand_dims(scaled, aw + 1), ah + 1)
        split = _split_shape(x_shape, ah, aw, oh, ow)
        dx = xp.broadcast_to(expanded, split).reshape(x_shape).astype(dy.dtype, copy=False)
        if xp is np and not dx.flags.writeable:  # windows of one: reshape kept the view
            dx = dx.copy()
        return xp.ascontiguousarray(dx)
    # The adjoint of y = Ph x Pw^T is dx = Ph^T dy Pw: the same separable map, transposed.
    return _separable(dy, (h, oh), (w, ow), ah, aw, acc, adjoint=True).astype(dy.dtype,
                                                                              copy=False)


def _separable(a: Any, hs: tuple[int, int], ws: tuple[int, int], ah: int, aw: int,
               acc: np.dtype, adjoint: bool) -> Any:
    """Contract axis ah with the (out, in) averaging matrix of hs = (in, out), and axis aw
    with that of ws (their transposes when `adjoint`), in dtype acc."""
    xp = array_module(a)
    a = a.astype(acc, copy=False)
    if xp is not np:  # Note [adaptive pooling without cuBLAS]
        return _separable_windows(xp, a, hs, ws, ah, aw, acc, adjoint)  # pragma: gpu
    out = a
    try:
        for axis, (length, n) in ((ah, hs), (aw, ws)):
            m = pooling_matrix(length, n).astype(acc)
            out = np.moveaxis(np.tensordot(m.T if adjoint else m, out, axes=([1], [axis])),
                              0, axis)
    except (RuntimeWarning, FloatingPointError):  # 0 * inf under warnings-as-errors
        out = None
    if out is None or not np.isfinite(out).all():
        # Note [non-finite values in adaptive pooling]; inf + -inf in a window is NaN, as
        # in torch, silently (only non-finite data comes here)
        with np.errstate(all="ignore"):
            return _separable_windows(np, a, hs, ws, ah, aw, acc, adjoint)
    return np.ascontiguousarray(out)


def _separable_windows(xp: Any, a: Any, hs: tuple[int, int], ws: tuple[int, int], ah: int,
                       aw: int, acc: np.dtype, adjoint: bool) -> Any:
    """What `_separable` computes, window by window (a sum of each window's slice, or its
    adjoint, an add into each window's slice): exact for inf and NaN, and free of cuBLAS."""
    for axis, (length, n) in ((ah, hs), (aw, ws)):
        def at(start: int, end: int, axis: int = axis) -> tuple[slice, ...]:
            return (slice(None),) * axis + (slice(start, end),)

        spans = windows(length, n)
        if adjoint:  # a holds n cells on `axis`; each spreads over its window
            shape = list(a.shape)
            shape[axis] = length
            grown = xp.zeros(shape, dtype=acc)
            for i, (start, end) in enumerate(spans):
                grown[at(start, end)] += a[at(i, i + 1)] * acc.type(1.0 / (end - start))
            a = grown
        else:
            a = xp.concatenate([a[at(start, end)].sum(axis=axis, keepdims=True)
                                * acc.type(1.0 / (end - start)) for start, end in spans],
                               axis=axis)
    return xp.ascontiguousarray(a)
