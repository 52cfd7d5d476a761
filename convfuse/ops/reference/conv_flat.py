"""Stride-1 convolution without materialised columns: the padded input laid out flat
(conv_images.py takes the same layout image by image).

Note [flat padded convolution]
With stride 1, put x channel-major into one flat row per channel, F[c, lead + n*P + pos],
where every spatial axis a is padded on one side only by its padding p_a (pitch
S_a + p_a; P is the product of the pitches) and the gaps are zeros. Output position q =
n*P + i*pitch_h + j (i < Ho, j < Wo) then reads F[c, q + sum_a d_a*k_a*pitch_a] at kernel
offset k: one shared gap of p_a between neighbouring rows (and images) serves as the right
padding of one and the left padding of the next, since with p_a <= d_a*(k_a - 1) no read
reaches past it. So the columns for a run of consecutive q are, per channel and offset, one
contiguous run of F: a strided view with unit inner stride.

The engine walks q in fixed blocks of BLOCK_BYTES worth of columns: each block's columns
are copied into a per-thread buffer (so they stay in the core's cache), multiplied at
once, and dropped. Nothing of size prod(kernel) * |x| is ever written to memory: the
im2col copy, which cost as much as the GEMM here (rows of 7-56 elements copy at ~8 ns
each), becomes copies of rows of hundreds of elements out of cache.

Positions with i >= Ho or j >= Wo ("gap outputs", a factor P / prod(out) of extra work:
1.15 at 14x14, 1.31 at 7x7, 1.04 at 56x56 for a 3x3 "same" conv) are computed and thrown
away; they read only x and zeros. The filter gradient gives them dz = 0, so they add
nothing, unless x holds an inf or NaN that a gap output reads (0 * inf = NaN): a dw that
is not all finite is therefore recomputed by the exact im2col path (conv.py).

Blocks are fixed by the shape alone, and the filter gradient adds them up in fixed runs of
consecutive blocks whose partial sums are then added in order, so results do not depend on
the thread count.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...geometry import ConvGeometry
from . import _threads

# Columns per block, in bytes. Timed here (interleaved, batch 128 MNIST convs and a ResNet
# 64x56x56 conv): 1 MiB was as fast as or faster than 384 KiB, 2 MiB and 4 MiB; smaller
# blocks pay per-call overhead, larger ones spill the columns out of cache.
BLOCK_BYTES = 1 << 20
MIN_BLOCK, MAX_BLOCK = 256, 8192
BLOCK_ALIGN = 64
# The filter gradient sums the blocks in at most PARTIALS fixed runs (fixed by the shape, so
# the thread count changes no bit), each run's sum a weight-sized partial; at most
# PARTIAL_BYTES of them (a 512x512x3x3 conv's weight is 9 MiB).
PARTIALS = 16
PARTIAL_BYTES = 64 << 20


@dataclass(frozen=True)
class FlatLayout:
    pitches: tuple[int, ...]  # padded sizes S_a + p_a of the spatial axes
    strides: tuple[int, ...]  # flat distance of one step along each spatial axis
    offset_strides: tuple[int, ...]  # flat distance of one kernel step, d_a * strides[a]
    lead: int  # zeros before image 0 (the first rows' and columns' left padding)
    per_image: int  # P = prod(pitches)
    positions: int  # Q = N * P outputs computed, gap outputs included
    length: int  # a channel's row in F: lead + Q + the last reads' overhang
    block: int  # q per block

    def blocks(self) -> list[tuple[int, int]]:
        return [(lo, min(self.positions, lo + self.block))
                for lo in range(0, self.positions, self.block)]


@functools.lru_cache(maxsize=512)
def flat_layout(geom: ConvGeometry, itemsize: int) -> FlatLayout | None:
    """The layout of Note [flat padded convolution], or None where it does not apply (a
    stride, or padding past the kernel's reach d*(k - 1))."""
    reach = [d * (k - 1) for d, k in zip(geom.dilation, geom.kernel_size, strict=True)]
    if any(s != 1 for s in geom.stride) or any(
            p > r for p, r in zip(geom.padding, reach, strict=True)):
        return None
    pitches = tuple(s + p for s, p in zip(geom.input_shape_cf[2:], geom.padding, strict=True))
    strides = tuple(math.prod(pitches[a + 1:]) for a in range(len(pitches)))
    per_image = math.prod(pitches)
    positions = geom.batch * per_image
    lead = sum(p * st for p, st in zip(geom.padding, strides, strict=True))
    overhang = sum(r * st for r, st in zip(reach, strides, strict=True))
    column_bytes = (geom.in_channels // geom.groups) * math.prod(geom.kernel_size) * itemsize
    block = max(MIN_BLOCK, min(MAX_BLOCK, BLOCK_BYTES // column_bytes) // BLOCK_ALIGN * BLOCK_ALIGN)
    return FlatLayout(
        pitches, strides,
        tuple(d * st for d, st in zip(geom.dilation, strides, strict=True)),
        lead, per_image, positions, lead + positions + overhang, min(block, positions),
    )


def _image_view(flat: np.ndarray, layout: FlatLayout, start: int, n: int) -> np.ndarray:
    """(rows, N, *pitches) view of flat[:, start : start + N*P]."""
    rows = flat.shape[0]
    return flat[:, start:start + layout.positions].reshape(rows, n, *layout.pitches)


def _gap_slabs(sizes: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """Index tuples into (rows, N, *pitches) covering everything past `sizes` along some
    axis, once each: the gaps, zeroed without writing the data region twice."""
    slabs = []
    for axis, size in enumerate(sizes):
        slabs.append((slice(None), slice(None), *(slice(0, s) for s in sizes[:axis]),
                      slice(size, None)))
    return slabs


def flat_input(x_cf: np.ndarray, geom: ConvGeometry, layout: FlatLayout, cd: np.dtype,
               tag: str | None = None) -> np.ndarray:
    """F (C, layout.length): x (N, C, *S), channels-first view, laid out padded and flat,
    cast to `cd`. A scratch buffer when `tag` is given (Note [scratch buffers])."""
    c = geom.in_channels
    shape = (c, layout.length)
    flat = np.empty(shape, cd) if tag is None else _threads.scratch(tag, shape, cd)
    inner = (slice(None), slice(None), *(slice(0, s) for s in geom.input_shape_cf[2:]))
    images = _image_view(flat, layout, layout.lead, geom.batch)

    gaps = _gap_slabs(geom.input_shape_cf[2:])

    def run(lo: int, hi: int) -> None:
        flat[lo:hi, :layout.lead] = 0
        flat[lo:hi, layout.lead + layout.positions:] = 0
        part = images[lo:hi]
        for gap in gaps:
            part[gap] = 0
        part[inner] = x_cf[:, lo:hi].swapaxes(0, 1)

    _threads.parallel_for(c, flat.size, run)
    return flat


def flat_output(dz_cf: np.ndarray, geom: ConvGeometry, layout: FlatLayout, cd: np.dtype,
                tag: str) -> np.ndarray:
    """(K, Q): an output-shaped dz (N, K, *out) at the output positions q, 0 at the gap
    outputs, in `cd` (a scratch buffer)."""
    k = geom.out_channels
    out = _threads.scratch(tag, (k, layout.positions), cd)
    images = out.reshape(k, geom.batch, *layout.pitches)
    inner = (slice(None), slice(None), *(slice(0, o) for o in geom.output_spatial))

    gaps = _gap_slabs(geom.output_spatial)

    def run(lo: int, hi: int) -> None:
        part = images[lo:hi]
        for gap in gaps:
            part[gap] = 0
        part[inner] = dz_cf[:, lo:hi].swapaxes(0, 1)

    _threads.parallel_for(k, out.size, run)
    return out


def output_view(ym: np.ndarray, geom: ConvGeometry, layout: FlatLayout) -> np.ndarray:
    """(N, K, *out): the real outputs of a (K, Q) result, a view."""
    k = geom.out_channels
    images = ym.reshape(k, geom.batch, *layout.pitches)
    return images[(slice(None), slice(None), *(slice(0, o) for o in geom.output_spatial))
                  ].swapaxes(0, 1)


def _column_views(flat: np.ndarray, layout: FlatLayout, geom: ConvGeometry
                  ) -> list[np.ndarray]:
    """Per group, the columns of every output position as a read-only strided view of F,
    (C/G, *kernel, Q): element [c, *k, q] is F[c, q + sum_a k_a * offset_strides[a]].
    Built with np.ndarray on F's buffer (as_strided costs ~20 us a call)."""
    item = flat.itemsize
    shape = (geom.in_channels // geom.groups, *geom.kernel_size, layout.positions)
    strides = (flat.strides[0], *(s * item for s in layout.offset_strides), item)
    return group_views(flat, geom, shape, strides)


def group_views(flat: np.ndarray, geom: ConvGeometry, shape: tuple[int, ...],
                strides: tuple[int, ...]) -> list[np.ndarray]:
    """Per group, a read-only view of F's buffer with `shape` and byte `strides`, starting
    at the group's first channel."""
    cg = geom.in_channels // geom.groups
    views = []
    for g in range(geom.groups):
        view = np.ndarray(shape, flat.dtype, flat, g * cg * flat.strides[0], strides)
        view.flags.writeable = False
        views.append(view)
    return views


def _block_columns(view: np.ndarray, lo: int, hi: int, buf: np.ndarray) -> np.ndarray:
    """The columns of outputs [lo, hi), copied into buf, as (C/G * prod(kernel), hi - lo)."""
    cols = buf[:, :hi - lo]
    cols.reshape(*view.shape[:-1], hi - lo)[...] = view[..., lo:hi]
    return cols


def _column_buffer(geom: ConvGeometry, layout: FlatLayout, cd: np.dtype) -> np.ndarray:
    rows = (geom.in_channels // geom.groups) * math.prod(geom.kernel_size)
    return np.empty((rows, layout.block), cd)


def flat_conv(flat: np.ndarray, wm: np.ndarray, geom: ConvGeometry, layout: FlatLayout,
              tag: str) -> np.ndarray:
    """(K, Q) = conv at every output position: wm (G, K/G, C/G*prod(kernel)) times each
    block's columns (a scratch buffer)."""
    g, kg = geom.groups, geom.out_channels // geom.groups
    out = _threads.scratch(tag, (geom.out_channels, layout.positions), flat.dtype)
    blocks = layout.blocks()
    views = _column_views(flat, layout, geom)

    def run(first: int, last: int) -> None:
        buf = _column_buffer(geom, layout, flat.dtype)
        for lo, hi in blocks[first:last]:
            for grp in range(g):
                cols = _block_columns(views[grp], lo, hi, buf)
                np.matmul(wm[grp], cols, out=out[grp * kg:(grp + 1) * kg, lo:hi])

    run_blocks(len(blocks), wm[0].size * layout.positions * g, run)
    return out


def flat_filter_grad(flat: np.ndarray, dzq: np.ndarray, geom: ConvGeometry,
                     layout: FlatLayout) -> np.ndarray:
    """dw (G, K/G, C/G*prod(kernel)) = sum over q of dzq[:, q] times q's columns, from the
    input's F and dz at the output positions (K, Q), gap outputs 0."""
    g, kg = geom.groups, geom.out_channels // geom.groups
    rows = (geom.in_channels // g) * math.prod(geom.kernel_size)
    blocks = layout.blocks()
    weight_bytes = g * kg * rows * flat.itemsize
    runs = _threads.chunks(len(blocks), max(1, min(PARTIALS, PARTIAL_BYTES // weight_bytes)))
    partial = np.empty((len(runs), g, kg, rows), flat.dtype)
    views = _column_views(flat, layout, geom)

    def run(first: int, last: int) -> None:
        buf = _column_buffer(geom, layout, flat.dtype)
        tmp = np.empty((kg, rows), flat.dtype)
        # a gap output's 0 * inf is thrown away by the caller: no warning for it
        with np.errstate(invalid="ignore", over="ignore"):
            for r in range(first, last):
                for b in range(*runs[r]):
                    lo, hi = blocks[b]
                    for grp in range(g):
                        cols = _block_columns(views[grp], lo, hi, buf)
                        dz_block = dzq[grp * kg:(grp + 1) * kg, lo:hi]
                        if b == runs[r][0]:
                            np.matmul(dz_block, cols.T, out=partial[r, grp])
                        else:
                            np.matmul(dz_block, cols.T, out=tmp)
                            partial[r, grp] += tmp

    run_blocks(len(runs), kg * rows * layout.positions * g, run)
    with np.errstate(invalid="ignore", over="ignore"):
        return partial.sum(axis=0)


def run_blocks(n_blocks: int, flops: int, run: Callable[[int, int], None]) -> None:
    """run(first, last) over runs of blocks, one per thread, BLAS on one thread (_threads
    Note [GEMMs on the pool])."""
    if flops < _threads.TINY_GEMM_FLOPS:
        run(0, n_blocks)
        return
    with _threads.single_threaded_blas():
        threads = min(_threads.num_threads(), n_blocks)
        if threads <= 1 or flops < _threads.MIN_GEMM_FLOPS:
            run(0, n_blocks)
        else:
            _threads.run_chunks(n_blocks, threads, run)

