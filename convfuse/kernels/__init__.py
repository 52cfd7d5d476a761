"""convfuse's own CUDA kernels: sources shipped beside this file, compiled by NVRTC.

Convention: every kernel is `extern "C"` with its dtype in its name (e.g. `adam_f32`),
so one source compiles to one module with no name expressions, and the CPU test suite
can compile each source through NVRTC for several architectures without a device.
"""

from __future__ import annotations

import functools
import sys
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import ConvfuseError

#: Architectures every kernel must compile for (checked in the CPU suite).
CHECKED_ARCHS = ("sm_80", "sm_90")


class KernelCompileError(ConvfuseError, RuntimeError):
    """NVRTC rejected a kernel source; the message carries the compiler log."""


def names() -> list[str]:
    """Names of the kernel sources shipped with convfuse (without `.cu`)."""
    folder = resources.files(__name__)
    return sorted(p.name[:-3] for p in folder.iterdir() if p.name.endswith(".cu"))


def source(name: str) -> str:
    path = resources.files(__name__) / f"{name}.cu"
    if not path.is_file():
        raise ValueError(f"no kernel source {name!r}; known: {', '.join(names())}")
    return path.read_text()


@functools.cache
def include_dirs() -> tuple[str, ...]:
    """Folders holding cuda_fp16.h and cuda_bf16.h, which NVRTC does not ship built in."""
    for site in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include"):
            cand = Path(site) / sub
            if (cand / "cuda_fp16.h").is_file():
                return (str(cand),)  # one header set only: mixing CUDA versions breaks builds
    home = Path("/usr/local/cuda/include")
    return (str(home),) if (home / "cuda_fp16.h").is_file() else ()


def nvrtc() -> ModuleType:
    """CuPy's NVRTC binding (its module moved between CuPy releases)."""
    try:
        from cupy_backends.cuda.libs import nvrtc as mod
    except ImportError:
        from cupy.cuda import nvrtc as mod  # type: ignore[no-redef]
    return mod


def compile_options(arch: str | None = None) -> list[str]:
    here = str(resources.files(__name__))  # for the shared common.cuh
    opts = ["--std=c++17", f"-I{here}", *(f"-I{d}" for d in include_dirs())]
    if arch:
        opts.append(f"-arch={arch}")
    return opts


def nvrtc_compile(name: str, arch: str = "sm_90") -> bytes:
    """Compile a shipped kernel source to a cubin with NVRTC; works without a GPU."""
    lib = nvrtc()
    prog = lib.createProgram(source(name), f"{name}.cu", [], [])
    try:
        try:
            lib.compileProgram(prog, compile_options(arch))
        except lib.NVRTCError as exc:
            log = lib.getProgramLog(prog)
            raise KernelCompileError(f"{name}.cu failed to compile for {arch}:\n{log}") from exc
        return lib.getCUBIN(prog)
    finally:
        lib.destroyProgram(prog)


@functools.cache
def _module(name: str, device_id: int) -> Any:  # pragma: gpu
    import cupy

    return cupy.RawModule(code=source(name), options=tuple(compile_options()))


def function(module: str, kernel: str) -> Any:  # pragma: gpu
    """A compiled kernel on the current device (compiled once per device and source)."""
    import cupy

    return _module(module, cupy.cuda.Device().id).get_function(kernel)
