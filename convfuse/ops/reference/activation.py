"""Activations and their gradients on NumPy arrays, exactly as PyTorch defines them.

relu, sigmoid, tanh, elu (alpha 1), relu6, leaky_relu (slope 0.01), silu and the exact
(erf) gelu; identity passes through. NaN propagates through every activation. Backward
takes what `convfuse.activations.saves` names (Note [what backward saves] there): the
output y for relu, relu6, leaky_relu, sigmoid and tanh; the pre-activation z for elu,
silu and gelu; nothing for identity. At the kinks the gradient is PyTorch's: relu and
relu6 give 0 at 0 (and relu6 at 6), leaky_relu gives the slope at 0.

Arithmetic runs in `dtypes.compute_dtype` (float64 for float64, else float32) and results
are rounded to the storage dtype once, at the end (`finish`).

Note [erf without SciPy]
NumPy has no erf, and np.vectorize(math.erf) costs ~130 ns an element. `erf`/`erfc` here
are vectorised and accurate to a few float64 ulps (tests check against math.erf/erfc):
- |x| < 0.5: erf's Taylor series in x^2 (13 terms, coefficients from exact rationals);
- |x| >= 0.5: erfc(|x|) = exp(-x^2) * erfcx(|x|), with erfcx = exp(x^2) erfc(x) smooth and
  slowly varying. erfcx is interpolated at Chebyshev points, degree 14, on intervals
  [0.5 * 2^(j/3), 0.5 * 2^((j+1)/3)] up to 32 (erfc underflows past 27.3). The samples come
  from math.erfc once, at first use; from x = 20 the asymptotic series is used instead,
  since exp(x^2) overflows there. exp(-x^2) splits x = hi + lo so that hi^2 is exact:
  rounding x^2 first would cost x^2 ulps (over 700 near the underflow).
gelu uses erfc(-z / sqrt 2), equal to PyTorch's 1 + erf(z / sqrt 2) but without its
cancellation for negative z.

Note [edge values]
Where PyTorch's CPU engine gives a NaN, an inf or a 0, so does this engine, silently:
- relu's gradient is 0 where the saved output y <= 0 and dy elsewhere, so a NaN
  pre-activation (which relu passes on as y = NaN) passes dy on, as torch's
  threshold_backward does (the GPU kernel in kernels/activation.cu does the same);
- relu6 and elu do the same at a NaN y or z: relu6's gradient is 0 where y <= 0 or y >= 6
  (so exactly 0 at z = 0, z = 6 and z = +-inf) and dy elsewhere; elu's, from the saved z
  as torch.nn.ELU's (elu_backward with is_result=False), is dy * exp(z) where z <= 0 and
  dy elsewhere (dy at +-0 and +inf, 0 at -inf). That is the rule PyTorch writes in its
  scalar CPU loop and its CUDA kernels (hardtanh_backward, elu_backward). Its CPU SIMD
  loop gives 0 (relu6) and NaN (elu) at a NaN instead, so torch's CPU answer there
  depends on whether the element falls in a whole vector or the scalar tail; convfuse
  does not copy that position dependence.
  Forward keeps -0.0, as torch does, but for relu (+0.0 there: `relu`'s docstring);
- silu and gelu at -inf are NaN (-inf * 0), at +inf +inf, and their gradients at +-inf
  NaN, as in PyTorch; huge |z| overflows intermediate squares harmlessly. NumPy would warn
  (invalid value, overflow); those warnings are suppressed inside the functions that
  expect them (np.errstate is per thread, and the engine runs on several).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

from ... import activations as acts
from ...dtypes import compute_dtype
from ...geometry import ConvGeometry
from . import _threads
from ._accumulate import channel_sum

_SQRT1_2 = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_HI_MASK = np.uint64(0xFFFFFFFFF8000000)  # keeps 26 significand bits, so hi * hi is exact

# erf(x) = x * sum_n c_n x^(2n), c_n = 2/sqrt(pi) (-1)^n / (n! (2n+1)); |x| < 0.5 needs 13.
_ERF_TAYLOR = tuple(
    2.0 / math.sqrt(math.pi) * (-1) ** n / (math.factorial(n) * (2 * n + 1)) for n in range(13)
)
_TABLE_PER_OCTAVE, _TABLE_OCTAVES, _TABLE_DEGREE = 3, 6, 14
_BLOCK = 16384


def _square_split(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    hi = (a.view(np.uint64) & _HI_MASK).view(np.float64)
    return hi, a - hi


def _exp_minus_square(a: np.ndarray) -> np.ndarray:
    hi, lo = _square_split(a)
    return np.exp(-hi * hi) * np.exp(-lo * (2.0 * hi + lo))


def _erfcx_sample(x: float) -> float:
    if x >= 20.0:  # asymptotic series: the 12th term is below 1e-20 here
        t, term, total = 0.5 / (x * x), 1.0, 1.0
        for n in range(1, 12):
            term *= -(2 * n - 1) * t
            total += term
        return total / (x * math.sqrt(math.pi))
    hi = float(_square_split(np.array([x]))[0][0])
    lo = x - hi
    return math.erfc(x) * math.exp(hi * hi) * math.exp(lo * (2.0 * hi + lo))


@functools.cache
def _erfcx_table() -> np.ndarray:
    """erfcx as polynomials in u in [-1, 1], one per interval (Note [erf without SciPy])."""
    deg = _TABLE_DEGREE
    k = np.arange(deg + 1)
    # cos(pi j (2k+1) / (2(deg+1))) with the angle reduced exactly, for accurate coefficients
    cosines = np.cos(np.pi * (np.outer(k, 2 * k + 1) % (4 * (deg + 1))) / (2 * (deg + 1)))
    rows = []
    for j in range(_TABLE_PER_OCTAVE * _TABLE_OCTAVES):
        a, b = (0.5 * 2.0 ** ((j + i) / _TABLE_PER_OCTAVE) for i in (0, 1))
        nodes = 0.5 * (a + b) + 0.5 * (b - a) * cosines[1]
        cheb = 2.0 / (deg + 1) * (cosines @ np.array([_erfcx_sample(float(v)) for v in nodes]))
        cheb[0] /= 2.0
        mono = np.polynomial.chebyshev.cheb2poly(cheb)  # trims trailing zeros
        rows.append(np.pad(mono, (0, deg + 1 - mono.size)))
    return np.ascontiguousarray(np.array(rows).T)  # row i holds every interval's u^i


def _erfc_from_half(a: np.ndarray) -> np.ndarray:
    """erfc(a) for finite float64 a >= 0.5."""
    a = np.minimum(a, 28.0)  # erfc(28) underflows to 0; larger a would overflow the polynomial
    cols = _erfcx_table()
    n_int = cols.shape[1]
    j = np.floor(np.log2(a * 2.0) * _TABLE_PER_OCTAVE).astype(np.intp)
    np.clip(j, 0, n_int - 1, out=j)
    lo = 0.5 * np.exp2(j / _TABLE_PER_OCTAVE)
    width = lo * (2.0 ** (1.0 / _TABLE_PER_OCTAVE) - 1.0)
    u = (a - lo) * (2.0 / width) - 1.0
    poly = cols[-1].take(j)
    for i in range(cols.shape[0] - 2, -1, -1):
        poly *= u
        poly += cols[i].take(j)
    return _exp_minus_square(a) * poly


def _erf_small(x: np.ndarray) -> np.ndarray:
    s = x * x
    acc = np.full_like(x, _ERF_TAYLOR[-1])
    for c in _ERF_TAYLOR[-2::-1]:
        acc *= s
        acc += c
    return acc * x


def _erf_block(x: np.ndarray) -> np.ndarray:
    out = x.copy()  # NaN stays NaN: it is in neither mask
    a = np.abs(x)
    small = a < 0.5
    out[small] = _erf_small(x[small])
    big = (a >= 0.5) & np.isfinite(a)
    out[big] = np.copysign(1.0 - _erfc_from_half(a[big]), x[big])
    out[np.isinf(x)] = np.sign(x[np.isinf(x)])
    return out


def _erfc_block(x: np.ndarray) -> np.ndarray:
    out = x.copy()
    a = np.abs(x)
    small = a < 0.5
    out[small] = 1.0 - _erf_small(x[small])
    big = (a >= 0.5) & np.isfinite(a)
    tail = _erfc_from_half(a[big])
    out[big] = np.where(x[big] < 0, 2.0 - tail, tail)
    out[np.isinf(x)] = np.where(x[np.isinf(x)] > 0, 0.0, 2.0)
    return out


def _blockwise(fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
    # ~60 passes over the data: in cache-sized blocks they run about twice as fast
    flat = np.asarray(x, dtype=np.float64).reshape(-1)
    out = np.empty_like(flat)
    for i in range(0, flat.size, _BLOCK):
        out[i:i + _BLOCK] = fn(flat[i:i + _BLOCK])
    return out.reshape(np.shape(x))


def erf(x: np.ndarray) -> np.ndarray:
    """The error function in float64, elementwise (Note [erf without SciPy])."""
    return _blockwise(_erf_block, x)


def erfc(x: np.ndarray) -> np.ndarray:
    """The complementary error function 1 - erf(x) in float64, accurate in the tail."""
    return _blockwise(_erfc_block, x)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(z))  # never overflows, unlike exp(-z)
    return np.where(z >= 0, 1.0, e) / (1.0 + e)


def _gelu_cdf(z: np.ndarray) -> np.ndarray:
    return (0.5 * erfc(-(z.astype(np.float64) * _SQRT1_2))).astype(z.dtype, copy=False)


def _elu(z: np.ndarray) -> np.ndarray:
    # minimum(0, z), not minimum(z, 0): NumPy returns the second of two equal arguments,
    # so -0.0 stays -0.0 as in torch (elu and relu6 below; tests check the sign).
    return np.where(z > 0, z, acts.ELU_ALPHA * np.expm1(np.minimum(0, z)))


def _quiet(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    """Run fn without NumPy's RuntimeWarnings (Note [edge values])."""

    @functools.wraps(fn)
    def wrapper(*args: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            return fn(*args)

    return wrapper


@_quiet
def _silu(z: np.ndarray) -> np.ndarray:
    return z * _sigmoid(z)


@_quiet
def _gelu(z: np.ndarray) -> np.ndarray:
    return z * _gelu_cdf(z)


@functools.lru_cache(maxsize=64)
def _zeros(n: int, dtype: np.dtype) -> np.ndarray:
    zeros = np.zeros(n, dtype)
    zeros.flags.writeable = False
    return zeros


def relu(z: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """np.maximum(z, 0), value for value (NaN passes; -0.0 comes out +0.0, where torch keeps
    the sign: maximum returns its second operand for equal values), against a row of zeros
    broadcast along the last axis: NumPy's maximum with a scalar operand ran 4x slower here
    than with an array (0.37 against 0.09 ms on 464K float32 elements)."""
    if z.ndim == 0:
        return np.maximum(z, 0, out=out)
    return np.maximum(z, _zeros(z.shape[-1], z.dtype), out=out)


_FORWARD: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "identity": lambda z: z.copy(),
    "relu": relu,
    "sigmoid": _sigmoid,
    "tanh": np.tanh,
    "elu": _elu,
    "relu6": lambda z: np.minimum(np.maximum(0, z), acts.RELU6_CAP),
    "leaky_relu": lambda z: np.where(z > 0, z, z * acts.LEAKY_RELU_SLOPE),
    "silu": _silu,
    "gelu": _gelu,
}


@_quiet
def _silu_grad(dy: np.ndarray, z: np.ndarray) -> np.ndarray:
    s = _sigmoid(z)
    return dy * s * (1 + z * (1 - s))


@_quiet
def _gelu_grad(dy: np.ndarray, z: np.ndarray) -> np.ndarray:
    pdf = np.exp(-0.5 * z * z) * _INV_SQRT_2PI
    return dy * (_gelu_cdf(z) + z * pdf)


def _relu_grad(dy: np.ndarray, y: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """dy where y is not <= 0 (so a NaN y passes dy on, as torch's threshold_backward),
    else +0; placed with a bit mask, which runs branch-free (Note [edge values])."""
    bits = np.dtype(f"u{dy.dtype.itemsize}")
    mask = np.less_equal(y, 0).astype(bits)
    mask -= 1  # True -> 0, False -> all ones
    if out is None:
        out = np.empty(dy.shape, dy.dtype)
    np.bitwise_and(dy.view(bits), mask, out=out.view(bits))
    return out


@_quiet
def _elu_grad(dy: np.ndarray, z: np.ndarray) -> np.ndarray:
    """dy * exp(z) where z <= 0, else dy (a NaN z passes dy on: Note [edge values]); from z,
    not from y + 1, which cancels near y = -1 (Note [what backward saves])."""
    return np.where(z <= 0, dy * np.exp(z), dy)


# dz from (dy, saved), saved per Note [what backward saves].
_BACKWARD: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "relu": _relu_grad,
    "sigmoid": lambda dy, y: dy * (1 - y) * y,
    "tanh": lambda dy, y: dy * (1 - y * y),
    # Both test for the zero-gradient side, so a NaN y or z passes dy on (Note [edge values]).
    "elu": _elu_grad,
    "relu6": lambda dy, y: np.where((y <= 0) | (y >= acts.RELU6_CAP), 0, dy),
    "leaky_relu": lambda dy, y: np.where(y > 0, dy, dy * acts.LEAKY_RELU_SLOPE),
    "silu": _silu_grad,
    "gelu": _gelu_grad,
}


def apply_activation(z: np.ndarray, activation: str) -> np.ndarray:
    """act(z) in z's own (compute) dtype, as a new array; `activation` already normalized."""
    y = _FORWARD[activation](z)
    return y.astype(z.dtype, copy=False)


def finish(result: np.ndarray, dtype: np.dtype, out: np.ndarray | None = None,
           beta: float = 0.0) -> np.ndarray:
    """Round a compute-dtype result to `dtype` once; with `out`, write result + beta * out.

    beta == 0 never reads `out` (cuDNN's rule), so stale NaN there cannot leak in.
    """
    if out is None:
        if beta != 0.0:
            raise ValueError(f"beta={beta} needs an out= array to accumulate into")
        return result.astype(dtype, order="C", copy=False)
    if beta != 0.0:
        result = result + result.dtype.type(beta) * out.astype(result.dtype)
    out[...] = result
    return out


def _check_saved(saved: np.ndarray | None, act: str) -> None:
    if act != "identity" and saved is None:
        what = "pre-activation z" if acts.saves(act) == "preactivation" else "output y"
        raise ValueError(f"activation_backward for {act!r} needs saved= (the {what})")


def _backward_piece(dy: np.ndarray, saved: np.ndarray | None, act: str, dz: np.ndarray
                    ) -> None:
    """dz (compute dtype) = the activation's backward of one piece."""
    cd = dz.dtype
    if act == "identity":
        dz[...] = dy
    elif act == "relu" and dy.dtype == cd and saved is not None:
        _relu_grad(dy, saved, out=dz)
    else:
        assert saved is not None
        dz[...] = _BACKWARD[act](dy.astype(cd, copy=False), saved.astype(cd, copy=False))


def _backward_cd(dy: np.ndarray, saved: np.ndarray | None, act: str,
                 sum_axes: tuple[int, ...] | None = None
                 ) -> tuple[np.ndarray, np.ndarray | None]:
    """(dz, per-sample sums): dz in the compute dtype, computed in cache-sized pieces of
    samples on the engine's threads (_threads Note [cache-sized pieces]); with `sum_axes`
    (the axes a bias gradient sums over, 0 included) also dz summed over them but axis 0,
    one row per sample, so their total does not depend on how the batch was split."""
    _check_saved(saved, act)
    cd = compute_dtype(dy.dtype)
    dz = np.empty(dy.shape, cd)
    n = dy.shape[0] if dy.ndim else 1
    rows = None
    if sum_axes is not None:
        inner = tuple(a for a in sum_axes if a != 0)
        keep = [d for a, d in enumerate(dy.shape) if a not in sum_axes]
        rows = np.empty((n, *keep), cd)
    if dy.ndim == 0:
        _backward_piece(dy, saved, act, dz)
        return dz, None

    def run(lo: int, hi: int) -> None:
        _backward_piece(dy[lo:hi], None if saved is None else saved[lo:hi], act, dz[lo:hi])
        if rows is not None:
            channel_sum(dz[lo:hi], inner, out=rows[lo:hi])  # Note [channels-last sums]

    _threads.parallel_for(n, dy.size, run, cached=True)
    return dz, rows


def activation_forward(z: np.ndarray, activation: str | None,
                       out: np.ndarray | None = None) -> np.ndarray:
    """y = act(z), in z's dtype; written into `out` when given."""
    act = acts.normalize(activation)
    return finish(apply_activation(z.astype(compute_dtype(z.dtype)), act), z.dtype, out)


def activation_backward(dy: np.ndarray, saved: np.ndarray | None, activation: str | None,
                        out: np.ndarray | None = None) -> np.ndarray:
    """dz = dy * act'(z), from `saved` = y or z per Note [what backward saves]."""
    act = acts.normalize(activation)
    return finish(_backward_cd(dy, saved, act)[0], dy.dtype, out)


def activation_backward_bias(dy: np.ndarray, saved: np.ndarray | None, activation: str | None,
                             geom: ConvGeometry, db_out: np.ndarray | None = None,
                             beta: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(dz, db): the activation gradient and its sum over all but the channel axis.

    db sums the compute-dtype dz before it is rounded, as a fused GPU kernel would.
    """
    act = acts.normalize(activation)
    if (act == "identity" and dy.ndim and dy.size < 2 * _threads.MIN_ELEMENTS
            and dy.dtype == compute_dtype(dy.dtype) and dy.flags.c_contiguous):
        # what _backward_cd computes for a pass it runs as one piece (the same reductions
        # over the same layout), without the pass:
        # dz is a copy of dy, each sample's row its sum over the other axes
        inner = tuple(a for a in geom.reduce_axes if a != 0)
        per_sample = channel_sum(dy, inner)
        return dy.copy(), finish(channel_sum(per_sample, (0,)), dy.dtype, db_out, beta)
    dz, rows = _backward_cd(dy, saved, act, geom.reduce_axes)
    assert rows is not None
    return finish(dz, dy.dtype), finish(channel_sum(rows, (0,)), dy.dtype, db_out, beta)
