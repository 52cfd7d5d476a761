"""A tiny convolution's calls with every shape decided once (Note [tiny plans]).

Note [tiny plans]
A tiny geometry (conv.py Note [choosing the method]) costs a handful of NumPy calls, and
before this its Python cost a multiple of them: each call re-derived the live taps, the
gather index, the GEMM's operand shapes and the output views through a chain of helpers,
each looking the geometry up in its own cache (a geometry's hash is a Python call), and
the torch bridge pays that four times per training step of a layer (forward, bias, filter
and data gradients). A TinyConv holds one geometry's answers in one object, looked up once
per call (`conv._tiny`), and runs the same operations in the same order as the general
path's columns + GEMM: one gather, one batched GEMM of the same operands, the same epilogue
and the same rounding, so each result is the one conv.py's general functions define.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ...geometry import ConvGeometry
from . import _threads
from .activation import finish, relu


class TinyConv:
    """One tiny geometry in one compute dtype `cd`: `index` is conv._gather_index(geom),
    `live` its live taps, `data` the TinyConv of the data gradient's convolution
    (conv._transposed_geometry) or None where that is not tiny or not one, and with dead
    taps, `dead_rules` conv's (_dead_tap_nans, _full_filter), their non-finite rules."""

    __slots__ = (
        "__weakref__",  # runners hold it weakly (conv._TinyRunner)
        "bias_shape",
        "cd",
        "cl",
        "data",
        "dead_rules",
        "ext",
        "flip",
        "geom",
        "index",
        "k_shape",
        "local",
        "matmul",
        "out_shape",
        "reduce_axes",
        "src_shape",
        "take",
        "w4_shape",
        "w_cf_shape",
        "wf_shape",
        "wm_shape",
        "y_shape",
        "ym_shape",
    )

    def __init__(self, geom: ConvGeometry, cd: np.dtype, index: np.ndarray,
                 live: tuple[int, ...], data: TinyConv | None, dead_rules: Any = None,
                 ) -> None:
        g, k, c = geom.groups, geom.out_channels, geom.in_channels
        taps = math.prod(geom.kernel_size)
        self.geom, self.cd, self.cl, self.index, self.data = geom, cd, geom.channels_last, \
            index, data
        self.dead_rules = dead_rules
        self.ext = math.prod(geom.input_shape) + 1
        self.w4_shape = (g, k // g, c // g, taps)
        # conv._taps: the live taps as one run (a view) when they are one, else a list
        self.take: Any = None
        if dead_rules is not None:
            run = live and live[-1] - live[0] == len(live) - 1
            self.take = slice(live[0], live[-1] + 1) if run else list(live)
        self.wm_shape = (g, k // g, (c // g) * len(live))
        self.ym_shape = (k, geom.batch, *geom.output_spatial)
        self.out_shape = geom.output_shape
        self.y_shape = (g, k // g, geom.batch * math.prod(geom.output_spatial))
        self.w_cf_shape = geom.weight_shape_cf
        self.k_shape = (g, k // g, c // g, *geom.kernel_size)
        self.wf_shape = (g, c // g, k // g, taps)
        self.flip: tuple[Any, ...] = (Ellipsis, *[slice(None, None, -1)] * geom.rank)
        self.reduce_axes = geom.reduce_axes
        self.bias_shape = (k, *[1] * geom.rank)
        # _threads.matmul's own choice for these operands, made once: the forward's GEMM
        # and the filter gradient's multiply the same number of products
        products = self.wm_shape[1] * self.wm_shape[2] * self.y_shape[2]
        self.matmul = np.matmul if products < _threads.TINY_GEMM_FLOPS else _threads.matmul
        # one image: the GEMM's (K, N*P) rows already are the (N, K, *out) output, in order
        self.src_shape = geom.output_shape_cf if geom.batch == 1 else None
        self.local = threading.local()  # each thread's zero-extended copy of x

    def _src(self, ym: np.ndarray) -> np.ndarray:
        """The GEMM result as an (N, K, *out) view (conv._gemm_view)."""
        if self.src_shape is not None:
            return ym.reshape(self.src_shape)
        return ym.reshape(self.ym_shape).swapaxes(0, 1)

    def _cf(self, a: np.ndarray) -> np.ndarray:
        return np.moveaxis(a, -1, 1) if self.cl else a

    def columns(self, x: np.ndarray) -> np.ndarray:
        """conv._columns of x: one gather through the index, in the compute dtype, from x
        copied into this thread's buffer whose last element stays zero (the padding's)."""
        ext = getattr(self.local, "ext", None)
        if ext is None:
            ext = self.local.ext = np.zeros(self.ext, self.cd)
        ext[:-1] = x.reshape(-1)
        return ext[self.index]

    def _matrix(self, w4: np.ndarray) -> np.ndarray:
        """conv._matrix(w4, live_only=True): a view where w4 already is the operand."""
        if self.take is not None:
            w4 = w4[..., self.take]
        if w4.dtype == self.cd and w4.flags.c_contiguous:
            return w4.reshape(self.wm_shape)
        buf = np.empty(w4.shape, self.cd)
        buf[...] = w4
        return buf.reshape(self.wm_shape)

    def _product(self, x: np.ndarray, w4: np.ndarray, dead_nans: bool) -> np.ndarray:
        """The convolution's GEMM of columns and weight, as an (N, K, *out) view in the
        compute dtype (with the dead taps' NaN rule where `dead_nans`)."""
        ym = self.matmul(self._matrix(w4), self.columns(x))
        if dead_nans and self.dead_rules is not None:
            self.dead_rules[0](ym, w4, self.geom)
        return self._src(ym)

    def convolve(self, x: np.ndarray, w4: np.ndarray, dtype: np.dtype,
                 epilogue: Callable[[np.ndarray, np.ndarray, int, int], None] | None,
                 dead_nans: bool) -> np.ndarray:
        """conv._convolve of the tiny geometry: columns, GEMM, then `epilogue` into a new
        array in the geometry's layout and `dtype`."""
        src = self._product(x, w4, dead_nans)
        out = np.empty(self.out_shape, dtype)
        dst = self._cf(out)
        cd = self.cd
        if epilogue is None:
            dst[...] = src
        elif dtype == cd:
            epilogue(src, dst, 0, self.geom.batch)
        else:
            tmp = np.empty(dst.shape, cd)
            epilogue(src, tmp, 0, self.geom.batch)
            dst[...] = tmp  # rounded to the storage dtype once
        return out

    def bias_act(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None,
                 act: str) -> np.ndarray:
        """conv.conv_bias_act's y for x, w and b in the compute dtype, act identity or
        relu and no residual: the same GEMM and the same epilogue passes, without
        building the general epilogue."""
        src = self._product(x, self.weight_taps(w), True)
        out = np.empty(self.out_shape, self.cd)
        dst = self._cf(out)
        if b is None:
            if act == "relu":
                relu(src, out=dst)
            else:
                np.copyto(dst, src)
            return out
        np.add(src, b.reshape(self.bias_shape), out=dst)
        if act == "relu":
            relu(dst, out=dst)
        return out

    def weight_taps(self, w: np.ndarray) -> np.ndarray:
        """conv._weight_taps: w as (G, K/G, C/G, prod(kernel))."""
        return self._cf(w).reshape(self.w4_shape)

    def bias_grad(self, dz: np.ndarray, out: np.ndarray | None, beta: float) -> np.ndarray:
        """conv.conv_backward_bias."""
        return finish(np.add.reduce(dz, axis=self.reduce_axes, dtype=self.cd), dz.dtype,
                      out, beta)

    def filter_grad(self, x: np.ndarray, dz: np.ndarray, out: np.ndarray | None,
                    beta: float) -> np.ndarray:
        """conv.conv_backward_filter by the columns."""
        cols = self.columns(x)
        dzm = np.empty(self.ym_shape, self.cd)  # conv._output_matrix
        dzm[...] = self._cf(dz).swapaxes(0, 1)
        dzm = dzm.reshape(self.y_shape)
        dw = self.matmul(dzm, cols.transpose(0, 2, 1))
        if self.dead_rules is not None:
            dw = self.dead_rules[1](dw, dzm, self.geom)
        dw = dw.reshape(self.w_cf_shape)
        if self.cl:
            dw = np.moveaxis(dw, 1, -1)
        return finish(dw, x.dtype, out, beta)

    def data_grad(self, dz: np.ndarray, w: np.ndarray, out: np.ndarray | None,
                  beta: float) -> np.ndarray:
        """conv.conv_backward_data as the convolution of dz with the flipped filter; only
        where `data` is set."""
        assert self.data is not None
        wf = self._cf(w).reshape(self.k_shape).swapaxes(1, 2)[self.flip].reshape(self.wf_shape)
        dx = self.data.convolve(dz, wf, dz.dtype if out is None else self.cd, None, False)
        return finish(dx, dz.dtype, out, beta)
