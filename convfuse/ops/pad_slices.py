"""The explicit padding of convfuse.pad_geometry, written once for NumPy and CuPy.

Padding and its backward are pure data movement, so both engines run this same slicing
code with their array module: on CuPy every step is a device copy or add on the current
stream, with no host sync and no custom kernel. Each dim is padded (and folded back) in
turn; the maps of different dims commute, so the order is free.

Note [pad backward]: the padded input's gradient folds back into the input's: the
interior as it is, plus each border element's gradient added where forward read it from.
  reflect    begin j < p  came from  p - j        (mirrored, the edge itself excluded)
             end   t < q  came from  n - 2 - t
  replicate  every begin element came from 0, every end element from n - 1 (summed)
  circular   begin j < p  came from  n - p + j    (wrapped)
             end   t < q  came from  t
  zeros      the borders read nothing; they are dropped.
Sums run in the compute dtype (float32 for float16/bfloat16) and round once at the end,
as the reference engine's arithmetic does.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..dtypes import compute_dtype
from ..pad_geometry import PadGeometry


def _at(ndim: int, axis: int, index: slice) -> tuple[slice, ...]:
    out = [slice(None)] * ndim
    out[axis] = index
    return tuple(out)


def pad_forward(xp: ModuleType, x: Any, g: PadGeometry) -> Any:
    """A new C-contiguous array of g.output_shape: x padded by g.mode."""
    y = xp.empty(g.output_shape, dtype=x.dtype)
    axes, nd = g.spatial_axes, x.ndim
    inner = [slice(None)] * nd
    for a, (lo, _), n in zip(axes, g.pads, g.spatial):
        inner[a] = slice(lo, lo + n)
    y[tuple(inner)] = x
    # Dim by dim: axes already done span their whole padded range, later ones only the
    # interior, so every border element is written once, from elements already written.
    region = list(inner)
    for a, (lo, hi), n in zip(axes, g.pads, g.spatial):
        for dst, src in _border_sources(g.mode, lo, hi, n):
            region[a] = dst
            target = tuple(region)
            if src is None:
                y[target] = 0
            else:
                region[a] = src
                y[target] = y[tuple(region)]
        region[a] = slice(None)
    return y


def _border_sources(mode: str, lo: int, hi: int, n: int
                    ) -> list[tuple[slice, slice | None]]:
    """(destination, source) index ranges along one padded dim; source None: zeros."""
    end = lo + n  # first end-border index in the padded dim
    out: list[tuple[slice, slice | None]] = []
    if lo:
        src_lo = {"zeros": None,
                  "reflect": slice(2 * lo, lo, -1),  # lo + (lo - j) for j = 0 .. lo-1
                  "replicate": slice(lo, lo + 1),  # broadcast along the border
                  "circular": slice(end - lo, end)}[mode]
        out.append((slice(0, lo), src_lo))
    if hi:
        src_hi = {"zeros": None,
                  "reflect": slice(end - 2, end - 2 - hi, -1) if end - 2 - hi >= 0
                  else slice(end - 2, None, -1),
                  "replicate": slice(end - 1, end),
                  "circular": slice(lo, lo + hi)}[mode]
        out.append((slice(end, end + hi), src_hi))
    return out


def pad_backward(xp: ModuleType, dy: Any, g: PadGeometry) -> Any:
    """dx of g.input_shape: dy folded back per Note [pad backward]."""
    acc = compute_dtype(dy.dtype)
    grad = dy.astype(acc, copy=dy.dtype != acc)
    for a, (lo, hi), n in zip(g.spatial_axes, g.pads, g.spatial):
        grad = _fold(xp, grad, a, lo, hi, n, g.mode)
    return xp.ascontiguousarray(grad.astype(dy.dtype, copy=False))


def _fold(xp: ModuleType, grad: Any, a: int, lo: int, hi: int, n: int, mode: str) -> Any:
    nd = grad.ndim
    end = lo + n
    out = grad[_at(nd, a, slice(lo, end))].copy()
    begin_g = grad[_at(nd, a, slice(0, lo))]
    end_g = grad[_at(nd, a, slice(end, end + hi))]
    if mode == "reflect":
        if lo:
            out[_at(nd, a, slice(1, lo + 1))] += xp.flip(begin_g, axis=a)
        if hi:
            out[_at(nd, a, slice(n - 1 - hi, n - 1))] += xp.flip(end_g, axis=a)
    elif mode == "replicate":
        if lo:
            out[_at(nd, a, slice(0, 1))] += begin_g.sum(axis=a, keepdims=True)
        if hi:
            out[_at(nd, a, slice(n - 1, n))] += end_g.sum(axis=a, keepdims=True)
    elif mode == "circular":
        if lo:
            out[_at(nd, a, slice(n - lo, n))] += begin_g
        if hi:
            out[_at(nd, a, slice(0, hi))] += end_g
    return out
