"""Batch normalization on NumPy arrays, with PyTorch's formulas (torch.nn.functional.batch_norm).

Training normalises with the biased batch variance and folds the unbiased one into
running_var; evaluation uses the running statistics. The fused form computes
act(batchnorm(x) + residual). Arithmetic runs in float64 for float64 data and float32
otherwise; float16/bfloat16 results are rounded once at the end. The per-channel arrays
(weight, bias, running statistics, mean, invstd) are in that compute dtype, as cuDNN's
derived BN descriptor requires. Inputs are never modified; the running statistics are
documented outputs and are updated in place.

Note [batch norm's temporaries]
At the sizes where a training step waits on the host (issue #25: a 2x1x4x4 batch norm), each
NumPy call costs about a microsecond whatever its size, and a copy is a call. So the
formulas write into temporaries the call made itself (`out=`, in-place operators), and
`astype` takes copy=False wherever its result is only read or is already a fresh array: x in
the compute dtype, the output before a half-precision rounding, identity's output, which is
the pre-activation itself. What a caller passed is never written, except the running
statistics; a gradient that may be dy itself (identity's dz) is copied before it is
returned. The forward folds invstd * weight per channel before the samples' pass (one
multiply and one add per value, torch's CPU kernel's order), so its last bits differ from
the unfolded (x - mean) * invstd * weight + bias; every consumer compares with a tolerance,
and both torch bridge paths run this same engine. Per-geometry constants (reduce axes,
broadcast shape, the mean's intp divisor) come from `_axes`, found by the geometry object
before its value: the torch bridge's plans hand over the same object at every call, and the
geometry's dataclass hash is Python.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from ... import activations as acts
from ...dtypes import compute_dtype
from ...plan.batchnorm import BatchNormGeometry
from .activation import _backward_cd, apply_activation


class _Axes(NamedTuple):
    """What the formulas read of a geometry, derived once per geometry (its properties
    recompute at every access): the reduce axes, the broadcast shape of a (C,) array, and
    the values per channel (and as the intp NumPy's mean divides by)."""

    reduce: tuple[int, ...]
    shape: tuple[int, ...]
    values: int
    divisor: np.intp


_BY_OBJECT: dict[int, tuple[BatchNormGeometry, _Axes]] = {}


def _axes(g: BatchNormGeometry) -> _Axes:
    """_Axes of `g`: found by the geometry object itself first (a caller that keeps its
    geometry, the torch bridge's plans, pays no hash of the dataclass), then by value."""
    hit = _BY_OBJECT.get(id(g))
    if hit is not None and hit[0] is g:  # the entry keeps g alive: its id is not reused
        return hit[1]
    ax = _axes_of(g)
    if len(_BY_OBJECT) >= 256:
        _BY_OBJECT.clear()
    _BY_OBJECT[id(g)] = (g, ax)
    return ax


@functools.lru_cache(maxsize=256)
def _axes_of(g: BatchNormGeometry) -> _Axes:
    shape = [1] * g.ndim
    shape[g.channel_axis] = g.channels
    return _Axes(g.reduce_axes, tuple(shape), g.count, np.intp(g.count))


#: compute_dtype of the storage dtypes, without its canonicalisation (one dict lookup per
#: call at the sizes where the call's overhead is the cost)
_COMPUTE: dict[np.dtype, np.dtype] = {
    np.dtype(np.float64): np.dtype(np.float64), np.dtype(np.float32): np.dtype(np.float32),
    np.dtype(np.float16): np.dtype(np.float32)}


def _compute(dtype: np.dtype) -> np.dtype:
    cd = _COMPUTE.get(dtype)
    return cd if cd is not None else compute_dtype(dtype)


def _per_channel(a: np.ndarray, ax: _Axes) -> np.ndarray:
    """A (C,) array shaped to broadcast against x."""
    return a.reshape(ax.shape)


def _sum(a: np.ndarray, ax: _Axes) -> np.ndarray:
    """a.sum over the reduce axes (what ndarray.sum runs, without its Python wrapper)."""
    return np.add.reduce(a, axis=ax.reduce)


def _mean(a: np.ndarray, ax: _Axes) -> np.ndarray:
    """a.mean over the reduce axes, bit for bit: NumPy's _mean is this sum divided in place
    by the count as an intp."""
    total = np.add.reduce(a, axis=ax.reduce)
    np.true_divide(total, ax.divisor, out=total, casting="unsafe")
    return total


def _normalised(x: np.ndarray, mean: np.ndarray, invstd: np.ndarray,
                ax: _Axes) -> np.ndarray:
    """(x - mean) * invstd, a fresh array in the compute dtype."""
    xhat = x.astype(_compute(x.dtype), copy=False) - mean.reshape(ax.shape)
    return np.multiply(xhat, invstd.reshape(ax.shape), out=xhat)


def _affine_act(centred: np.ndarray, invstd: np.ndarray, weight: Any, bias: Any,
                residual: Any, activation: str, ax: _Axes, dtype: np.dtype,
                ) -> tuple[np.ndarray, Any]:
    """(y, saved): y = act((x - mean) * (invstd * weight) + bias + residual), saved per
    activations.saves. `centred` (x - mean, compute dtype) is a fresh array this call owns
    and becomes z in place (Note [batch norm's temporaries]): the per-channel scale is
    folded first, so the samples take one multiply and one add, as torch's CPU kernel
    (alpha = invstd * weight, beta = bias - mean * alpha) does."""
    cd, shape = centred.dtype, ax.shape
    scale = invstd if weight is None else invstd * weight.astype(cd, copy=False)
    z = np.multiply(centred, scale.reshape(shape), out=centred)
    if bias is not None:
        z += bias.astype(cd, copy=False).reshape(shape)
    if residual is not None:
        z += residual.astype(cd, copy=False)
    # identity's y is z itself, a fresh C-contiguous array (the `astype` below copies
    # only to round to a half dtype)
    y = z if activation == "identity" else apply_activation(z, activation)
    y = y.astype(dtype, order="C", copy=False)
    need = acts.saves(activation)
    saved = y if need == "output" else (z.astype(dtype, order="C") if need != "none" else None)
    return y, saved


def batchnorm_forward_training(x: np.ndarray, weight: Any, bias: Any, running_mean: Any,
                               running_var: Any, g: BatchNormGeometry, eps: float,
                               factor: float, activation: str,
                               residual: Any) -> tuple[np.ndarray, Any, np.ndarray, np.ndarray]:
    """(y, saved, mean, invstd); updates running_mean/var in place when given."""
    cd = _compute(x.dtype)
    ax = _axes(g)
    axes, divisor = ax.reduce, ax.divisor
    xc = x.astype(cd, copy=False)  # only read
    mean = np.add.reduce(xc, axis=axes)  # _mean's, inline: this runs at every call
    np.true_divide(mean, divisor, out=mean, casting="unsafe")
    centred = xc - mean.reshape(ax.shape)
    var = np.add.reduce(centred * centred, axis=axes)
    np.true_divide(var, divisor, out=var, casting="unsafe")
    invstd = var + cd.type(eps)
    np.sqrt(invstd, out=invstd)
    np.true_divide(1.0, invstd, out=invstd)
    y, saved = _affine_act(centred, invstd, weight, bias, residual, activation, ax, x.dtype)
    if running_mean is not None:
        n = ax.values
        f = cd.type(factor)
        keep = 1 - f
        unbiased = var * cd.type(n / (n - 1))
        np.add(keep * running_mean, f * mean, out=running_mean)
        np.add(keep * running_var, f * unbiased, out=running_var)
    return y, saved, mean, invstd


def batchnorm_forward_inference(x: np.ndarray, weight: Any, bias: Any, running_mean: np.ndarray,
                                running_var: np.ndarray, g: BatchNormGeometry, eps: float,
                                activation: str,
                                residual: Any) -> tuple[np.ndarray, Any, np.ndarray, np.ndarray]:
    """(y, saved, mean, invstd) with the running statistics (copied, so backward sees the
    statistics this forward used)."""
    cd = _compute(x.dtype)
    ax = _axes(g)
    mean = running_mean.astype(cd, copy=True)
    invstd = (1.0 / np.sqrt(running_var.astype(cd) + cd.type(eps))).astype(cd)
    centred = x.astype(cd, copy=False) - mean.reshape(ax.shape)
    y, saved = _affine_act(centred, invstd, weight, bias, residual, activation, ax, x.dtype)
    return y, saved, mean, invstd


def batchnorm_backward(dy: np.ndarray, x: np.ndarray, weight: Any, saved: Any, mean: np.ndarray,
                       invstd: np.ndarray, training: bool, g: BatchNormGeometry, activation: str,
                       residual: bool, need_dx: bool) -> tuple[Any, np.ndarray, np.ndarray, Any]:
    """(dx, dweight, dbias, dresidual) in the compute dtype for the per-channel ones.

    dz = dy * act'(...); dbias = sum(dz); dweight = sum(dz * xhat); in training
    dx = weight * invstd / n * (n * dz - dbias - xhat * dweight) (the batch statistics
    depend on x), in evaluation dx = dz * weight * invstd.
    """
    cd = _compute(x.dtype)
    ax = _axes(g)
    shape = ax.shape
    # identity's backward is dy itself: no pass over the samples (dz is only read below)
    dz = dy.astype(cd, copy=False) if activation == "identity" \
        else _backward_cd(dy, saved, activation)[0]
    xhat = _normalised(x, mean, invstd, ax)
    dbias = _sum(dz, ax)
    dweight = _sum(dz * xhat, ax)
    dx = None
    if need_dx:
        w = weight.astype(cd, copy=False) if weight is not None else np.ones(g.channels, cd)
        scale = (w * invstd).reshape(shape)
        if training:
            n = cd.type(ax.values)
            dx = n * dz
            dx -= dbias.reshape(shape)
            dx -= np.multiply(xhat, dweight.reshape(shape), out=xhat)
            dx *= scale / n
        else:
            dx = dz * scale
        dx = dx.astype(x.dtype, order="C", copy=False)  # fresh: rounded to a half dtype only
    # dz may be dy itself (identity): dres is always a copy
    dres = dz.astype(x.dtype, order="C") if residual else None
    return dx, dweight.astype(cd, copy=False), dbias.astype(cd, copy=False), dres
