"""Which array library and device an array lives on, and whether a GPU is usable.

CuPy is optional: convfuse imports and runs on NumPy alone. Everything that asks about
the GPU goes through here so that the answer (and the reason when it is "no") is one.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import numpy as np

from .errors import DeviceMismatchError, DeviceUnavailableError


@functools.cache
def cupy_module() -> ModuleType | None:
    """CuPy if it imports, else None (cupy_import_error() says why, when it is installed)."""
    try:
        import cupy
    except Exception:
        return None
    return cupy


@functools.cache
def cupy_import_error() -> str | None:
    """Why an installed CuPy does not import ('ImportError: libcudart.so.12 ...'); None
    when it imports or is not installed at all (no module to find)."""
    import importlib.util

    if cupy_module() is not None:
        return None
    try:
        if importlib.util.find_spec("cupy") is None:
            return None
        import cupy  # noqa: F401  (fails again, with the error to report)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@functools.cache
def gpu_unavailable_reason() -> str | None:
    """None when a CUDA device is usable, else a sentence saying why not."""
    cp = cupy_module()
    if cp is None:
        error = cupy_import_error()
        if error is not None:  # installed but broken: reinstalling it is not the fix
            return (f"CuPy is installed but does not import ({error}); run `convfuse "
                    "selfcheck` for the fix")
        return ("CuPy is not installed (pip install cupy-cuda12x nvidia-cudnn-cu12, or the "
                "cu13 pair; from the convfuse checkout, its cu12 or cu13 extra)")
    try:
        if not cp.cuda.is_available():
            return "no usable CUDA device or driver was found (cupy.cuda.is_available() is False)"
        cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # a broken driver raises rather than returning False
        return f"no usable CUDA device or driver was found ({type(exc).__name__}: {exc})"
    return None


def gpu_available() -> bool:
    return gpu_unavailable_reason() is None


def require_gpu(what: str = "this operation") -> ModuleType:
    """Return CuPy, or raise DeviceUnavailableError naming `what` and the reason."""
    reason = gpu_unavailable_reason()
    if reason is not None:
        raise DeviceUnavailableError(f"{what} needs a CUDA GPU, but {reason}")
    return cupy_module()  # type: ignore[return-value]


#: Array types that stand for CuPy arrays in the engine: the pointer path's DeviceArray
#: (Note [the pointer path] in convfuse/ops/cudnn/device.py, which registers it with
#: register_device_array_type).
DEVICE_ARRAY_TYPES: tuple[type, ...] = ()
# cupy.ndarray (where CuPy imports) and DEVICE_ARRAY_TYPES, made once: is_cupy runs several
# times per op call, and the import and tuple it would otherwise redo are most of its time
_device_types: tuple[type, ...] | None = None


def register_device_array_type(cls: type) -> None:
    """Make is_cupy accept `cls` (an engine's stand-in for a CuPy array)."""
    global DEVICE_ARRAY_TYPES, _device_types
    if not isinstance(cls, type):
        raise TypeError(f"register_device_array_type: cls must be a class, got "
                        f"{type(cls).__name__} {cls!r}")
    if cls not in DEVICE_ARRAY_TYPES:
        DEVICE_ARRAY_TYPES = (*DEVICE_ARRAY_TYPES, cls)
    _device_types = None


def is_cupy(a: Any) -> bool:
    """A CuPy array, or a DeviceArray (device memory the cuDNN engine runs on as it is)."""
    global _device_types
    types = _device_types
    if types is None:
        registered = DEVICE_ARRAY_TYPES
        cp = cupy_module()
        types = () if cp is None else (cp.ndarray, *registered)
        if registered is DEVICE_ARRAY_TYPES:  # else a registration came in between
            _device_types = types
    return isinstance(a, types)


def device_of(a: Any) -> str:
    """'cuda' for a CuPy array, 'cpu' for a NumPy array; TypeError for anything else."""
    if isinstance(a, np.ndarray):
        return "cpu"
    if is_cupy(a):
        return "cuda"
    raise TypeError(f"expected a NumPy or CuPy array, got {type(a).__name__}")


def array_module(*arrays: Any) -> ModuleType:
    """NumPy or CuPy for the given arrays (None entries ignored); refuses to mix them."""
    devices = {device_of(a) for a in arrays if a is not None}
    if len(devices) > 1:
        names = ", ".join(
            f"{type(a).__module__}.{type(a).__name__}" for a in arrays if a is not None
        )
        raise DeviceMismatchError(f"cannot mix NumPy and CuPy arrays in one call ({names})")
    if devices == {"cuda"}:
        return cupy_module()  # type: ignore[return-value]
    return np


def resolve_device(device: str | None) -> str:
    """Map a user's device argument to 'cuda' or 'cpu'. None picks cuda when usable."""
    if device is None:
        return "cuda" if gpu_available() else "cpu"
    if not isinstance(device, str):
        raise TypeError(f"device must be 'cuda', 'cpu' or None, got {device!r}")
    kind, _, index = device.lower().partition(":")
    if kind not in ("cuda", "cpu") or (index and not (index.isdigit() and index.isascii())) \
            or (kind == "cpu" and index not in ("", "0")) or (":" in device and not index):
        raise ValueError(f"device must be 'cuda', 'cuda:N', 'cpu' or None, got {device!r}")
    if kind == "cpu":
        return "cpu"
    cp = require_gpu(f"device={device!r}")
    if index and int(index) != cp.cuda.Device().id:
        # native arrays live on CuPy's current device: another index would be ignored
        raise ValueError(f"device={device!r}: convfuse's layers use CuPy's current device "
                         f"({cp.cuda.Device().id}); make GPU {int(index)} current (with "
                         f"cupy.cuda.Device({int(index)}):) around construction and calls, "
                         "and pass device='cuda'")
    return "cuda"


def xp_for(device: str) -> ModuleType:
    """The array module that holds arrays of `device` ('cuda' or 'cpu', any case, 'cuda:N'
    as 'cuda'); anything else is refused as resolve_device refuses it."""
    if device != "cuda" and device != "cpu":
        device = resolve_device(device) if device is not None else _not_none("xp_for")
    return require_gpu(f"device={device!r}") if device == "cuda" else np


def _not_none(fn: str) -> str:
    raise TypeError(f"{fn}: device must be 'cuda' or 'cpu', got None")


def to_device(a: Any, device: str) -> Any:
    """Copy an array to 'cuda' or 'cpu' (no copy when it is there already); the device as
    xp_for takes it."""
    if a is None:
        return None
    if device != "cuda" and device != "cpu":
        device = resolve_device(device) if device is not None else _not_none("to_device")
    if device == "cuda":
        cp = require_gpu("moving an array to the GPU")
        return cp.asarray(a)
    if is_cupy(a):
        return a.get()  # pragma: gpu
    return np.asarray(a)
