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
"""

from __future__ import annotations

import itertools

import numpy as np

from ... import activations as acts
from ...dtypes import compute_dtype
from ...geometry import ConvGeometry
from .activation import apply_activation, finish


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


def _columns(x: np.ndarray, geom: ConvGeometry, cd: np.dtype) -> np.ndarray:
    """cols[G, C/G*prod(kernel), N*prod(out)] (Note [im2col per group])."""
    g, c = geom.groups, geom.in_channels
    xc = _channels_first(x, geom.channels_last)
    if any(geom.padding):
        xc = np.pad(xc, [(0, 0), (0, 0), *((p, p) for p in geom.padding)])
    slices = _offset_slices(geom)
    cols = np.empty((g, c // g, len(slices), geom.batch, *geom.output_spatial), cd)
    for j, where in enumerate(slices):
        cols[:, :, j] = _grouped(xc[(slice(None), slice(None), *where)], g)
    return cols.reshape(g, (c // g) * len(slices), -1)


def _weight_matrix(w: np.ndarray, geom: ConvGeometry, cd: np.dtype) -> np.ndarray:
    """w as (G, K/G, C/G*prod(kernel)) in the compute dtype."""
    wc = _cast_copy(_channels_first(w, geom.channels_last), cd)
    return wc.reshape(geom.groups, geom.out_channels // geom.groups, -1)


def _output_matrix(dz: np.ndarray, geom: ConvGeometry, cd: np.dtype) -> np.ndarray:
    """An output-shaped array (y or dz, in the geometry's layout) as (G, K/G, N*prod(out))."""
    dzm = _cast_copy(_grouped(_channels_first(dz, geom.channels_last), geom.groups), cd)
    return dzm.reshape(geom.groups, geom.out_channels // geom.groups, -1)


def _output_from_matrix(ym: np.ndarray, geom: ConvGeometry) -> np.ndarray:
    """(G, K/G, N*prod(out)) back to a C-contiguous array in the geometry's layout."""
    r = geom.rank
    y = ym.reshape(geom.out_channels, geom.batch, *geom.output_spatial)  # (K, N, *out)
    perm = (1, *range(2, 2 + r), 0) if geom.channels_last else (1, 0, *range(2, 2 + r))
    return np.ascontiguousarray(y.transpose(perm))


def _forward_cd(x: np.ndarray, w: np.ndarray, geom: ConvGeometry, cd: np.dtype) -> np.ndarray:
    return _output_from_matrix(np.matmul(_weight_matrix(w, geom, cd), _columns(x, geom, cd)),
                               geom)


def conv_forward(x: np.ndarray, w: np.ndarray, geom: ConvGeometry) -> np.ndarray:
    """y = conv(x, w): cross-correlation in the geometry's layout, in x's dtype."""
    return finish(_forward_cd(x, w, geom, compute_dtype(x.dtype)), x.dtype)


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
    cd = compute_dtype(x.dtype)
    z = _forward_cd(x, w, geom, cd)
    if b is not None:
        bias_shape = [1] * z.ndim
        bias_shape[geom.channel_axis] = geom.out_channels
        z += b.astype(cd).reshape(bias_shape)
    if residual is not None:
        z += cd.type(residual_scale) * residual.astype(cd)
    y = finish(apply_activation(z, act), x.dtype)
    keep_z = acts.saves(act) == "preactivation"
    return y, (finish(z, x.dtype) if keep_z else None)


def conv_backward_data(dz: np.ndarray, w: np.ndarray, geom: ConvGeometry,
                       out: np.ndarray | None = None, beta: float = 0.0) -> np.ndarray:
    """dx = conv^T(dz, w), shaped like the input; `out`/`beta` as cuDNN's beta."""
    g = geom.groups
    cd = compute_dtype(dz.dtype)
    wm = _weight_matrix(w, geom, cd)
    dcols = np.matmul(wm.transpose(0, 2, 1), _output_matrix(dz, geom, cd))
    slices = _offset_slices(geom)
    c = geom.in_channels
    dcols = dcols.reshape(g, c // g, len(slices), geom.batch, *geom.output_spatial)
    padded = _padded_shape(geom)
    dxp = np.zeros((geom.batch, g, c // g, *padded[2:]), cd)
    for j, where in enumerate(slices):
        # slicing and transposing only, so this is a view and += scatters into dxp;
        # offsets overlap, hence one offset at a time
        target = dxp[(slice(None), slice(None), slice(None), *where)]
        target = target.transpose(1, 2, 0, *range(3, 3 + geom.rank))
        target += dcols[:, :, j]
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
    cols = _columns(x, geom, cd)
    dw = np.matmul(_output_matrix(dz, geom, cd), cols.transpose(0, 2, 1))  # (G, K/G, C/G*k)
    dw = dw.reshape(geom.weight_shape_cf)
    if geom.channels_last:
        dw = np.moveaxis(dw, 1, -1)
    return finish(dw, x.dtype, out, beta)


def conv_backward_bias(dz: np.ndarray, geom: ConvGeometry, out: np.ndarray | None = None,
                       beta: float = 0.0) -> np.ndarray:
    """db (shape (K,)) = dz summed over all axes but the channel axis."""
    db = np.sum(dz, axis=geom.reduce_axes, dtype=compute_dtype(dz.dtype))
    return finish(db, dz.dtype, out, beta)
