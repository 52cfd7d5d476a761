"""convfuse's own CUDA kernels: sources shipped beside this file, compiled by NVRTC.

Convention: every kernel is `extern "C"` with its dtype in its name (e.g. `adam_f32`),
so one source compiles to one module with no name expressions, and the CPU test suite
can compile each source through NVRTC for several architectures without a device.
"""

from __future__ import annotations

import functools
import re
import time
from importlib import resources
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
    """The kernel source with every `#include "file"` of a shipped header pasted in.

    CuPy's on-disk kernel cache is keyed by the source string and the options, not by
    the files an #include pulls in, so an edit of common.cuh would otherwise reuse stale
    cubins. Pasted in, the headers are part of the key, and NVRTC needs no -I at all
    (Note [kernels need no CUDA headers] in common.cuh).
    """
    path = resources.files(__name__) / f"{name}.cu"
    if not path.is_file():
        raise ValueError(f"no kernel source {name!r}; known: {', '.join(names())}")
    return _inline_includes(path.read_text(), set())


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)".*$', re.M)


def _inline_includes(text: str, seen: set[str]) -> str:
    def paste(match: re.Match[str]) -> str:
        header = match.group(1)
        if header in seen:  # every shipped header is `#pragma once`
            return f"// {header}: already included"
        seen.add(header)
        path = resources.files(__name__) / header
        if not path.is_file():
            raise ValueError(f"kernel source includes {header!r}, which convfuse does not ship")
        body = path.read_text().replace("#pragma once", f"// {header}")
        return _inline_includes(body, seen)

    return _INCLUDE.sub(paste, text)


def nvrtc() -> ModuleType:
    """CuPy's NVRTC binding (its module moved between CuPy releases)."""
    try:
        from cupy_backends.cuda.libs import nvrtc as mod
    except ImportError:
        from cupy.cuda import nvrtc as mod
    return mod


#: Options CuPy appends to every kernel it compiles, RawModule included (CuPy 14.2,
#: cupy/cuda/compiler.py `_compile_with_cache_cuda`: `options += ('-ftz=true',)`).
#: Note [CuPy compiles with -ftz=true]: float32 arithmetic in convfuse's kernels flushes
#: subnormal operands and results to zero (sign kept), comparisons included. float64 is
#: untouched; float16 data is converted to float exactly and its whole range is normal in
#: float; bfloat16 shares float's exponent range, so a bfloat16 subnormal becomes 0 as soon
#: as it is computed with. What that changes:
#: - branches: none. A flushed comparison would send a positive subnormal saved y down
#:   relu's `y <= 0` branch (dz = 0 instead of dy, and the fused bias gradient loses the
#:   term), so every sign decision reads the bits (Note [branches on saved values read
#:   their bits] in activation.cu; tests/test_kernels_nvrtc.py checks the PTX and runs the
#:   rules flushed on the host).
#: - a result: by less than float's smallest normal, 1.18e-38, when the flushed value is
#:   the result or is added to it (every forward activation).
#: - a result scaled after the flush: by up to about (|dy| (1 + |s|) + 1) * 1.18e-38 in a
#:   backward (s the saved value), far above 1.18e-38 for a large dy: silu's backward at
#:   z = -95 flushes sigmoid(z) = 5.5e-42, and with dy = 1e10 gives -0.0 instead of
#:   -5.19e-30. Tests with subnormal intermediates compare with a tolerance scaled so.
CUPY_ADDED_OPTIONS = ("-ftz=true",)


def compile_options(arch: str | None = None) -> list[str]:
    """The options convfuse passes to CuPy: no include folders (Note [kernels need no CUDA
    headers]). NVRTC sees these plus CUPY_ADDED_OPTIONS (see nvrtc_options)."""
    opts = ["--std=c++17"]
    if arch:
        opts.append(f"-arch={arch}")
    return opts


def nvrtc_options(arch: str | None = None) -> list[str]:
    """What NVRTC really receives when CuPy compiles a kernel: compile_options plus what
    CuPy adds (Note [CuPy compiles with -ftz=true]); the CPU-side checks compile with it."""
    return [*compile_options(arch), *CUPY_ADDED_OPTIONS]


def nvrtc_compile(name: str, arch: str = "sm_90") -> bytes:
    """Compile a shipped kernel source to a cubin with NVRTC, with the options CuPy uses;
    works without a GPU."""
    lib = nvrtc()
    prog = lib.createProgram(source(name), f"{name}.cu", [], [])
    try:
        try:
            lib.compileProgram(prog, nvrtc_options(arch))
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


def compile_all() -> dict[str, float]:  # pragma: gpu
    """Compile every shipped source for the current device now; seconds per source.

    Each source compiles once per process (`_module` is cached) and once per machine:
    CuPy keeps the cubin in its on-disk cache (CUPY_CACHE_DIR), keyed by source and
    options, so later processes (pytest-xdist workers, the next test chunk) load it.
    """
    import cupy

    device = cupy.cuda.Device().id
    seconds = {}
    for name in names():
        t0 = time.perf_counter()
        _module(name, device).compile()
        seconds[name] = time.perf_counter() - t0
    return seconds


def function(module: str, kernel: str) -> Any:
    """A compiled kernel on the current device (compiled once per device and source, and
    looked up once: a lookup builds a new CuPy Function, a host cost per launch)."""
    import cupy

    return function_on(module, kernel, cupy.cuda.Device().id)


@functools.cache
def function_on(module: str, kernel: str, device_id: int) -> Any:
    """`function` for device `device_id`, which must be the current one at the first call
    (callers that know the device skip asking CUDA for it)."""
    return _module(module, device_id).get_function(kernel)
