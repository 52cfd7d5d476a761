"""Max and average pooling, forward and backward, on NumPy arrays (see PoolGeometry).

Both run as one vectorised pass per kernel offset over a padded channels-first view:
the slice of the padded input that each output position sees at that offset.

Note [max-pool ties]
The gradient of a window goes to its first maximal element in row-major window order
(the first offset that strictly beats all earlier ones), as cuDNN and PyTorch do. Padding
is -inf, so it never wins. NaN beats every number, so a window holding NaN outputs NaN
(as in PyTorch) and sends its gradient to its first NaN. `pool_backward` recomputes the
winners from x; y is accepted for parity with cuDNN's poolingBackward and not read.
"""

from __future__ import annotations

import itertools

import numpy as np

from ...dtypes import compute_dtype
from ...pool_geometry import PoolGeometry
from .activation import finish


def _channels_first(a: np.ndarray, pg: PoolGeometry) -> np.ndarray:
    return np.moveaxis(a, -1, 1) if pg.channels_last else a


def _padded(x: np.ndarray, pg: PoolGeometry, fill: float) -> np.ndarray:
    """x channels-first in the compute dtype, padded with `fill` (always a new array)."""
    xc = _channels_first(x, pg)
    shape = (*xc.shape[:2], *(n + 2 * p for n, p in zip(xc.shape[2:], pg.padding, strict=True)))
    xp = np.full(shape, fill, compute_dtype(x.dtype))
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


def _crop(dxp: np.ndarray, pg: PoolGeometry) -> np.ndarray:
    sizes = pg.input_shape_cf[2:]
    dx = dxp[(slice(None), slice(None), *(slice(p, p + n) for p, n in
                                          zip(pg.padding, sizes, strict=True)))]
    return np.moveaxis(dx, 1, -1) if pg.channels_last else dx


def _argmax(xp: np.ndarray, pg: PoolGeometry) -> tuple[np.ndarray, np.ndarray]:
    """Per output: the window maximum and the index of the offset holding it (first wins)."""
    offsets = _offsets(pg)
    best = xp[offsets[0]].copy()
    arg = np.zeros(best.shape, np.intp)
    for i, where in enumerate(offsets[1:], start=1):
        v = xp[where]
        wins = (v > best) | (np.isnan(v) & ~np.isnan(best))
        best[wins] = v[wins]
        arg[wins] = i
    return best, arg


def pool_forward(x: np.ndarray, pg: PoolGeometry) -> np.ndarray:
    """y: the max or the mean (padding counted) of every window, in x's dtype and layout."""
    if pg.mode == "max":
        yc = _argmax(_padded(x, pg, -np.inf), pg)[0]
    else:
        xp = _padded(x, pg, 0.0)
        offsets = _offsets(pg)
        yc = xp[offsets[0]].copy()
        for where in offsets[1:]:
            yc += xp[where]
        yc /= pg.window_size
    return finish(np.moveaxis(yc, 1, -1) if pg.channels_last else yc, x.dtype)


def pool_backward(dy: np.ndarray, x: np.ndarray, y: np.ndarray, pg: PoolGeometry) -> np.ndarray:
    """dx: max sends dy to each window's first maximum (Note [max-pool ties]); avg spreads
    dy / window_size over the whole window, padding included."""
    del y  # Note [max-pool ties]
    cd = compute_dtype(dy.dtype)
    dyc = _channels_first(dy, pg).astype(cd)
    padded = (*dyc.shape[:2], *(n + 2 * p for n, p in zip(pg.input_shape_cf[2:], pg.padding,
                                                         strict=True)))
    dxp = np.zeros(padded, cd)
    offsets = _offsets(pg)
    if pg.mode == "max":
        arg = _argmax(_padded(x, pg, -np.inf), pg)[1]
        for i, where in enumerate(offsets):
            dxp[where] += np.where(arg == i, dyc, 0)
    else:
        share = dyc / pg.window_size
        for where in offsets:
            dxp[where] += share
    return finish(_crop(dxp, pg), dy.dtype)
