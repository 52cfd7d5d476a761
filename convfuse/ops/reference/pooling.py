"""Max and average pooling, forward and backward, on NumPy arrays (see PoolGeometry).

Every pass is a handful of whole-array ufuncs per kernel offset over a channels-first view
(the slice of the input, padded where the geometry pads, that each output position sees at
that offset), with `out=` buffers and no boolean fancy indexing. The batch is split across
threads (`_threads.parallel_for`); each thread owns its samples' slice of the result.

Note [max-pool ties]
The gradient of a window goes where PyTorch's CPU kernel (and its saved indices) send it:
walking the window's real elements in row-major order from a running maximum of -inf,
an element takes over when it is greater than the maximum or is NaN. So:
- ties go to the first maximal element;
- a window holding NaN outputs NaN and sends its gradient to its LAST NaN;
- a window whose real elements are all -inf sends it to its first real element, never into
  padding (padding is -inf and is never taken, since -inf is not greater than -inf).
The forward needs only the maximum (np.maximum propagates NaN, as PyTorch's output does);
the backward recomputes the winners from x in one pass per offset, which costs less than
keeping indices between calls would save, and keeps the engine stateless. y is accepted
for parity with cuDNN's poolingBackward and is not read.

Note [first maximal element]
When windows tile the input (stride == kernel, no padding) and hold no NaN, the winner of
a window is simply its first element equal to the window's maximum: the walk below only
ever replaces its winner by a strictly greater element, and padding, which could hold the
maximum -inf, does not occur. The backward then recomputes y (one np.maximum per offset)
and takes, offset by offset, the elements equal to y that no earlier offset matched:
ties at zero, which every ReLU before a max-pool makes common, cost nothing extra. Six
passes per offset instead of ten; a NaN window sends its piece to the walk.

Note [branch-free masks]
np.copyto(..., where=mask) and boolean indexing branch per element, and a max-pool mask is
close to random (about 1 in 4 for 2x2 windows): they ran 5-20x slower than plain ufuncs
here. So the winners' index is a running np.maximum, and the gradient is placed with
bitwise AND against an all-ones/all-zeros mask of the float's width, which also keeps a
NaN or inf in dy from leaking into the positions that do not win (d * 0 would).
"""

from __future__ import annotations

import itertools

import numpy as np

from ...dtypes import compute_dtype
from ...pool_geometry import PoolGeometry
from . import _threads
from .activation import finish


def _channels_first(a: np.ndarray, pg: PoolGeometry) -> np.ndarray:
    return np.moveaxis(a, -1, 1) if pg.channels_last else a


def _padded(xc: np.ndarray, pg: PoolGeometry, fill: float, cd: np.dtype) -> np.ndarray:
    """xc (channels-first) in the compute dtype, padded with `fill`; a view when no pad and
    no cast is needed (the passes only read it)."""
    if not any(pg.padding):
        return xc if xc.dtype == cd else xc.astype(cd)
    shape = (*xc.shape[:2], *(n + 2 * p for n, p in zip(xc.shape[2:], pg.padding, strict=True)))
    xp = np.full(shape, fill, cd)
    xp[(slice(None), slice(None), *(slice(p, p + n) for p, n in
                                    zip(pg.padding, xc.shape[2:], strict=True)))] = xc
    return xp


def _offsets(pg: PoolGeometry) -> list[tuple[slice, ...]]:
    """For each kernel offset (row-major), the padded-input slice its output positions see."""
    return [
        (slice(None), slice(None), *(
            slice(i, i + s * (o - 1) + 1, s)
            for i, s, o in zip(offset, pg.stride, pg.output_spatial, strict=True)
        ))
        for offset in itertools.product(*(range(k) for k in pg.kernel_size))
    ]


def _padded_spatial(pg: PoolGeometry) -> tuple[int, ...]:
    return tuple(n + 2 * p for n, p in zip(pg.input_shape_cf[2:], pg.padding, strict=True))


def _crop(dxp: np.ndarray, pg: PoolGeometry) -> np.ndarray:
    if not any(pg.padding):
        return dxp
    sizes = pg.input_shape_cf[2:]
    return dxp[(slice(None), slice(None), *(slice(p, p + n) for p, n in
                                            zip(pg.padding, sizes, strict=True)))]


def _first_real_offset(pg: PoolGeometry, dtype: np.dtype) -> np.ndarray:
    """Per output position (broadcastable over N, C), the row-major index of the first
    window element inside the input: where an all -inf window sends its gradient."""
    index = np.zeros((1,) * len(pg.kernel_size), dtype)
    weight = 1
    for axis in range(len(pg.kernel_size) - 1, -1, -1):
        o = np.arange(pg.output_spatial[axis])
        first = np.maximum(0, pg.padding[axis] - o * pg.stride[axis])
        shape = [1] * len(pg.kernel_size)
        shape[axis] = -1
        index = index + (first * weight).astype(dtype).reshape(shape)
        weight *= pg.kernel_size[axis]
    return index[None, None]


def _may_hold_nan(a: np.ndarray) -> bool:
    # one fast reduction: any NaN (or inf - inf, or overflow) makes the sum non-finite,
    # and then the NaN-aware path runs; finite sums prove there is no NaN
    with np.errstate(invalid="ignore", over="ignore"):
        return not np.isfinite(np.add.reduce(a, axis=None, dtype=np.float64))


def _max_forward(xp: np.ndarray, out: np.ndarray, offsets: list) -> None:
    np.copyto(out, xp[offsets[0]])
    for where in offsets[1:]:
        np.maximum(out, xp[where], out=out)


def _avg_forward(xp: np.ndarray, out: np.ndarray, offsets: list, window: int) -> None:
    np.copyto(out, xp[offsets[0]])
    for where in offsets[1:]:
        out += xp[where]
    out /= window


def _max_winners(xp: np.ndarray, pg: PoolGeometry, offsets: list) -> np.ndarray:
    """Per output position, the offset index of the element that gets its gradient.

    Branch-free (Note [branch-free masks]): an element that takes over has a larger offset
    index than any earlier winner (offsets are walked in order, and the initial winner is
    the first real element), so the index is a running maximum of take * i.
    """
    out_shape = (*xp.shape[:2], *pg.output_spatial)
    index_dtype = np.dtype(np.uint8 if len(offsets) <= 255 else np.int32)
    arg = np.empty(out_shape, index_dtype)
    arg[...] = _first_real_offset(pg, index_dtype)
    best = np.full(out_shape, -np.inf, xp.dtype)
    take = np.empty(out_shape, bool)
    step = np.empty(out_shape, index_dtype)
    nan = np.empty(out_shape, bool) if _may_hold_nan(xp) else None
    for i, where in enumerate(offsets):
        v = xp[where]
        np.greater(v, best, out=take)
        if nan is not None:
            np.isnan(v, out=nan)
            take |= nan
        np.maximum(best, v, out=best)  # NaN sticks, as the rule wants
        np.multiply(take, index_dtype.type(i), out=step)
        np.maximum(arg, step, out=arg)
    return arg


def _scatter_winners(target: np.ndarray, d: np.ndarray, arg: np.ndarray, offsets: list,
                     overlap: bool) -> None:
    """target[offset i] (+)= d where arg == i, with bit masks (Note [branch-free masks])."""
    bits = np.dtype(f"u{d.dtype.itemsize}")
    d_bits = d.view(bits)
    hit = np.empty(arg.shape, bool)
    mask = np.empty(arg.shape, bits)
    part = np.empty(arg.shape, d.dtype) if overlap else None
    for i, where in enumerate(offsets):
        np.equal(arg, i, out=hit)
        np.copyto(mask, hit, casting="unsafe")
        np.negative(mask, out=mask)  # 1 -> all ones, 0 -> 0
        if part is None:  # windows do not share elements: each is written once
            np.bitwise_and(d_bits, mask, out=target[where].view(bits))
        else:
            np.bitwise_and(d_bits, mask, out=part.view(bits))
            target[where] += part


def _tiled(pg: PoolGeometry) -> bool:
    """Windows tile the input without padding or overlap (stride == kernel, the common
    2x2/2 max-pool): each input element belongs to at most one window."""
    return not any(pg.padding) and pg.stride == pg.kernel_size


def _scatter_first(target: np.ndarray, d: np.ndarray, x: np.ndarray, offsets: list) -> bool:
    """Note [first maximal element]: target gets d at each window's first maximal element;
    False, writing nothing, when a window holds NaN."""
    best = np.empty(d.shape, x.dtype)
    _max_forward(x, best, offsets)
    if np.isnan(best).any():  # NaN windows follow the walk's last-NaN rule
        return False
    bits = np.dtype(f"u{d.dtype.itemsize}")
    d_bits, mask = d.view(bits), np.empty(d.shape, bits)
    hit, first, taken = (np.empty(d.shape, bool) for _ in range(3))
    taken.fill(False)
    for where in offsets:
        np.equal(x[where], best, out=hit)
        np.greater(hit, taken, out=first)  # a hit where no earlier offset had one
        taken |= hit
        np.copyto(mask, first, casting="unsafe")
        np.negative(mask, out=mask)  # 1 -> all ones, 0 -> 0
        np.bitwise_and(d_bits, mask, out=target[where].view(bits))
    return True


def pool_forward(x: np.ndarray, pg: PoolGeometry) -> np.ndarray:
    """y: the max or the mean (padding counted) of every window, in x's dtype and layout."""
    cd = compute_dtype(x.dtype)
    xc = _channels_first(x, pg)
    yc = np.empty((xc.shape[0], xc.shape[1], *pg.output_spatial), cd)
    offsets = _offsets(pg)
    fill = -np.inf if pg.mode == "max" else 0.0

    def run(lo: int, hi: int) -> None:
        xp = _padded(xc[lo:hi], pg, fill, cd)
        if pg.mode == "max":
            _max_forward(xp, yc[lo:hi], offsets)
        else:
            _avg_forward(xp, yc[lo:hi], offsets, pg.window_size)

    _threads.parallel_for(xc.shape[0], x.size, run, cached=True)
    return finish(np.moveaxis(yc, 1, -1) if pg.channels_last else yc, x.dtype)


def pool_backward(dy: np.ndarray, x: np.ndarray, y: np.ndarray, pg: PoolGeometry) -> np.ndarray:
    """dx: max sends dy to each window's winner (Note [max-pool ties]); avg spreads
    dy / window_size over the whole window, padding included."""
    del y  # Note [max-pool ties]
    cd = compute_dtype(dy.dtype)
    dyc = _channels_first(dy, pg)
    xc = _channels_first(x, pg)
    n, c = xc.shape[:2]
    dxp = np.empty((n, c, *_padded_spatial(pg)), cd)
    offsets = _offsets(pg)
    overlap = any(s < k for s, k in zip(pg.stride, pg.kernel_size, strict=True))
    tiled = _tiled(pg)
    # max-pool tiles covering every element write each one exactly once (both paths)
    covered = tiled and pg.mode == "max" and all(
        o * k == size for o, k, size in zip(pg.output_spatial, pg.kernel_size,
                                            pg.input_shape_cf[2:], strict=True))

    def run(lo: int, hi: int) -> None:
        d = dyc[lo:hi].astype(cd, copy=False)
        target = dxp[lo:hi]
        if not covered:
            target.fill(0)  # here, so the piece is in cache when the scatter writes it
        if pg.mode == "max":
            d = np.ascontiguousarray(d)
            xp = _padded(xc[lo:hi], pg, -np.inf, cd)
            if tiled and _scatter_first(target, d, xp, offsets):
                return
            _scatter_winners(target, d, _max_winners(xp, pg, offsets), offsets, overlap)
        else:
            share = d / pg.window_size
            for where in offsets:
                target[where] += share

    _threads.parallel_for(n, x.size, run, cached=True)
    dx = _crop(dxp, pg)
    return finish(np.moveaxis(dx, 1, -1) if pg.channels_last else dx, dy.dtype)
