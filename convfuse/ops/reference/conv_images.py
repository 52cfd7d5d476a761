"""Stride-1 convolutions with few channels, image by image, on conv_flat's padded input.

Note [by images]
With few channels (C/G * prod(kernel) below IMAGE_MAX_ROWS: an MNIST net's first two
layers) the GEMMs are small and the passes around them dominate: the gather of the real
outputs out of the (K, Q) result (rows of Wo elements) and the gap outputs. Channels-first
convs there take the same F image by image instead: the columns of a few whole images,
real positions only, are copied into a buffer (N, rows, Ho*Wo), and one batched matmul
writes (K, Ho*Wo) per image straight into the output's own layout, where the epilogue
(bias, residual, activation) runs while the block is in cache; the filter gradient reads
dz as it is. Timed here at batch 128, interleaved with the flat form: the first layer's
forward 3.8 -> 3.0 ms and filter gradient 3.4 -> 2.3 ms, the second's 6.1 -> 5.9 and
4.3 -> 4.2 ms. With one output channel per group (the first layer's data gradient) the
products are matrix-vector ones and it was slower (5.0 -> 7.9 ms), hence IMAGE_MIN_OUT;
from 288 rows on (and for 56x56 images) the flat form was as fast or faster.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ...geometry import ConvGeometry
from . import _threads, conv_flat
from .conv_flat import FlatLayout

# Note [by images]: below this many column rows (C/G * prod(kernel)) a channels-first conv
# multiplies image by image, writing its output in place.
IMAGE_MAX_ROWS = 256
IMAGE_MIN_OUT = 8  # output channels per group


def by_images(geom: ConvGeometry) -> bool:
    """Whether the conv takes F image by image (Note [by images])."""
    rows = (geom.in_channels // geom.groups) * math.prod(geom.kernel_size)
    return (not geom.channels_last and rows < IMAGE_MAX_ROWS
            and geom.out_channels // geom.groups >= IMAGE_MIN_OUT)


def _image_views(flat: np.ndarray, layout: FlatLayout, geom: ConvGeometry
                 ) -> list[np.ndarray]:
    """Per group, the columns at the real output positions, image by image, as a read-only
    view of F: (N, C/G, *kernel, *out)."""
    item = flat.itemsize
    shape = (geom.batch, geom.in_channels // geom.groups, *geom.kernel_size,
             *geom.output_spatial)
    strides = (layout.per_image * item, flat.strides[0],
               *(s * item for s in layout.offset_strides), *(s * item for s in layout.strides))
    return conv_flat.group_views(flat, geom, shape, strides)


def _image_blocks(geom: ConvGeometry, rows: int, itemsize: int) -> list[tuple[int, int]]:
    per_image = rows * math.prod(geom.output_spatial) * itemsize
    step = max(1, conv_flat.BLOCK_BYTES // per_image)
    return [(lo, min(geom.batch, lo + step)) for lo in range(0, geom.batch, step)]


def image_conv(flat: np.ndarray, wm: np.ndarray, geom: ConvGeometry, layout: FlatLayout,
               dtype: np.dtype,
               epilogue: Callable[[np.ndarray, np.ndarray, int, int], None] | None = None
               ) -> np.ndarray:
    """The conv's output (N, K, *out) in `dtype`, image by image (Note [by images]);
    `epilogue(z, z, lo, hi)` finishes images [lo, hi) in place, in F's dtype."""
    n, k, g = geom.batch, geom.out_channels, geom.groups
    kg, hw = k // g, math.prod(geom.output_spatial)
    cd = flat.dtype
    rows = (geom.in_channels // g) * math.prod(geom.kernel_size)
    out = np.empty(geom.output_shape, dtype)
    om = out.reshape(n, k, hw)
    views = _image_views(flat, layout, geom)
    blocks = _image_blocks(geom, rows, cd.itemsize)
    width = blocks[0][1]

    def run(first: int, last: int) -> None:
        buf = np.empty((width, rows, hw), cd)
        tmp = None if dtype == cd else np.empty((width, k, hw), cd)
        for lo, hi in blocks[first:last]:
            m = hi - lo
            dst = om[lo:hi] if tmp is None else tmp[:m]
            for grp in range(g):
                buf[:m].reshape(m, *views[grp].shape[1:])[...] = views[grp][lo:hi]
                np.matmul(wm[grp], buf[:m], out=dst[:, grp * kg:(grp + 1) * kg])
            if epilogue is not None:
                z = dst.reshape(m, k, *geom.output_spatial)
                epilogue(z, z, lo, hi)
            if tmp is not None:
                om[lo:hi] = dst  # rounded to the storage dtype once

    conv_flat.run_blocks(len(blocks), k * rows * hw * n, run)
    return out


def image_filter_grad(flat: np.ndarray, dz_cf: np.ndarray, geom: ConvGeometry,
                      layout: FlatLayout) -> np.ndarray:
    """dw (G, K/G, C/G*prod(kernel)) from F and dz (N, K, *out), image by image, summed in
    fixed runs of blocks of images (Note [by images])."""
    n, k, g = geom.batch, geom.out_channels, geom.groups
    kg, hw = k // g, math.prod(geom.output_spatial)
    cd = flat.dtype
    rows = (geom.in_channels // g) * math.prod(geom.kernel_size)
    dzm = dz_cf.reshape(n, k, hw)
    views = _image_views(flat, layout, geom)
    blocks = _image_blocks(geom, rows, cd.itemsize)
    width = blocks[0][1]
    runs = _threads.chunks(len(blocks), max(1, min(
        conv_flat.PARTIALS, conv_flat.PARTIAL_BYTES // (k * rows * cd.itemsize))))
    partial = np.zeros((len(runs), g, kg, rows), cd)

    def run(first: int, last: int) -> None:
        buf = np.empty((width, rows, hw), cd)
        tmp = np.empty((width, kg, rows), cd)
        for r in range(first, last):
            for lo, hi in blocks[runs[r][0]:runs[r][1]]:
                m = hi - lo
                for grp in range(g):
                    buf[:m].reshape(m, *views[grp].shape[1:])[...] = views[grp][lo:hi]
                    dz = dzm[lo:hi, grp * kg:(grp + 1) * kg].astype(cd, copy=False)
                    np.matmul(dz, buf[:m].transpose(0, 2, 1), out=tmp[:m])
                    partial[r, grp] += tmp[:m].sum(axis=0)

    conv_flat.run_blocks(len(runs), k * rows * hw * n, run)
    return partial.sum(axis=0)
