"""The four storage dtypes convfuse supports, and how each computes.

bfloat16 comes from ml_dtypes, which both NumPy and CuPy (14+) understand.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)

SUPPORTED: dict[str, np.dtype] = {
    "float32": float32,
    "float16": float16,
    "bfloat16": bfloat16,
    "float64": float64,
}


def canonical(dtype: Any) -> np.dtype:
    """Map a dtype spec ('float32', np.float16, ml_dtypes.bfloat16, ...) to a supported dtype;
    None is the default, float32, as in torch.nn (NumPy would read it as float64)."""
    if dtype is None:
        return float32
    try:
        dt = np.dtype(dtype) if not isinstance(dtype, str) else SUPPORTED[dtype.lower()]
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"unsupported dtype {dtype!r}: convfuse supports {', '.join(SUPPORTED)}"
        ) from exc
    if dt not in SUPPORTED.values():
        raise ValueError(f"unsupported dtype {dt}: convfuse supports {', '.join(SUPPORTED)}")
    return dt


_NAMES: dict[np.dtype, str] = {dt: key for key, dt in SUPPORTED.items()}


def name(dtype: Any) -> str:
    """canonical(dtype).name, without reading NumPy's `dtype.name`: NumPy computes it in
    Python at every access (about 15 us on a loaded CI core), and plan lookups, layout
    checks and kernel names ask at every call."""
    if isinstance(dtype, np.dtype):
        known = _NAMES.get(dtype)
        if known is not None:
            return known
    return _NAMES[canonical(dtype)]


def compute_dtype(dtype: Any) -> np.dtype:
    """Accumulation dtype: float64 for float64 data, float32 for everything narrower."""
    return float64 if canonical(dtype) == float64 else float32


def is_reduced_precision(dtype: Any) -> bool:
    return canonical(dtype) in (float16, bfloat16)
