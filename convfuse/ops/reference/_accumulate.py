"""Per-channel sums that stay accurate in every layout.

Note [channels-last sums]
NumPy sums pairwise along the innermost axes it reduces, but adds the rows of the outer
reduced axes one at a time: a sum over (N, H, W) of an (N, H, W, C) array runs one total
per channel through all N*H*W values, and in float32 the error grows with that count
(2.4e-4 relative over 1M values per channel, against 2e-7 for the same data in NCHW or
torch's float32 kernels; a BatchNorm1d over (N, C, 1) is the same case). This engine is
the oracle the GPU tests compare against, so a float32 sum with more than BLOCK such rows
adds them in blocks of BLOCK rows in float32 (NumPy's fast loop) and the block totals in
float64: as accurate as a float64 sum, at about a float32 sum's speed. Every other sum is
NumPy's own, bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

_reduce = np.add.reduce
BLOCK = 256


def channel_sum(a: np.ndarray, axes: tuple[int, ...], out: Any = None,
                dtype: Any = None) -> np.ndarray:
    """a summed over `axes` (in `dtype`, default a's), into `out` when given."""
    if dtype is not None and np.dtype(dtype) != a.dtype:
        return _reduce(a, axes, dtype=dtype, out=out)
    # the size first: small sums (the host-bound tiny calls) pay one comparison
    if a.size <= 16 * BLOCK or a.dtype != np.float32 or not a.flags.c_contiguous:
        return _reduce(a, axes, out=out)
    nd = a.ndim
    j = nd  # axes j.. are the innermost reduced run, which NumPy sums pairwise
    while j - 1 in axes:
        j -= 1
    outer = sorted(x for x in axes if x < j)
    if not outer or outer != list(range(outer[0], outer[-1] + 1)):
        return _reduce(a, axes, out=out)
    first, last = outer[0], outer[-1]
    rows = math.prod(a.shape[first:last + 1])
    if rows <= BLOCK:
        return _reduce(a, axes, out=out)
    r = _reduce(a, tuple(range(j, nd))) if j < nd else a  # C-contiguous either way
    lead, mid = a.shape[:first], a.shape[last + 1:j]
    r = r.reshape(math.prod(lead), rows, math.prod(mid))
    whole = rows // BLOCK * BLOCK
    blocks = r[:, :whole].reshape(r.shape[0], whole // BLOCK, BLOCK, r.shape[2])
    total = blocks.sum(axis=2).sum(axis=1, dtype=np.float64)
    if whole < rows:
        total += r[:, whole:].sum(axis=1, dtype=np.float64)
    total = total.reshape(lead + mid)
    if out is None:
        return total.astype(np.float32)
    np.copyto(out, total, casting="same_kind")
    return out
