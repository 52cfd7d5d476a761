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
formulas write into temporaries the call made itself (in-place operators), and an array is
converted only where it is not already what is needed (`_in`: x, dy and the parameters
already in the compute dtype are read as they are; the output is copied only to round it to
a half dtype or to make it C-contiguous). What a caller passed is never written, except the running
statistics; a gradient that may be dy itself (identity's dz) is copied before it is
returned. The forward folds invstd * weight per channel before the samples' pass (one
multiply and one add per value, torch's CPU kernel's order), so its last bits differ from
the unfolded (x - mean) * invstd * weight + bias; every consumer compares with a tolerance,
and both torch bridge paths run this same engine. Per-geometry constants (reduce axes,
broadcast shape, the mean's intp divisor) come from `_axes`, found by the geometry object
before its value: the torch bridge's plans hand over the same object at every call, and the
geometry's dataclass hash is Python.

Note [batch norm's scalars]
At these sizes a NumPy scalar costs as much as the arithmetic: making one (`cd.type(eps)`)
is a call, an operation between a NumPy scalar and an array converts it first, and a ufunc
given `out=` or `casting=` as keywords parses them; a 0-d array operand costs least. So the
scalars are made once as read-only 0-d arrays of the compute dtype: the count and n / (n - 1)
per geometry (`_axes`), eps, the momentum factor and 1 - factor per (dtype, eps, factor)
(`_scalars`, 1 - factor computed in the compute dtype as before). The values and the dtype
of every operation are the same, so are the bits. NumPy's mean divides the float32 sum by
the count as an intp, in float64, and rounds to float32; dividing in float32 by the count
gives the same bits wherever the count is exact in float32 (at most 2**24): a correctly
rounded quotient rounded again from float64 (53 bits, at least 2 * 24 + 2) is the correctly
rounded float32 quotient. Past 2**24 values per channel `_mean` keeps NumPy's division. The
running statistics are assigned in place (`running[...] = keep * running + f * batch`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from ... import activations as acts
from ...dtypes import compute_dtype
from ...plan.batchnorm import BatchNormGeometry
from ._accumulate import channel_sum
from .activation import _backward_cd, apply_activation


class _Axes(NamedTuple):
    """What the formulas read of a geometry, derived once per geometry (its properties
    recompute at every access): the reduce axes, the broadcast shape of a (C,) array, the
    values per channel (and as the intp NumPy's mean divides by), and per compute dtype the
    count as that dtype's scalar and the unbiasing factor n / (n - 1) (Note [batch norm's
    scalars])."""

    reduce: tuple[int, ...]
    shape: tuple[int, ...]
    values: int
    divisor: np.intp
    counts: dict[np.dtype, tuple[Any, bool, Any]]


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


_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)
#: the largest count each compute dtype holds exactly (its significand's range)
_EXACT: dict[np.dtype, int] = {_F32: 2 ** 24, _F64: 2 ** 53}


@functools.lru_cache(maxsize=256)
def _axes_of(g: BatchNormGeometry) -> _Axes:
    shape = [1] * g.ndim
    shape[g.channel_axis] = g.channels
    n = g.count
    counts = {cd: (_constant(cd, n), n <= limit,
                   _constant(cd, n / (n - 1)) if n > 1 else None)
              for cd, limit in _EXACT.items()}
    return _Axes(g.reduce_axes, tuple(shape), n, np.intp(n), counts)


#: compute_dtype of the storage dtypes, without its canonicalisation (one dict lookup per
#: call at the sizes where the call's overhead is the cost)
_COMPUTE: dict[np.dtype, np.dtype] = {_F64: _F64, _F32: _F32, np.dtype(np.float16): _F32}


def _compute(dtype: np.dtype) -> np.dtype:
    cd = _COMPUTE.get(dtype)
    return cd if cd is not None else compute_dtype(dtype)


def _in(a: Any, cd: np.dtype) -> Any:
    """`a` in the compute dtype, only read: itself where it already is (astype's copy=False
    without its keyword parsing)."""
    return a if a.dtype is cd else a.astype(cd)


_SCALARS: dict[tuple[np.dtype, float, float], tuple[Any, Any, Any]] = {}


def _scalars(cd: np.dtype, eps: float, factor: float) -> tuple[Any, Any, Any]:
    """(eps, factor, 1 - factor) as `cd` scalars, the last computed in `cd` (Note [batch
    norm's scalars])."""
    key = (cd, eps, factor)
    hit = _SCALARS.get(key)
    if hit is None:
        if len(_SCALARS) >= 256:
            _SCALARS.clear()
        f = cd.type(factor)
        hit = _SCALARS[key] = (_constant(cd, eps), _constant(cd, f), _constant(cd, 1 - f))
    return hit


def _constant(cd: np.dtype, value: Any) -> np.ndarray:
    """`value` as a read-only 0-d array of `cd` (Note [batch norm's scalars])."""
    a = np.array(value, dtype=cd)
    a.flags.writeable = False
    return a


def _sum(a: np.ndarray, ax: _Axes) -> np.ndarray:
    """a.sum over the reduce axes (what ndarray.sum runs, without its Python wrapper;
    channels-last float32 in float64, Note [channels-last sums])."""
    return channel_sum(a, ax.reduce)


def _mean(a: np.ndarray, ax: _Axes) -> np.ndarray:
    """a.mean over the reduce axes, bit for bit: NumPy's _mean divides the sum in place by
    the count as an intp, in float64 for a float32 sum, then rounds; where the count is
    exact in a's dtype the division in that dtype gives the same bits (Note [batch norm's
    scalars])."""
    total = channel_sum(a, ax.reduce)
    count = ax.counts.get(a.dtype)
    if count is not None and count[1]:
        return total / count[0]
    np.true_divide(total, ax.divisor, out=total, casting="unsafe")
    return total


def _normalised(x: np.ndarray, mean: np.ndarray, invstd: np.ndarray,
                ax: _Axes) -> np.ndarray:
    """(x - mean) * invstd, a fresh array in the compute dtype."""
    xhat = _in(x, _compute(x.dtype)) - mean.reshape(ax.shape)
    xhat *= invstd.reshape(ax.shape)
    return xhat


def _affine_act(centred: np.ndarray, invstd: np.ndarray, weight: Any, bias: Any,
                residual: Any, activation: str, ax: _Axes, dtype: np.dtype,
                ) -> tuple[np.ndarray, Any]:
    """(y, saved): y = act((x - mean) * (invstd * weight) + bias + residual), saved per
    activations.saves. `centred` (x - mean, compute dtype) is a fresh array this call owns
    and becomes z in place (Note [batch norm's temporaries]): the per-channel scale is
    folded first, so the samples take one multiply and one add, as torch's CPU kernel
    (alpha = invstd * weight, beta = bias - mean * alpha) does."""
    cd, shape = centred.dtype, ax.shape
    scale = invstd if weight is None else invstd * _in(weight, cd)
    z = centred
    z *= scale.reshape(shape)
    if bias is not None:
        z += _in(bias, cd).reshape(shape)
    if residual is not None:
        z += _in(residual, cd)
    # identity's y is z itself, a fresh array (copied only to round to a half dtype, or
    # where x's strides made z's other than C order)
    y = z if activation == "identity" else apply_activation(z, activation)
    if y.dtype is not dtype or not y.flags.c_contiguous:
        y = y.astype(dtype, order="C")
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
    xc = _in(x, cd)  # only read
    mean = _mean(xc, ax)
    centred = xc - mean.reshape(ax.shape)
    var = _mean(centred * centred, ax)
    eps_c, f, keep = _scalars(cd, eps, factor)
    invstd = var + eps_c
    np.sqrt(invstd, invstd)
    invstd = 1.0 / invstd
    y, saved = _affine_act(centred, invstd, weight, bias, residual, activation, ax, x.dtype)
    if running_mean is not None:
        unbias = ax.counts[cd][2]
        n = ax.values
        unbiased = var * (unbias if unbias is not None else cd.type(n / (n - 1)))
        running_mean[...] = keep * running_mean + f * mean
        running_var[...] = keep * running_var + f * unbiased
    return y, saved, mean, invstd


def batchnorm_forward_inference(x: np.ndarray, weight: Any, bias: Any, running_mean: np.ndarray,
                                running_var: np.ndarray, g: BatchNormGeometry, eps: float,
                                activation: str, residual: Any,
                                stats: bool = True) -> tuple[np.ndarray, Any, Any, Any]:
    """(y, saved, mean, invstd) with the running statistics (copied, so backward sees the
    statistics this forward used); mean and invstd None without `stats` (the same y)."""
    cd = _compute(x.dtype)
    ax = _axes(g)
    mean = running_mean.astype(cd, copy=stats)
    invstd = (1.0 / np.sqrt(running_var.astype(cd) + cd.type(eps))).astype(cd)
    centred = _in(x, cd) - mean.reshape(ax.shape)
    y, saved = _affine_act(centred, invstd, weight, bias, residual, activation, ax, x.dtype)
    return (y, saved, mean, invstd) if stats else (y, saved, None, None)


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
    dz = _in(dy, cd) if activation == "identity" else _backward_cd(dy, saved, activation)[0]
    xhat = _normalised(x, mean, invstd, ax)
    dbias = _sum(dz, ax)
    dweight = _sum(dz * xhat, ax)
    dx = None
    if need_dx:
        # weight None is weight 1: 1 * invstd is invstd
        scale = invstd if weight is None else _in(weight, cd) * invstd
        if training:
            n = ax.counts[cd][0]
            dx = n * dz
            dx -= dbias.reshape(shape)
            xhat *= dweight.reshape(shape)
            dx -= xhat
            dx *= (scale / n).reshape(shape)
        else:
            dx = dz * scale.reshape(shape)
        if dx.dtype is not x.dtype or not dx.flags.c_contiguous:  # rounded to a half dtype
            dx = dx.astype(x.dtype, order="C")
    # dz may be dy itself (identity): dres is always a copy
    dres = dz.astype(x.dtype, order="C") if residual else None
    return dx, dweight, dbias, dres
