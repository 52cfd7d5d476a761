"""Array helpers shared by the GPU check modules (gpu_checks.py, gpu_training.py), kept
apart so that neither imports the other, and the tolerance each dtype is held to."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import config, dtypes
from .report import TOLERANCES

#: float32 convolutions with TF32 (config.allow_tf32=True, the default) round inputs to a
#: 10-bit mantissa, float16's: float16's tolerance. Errors are a few 1e-4 relative to the
#: pre-activation, but the cases measure them against the output's largest value, which
#: tanh bounds by 1 while the pre-activation reaches ~10 (a 4e-3 error was simulated for
#: truncating conversion, near the 5e-3 this was).
TF32_TOLERANCE = TOLERANCES["float16"]


def tolerance(dtype: str) -> float:
    """TOLERANCES[dtype], or TF32_TOLERANCE for float32 while TF32 is allowed."""
    if dtype == "float32" and config.get().allow_tf32:
        return TF32_TOLERANCE
    return TOLERANCES[dtype]


def supported_dtypes(cp: Any) -> list[str]:  # pragma: gpu
    """float64 and float32 everywhere; float16 from sm_53 and bfloat16 from sm_80."""
    cc = int(cp.cuda.Device().compute_capability)
    names = ["float64", "float32"]
    if cc >= 53:
        names.append("float16")
    if cc >= 80:
        names.append("bfloat16")
    return names


def host_inputs(rng: np.random.Generator, dtype: str, *shapes: tuple[int, ...]
                ) -> list[np.ndarray]:
    """Random host arrays already rounded to `dtype` (so the reference sees the same values)."""
    dt = dtypes.SUPPORTED[dtype]
    return [rng.standard_normal(s).astype(dt) for s in shapes]


def f64(*arrays: Any) -> list[Any]:
    return [None if a is None else np.asarray(a).astype(np.float64) for a in arrays]


def host(a: Any) -> np.ndarray:  # pragma: gpu
    import cupy

    return cupy.asnumpy(a).astype(np.float64)


def poisoned(cp: Any, shape: tuple[int, ...], dtype: str) -> Any:  # pragma: gpu
    return cp.full(shape, np.nan, dtype=dtypes.SUPPORTED[dtype])


def dev(cp: Any, *arrays: Any) -> list[Any]:  # pragma: gpu
    return [None if a is None else cp.asarray(a) for a in arrays]
