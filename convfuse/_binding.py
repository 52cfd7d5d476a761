"""Load libcudnn and the compiled binding, lazily, with errors that say how to fix them.

`import convfuse` never touches cuDNN; the first op, plan or selfcheck that needs it
calls `cudnn()`. The extension links `libcudnn.so.9` by soname only, so the library must
be loaded first: cuda.pathfinder finds it in the nvidia-cudnn wheel (cu12 or cu13).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from types import ModuleType

from .errors import CudnnLoadError

_WHEELS = ("nvidia-cudnn-cu12", "nvidia-cudnn-cu13")


def installed_cudnn_wheels() -> list[str]:
    """Which nvidia-cudnn wheels are installed, as 'name==version'."""
    found = []
    for dist in _WHEELS:
        try:
            found.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def install_problem() -> str | None:
    """A sentence describing a broken cuDNN install, or None when it looks sound."""
    wheels = installed_cudnn_wheels()
    if len(wheels) > 1:
        return (
            f"both cuDNN wheels are installed ({', '.join(wheels)}); they overwrite the same "
            "files. Uninstall one: pip uninstall -y nvidia-cudnn-cu13 (or -cu12), then "
            "reinstall the other with pip install --force-reinstall"
        )
    return None


@functools.cache
def load_library() -> str:
    """Load libcudnn.so.9 into the process; returns its absolute path."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError as exc:
        raise CudnnLoadError(
            "cuda.pathfinder is missing: pip install cuda-pathfinder (a convfuse dependency)"
        ) from exc
    try:
        loaded = load_nvidia_dynamic_lib("cudnn")
    except Exception as exc:
        if "unknown" in f"{type(exc).__name__} {exc}".lower():  # pathfinder < 1.7
            raise CudnnLoadError(
                f"cuda-pathfinder does not know cuDNN by name ({type(exc).__name__}: {exc}): "
                "pip install -U 'cuda-pathfinder>=1.7'") from exc
        raise CudnnLoadError(
            "libcudnn.so.9 could not be found or loaded "
            f"({type(exc).__name__}: {exc}). Install the wheel matching your CUDA: "
            "pip install nvidia-cudnn-cu12 (with cupy-cuda12x) or nvidia-cudnn-cu13 (with "
            "cupy-cuda13x)"
        ) from exc
    return str(loaded.abs_path)


@functools.cache
def cudnn() -> ModuleType:
    """The `convfuse._cudnn` extension, after libcudnn has been loaded."""
    load_library()
    try:
        return importlib.import_module("convfuse._cudnn")
    except ImportError as exc:
        raise CudnnLoadError(
            f"the compiled binding convfuse._cudnn could not be imported ({exc}). "
            "Rebuild it: pip install --no-build-isolation -e . (see README)"
        ) from exc
