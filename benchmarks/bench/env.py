"""The environment a run happened in: enough to tell two result files apart."""

from __future__ import annotations

import ctypes
import datetime
import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

import convfuse as cf
from convfuse import _binding
from convfuse.backend import gpu_unavailable_reason

from .engine import Engine


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cudnn_version() -> dict[str, Any]:
    """cuDNN's version from the binding, else straight from libcudnn (needs no GPU)."""
    info: dict[str, Any] = {"wheels": _binding.installed_cudnn_wheels()}
    try:
        lib = _binding.cudnn()
        info["version"] = int(lib.getVersion())
        info["via"] = "convfuse._cudnn.getVersion"
        return info
    except Exception as exc:
        info["binding"] = f"unavailable ({type(exc).__name__}: {exc})"
    try:
        path = _binding.load_library()
        info["version"] = int(ctypes.CDLL(path).cudnnGetVersion())
        info["via"] = f"cudnnGetVersion from {path}"
    except Exception as exc:
        info["version"] = None
        info["via"] = f"unavailable ({type(exc).__name__}: {exc})"
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _git_dirty() -> bool | None:
    """Whether the checkout has uncommitted changes (the commit alone would not say what
    ran)."""
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                              "--untracked-files=no"], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def _torch_side() -> dict[str, Any] | None:
    """The versions and switches PyTorch's own calls ran with, where it is imported: its
    cuDNN may differ from the one convfuse loads, and its flags decide its precision."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        cudnn = torch.backends.cudnn
        return {"cuda": torch.version.cuda, "cudnn": cudnn.version(),
                "cudnn_allow_tf32": cudnn.allow_tf32, "cudnn_benchmark": cudnn.benchmark,
                "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32}
    except Exception as exc:  # a report, not a reason to stop
        return {"error": f"{type(exc).__name__}: {exc}"}


def gpu_info(engine: Engine) -> dict[str, Any]:  # pragma: gpu
    rt = engine.xp.cuda.runtime
    info = dict(engine.info)
    info["driver_version"] = rt.driverGetVersion()
    info["cuda_runtime_version"] = rt.runtimeGetVersion()
    return info


def collect(engine: Engine, argv: list[str], torch_note: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "timestamp_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "command": " ".join([Path(sys.argv[0]).name, *argv]),
        "engine": engine.kind,
        "label": engine.label,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "numpy": np.__version__,
        "cupy": _version("cupy-cuda12x") or _version("cupy-cuda13x") or _version("cupy"),
        "convfuse": cf.__version__,
        "convfuse_path": str(Path(cf.__file__).parent),
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),
        "cudnn": cudnn_version(),
        "torch": _version("torch"),
        "torch_note": torch_note,
        "torch_side": _torch_side(),
        "timer": engine.timer.kind,
        "gpu_unavailable_reason": gpu_unavailable_reason(),
    }
    if engine.is_gpu:  # pragma: gpu
        env["gpu"] = gpu_info(engine)
    else:
        env["gpu"] = None
    return env
