"""Explicit padding on CuPy arrays: convfuse.ops.pad_slices with CuPy (cuDNN pads only
symmetrically with zeros). Device copies and adds on the current stream, no host sync."""

from __future__ import annotations

from typing import Any

from .. import pad_slices
from .device import is_device_array, on_cupy


def pad_forward(x: Any, pgeom: Any) -> Any:  # pragma: gpu
    if is_device_array(x):  # CuPy slicing: Note [the pointer path] in device.py
        return on_cupy(pad_forward, x, pgeom)
    import cupy as cp

    return pad_slices.pad_forward(cp, x, pgeom)


def pad_backward(dy: Any, pgeom: Any) -> Any:  # pragma: gpu
    if is_device_array(dy):  # CuPy slicing: Note [the pointer path] in device.py
        return on_cupy(pad_backward, dy, pgeom)
    import cupy as cp

    return pad_slices.pad_backward(cp, dy, pgeom)
