"""Independent oracles: plain Python loops over every index, float64 accumulators.

Nothing here imports convfuse's engines (or its geometry): shapes, output sizes and
layouts are worked out from the definitions, so a shared bug cannot hide. Tiny sizes only.
Layout: channels_last arrays are (N, *spatial, C) and filters (K, *kernel, C/groups).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

LEAKY_SLOPE = 0.01


def _at(n: int, c: int, pos: tuple[int, ...], channels_last: bool) -> tuple[int, ...]:
    return (n, *pos, c) if channels_last else (n, c, *pos)


def _spatial(shape: tuple[int, ...], channels_last: bool) -> tuple[int, ...]:
    return tuple(shape[1:-1]) if channels_last else tuple(shape[2:])


def _channels(shape: tuple[int, ...], channels_last: bool) -> int:
    return shape[-1] if channels_last else shape[1]


def _tuple(v, rank: int) -> tuple[int, ...]:
    return (v,) * rank if isinstance(v, int) else tuple(v)


def _conv_terms(x_shape, w_shape, stride, padding, dilation, groups, channels_last):
    """Yield (x index, w index, y index) for every product term of the convolution."""
    rank = len(x_shape) - 2
    stride, padding, dilation = (_tuple(v, rank) for v in (stride, padding, dilation))
    size = _spatial(x_shape, channels_last)
    kernel = _spatial(w_shape, channels_last)
    c_in = _channels(x_shape, channels_last)
    k_out = w_shape[0]
    cg, kg = c_in // groups, k_out // groups
    out = tuple(
        (n + 2 * p - d * (k - 1) - 1) // s + 1
        for n, k, s, p, d in zip(size, kernel, stride, padding, dilation)
    )
    for n in range(x_shape[0]):
        for k in range(k_out):
            g = k // kg
            for o in itertools.product(*map(range, out)):
                for ci in range(cg):
                    for kk in itertools.product(*map(range, kernel)):
                        pos = tuple(oi * s - p + ki * d for oi, ki, s, p, d in
                                    zip(o, kk, stride, padding, dilation))
                        if all(0 <= q < m for q, m in zip(pos, size)):
                            yield (_at(n, g * cg + ci, pos, channels_last),
                                   _at(k, ci, kk, channels_last),
                                   _at(n, k, o, channels_last))


def conv_output_shape(x_shape, w_shape, stride=1, padding=0, dilation=1, channels_last=False):
    rank = len(x_shape) - 2
    stride, padding, dilation = (_tuple(v, rank) for v in (stride, padding, dilation))
    out = tuple(
        (n + 2 * p - d * (k - 1) - 1) // s + 1
        for n, k, s, p, d in zip(_spatial(x_shape, channels_last), _spatial(w_shape, channels_last),
                                 stride, padding, dilation)
    )
    return (x_shape[0], *out, w_shape[0]) if channels_last else (x_shape[0], w_shape[0], *out)


def conv_forward(x, w, stride=1, padding=0, dilation=1, groups=1, channels_last=False):
    """y[n, k, o] = sum_{c in group(k), kk} x[n, c, o*s - p + kk*d] * w[k, c, kk]."""
    y = np.zeros(conv_output_shape(x.shape, w.shape, stride, padding, dilation, channels_last))
    for xi, wi, yi in _conv_terms(x.shape, w.shape, stride, padding, dilation, groups,
                                  channels_last):
        y[yi] += float(x[xi]) * float(w[wi])
    return y


def conv_backward_data(dy, w, x_shape, stride=1, padding=0, dilation=1, groups=1,
                       channels_last=False):
    """The adjoint of conv_forward in x: every term's contribution, summed."""
    dx = np.zeros(x_shape)
    for xi, wi, yi in _conv_terms(x_shape, w.shape, stride, padding, dilation, groups,
                                  channels_last):
        dx[xi] += float(dy[yi]) * float(w[wi])
    return dx


def conv_backward_filter(x, dy, w_shape, stride=1, padding=0, dilation=1, groups=1,
                         channels_last=False):
    """The adjoint of conv_forward in w."""
    dw = np.zeros(w_shape)
    for xi, wi, yi in _conv_terms(x.shape, w_shape, stride, padding, dilation, groups,
                                  channels_last):
        dw[wi] += float(dy[yi]) * float(x[xi])
    return dw


def conv_backward_bias(dy, channels_last=False):
    k_out = _channels(dy.shape, channels_last)
    db = np.zeros(k_out)
    for idx in itertools.product(*map(range, dy.shape)):
        db[idx[-1] if channels_last else idx[1]] += float(dy[idx])
    return db


# --- activations on Python floats, as PyTorch defines them --------------------------------

def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def act(name: str, z: float) -> float:
    z = float(z)
    if name == "identity":
        return z
    if name == "relu":
        return z if z > 0 else 0.0
    if name == "sigmoid":
        return _sigmoid(z)
    if name == "tanh":
        return math.tanh(z)
    if name == "elu":
        return z if z > 0 else math.expm1(z)
    if name == "relu6":
        return min(max(z, 0.0), 6.0)
    if name == "leaky_relu":
        return z if z > 0 else LEAKY_SLOPE * z
    if name == "silu":
        return z * _sigmoid(z)
    if name == "gelu":  # 0.5 z (1 + erf(z / sqrt 2)), written with erfc to keep the tail
        return 0.5 * z * math.erfc(-z * math.sqrt(0.5))
    raise ValueError(name)


def act_grad(name: str, z: float) -> float:
    """d act / dz at z, from z (PyTorch's values at the kinks)."""
    z = float(z)
    if name == "identity":
        return 1.0
    if name == "relu":
        return 1.0 if z > 0 else 0.0
    if name == "sigmoid":
        s = _sigmoid(z)
        return s * (1.0 - s)
    if name == "tanh":
        return 1.0 - math.tanh(z) ** 2
    if name == "elu":
        return 1.0 if z > 0 else math.exp(z)
    if name == "relu6":
        return 1.0 if 0.0 < z < 6.0 else 0.0
    if name == "leaky_relu":
        return 1.0 if z > 0 else LEAKY_SLOPE
    if name == "silu":
        s = _sigmoid(z)
        return s + z * s * (1.0 - s)
    if name == "gelu":
        cdf = 0.5 * math.erfc(-z * math.sqrt(0.5))
        return cdf + z * math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    raise ValueError(name)


def act_array(name: str, z: np.ndarray) -> np.ndarray:
    return np.array([act(name, v) for v in np.asarray(z, np.float64).ravel()]).reshape(z.shape)


def act_grad_array(name: str, z: np.ndarray) -> np.ndarray:
    flat = np.asarray(z, np.float64).ravel()
    return np.array([act_grad(name, v) for v in flat]).reshape(z.shape)


# --- pooling -------------------------------------------------------------------------------

def _pool_windows(x_shape, kernel, stride, padding, channels_last):
    """Yield (y index, [x indices of the window's real elements, row-major]) per output."""
    rank = len(x_shape) - 2
    kernel = _tuple(kernel, rank)
    stride = kernel if stride is None else _tuple(stride, rank)
    padding = _tuple(padding, rank)
    size = _spatial(x_shape, channels_last)
    out = tuple((n + 2 * p - k) // s + 1 for n, k, s, p in zip(size, kernel, stride, padding))
    for n in range(x_shape[0]):
        for c in range(_channels(x_shape, channels_last)):
            for o in itertools.product(*map(range, out)):
                members = []
                for kk in itertools.product(*map(range, kernel)):
                    pos = tuple(oi * s - p + ki for oi, ki, s, p in zip(o, kk, stride, padding))
                    if all(0 <= q < m for q, m in zip(pos, size)):
                        members.append(_at(n, c, pos, channels_last))
                yield _at(n, c, o, channels_last), members, out


def pool_output_shape(x_shape, kernel, stride=None, padding=0, channels_last=False):
    rank = len(x_shape) - 2
    kernel = _tuple(kernel, rank)
    stride = kernel if stride is None else _tuple(stride, rank)
    padding = _tuple(padding, rank)
    size = _spatial(x_shape, channels_last)
    out = tuple((n + 2 * p - k) // s + 1 for n, k, s, p in zip(size, kernel, stride, padding))
    c = _channels(x_shape, channels_last)
    return (x_shape[0], *out, c) if channels_last else (x_shape[0], c, *out)


def pool_forward(x, kernel, stride=None, padding=0, mode="max", channels_last=False):
    """max over the window's real elements; avg = their sum / prod(kernel) (padding counts)."""
    y = np.zeros(pool_output_shape(x.shape, kernel, stride, padding, channels_last))
    window = math.prod(_tuple(kernel, x.ndim - 2))
    for yi, members, _ in _pool_windows(x.shape, kernel, stride, padding, channels_last):
        values = [float(x[m]) for m in members]
        y[yi] = max(values) if mode == "max" else sum(values) / window
    return y


def pool_backward(dy, x, kernel, stride=None, padding=0, mode="max", channels_last=False):
    """max: dy to the first element (row-major) equal to the window max; avg: dy / window."""
    dx = np.zeros(x.shape)
    window = math.prod(_tuple(kernel, x.ndim - 2))
    for yi, members, _ in _pool_windows(x.shape, kernel, stride, padding, channels_last):
        if mode == "max":
            best = members[0]
            for m in members[1:]:
                if float(x[m]) > float(x[best]):
                    best = m
            dx[best] += float(dy[yi])
        else:
            for m in members:
                dx[m] += float(dy[yi]) / window
    return dx
