"""Explicit padding on CuPy arrays: convfuse.ops.pad_slices with CuPy (cuDNN pads only
symmetrically with zeros). Device copies and adds on the current stream, no host sync."""

from __future__ import annotations

from typing import Any

from .. import pad_slices


def pad_forward(x: Any, pgeom: Any) -> Any:  # pragma: gpu
    import cupy as cp

    return pad_slices.pad_forward(cp, x, pgeom)


def pad_backward(dy: Any, pgeom: Any) -> Any:  # pragma: gpu
    import cupy as cp

    return pad_slices.pad_backward(cp, dy, pgeom)
