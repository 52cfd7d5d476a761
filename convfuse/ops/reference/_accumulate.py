"""Per-channel sums that stay accurate in channels-last layouts.

Note [channels-last sums]
NumPy sums pairwise along the innermost axis it reduces, but reduces outer axes row by
row: a sum over (N, H, W) of an (N, H, W, C) array adds each value to a running total, and
in float32 the error grows with the count (2.4e-4 relative over 1M values per channel,
against 2e-7 for the same data in NCHW, or torch's float32 kernels). This engine is the
oracle the GPU tests compare against, so a float32 sum that keeps the innermost axis is
accumulated in float64 and rounded once; every other sum is NumPy's own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_reduce = np.add.reduce


def channel_sum(a: np.ndarray, axes: tuple[int, ...], out: Any = None) -> np.ndarray:
    """a summed over `axes` in a's dtype (into `out` when given)."""
    # the size first: small sums (the host-bound tiny calls) pay one comparison
    if a.size > 4096 and a.dtype == np.float32 and (a.ndim - 1) not in axes:
        total = _reduce(a, axes, dtype=np.float64)
        if out is None:
            return total.astype(np.float32)
        np.copyto(out, total, casting="same_kind")
        return out
    return _reduce(a, axes, out=out)
