"""The environment block of a selfcheck: every version a bug report needs, never raising."""

from __future__ import annotations

import platform
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from .. import __version__, _binding
from ..backend import cupy_import_error, cupy_module, gpu_unavailable_reason
from .install import cupy_wheels, dist_version, format_cuda, format_cudnn


def driver_version() -> int:
    """cudaDriverGetVersion: e.g. 12040; 0 when no driver (or no CuPy) is present."""
    cp = cupy_module()
    if cp is None:
        return 0
    try:
        return int(cp.cuda.runtime.driverGetVersion())
    except Exception:
        return 0


def runtime_version() -> int:
    """The CUDA runtime CuPy loaded, e.g. 12090; 0 when unknown."""
    cp = cupy_module()
    if cp is None:
        return 0
    try:
        return int(cp.cuda.runtime.runtimeGetVersion())
    except Exception:
        return 0


def gpu_description() -> str:  # pragma: gpu
    import cupy as cp

    count = cp.cuda.runtime.getDeviceCount()
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    free, total = cp.cuda.runtime.memGetInfo()
    return (f"{name}, compute capability {props['major']}.{props['minor']}, "
            f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free); device {dev.id} "
            f"of {count}")


def collect(library_path: str | None, binding: ModuleType | None,
            load_error: str | None = None) -> dict[str, Any]:
    """Name -> one-line description, in the order a reader wants them."""
    env: dict[str, Any] = {}
    env["convfuse"] = f"{__version__} ({Path(__file__).resolve().parents[1]})"
    env["Python"] = (f"{platform.python_version()} ({platform.python_implementation()}, "
                     f"{platform.system()} {platform.machine()})")
    env["NumPy"] = np.__version__
    cp = cupy_module()
    wheels = cupy_wheels()
    broken = cupy_import_error()
    env["CuPy"] = (f"{cp.__version__} ({', '.join(wheels) or 'not from a wheel'})"
                   if cp is not None else
                   f"installed ({', '.join(wheels) or 'not from a wheel'}) but does not "
                   f"import: {broken}" if broken is not None else
                   "not installed (the GPU engine needs it)")
    rt, drv = runtime_version(), driver_version()
    env["CUDA runtime"] = format_cuda(rt) + " (CuPy's)" if rt else "unknown (no CuPy)"
    env["CUDA driver"] = format_cuda(drv) if drv else "none found"
    if binding is not None:
        env["cuDNN"] = f"{format_cudnn(int(binding.getVersion()))} ({library_path})"
        env["cuDNN binding"] = (
            f"built against cuDNN {format_cudnn(int(binding.CUDNN_VERSION))}; the loaded "
            f"cuDNN was built with CUDA {format_cuda(int(binding.getCudartVersion()))}"
        )
    elif library_path is not None:
        env["cuDNN"] = f"loaded from {library_path}, but the binding is unusable"
    else:
        env["cuDNN"] = f"not loaded ({load_error or 'see install problems'})"
    env["cuDNN wheels"] = ", ".join(_binding.installed_cudnn_wheels()) or "none"
    env["cuda-pathfinder"] = dist_version("cuda-pathfinder") or "not installed"
    reason = gpu_unavailable_reason()
    env["GPU"] = f"none ({reason})" if reason is not None else _safe_gpu_description()
    return env


def _safe_gpu_description() -> str:  # pragma: gpu
    try:
        return gpu_description()
    except Exception as exc:
        return f"present, but its properties could not be read ({type(exc).__name__}: {exc})"
