"""Explicit padding on NumPy arrays: convfuse.ops.pad_slices with NumPy."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import pad_slices


def pad_forward(x: Any, pgeom: Any) -> Any:
    return pad_slices.pad_forward(np, x, pgeom)


def pad_backward(dy: Any, pgeom: Any) -> Any:
    return pad_slices.pad_backward(np, dy, pgeom)
