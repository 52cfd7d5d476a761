"""FLOPs and the minimum bytes each benchmarked operation must move, and its floor time.

The byte counts are floors: every input read once and every output written once, in the
storage dtype, with nothing re-read and no intermediate tensor written. A real kernel moves
more (an unfused one much more), which is the point of reporting time against the floor.
The floor time of one operation is max(flops / peak FLOP rate, bytes / peak bandwidth);
a sequence of operations (a backward, a training step) gets the sum of its parts' floors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from convfuse import activations, dtypes
from convfuse.geometry import ConvGeometry

# Arithmetic of one Adam update (m, v, bias corrections, sqrt, divide, step). Adam is so far
# below its compute roof that only its 28 bytes per fp32 parameter matter to the floor.
ADAM_FLOPS_PER_PARAM = 14
ADAM_TENSORS_READ = 4  # p, g, m, v
ADAM_TENSORS_WRITTEN = 3  # p, m, v


@dataclass(frozen=True)
class Work:
    """What one operation must do: arithmetic and memory traffic at the floor."""

    flops: int
    bytes: int

    def floor_seconds(self, peak_flops: float, peak_bandwidth: float) -> float:
        return max(self.flops / peak_flops, self.bytes / peak_bandwidth)


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def itemsize(dtype: Any) -> int:
    return dtypes.canonical(dtype).itemsize


def conv_forward(geom: ConvGeometry, dtype: Any, activation: str = "identity",
                 bias: bool = True, residual: bool = False) -> Work:
    """act(conv(x, w) + bias + z): the fused call's work, which unfused passes must also do."""
    act = activations.normalize(activation)
    n_y = _numel(geom.output_shape)
    per_output = int(bias) + int(residual) + int(act != "identity")
    flops = geom.flops() + per_output * n_y
    elems = (_numel(geom.input_shape) + _numel(geom.weight_shape) + n_y
             + (geom.out_channels if bias else 0) + (n_y if residual else 0))
    return Work(flops, elems * itemsize(dtype))


def conv_backward(geom: ConvGeometry, dtype: Any, activation: str = "identity",
                  bias: bool = True, need_dx: bool = True) -> Work:
    """dz = act'(dy), db = sum(dz), dw = filter grad, dx = data grad (each a conv's FLOPs).

    Reads dy, the saved activation (when the activation needs one), x and w; writes dw,
    db and dx. The residual's gradient is dz itself, so it adds nothing.
    """
    act = activations.normalize(activation)
    n_y, n_x, n_w = (_numel(s) for s in (geom.output_shape, geom.input_shape, geom.weight_shape))
    conv_passes = 2 if need_dx else 1
    flops = conv_passes * geom.flops() + (n_y if act != "identity" else 0) + (n_y if bias else 0)
    saved = n_y if activations.saves(act) != "none" else 0
    elems = (n_y + saved + n_x + n_w  # reads
             + n_w + (n_x if need_dx else 0) + (geom.out_channels if bias else 0))  # writes
    return Work(flops, elems * itemsize(dtype))


def bias_grad(shape: Sequence[int], channels: int, dtype: Any, activation: str) -> Work:
    """db = sum of dz over all but channels; with an activation, dz = act'(dy) is also written.

    identity: read dy, write db. relu: read dy and y, write dz and db.
    """
    act = activations.normalize(activation)
    n = _numel(shape)
    if act == "identity":
        return Work(n, (n + channels) * itemsize(dtype))
    return Work(2 * n, (3 * n + channels) * itemsize(dtype))


def adam(n_params: int, dtype: Any = "float32") -> Work:
    """One Adam step: reads p, g, m, v and writes p, m, v (28 bytes per fp32 parameter)."""
    size = itemsize(dtype)
    return Work(ADAM_FLOPS_PER_PARAM * n_params,
                (ADAM_TENSORS_READ + ADAM_TENSORS_WRITTEN) * n_params * size)


def pool_forward(in_shape: Sequence[int], out_shape: Sequence[int], window: int,
                 dtype: Any) -> Work:
    n_out = _numel(out_shape)
    return Work(n_out * window, (_numel(in_shape) + n_out) * itemsize(dtype))


def pool_backward(in_shape: Sequence[int], out_shape: Sequence[int], dtype: Any) -> Work:
    """Reads dy, x and y; writes dx."""
    n_in, n_out = _numel(in_shape), _numel(out_shape)
    return Work(n_in, (2 * n_in + 2 * n_out) * itemsize(dtype))


def linear_forward(batch: int, fin: int, fout: int, dtype: Any) -> Work:
    """x @ w.T + b: read x, w, b; write y."""
    return Work(2 * batch * fin * fout + batch * fout,
                (batch * fin + fin * fout + fout + batch * fout) * itemsize(dtype))


def linear_backward(batch: int, fin: int, fout: int, dtype: Any) -> Work:
    """dw = dy.T @ x, db = sum(dy), dx = dy @ w: read dy, x, w; write dw, db, dx."""
    return Work(4 * batch * fin * fout + batch * fout,
                (batch * fout + 2 * batch * fin + 2 * fin * fout + fout) * itemsize(dtype))


def cross_entropy(batch: int, classes: int, dtype: Any) -> Work:
    """Softmax, loss and its gradient: read logits and labels, write dlogits."""
    n = batch * classes
    return Work(5 * n, 2 * n * itemsize(dtype) + 4 * batch)


def floor_seconds(works: Iterable[Work], peak_flops: float, peak_bandwidth: float) -> float:
    """A sequence's floor: the sum of each operation's own floor.

    It is the floor for any form that runs the operations one after another. A compiler
    that fuses across operations (torch.compile may) can beat it: a fraction above 1 says so.
    """
    return sum(w.floor_seconds(peak_flops, peak_bandwidth) for w in works)


def total(works: Iterable[Work]) -> Work:
    works = list(works)
    return Work(sum(w.flops for w in works), sum(w.bytes for w in works))
