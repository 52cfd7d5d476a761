"""AdaptiveAvgPool2d: PyTorch's adaptive average pooling, with its own backward.

Output cell i of an axis of length L pooled to O cells averages the input indices
[floor(i * L / O), ceil((i + 1) * L / O)), exactly as torch.nn.functional.adaptive_avg_pool2d.
A window is a product of one interval per axis and its divisor the product of their
lengths, so the pool is separable: y = Ph @ x @ Pw^T with per-axis averaging matrices.

Note [adaptive pooling without cuBLAS]: CuPy's matmul goes through cuBLAS, whose CuPy
wrapper raises during graph capture. So the common cases (a global pool, and any size that
divides the input) are one reshape + mean reduction, and the general case on CuPy is a
broadcast multiply + sum per axis (elementwise and reduction kernels, both capturable).
NumPy takes the matmul for the general case.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import dtypes
from ..backend import array_module
from .module import Layer


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


def pooling_matrix(length: int, out: int) -> np.ndarray:
    """(out, length) float64 matrix whose row i averages PyTorch's i-th adaptive window."""
    m = np.zeros((out, length))
    for i in range(out):
        start = (i * length) // out
        end = -((-(i + 1) * length) // out)  # ceil
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
        self.output_size = _as_output_size(output_size)
        if not isinstance(layout, str) or layout.upper() not in ("NCHW", "NHWC"):
            raise ValueError(f"AdaptiveAvgPool2d: layout must be 'NCHW' or 'NHWC', "
                             f"got {layout!r}")
        self.layout = layout.upper()
        self.device: str | None = None  # type: ignore[assignment]
        self._ctx = None

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
        y = _pool(x, h, w, oh, ow, ah, aw, dtypes.compute_dtype(dt))
        self._ctx = (tuple(x.shape), x.dtype, y.shape, (h, w, oh, ow))
        return y

    forward = __call__

    def backward(self, dy: Any) -> Any:
        ctx = self._take_ctx()
        x_shape, x_dtype, y_shape, (h, w, oh, ow) = ctx
        try:
            self._check_input(dy, "dy")
            if tuple(dy.shape) != tuple(y_shape) or dy.dtype != x_dtype:
                raise ValueError(
                    f"AdaptiveAvgPool2d: dy has shape {tuple(dy.shape)} and dtype {dy.dtype}, "
                    f"but the forward's output has shape {tuple(y_shape)} and dtype {x_dtype}"
                )
        except Exception:
            self._ctx = ctx  # a rejected dy keeps the forward
            raise
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
        dx = xp.broadcast_to(expanded, split).reshape(x_shape)
        return xp.ascontiguousarray(dx.astype(dy.dtype, copy=False))
    # The adjoint of y = Ph x Pw^T is dx = Ph^T dy Pw: the same separable map, transposed.
    return _separable(dy, (h, oh), (w, ow), ah, aw, acc, adjoint=True).astype(dy.dtype,
                                                                              copy=False)


def _separable(a: Any, hs: tuple[int, int], ws: tuple[int, int], ah: int, aw: int,
               acc: np.dtype, adjoint: bool) -> Any:
    """Contract axis ah with the (out, in) averaging matrix of hs = (in, out), and axis aw
    with that of ws (their transposes when `adjoint`), in dtype acc."""
    xp = array_module(a)
    a = a.astype(acc, copy=False)
    if xp is not np:
        return _separable_cupy(xp, a, hs, ws, ah, aw, acc, adjoint)  # pragma: gpu
    for axis, (length, out) in ((ah, hs), (aw, ws)):
        m = pooling_matrix(length, out).astype(acc)
        a = np.moveaxis(np.tensordot(m.T if adjoint else m, a, axes=([1], [axis])), 0, axis)
    return np.ascontiguousarray(a)


def device_pooling_matrix(xp: Any, length: int, out: int, dtype: Any) -> Any:
    """`pooling_matrix` built by elementwise kernels on xp's device: no host-to-device copy,
    so it may run inside a CUDA graph capture."""
    i = xp.arange(out).reshape(out, 1)
    j = xp.arange(length).reshape(1, length)
    start = (i * length) // out
    end = -((-(i + 1) * length) // out)
    inside = (j >= start) & (j < end)
    return inside.astype(dtype) / (end - start).astype(dtype)


def _separable_cupy(xp: Any, a: Any, hs: tuple[int, int], ws: tuple[int, int], ah: int,
                    aw: int, acc: np.dtype, adjoint: bool) -> Any:
    # Note [adaptive pooling without cuBLAS]: broadcast multiply + sum, one axis at a time.
    for axis, (length, out) in ((ah, hs), (aw, ws)):
        mat = device_pooling_matrix(xp, length, out, acc)
        if adjoint:
            mat = mat.T
        shape = [1] * (a.ndim + 1)
        shape[axis], shape[axis + 1] = mat.shape
        expanded = xp.expand_dims(a, axis)  # a new length-1 axis before the contracted one
        a = (expanded * mat.reshape(shape)).sum(axis=axis + 1)
    return xp.ascontiguousarray(a)
