"""A layer's memo of the geometries it checked (Note [geometry memos]).

Note [geometry memos]
Building and checking a call's geometry (shapes against the hyperparameters, the memory cap
config.max_array_bytes) is done once per input shape and remembered on the layer. What the
memo answers must be what a fresh layer would decide now, so:
- its key holds everything the geometry reads besides the layer's hyperparameters (whose
  assignment empties the memo): the input's shape, and where the geometry is built from the
  weight's shape, the weight's shape (a Parameter or its `.data` may be swapped for one of
  another kernel);
- it holds only under the config flags it was checked with (config.get() is a new object
  after any change): a lowered max_array_bytes refuses a remembered shape as it refuses a
  new one;
- it is bounded: a model fed ever new shapes (detection, segmentation) starts the memo
  over at MAX_GEOMETRIES entries rather than growing without bound.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from .. import config

#: Geometries remembered per layer before the memo starts over.
MAX_GEOMETRIES = 64

G = TypeVar("G")


def checked_geometry(layer: Any, key: Hashable, make: Callable[[], G]) -> G:
    """The geometry remembered under `key` for the config flags in force, else `make()`
    (which checks and may raise: nothing is remembered then), remembered."""
    d = layer.__dict__
    flags = config.get()
    memo = d.get("_geoms")
    if memo is None or d.get("_geoms_flags") is not flags:
        memo = d["_geoms"] = {}
        d["_geoms_flags"] = flags
    found = memo.get(key)
    if found is None:
        found = make()
        if len(memo) >= MAX_GEOMETRIES:
            memo.clear()
        memo[key] = found
    return found


def forget_geometries(layer: Any) -> None:
    """Empty the memo: what it holds was checked for hyperparameters just reassigned."""
    layer.__dict__["_geoms"] = {}
