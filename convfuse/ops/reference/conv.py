"""Convolution forward, data/filter/bias gradients and the fused conv + bias + activation.

Note [im2col per group]
Everything is one batched GEMM over the groups G, on channels-first views (channels-last
arrays are moved with np.moveaxis, a view; the one copy every path makes anyway puts the
data in the order the GEMM wants and results back in the caller's layout):
- columns: cols[G, C/G, prod(kernel), N, *out], filled with one strided copy per kernel
  offset (the padded input seen at that offset, sliced by stride and shifted by dilation),
  cast to the compute dtype on the way; the innermost axis stays the spatial one, so
  copies run over contiguous rows rather than 3-element kernel rows;
- forward: y[g] = w[g] @ cols[g], w[g] being (K/G, C/G*prod(kernel));
- backward data: dcols[g] = w[g]^T @ dz[g], then col2im: each offset's block of dcols is
  added into the strided positions of a zero padded dx, which is then cropped;
- backward filter: dw[g] = dz[g] @ cols[g]^T.
Cross-correlation, as in PyTorch and cuDNN's CUDNN_CROSS_CORRELATION.

Note [kept columns]
The filter gradient needs the forward's columns again. `convfuse.functional` asks for them
with `keep_columns()` around the forward and hands them back with `given_columns()` around
the filter gradient, which uses them only for the very array (`is`) and geometry they were
built from; otherwise it builds its own, so every op stays stateless. Kept columns are x
as the forward read it: dw is the gradient of the forward that ran. They cost
prod(kernel) times x's size, so all kept columns alive together are capped at
KEEP_COLUMNS_BYTES (a layer keeps its context until backward, also in inference): past the
cap the backward rebuilds them, as it always did.

Note [choosing the method]
Each geometry's columns come one of three ways, chosen by what each computes:
- tiny problems (at most GATHER_ELEMENTS column entries and input elements): one gather
  through an index array built once per geometry (`_gather_index`). A handful of NumPy
  calls, where the per-tap copies below and the flat layout's passes cost tens of us of
  Python per call, which is all a 1x1x4x4 convolution costs;
- stride 1 (conv_flat.py Note [flat padded convolution]): the flat padded convolution
  computes every padded position of every tap, P per image against prod(out) useful ones.
  It saves the im2col copy, and pays where its waste is small: it is taken only while
  positions * taps <= FLAT_WASTE * outputs * live taps (`flat_choice`);
- otherwise im2col columns of the live taps only. A tap whose every read falls in the
  padding multiplies zeros: DeepLabV3's ASPP conv (3x3, dilation and padding 36, a 4x4 map)
  has one live tap of nine, and the flat form computed 1,600 positions for its 16 outputs.
  Its columns and its rows of the weight are left out (`_live_taps`). That changes no sum
  (up to the sign of a zero one); the one value it could change is a non-finite operand:
  inf * 0 = NaN, so a channel with a non-finite weight at a dead tap gets NaN everywhere, and
  the filter gradient at dead taps is NaN where dz holds a non-finite value, as im2col and
  torch give (`_dead_tap_nans`, `_full_filter`); a sum screens both, so finite operands pay
  one pass. The data gradient's dead taps scatter only into the padding it crops, so they
  are dropped without that rule (torch's dx stays finite there too).
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import activations as acts
from ...dtypes import compute_dtype
from ...geometry import ConvGeometry
from . import _threads, conv_flat, conv_images
from ._accumulate import channel_sum
from .activation import apply_activation, finish, relu
from .conv_tiny import TinyConv


def _channels_first(a: np.ndarray, channels_last: bool) -> np.ndarray:
    """A channels-first view of an activation (N, *S, C) or a filter (K, *k, C/G)."""
    return np.moveaxis(a, -1, 1) if channels_last else a


def _cast_copy(view: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A C-contiguous copy in `dtype`: one pass, casting while copying."""
    buf = np.empty(view.shape, dtype)
    buf[...] = view
    return buf


def _offset_slices(geom: ConvGeometry) -> list[tuple[slice, ...]]:
    """Per kernel offset (row-major), the padded-input positions the outputs read there."""
    return [
        tuple(
            slice(i * d, i * d + s * (o - 1) + 1, s)
            for i, d, s, o in zip(offset, geom.dilation, geom.stride, geom.output_spatial,
                                  strict=True)
        )
        for offset in itertools.product(*(range(k) for k in geom.kernel_size))
    ]


def _padded_shape(geom: ConvGeometry) -> tuple[int, ...]:
    sizes = zip(geom.input_shape_cf[2:], geom.padding, strict=True)
    return (geom.batch, geom.in_channels, *(n + 2 * p for n, p in sizes))


def _grouped(a: np.ndarray, groups: int) -> np.ndarray:
    """(N, C, *S) -> (G, C/G, N, *S), a view."""
    n, c = a.shape[:2]
    a = a.reshape(n, groups, c // groups, *a.shape[2:])
    return a.transpose(1, 2, 0, *range(3, a.ndim))


def _valid_range(offset: int, dilation: int, stride: int, pad: int, size: int, out: int
                 ) -> tuple[int, int, int]:
    """Along one axis, at one kernel offset: the outputs [lo, hi) whose input position
    offset * dilation + stride * o - pad falls inside the input, and that first position."""
    first = offset * dilation - pad
    lo = min(out, max(0, -(first // stride)))  # ceil(-first / stride), clipped to [0, out]
    hi = max(lo, min(out, (size - 1 - first) // stride + 1))
    return lo, hi, first + stride * lo


@functools.lru_cache(maxsize=512)
def _column_plan(geom: ConvGeometry) -> tuple[tuple[Any, Any, list[Any]], ...]:
    """Per kernel offset: (output region, input slices, zeroed slabs) for `_columns`."""
    plans = []
    for offset in itertools.product(*(range(k) for k in geom.kernel_size)):
        ranges = [_valid_range(*a) for a in zip(offset, geom.dilation, geom.stride,
                                                 geom.padding, geom.input_shape_cf[2:],
                                                 geom.output_spatial, strict=True)]
        dst = tuple(slice(lo, hi) for lo, hi, _ in ranges)
        src = tuple(slice(first, first + s * (hi - lo - 1) + 1, s) if hi > lo else slice(0, 0)
                    for (lo, hi, first), s in zip(ranges, geom.stride, strict=True))
        # the parts of the output grid that read padding: a slab per axis and side
        zero = []
        for axis, (lo, hi, _) in enumerate(ranges):
            for part in (slice(0, lo), slice(hi, None)):
                if part.stop != part.start:
                    zero.append((slice(None),) * 3 + (*dst[:axis], part))
        plans.append(((slice(None),) * 3 + dst, (slice(None), *src), zero))
    return tuple(plans)


# Note [choosing the method]: column entries (and input elements) up to which a geometry's
# columns are one gather; past it the flat form is taken while its computed positions stay
# within FLAT_WASTE times the useful ones.
GATHER_ELEMENTS = 1 << 14
FLAT_WASTE = 2.0


@functools.lru_cache(maxsize=512)
def _live_taps(geom: ConvGeometry) -> tuple[int, ...]:
    """The kernel offsets (row-major) at which some output reads the input, not only padding
    (Note [choosing the method])."""
    live = []
    for j, offset in enumerate(itertools.product(*(range(k) for k in geom.kernel_size))):
        ranges = [_valid_range(*a) for a in zip(offset, geom.dilation, geom.stride,
                                                 geom.padding, geom.input_shape_cf[2:],
                                                 geom.output_spatial, strict=True)]
        if all(hi > lo for lo, hi, _ in ranges):
            live.append(j)
    return tuple(live)


@functools.lru_cache(maxsize=512)
def _dead_taps(geom: ConvGeometry) -> tuple[int, ...]:
    live = set(_live_taps(geom))
    return tuple(j for j in range(math.prod(geom.kernel_size)) if j not in live)


@functools.lru_cache(maxsize=512)
def _column_entries(geom: ConvGeometry) -> int:
    entries = geom.in_channels * len(_live_taps(geom)) * geom.batch * math.prod(
        geom.output_spatial)
    return max(entries, math.prod(geom.input_shape))


@functools.lru_cache(maxsize=512)
def _flat_by_cost(geom: ConvGeometry, itemsize: int) -> conv_flat.FlatLayout | None:
    layout = conv_flat.flat_layout(geom, itemsize)
    if layout is None:
        return None
    useful = geom.batch * math.prod(geom.output_spatial) * len(_live_taps(geom))
    if layout.positions * math.prod(geom.kernel_size) > FLAT_WASTE * useful:
        return None
    return layout


def flat_choice(geom: ConvGeometry, itemsize: int) -> conv_flat.FlatLayout | None:
    """The flat layout where the engine takes the flat form for `geom`, else None (the
    columns; Note [choosing the method])."""
    if _column_entries(geom) <= GATHER_ELEMENTS:
        return None
    return _flat_by_cost(geom, itemsize)


def _fill_columns(xc: np.ndarray, geom: ConvGeometry, dtype: np.dtype, fill: Any,
                  tag: str | None = None) -> np.ndarray:
    """cols[G, C/G*L, N*prod(out)] of the L live taps (Note [im2col per group]) from the
    channels-first xc, `fill` where the padding is read.

    Built per batch chunk on the engine's threads (ops/reference/_threads.py). No padded copy of x:
    each offset's block gets the input positions it reads copied in, and only the outputs
    that read padding are filled.
    """
    g, c = geom.groups, geom.in_channels
    plans = _column_plan(geom)
    live = _live_taps(geom)
    shape = (g, c // g, len(live), geom.batch, *geom.output_spatial)
    cols = np.empty(shape, dtype) if tag is None else _threads.scratch(tag, shape, dtype)

    def run(lo: int, hi: int) -> None:
        rows = slice(lo, hi)
        for j, t in enumerate(live):
            dst, src, zero = plans[t]
            block = cols[:, :, j, rows]  # (G, C/G, n, *out)
            for where in zero:
                block[where] = fill
            block[dst] = _grouped(xc[(rows, *src)], g)

    _threads.parallel_for(geom.batch, cols.size, run)
    # sizes spelled out: with no live tap (L = 0) -1 would be ambiguous
    return cols.reshape(g, (c // g) * len(live), geom.batch * math.prod(geom.output_spatial))


@functools.lru_cache(maxsize=128)
def _gather_index(geom: ConvGeometry) -> np.ndarray:
    """For a tiny geometry, the columns as indices into x's flat memory with one zero
    appended (index x.size): cols = ext[index] (Note [choosing the method])."""
    n = math.prod(geom.input_shape)
    ids = np.arange(n, dtype=np.intp).reshape(geom.input_shape)
    index = _fill_columns(_channels_first(ids, geom.channels_last), geom, np.dtype(np.intp), n)
    index.flags.writeable = False
    return index


def _columns(x: np.ndarray, geom: ConvGeometry, cd: np.dtype, tag: str | None = None
             ) -> np.ndarray:
    """cols[G, C/G*L, N*prod(out)] of the L live taps, in `cd`: one gather for tiny
    problems, else one strided copy per tap (Note [choosing the method])."""
    tiny = _tiny(geom, cd)
    if tiny is not None:
        return tiny.columns(x)
    return _fill_columns(_channels_first(x, geom.channels_last), geom, cd, 0, tag)


def _taps(w4: np.ndarray, taps: tuple[int, ...]) -> np.ndarray:
    """w4[..., taps]: a view where the taps are one run (one live tap, say), else a copy."""
    if taps and taps[-1] - taps[0] == len(taps) - 1:  # sorted, so one run
        return w4[..., taps[0]:taps[-1] + 1]
    return w4[..., list(taps)]


def _matrix(w4: np.ndarray, geom: ConvGeometry, cd: np.dtype, live_only: bool
            ) -> np.ndarray:
    """A weight (G, A, B, prod(kernel)) view as the GEMM's (G, A, B*T) in `cd`, one pass;
    with `live_only`, T is the live taps only (Note [choosing the method])."""
    if live_only and _dead_taps(geom):
        w4 = _taps(w4, _live_taps(geom))
    shape = (w4.shape[0], w4.shape[1], w4.shape[2] * w4.shape[3])
    if w4.dtype == cd and w4.flags.c_contiguous:  # already the GEMM's operand: a view
        return w4.reshape(shape)
    return _cast_copy(w4, cd).reshape(shape)


def _dead_tap_nans(ym: np.ndarray, w4: np.ndarray, geom: ConvGeometry) -> None:
    """NaN into every output of a channel whose weight is not finite at a dead tap, as the
    full columns give (inf * 0); ym (G, A, M) is the live taps' GEMM result."""
    dead = _dead_taps(geom)
    if not dead or np.isfinite(w4.sum()):  # the sum screens: finite operands, finite sum
        return
    bad = ~np.isfinite(_taps(w4, dead)).all(axis=(2, 3))
    ym[bad] = np.nan


def _full_filter(dw: np.ndarray, dzm: np.ndarray, geom: ConvGeometry) -> np.ndarray:
    """The live taps' filter gradient (G, K/G, C/G*L) as the whole (G, K/G, C/G*prod(kernel)):
    zeros at the dead taps, NaN there for a channel whose dz holds a non-finite value."""
    dead = _dead_taps(geom)
    if not dead:
        return dw
    g, kg = dw.shape[:2]
    taps = math.prod(geom.kernel_size)
    full = np.zeros((g, kg, geom.in_channels // g, taps), dw.dtype)
    live = dw.reshape(g, kg, geom.in_channels // g, len(_live_taps(geom)))
    for j, t in enumerate(_live_taps(geom)):
        full[..., t] = live[..., j]
    if not np.isfinite(dzm.sum()):
        bad = ~np.isfinite(dzm).all(axis=-1)  # (G, K/G)
        for t in dead:
            full[..., t][bad] = np.nan
    return full.reshape(g, kg, -1)


KEEP_COLUMNS_BYTES = 256 << 20
_local = threading.local()
_kept_lock = threading.Lock()
_kept_bytes = 0


@dataclass
class KeptColumns:
    """Columns built by a forward, for the filter gradient (Note [kept columns])."""

    x: Any
    geom: ConvGeometry | None = None
    cols: np.ndarray | None = None
    kind: str = "columns"  # or "flat": conv_flat's padded input F


def kept_bytes() -> int:
    """Bytes of kept columns alive now."""
    return _kept_bytes


def _release(nbytes: int) -> None:
    global _kept_bytes
    with _kept_lock:
        _kept_bytes -= nbytes


def _reserve(nbytes: int) -> bool:
    global _kept_bytes
    with _kept_lock:
        if _kept_bytes + nbytes > KEEP_COLUMNS_BYTES:
            return False
        _kept_bytes += nbytes
        return True


class keep_columns:
    """Within the block, a forward on `x` leaves its columns in the yielded box (when the
    cap allows, and the columns were not one gather: Note [choosing the method]; else
    box.cols stays None). A class rather than a generator: every forward enters one."""

    __slots__ = ("box", "outer")

    def __init__(self, x: Any) -> None:
        self.box = KeptColumns(x)

    def __enter__(self) -> KeptColumns:
        self.outer = getattr(_local, "keep", None)
        _local.keep = self.box
        return self.box

    def __exit__(self, *exc: object) -> None:
        _local.keep = self.outer


@contextmanager
def given_columns(kept: KeptColumns | None) -> Iterator[None]:
    """Within the block, a filter gradient on kept.x and kept.geom uses kept.cols."""
    outer = getattr(_local, "given", None)
    _local.given = kept
    try:
        yield
    finally:
        _local.given = outer


def _keep(x: np.ndarray, geom: ConvGeometry, cols: np.ndarray, kind: str) -> None:
    box = getattr(_local, "keep", None)
    if box is None or box.x is not x or box.cols is not None or not _reserve(cols.nbytes):
        return
    weakref.finalize(cols, _release, cols.nbytes)
    box.geom, box.cols, box.kind = geom, cols, kind


def _keeping(x: np.ndarray) -> bool:
    """Whether a forward on x runs inside keep_columns(x) with its box still empty."""
    box = getattr(_local, "keep", None)
    return box is not None and box.x is x and box.cols is None


def _given(x: np.ndarray, geom: ConvGeometry, cd: np.dtype, kind: str) -> np.ndarray | None:
    kept = getattr(_local, "given", None)
    if (kept is None or kept.x is not x or kept.cols is None or kept.geom != geom
            or kept.cols.dtype != cd or kept.kind != kind):
        return None
    return kept.cols


def _weight_taps(w: np.ndarray, geom: ConvGeometry) -> np.ndarray:
    """w as (G, K/G, C/G, prod(kernel)): a view of a channels-first weight."""
    wc = _channels_first(w, geom.channels_last)
    g = geom.groups
    return wc.reshape(g, geom.out_channels // g, geom.in_channels // g, -1)


def _output_matrix(dz: np.ndarray, geom: ConvGeometry, cd: np.dtype) -> np.ndarray:
    """An output-shaped array (y or dz, in the geometry's layout) as (G, K/G, N*prod(out))."""
    src = _channels_first(dz, geom.channels_last)  # (N, K, *out)
    dzm = np.empty((geom.out_channels, geom.batch, *geom.output_spatial), cd)

    def run(lo: int, hi: int) -> None:
        dzm[:, lo:hi] = src[lo:hi].swapaxes(0, 1)

    _threads.parallel_for(geom.batch, dzm.size, run)
    return dzm.reshape(geom.groups, geom.out_channels // geom.groups, -1)


def _gemm_view(ym: np.ndarray, geom: ConvGeometry) -> np.ndarray:
    """(N, K, *out) view of a (G, K/G, N*prod(out)) GEMM result."""
    return ym.reshape(geom.out_channels, geom.batch, *geom.output_spatial).swapaxes(0, 1)


def _finish_output(src: np.ndarray, geom: ConvGeometry, dtype: np.dtype,
                   epilogue: Callable[[np.ndarray, np.ndarray, int, int], None] | None = None
                   ) -> np.ndarray:
    """An (N, K, *out) view of a GEMM result -> a new C-contiguous array in the geometry's
    layout and `dtype`.

    One threaded pass per batch chunk: `epilogue(src, dst, lo, hi)` (bias, residual,
    activation) writes the chunk's final values into dst, computed in src's (the compute)
    dtype; when `dtype` is narrower, dst is a temporary and the store rounds it once.
    """
    out = np.empty(geom.output_shape, dtype)
    out_cf = _channels_first(out, geom.channels_last)  # (N, K, *out) view

    def run(lo: int, hi: int) -> None:
        dst = out_cf[lo:hi]
        if epilogue is None:
            dst[...] = src[lo:hi]
        elif dst.dtype == src.dtype:
            epilogue(src[lo:hi], dst, lo, hi)
        else:
            tmp = np.empty(dst.shape, src.dtype)
            epilogue(src[lo:hi], tmp, lo, hi)
            dst[...] = tmp

    _threads.parallel_for(geom.batch, out.size, run)
    return out


def _convolve(x: np.ndarray, w4: np.ndarray, geom: ConvGeometry, cd: np.dtype,
              dtype: np.dtype,
              epilogue: Callable[[np.ndarray, np.ndarray, int, int], None] | None = None,
              tag: str = "conv_y", keep: bool = True, dead_nans: bool = True) -> np.ndarray:
    """conv(x, .) with the weight w4 (G, K/G, C/G, prod(kernel)), finished by
    `epilogue` into a new array in the geometry's layout and `dtype`. With `keep`, a
    forward inside keep_columns(x) leaves what the filter gradient will read. `dead_nans`:
    skipped taps' inf * 0 put back (Note [choosing the method]); the data gradient's
    skipped taps scatter only into the cropped padding, so it passes False."""
    tiny = _tiny(geom, cd)
    if tiny is not None:
        return tiny.convolve(x, w4, dtype, epilogue, dead_nans)
    layout = flat_choice(geom, cd.itemsize)
    if layout is not None:  # Note [flat padded convolution]
        wm = _matrix(w4, geom, cd, live_only=False)
        keeping = keep and _keeping(x)
        flat = conv_flat.flat_input(_channels_first(x, geom.channels_last), geom, layout, cd,
                                    tag=None if keeping else f"{tag}_flat")
        if keeping:
            _keep(x, geom, flat, "flat")
        if conv_images.by_images(geom):
            return conv_images.image_conv(flat, wm, geom, layout, dtype, epilogue)
        src = conv_flat.output_view(conv_flat.flat_conv(flat, wm, geom, layout, tag), geom,
                                    layout)
    else:
        cols = _columns(x, geom, cd)
        if keep:
            _keep(x, geom, cols, "columns")
        ym = _threads.matmul(_matrix(w4, geom, cd, live_only=True), cols, out_tag=tag)
        if dead_nans:
            _dead_tap_nans(ym, w4, geom)
        src = _gemm_view(ym, geom)
    return _finish_output(src, geom, dtype, epilogue)


#: Storage dtypes that are their own compute dtype (TinyConv.bias_act's).
_FAST = (np.dtype(np.float32), np.dtype(np.float64))


# 1,024 entries: a signature takes two (its TinyConv and its data gradient's), and the torch
# bridge's runners hold them weakly (_TinyRunner), so this bound is what keeps up to 512
# tiny signatures in rotation from being rebuilt at every call
@functools.lru_cache(maxsize=1024)
def _tiny(geom: ConvGeometry, cd: np.dtype, with_data: bool = True) -> TinyConv | None:
    """The TinyConv of a tiny geometry (Note [tiny plans] in conv_tiny.py), else None; its
    data gradient's own (`with_data`) where that is a tiny convolution too."""
    if _column_entries(geom) > GATHER_ELEMENTS:
        return None
    tgeom = _transposed_geometry(geom) if with_data else None
    return TinyConv(geom, cd, _gather_index(geom), _live_taps(geom),
                    None if tgeom is None else _tiny(tgeom, cd, False),
                    (_dead_tap_nans, _full_filter) if _dead_taps(geom) else None)


def bias_act_runner(geom: ConvGeometry, dtype: np.dtype, act: str, residual: bool,
                    ) -> Callable[..., np.ndarray | None] | None:
    """For a validated conv_bias_act signature whose arrays are all `dtype` (with a
    residual or not, `act` normalized): a callable (x, w, b) -> y computing what
    conv_bias_act returns as y with no per-call decision, where the signature is the
    common tiny one (TinyConv.bias_act's); else None (Note [call plans] in
    convfuse/torch/_call_plan.py)."""
    if residual or act not in ("relu", "identity") or dtype not in _FAST:
        return None
    tiny = _tiny(geom, dtype)
    return None if tiny is None else _TinyRunner(tiny, act)


class _TinyRunner:
    """TinyConv.bias_act for one activation, holding the TinyConv weakly: `_tiny`'s LRU
    decides how many stay alive, not the callers that keep a runner (the torch bridge's
    per-signature cache holds thousands, and a TinyConv's index arrays reach hundreds of
    kilobytes). Once the LRU let it go the runner answers None, and its caller takes the
    validated path, which makes it again."""

    __slots__ = ("act", "tiny")

    def __init__(self, tiny: TinyConv, act: str) -> None:
        self.tiny, self.act = weakref.ref(tiny), act

    def __call__(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None,
                 ) -> np.ndarray | None:
        tiny = self.tiny()
        return None if tiny is None else tiny.bias_act(x, w, b, self.act)


def conv_forward(x: np.ndarray, w: np.ndarray, geom: ConvGeometry) -> np.ndarray:
    """y = conv(x, w): cross-correlation in the geometry's layout, in x's dtype."""
    cd = compute_dtype(x.dtype)
    return _convolve(x, _weight_taps(w, geom), geom, cd, x.dtype)


def conv_bias_act(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None,
    geom: ConvGeometry,
    activation: str | None = "identity",
    residual: np.ndarray | None = None,
    residual_scale: float = 1.0,
) -> tuple[np.ndarray, np.ndarray | None]:
    """(y, z): z = conv(x, w) + b + residual_scale * residual, y = act(z).

    z is returned only when the activation's backward needs it (activations.saves(act) ==
    "preactivation"), else None. y is computed from the unrounded z, so each output is
    rounded to the storage dtype once.
    """
    act = acts.normalize(activation)
    if residual is None and (act == "relu" or act == "identity") and x.dtype in _FAST \
            and w.dtype == x.dtype and (b is None or b.dtype == x.dtype):
        tiny = _tiny(geom, x.dtype)
        if tiny is not None:  # the common tiny call, with no epilogue to build
            return tiny.bias_act(x, w, b, act), None
    cd = compute_dtype(x.dtype)
    bias = None
    if b is not None:
        bias = b.astype(cd, copy=False).reshape(geom.out_channels, *([1] * geom.rank))
    res_cf = None if residual is None else _channels_first(residual, geom.channels_last)
    scale = cd.type(residual_scale)
    z_out = np.empty(geom.output_shape, x.dtype) if acts.saves(act) == "preactivation" else None
    z_cf = None if z_out is None else _channels_first(z_out, geom.channels_last)

    def epilogue(src: np.ndarray, dst: np.ndarray, lo: int, hi: int) -> None:
        if bias is None and res_cf is None and z_cf is None and act == "relu":
            relu(src, out=dst)  # the common case: one pass
            return
        if bias is not None:
            np.add(src, bias, out=dst)
        else:
            np.copyto(dst, src)
        if res_cf is not None:
            r = res_cf[lo:hi].astype(cd, copy=False)
            dst += r if scale == 1 else scale * r  # 1 * r == r exactly: skip the pass
        if z_cf is not None:
            z_cf[lo:hi] = dst
        if act == "relu":
            relu(dst, out=dst)
        elif act != "identity":
            dst[...] = apply_activation(dst, act)

    tiny = _tiny(geom, cd)
    if tiny is not None:
        return tiny.convolve(x, tiny.weight_taps(w), x.dtype, epilogue, True), z_out
    return _convolve(x, _weight_taps(w, geom), geom, cd, x.dtype, epilogue), z_out


@functools.lru_cache(maxsize=512)
def _transposed_geometry(geom: ConvGeometry) -> ConvGeometry | None:
    """For stride 1, dx is a plain convolution of dz with the flipped, transposed filter,
    padded by dilation * (kernel - 1) - padding; that geometry, or None when it is not one
    (a stride, or padding past dilation * (kernel - 1))."""
    if any(s != 1 for s in geom.stride) or any(
            not 0 <= p <= d * (k - 1)
            for p, d, k in zip(geom.padding, geom.dilation, geom.kernel_size, strict=True)):
        return None
    c, kg = geom.in_channels, geom.out_channels // geom.groups
    w_shape = (c, *geom.kernel_size, kg) if geom.channels_last else (c, kg, *geom.kernel_size)
    pad = tuple(d * (k - 1) - p
                for p, d, k in zip(geom.padding, geom.dilation, geom.kernel_size, strict=True))
    return ConvGeometry.create(geom.output_shape, w_shape, 1, pad, geom.dilation, geom.groups,
                               geom.layout)


def _flipped_taps(w: np.ndarray, geom: ConvGeometry) -> np.ndarray:
    """w[g] transposed to (C/G, K/G) and flipped in space, as a (G, C/G, K/G, prod(kernel))
    view where the strides allow."""
    g, rank = geom.groups, geom.rank
    wc = _channels_first(w, geom.channels_last)  # (K, C/G, *k)
    wc = wc.reshape(g, geom.out_channels // g, geom.in_channels // g, *geom.kernel_size)
    flip: tuple[Any, ...] = (Ellipsis, *[slice(None, None, -1)] * rank)
    return wc.swapaxes(1, 2)[flip].reshape(g, geom.in_channels // g, geom.out_channels // g, -1)


def conv_backward_data(dz: np.ndarray, w: np.ndarray, geom: ConvGeometry,
                       out: np.ndarray | None = None, beta: float = 0.0) -> np.ndarray:
    """dx = conv^T(dz, w), shaped like the input; `out`/`beta` as cuDNN's beta.

    With stride 1 it is a convolution of dz (one im2col, one GEMM, one output pass);
    otherwise dcols = w^T dz is scattered back by col2im.
    """
    cd = compute_dtype(dz.dtype)
    tiny = _tiny(geom, cd)
    if tiny is not None and tiny.data is not None:
        return tiny.data_grad(dz, w, out, beta)
    g = geom.groups
    tgeom = _transposed_geometry(geom)
    if tgeom is not None:
        dtype = dz.dtype if out is None else cd
        dx = _convolve(dz, _flipped_taps(w, geom), tgeom, cd, dtype,
                       tag="conv_dx", keep=False, dead_nans=False)
        return finish(dx, dz.dtype, out, beta)
    # a dead tap scatters into the padding only, which is cropped: leaving it out is exact
    wm = _matrix(_weight_taps(w, geom), geom, cd, live_only=True)
    dcols = _threads.matmul(wm.transpose(0, 2, 1), _output_matrix(dz, geom, cd))
    every = _offset_slices(geom)
    slices = [every[t] for t in _live_taps(geom)]
    c = geom.in_channels
    dcols = dcols.reshape(g, c // g, len(slices), geom.batch, *geom.output_spatial)
    padded = _padded_shape(geom)
    dxp = np.empty((geom.batch, g, c // g, *padded[2:]), cd)

    def run(lo: int, hi: int) -> None:
        part = dxp[lo:hi]
        part.fill(0)
        for j, where in enumerate(slices):
            # slicing and transposing only, so this is a view and += scatters into dxp;
            # offsets overlap, hence one offset at a time
            target = part[(slice(None), slice(None), slice(None), *where)]
            target = target.transpose(1, 2, 0, *range(3, 3 + geom.rank))
            target += dcols[:, :, j, lo:hi]

    _threads.parallel_for(geom.batch, dxp.size, run)
    inner = tuple(slice(p, p + n)
                  for p, n in zip(geom.padding, geom.input_shape_cf[2:], strict=True))
    dx = dxp.reshape(padded)[(slice(None), slice(None), *inner)]
    if geom.channels_last:
        dx = np.moveaxis(dx, 1, -1)
    return finish(dx, dz.dtype, out, beta)


def conv_backward_filter(x: np.ndarray, dz: np.ndarray, geom: ConvGeometry,
                         out: np.ndarray | None = None, beta: float = 0.0) -> np.ndarray:
    """dw = sum over batch and positions of dz * x-windows, shaped like the weight."""
    cd = compute_dtype(x.dtype)
    tiny = _tiny(geom, cd)
    if tiny is not None:  # never the flat form, nor kept columns (a gather is cheaper)
        return tiny.filter_grad(x, dz, out, beta)
    dw = None
    layout = flat_choice(geom, cd.itemsize)
    if layout is not None:  # Note [flat padded convolution]
        flat = _given(x, geom, cd, "flat")
        if flat is None:
            flat = conv_flat.flat_input(_channels_first(x, geom.channels_last), geom, layout,
                                        cd, tag="conv_x_flat")
        if conv_images.by_images(geom):  # exact: no gap outputs
            dw = conv_images.image_filter_grad(flat, np.ascontiguousarray(dz), geom, layout)
        else:
            dzq = conv_flat.flat_output(_channels_first(dz, geom.channels_last), geom, layout,
                                        cd, tag="conv_dz_q")
            dw = conv_flat.flat_filter_grad(flat, dzq, geom, layout)
            if not np.isfinite(dw).all():
                dw = None  # maybe a gap output's 0 * inf: the exact path decides
    if dw is None:
        cols = _given(x, geom, cd, "columns")
        if cols is None:
            cols = _columns(x, geom, cd, tag="conv_x_cols")
        dzm = _output_matrix(dz, geom, cd)
        dw = _full_filter(_threads.matmul(dzm, cols.transpose(0, 2, 1)), dzm, geom)
    dw = dw.reshape(geom.weight_shape_cf)
    if geom.channels_last:
        dw = np.moveaxis(dw, 1, -1)
    return finish(dw, x.dtype, out, beta)


def conv_backward_bias(dz: np.ndarray, geom: ConvGeometry, out: np.ndarray | None = None,
                       beta: float = 0.0) -> np.ndarray:
    """db (shape (K,)) = dz summed over all axes but the channel axis."""
    cd = compute_dtype(dz.dtype)
    tiny = _tiny(geom, cd)
    if tiny is not None:
        return tiny.bias_grad(dz, out, beta)
    return finish(channel_sum(dz, geom.reduce_axes, dtype=cd), dz.dtype, out, beta)
