"""A tiny, independent oracle the selfcheck carries (tests/ is not installed with convfuse).

Only the forward convolution is written out as loops; the gradients are checked through
the adjoint identities <conv(x, w), g> = <x, dX(g, w)> = <w, dW(x, g)>, and activation
derivatives by central differences, so nothing here shares code with the engine it checks.
Channels-first, float64, tiny sizes only.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

_SCALAR = {
    "identity": lambda v: v,
    "relu": lambda v: max(v, 0.0),
    "sigmoid": lambda v: 1.0 / (1.0 + math.exp(-v)),
    "tanh": math.tanh,
    "elu": lambda v: v if v > 0 else math.expm1(v),
    "relu6": lambda v: min(max(v, 0.0), 6.0),
    "leaky_relu": lambda v: v if v > 0 else 0.01 * v,
    "silu": lambda v: v / (1.0 + math.exp(-v)),
    "gelu": lambda v: 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))),
}


def activation(name: str, z: np.ndarray) -> np.ndarray:
    """PyTorch's definitions, evaluated element by element with Python's math module."""
    f = _SCALAR[name]
    return np.array([f(float(v)) for v in np.ravel(z)], dtype=np.float64).reshape(np.shape(z))


def conv(x: np.ndarray, w: np.ndarray, stride: tuple[int, ...], padding: tuple[int, ...],
         dilation: tuple[int, ...], groups: int) -> np.ndarray:
    """Grouped cross-correlation by plain loops: x (N, C, *S), w (K, C/groups, *k)."""
    n_batch, _, *size = x.shape
    k_out, c_per, *kernel = w.shape
    out_size = [(s + 2 * p - d * (k - 1) - 1) // st + 1
                for s, k, st, p, d in zip(size, kernel, stride, padding, dilation)]
    k_per = k_out // groups
    y = np.zeros((n_batch, k_out, *out_size))
    for n, k, *o in itertools.product(range(n_batch), range(k_out), *map(range, out_size)):
        g = k // k_per
        acc = 0.0
        for c, *t in itertools.product(range(c_per), *map(range, kernel)):
            pos = [oi * st - p + ti * d
                   for oi, ti, st, p, d in zip(o, t, stride, padding, dilation)]
            if all(0 <= q < s for q, s in zip(pos, size)):
                acc += x[(n, g * c_per + c, *pos)] * w[(k, c, *t)]
        y[(n, k, *o)] = acc
    return y
