"""Diagnose a broken install: name what is wrong and the command that fixes it.

convfuse needs four things to line up: CuPy's CUDA line (cupy-cuda12x / -13x), the cuDNN
wheel's line (nvidia-cudnn-cu12 / -cu13), a driver new enough for that line, and the
compiled binding convfuse._cudnn. pip installs mismatched pairs without complaint (see
docs/VERIFYING.md), so each mismatch gets its own sentence here instead of a traceback.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from types import ModuleType

from .. import _binding
from ..backend import cupy_import_error
from ..errors import CudnnLoadError
from .report import Problem

_CUPY_WHEELS = ("cupy-cuda11x", "cupy-cuda12x", "cupy-cuda13x", "cupy")
#: The first cuda-pathfinder that loads cuDNN by name (pyproject.toml's floor).
PATHFINDER = "cuda-pathfinder>=1.7"
#: Where the GPU wheels come from: convfuse is not on PyPI, so its extras are named by the
#: checkout's command (README, "Set up on a fresh machine").
GPU_EXTRA = ("pip install --no-build-isolation -e '.[cu{line}]' in the convfuse checkout "
             "(after requirements/build-cu{line}.txt)")
_BUILD_FIX = (
    "build it in the source checkout: pip install -r requirements/build-cu12.txt (or "
    "build-cu13.txt), then pip install --no-build-isolation -e ."
)


def dist_version(name: str) -> str | None:
    """Installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _too_old(version: str | None) -> bool:
    """Whether a cuda-pathfinder version predates PATHFINDER's floor (1.7)."""
    parts = re.match(r"(\d+)\.(\d+)", version or "")
    return parts is not None and (int(parts[1]), int(parts[2])) < (1, 7)


def module_available(name: str) -> bool:
    """Whether `import name` would find something, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# the CUDA lines convfuse has extras and requirement files for (cu12, cu13)
SUPPORTED_LINES = (12, 13)


def cupy_wheels() -> list[str]:
    return [f"{d}=={v}" for d in _CUPY_WHEELS if (v := dist_version(d)) is not None]


def cuda_line(dist: str) -> int | None:
    """CUDA major version a wheel is built for: cupy-cuda12x -> 12, nvidia-cudnn-cu13 -> 13."""
    m = re.search(r"cu(?:da)?(\d+)x?(?:==|$)", dist)
    return int(m.group(1)) if m else None


def recommended_line(driver_version: int = 0) -> int:
    """The CUDA line to suggest: CuPy's if a CuPy wheel says, else what the driver runs."""
    lines = {cuda_line(w) for w in cupy_wheels()} - {None}
    if len(lines) == 1:
        return lines.pop()  # type: ignore[return-value]
    return 13 if driver_version >= 13000 else 12


def static_problems(driver_version: int = 0) -> list[Problem]:
    """Problems visible from package metadata alone (no library is loaded).

    `driver_version` is cudaDriverGetVersion's answer (e.g. 12040), 0 when no driver.
    """
    problems: list[Problem] = []
    line = recommended_line(driver_version)
    if not module_available("cuda.pathfinder"):
        problems.append(Problem(
            "cuda-pathfinder is not installed; convfuse uses it to find and load libcudnn",
            f"pip install '{PATHFINDER}'",
        ))
    cudnn = _binding.installed_cudnn_wheels()
    if len(cudnn) > 1:
        problems.append(Problem(
            f"both cuDNN wheels are installed ({', '.join(cudnn)}); they overwrite the same "
            "files under site-packages/nvidia/cudnn, so the library on disk is a mixture",
            "pip uninstall -y nvidia-cudnn-cu12 nvidia-cudnn-cu13, then "
            f"pip install nvidia-cudnn-cu{line} (the line matching your CuPy)",
        ))
    cupys = cupy_wheels()
    broken = cupy_import_error()
    if broken is not None:
        named = ", ".join(cupys) or "CuPy"
        problems.append(Problem(
            f"{named} is installed but does not import ({broken}); the GPU engine cannot run",
            f"pip install --force-reinstall {cupys[0].split('==')[0] if cupys else 'cupy-cuda12x'}"
            " (its CUDA line must match the driver's and the cuDNN wheel's), then rerun "
            "selfcheck",
        ))
    if len(cupys) > 1:
        problems.append(Problem(
            f"more than one CuPy is installed ({', '.join(cupys)}); they overwrite each other",
            f"pip uninstall -y {' '.join(w.split('==')[0] for w in cupys)}, then "
            f"pip install cupy-cuda{line}x",
        ))
    if len(cupys) == 1 and len(cudnn) == 1:
        cupy_line, cudnn_line = cuda_line(cupys[0]), cuda_line(cudnn[0])
        if cupy_line is not None and cudnn_line is not None and cupy_line != cudnn_line:
            problems.append(Problem(
                f"CuPy and cuDNN are for different CUDA lines: {cupys[0]} is CUDA "
                f"{cupy_line}, {cudnn[0]} is CUDA {cudnn_line}",
                f"pip uninstall -y {cudnn[0].split('==')[0]} && "
                f"pip install nvidia-cudnn-cu{cupy_line} (or install cupy-cuda{cudnn_line}x "
                "in place of your CuPy instead)",
            ))
    if driver_version > 0:
        driver_major = driver_version // 1000
        for wheel in cupys + cudnn:
            needed = cuda_line(wheel)
            if needed is not None and needed > driver_major:
                # convfuse's wheels exist for CUDA 12 and 13 only: an older driver has no
                # line to switch to
                fix = (f"update the NVIDIA driver, or switch to the CUDA {driver_major} "
                       f"wheels: {GPU_EXTRA.format(line=driver_major)}, after uninstalling "
                       f"the cu{needed} ones" if driver_major in SUPPORTED_LINES else
                       "update the NVIDIA driver (convfuse needs a CUDA 12 or 13 driver)")
                problems.append(Problem(
                    f"the NVIDIA driver supports CUDA up to {format_cuda(driver_version)}, "
                    f"but {wheel} needs a CUDA {needed} driver", fix))
    return problems


def load_binding() -> tuple[str | None, ModuleType | None, list[Problem]]:
    """Load libcudnn and convfuse._cudnn; (library path, module, problems found doing so)."""
    problems: list[Problem] = []
    try:
        path = _binding.load_library()
    except CudnnLoadError as exc:
        if not module_available("cuda.pathfinder"):
            return None, None, problems  # static_problems already names it
        if not _binding.installed_cudnn_wheels():
            problems.append(Problem(
                "no cuDNN wheel is installed and libcudnn.so.9 was not found elsewhere "
                f"({exc})",
                "pip install nvidia-cudnn-cu12 (with cupy-cuda12x) or nvidia-cudnn-cu13 "
                f"(with cupy-cuda13x); or {GPU_EXTRA.format(line=12)}",
            ))
        elif _too_old(dist_version("cuda-pathfinder")):
            problems.append(Problem(
                f"cuda-pathfinder {dist_version('cuda-pathfinder')} does not know cuDNN by "
                "name (1.7 is the first release that loads it)",
                f"pip install -U '{PATHFINDER}'",
            ))
        else:
            problems.append(Problem(
                f"libcudnn.so.9 did not load although a wheel is installed: {exc}",
                "reinstall it: pip install --force-reinstall "
                f"{_binding.installed_cudnn_wheels()[0].split('==')[0]}",
            ))
        return None, None, problems
    try:
        module = _binding.cudnn()
    except CudnnLoadError as exc:
        if not module_available("convfuse._cudnn"):
            problems.append(Problem(
                "the compiled binding convfuse._cudnn is missing: this convfuse was installed "
                "without building its C++ extension",
                _BUILD_FIX,
            ))
        else:
            problems.append(Problem(
                f"convfuse._cudnn exists but does not import: {exc}",
                "rebuild it against the installed cuDNN: " + _BUILD_FIX,
            ))
        return path, None, problems
    problems.extend(version_problems(module))
    return path, module, problems


def version_problems(module: ModuleType) -> list[Problem]:
    """cuDNN 9 is required, and the loaded library must have the header's major version."""
    loaded, header = int(module.getVersion()), int(module.CUDNN_VERSION)
    if loaded // 10000 < 9:
        return [Problem(f"cuDNN {format_cudnn(loaded)} is loaded; convfuse needs cuDNN 9",
                        "pip install 'nvidia-cudnn-cu12>=9,<10' (or -cu13)")]
    if loaded // 10000 != header // 10000:
        return [Problem(
            f"convfuse._cudnn was built against cuDNN {format_cudnn(header)} but cuDNN "
            f"{format_cudnn(loaded)} is loaded",
            "rebuild the binding: " + _BUILD_FIX,
        )]
    return []


def format_cudnn(version: int) -> str:
    """92800 -> '9.28.0' (cuDNN 9 encodes major*10000 + minor*100 + patch)."""
    return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"


def format_cuda(version: int) -> str:
    """12090 -> '12.9' (CUDA encodes major*1000 + minor*10)."""
    return f"{version // 1000}.{version % 1000 // 10}"
