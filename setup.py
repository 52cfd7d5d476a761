"""Build convfuse._cudnn, the thin pybind11 binding of cuDNN in csrc/.

The headers come from the environment the package installs into (the nvidia-cudnn wheel
plus a CUDA runtime header set), never from a download. Search order, first hit wins:
1. CONVFUSE_CUDNN_INCLUDE / CONVFUSE_CUDA_INCLUDE environment variables;
2. every sys.path entry (the target environment under --no-build-isolation);
3. cuda.pathfinder, which looks at the running interpreter's environment;
4. $CUDA_HOME/include and /usr/local/cuda/include for the CUDA runtime headers;
5. triton's bundled CUDA headers (triton/backends/nvidia/include, with crt/), which the
   torch cu13 wheels bring where the cu13 runtime wheel has no crt/ folder.
See shared FACTS: cudnn.h includes cuda_runtime_api.h, which needs crt/host_defines.h.

It prints the folders it chose to stderr, one line each (`convfuse setup: cuDNN include:
...`, with where it found them), and how it compiles csrc/; `pip install -v` shows them.

-Werror is on by default (CI builds with it); CONVFUSE_NO_WERROR=1 drops it, for a build
with a compiler nobody has tried (scripts/gpu_acceptance.sh sets it on the GPU machine,
whose g++ version is unknown: a new warning there must not stop the acceptance run).
CONVFUSE_UNITY_BUILD=1 compiles csrc/ as one translation unit (build/unity/): pybind11's
headers are then parsed once instead of once per file, a quarter of the CPU time (24
against 94 CPU-s measured), which wins on few or busy cores; the acceptance run sets it.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup


def _site_dirs() -> list[Path]:
    return [Path(p) for p in sys.path if p and Path(p).is_dir()]


def _say(what: str, value: object) -> None:
    """One line of what the build chose, on stderr (pip -v shows it; so does a plain
    `python setup.py build_ext`)."""
    print(f"convfuse setup: {what}: {value}", file=sys.stderr, flush=True)


def _find_cudnn_include() -> tuple[Path, str]:
    """The folder with cudnn.h, and where it was found."""
    env = os.environ.get("CONVFUSE_CUDNN_INCLUDE")
    if env:
        return Path(env), "CONVFUSE_CUDNN_INCLUDE"
    for site in _site_dirs():
        cand = site / "nvidia" / "cudnn" / "include"
        if (cand / "cudnn.h").is_file():
            return cand, "sys.path"
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudnn")
        if found:
            return Path(found), "cuda.pathfinder"
    except (ImportError, RuntimeError):  # (a cuda-pathfinder before 1.7 knows no "cudnn")
        pass
    raise SystemExit(
        "convfuse: cudnn.h not found. Install the cuDNN wheel first, e.g.\n"
        "  pip install -r requirements/build-cu12.txt\n"
        "then build with `pip install --no-build-isolation -e .`, or set CONVFUSE_CUDNN_INCLUDE."
    )


def _has_cuda_runtime_headers(folders: list[Path]) -> bool:
    names = ("cuda_runtime_api.h", "crt/host_defines.h")
    return all(any((f / n).is_file() for f in folders) for n in names)


def _find_cuda_includes() -> tuple[list[Path], str]:
    """The folders with the CUDA runtime headers, and where they were found."""
    env = os.environ.get("CONVFUSE_CUDA_INCLUDE")
    if env:
        return [Path(p) for p in env.split(os.pathsep)], "CONVFUSE_CUDA_INCLUDE"
    candidates: list[tuple[list[Path], str]] = []
    for site in _site_dirs():
        nv = site / "nvidia"
        candidates.append(([nv / "cu13" / "include"], "the CUDA 13 wheels"))
        candidates.append(([nv / "cuda_runtime" / "include", nv / "cuda_nvcc" / "include"],
                           "the CUDA 12 runtime and nvcc wheels"))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(([Path(os.environ[var]) / "include"], f"${var}"))
    candidates.append(([Path("/usr/local/cuda/include")], "/usr/local/cuda"))
    # Last: a complete, self-consistent header set (CUDA 12.8 here) that needs no toolkit;
    # the binding uses only cudaStream_t and the runtime API's types from it.
    for site in _site_dirs():
        candidates.append(([site / "triton" / "backends" / "nvidia" / "include"],
                           "triton's bundled headers"))
    for folders, source in candidates:
        if _has_cuda_runtime_headers(folders):
            return folders, source
    raise SystemExit(
        "convfuse: CUDA runtime headers (cuda_runtime_api.h and crt/host_defines.h) not found.\n"
        "  CUDA 12: pip install nvidia-cuda-runtime-cu12 nvidia-cuda-nvcc-cu12\n"
        "  CUDA 13: pip install nvidia-cuda-runtime nvidia-cuda-crt\n"
        "  (triton's bundled headers, triton/backends/nvidia/include, also do)\n"
        "or set CONVFUSE_CUDA_INCLUDE."
    )


def _werror() -> list[str]:
    return [] if os.environ.get("CONVFUSE_NO_WERROR", "") not in ("", "0") else ["-Werror"]


# Compile the csrc/ files in parallel (NPY_NUM_BUILD_JOBS overrides the job count).
ParallelCompile("NPY_NUM_BUILD_JOBS").install()

cudnn_include, found_in = _find_cudnn_include()
cudnn_lib = cudnn_include.parent / "lib"
cuda_includes, cuda_found_in = _find_cuda_includes()
_say("cuDNN include", f"{cudnn_include} (from {found_in})")
_say("cuDNN library", f"{cudnn_lib} (-l:libcudnn.so.9)")
for folder in cuda_includes:
    _say("CUDA include", f"{folder} (from {cuda_found_in})")

def _sources() -> list[str]:
    sources = sorted(glob.glob("csrc/*.cpp"))
    if os.environ.get("CONVFUSE_UNITY_BUILD", "") in ("", "0"):
        jobs = os.environ.get("NPY_NUM_BUILD_JOBS") or os.cpu_count()
        _say("csrc/", f"{len(sources)} files, compiled in parallel (up to {jobs} jobs)")
        return sources
    unity = Path("build") / "unity" / "_cudnn_unity.cpp"
    unity.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f'#include "{Path(src).resolve()}"\n' for src in sources)
    if not unity.is_file() or unity.read_text() != text:  # keep its timestamp otherwise
        unity.write_text(text)
    _say("csrc/", f"{len(sources)} files as one translation unit, {unity} "
                  "(CONVFUSE_UNITY_BUILD)")
    return [str(unity)]


ext = Pybind11Extension(
    "convfuse._cudnn",
    _sources(),
    # What the sources include, and (for the unity file, whose timestamp stays put) the
    # sources themselves: a plain `build_ext` rebuilds when any of them changed.
    depends=sorted(glob.glob("csrc/*.h")) + sorted(glob.glob("csrc/*.cpp")),
    include_dirs=["csrc", str(cudnn_include), *map(str, cuda_includes)],
    library_dirs=[str(cudnn_lib)],
    # The wheel ships only the versioned soname; the same binary runs with cu12 and cu13 wheels.
    extra_link_args=["-l:libcudnn.so.9"],
    # -g0 overrides the interpreter's own -g: debug info of pybind11's templates is a
    # third of the compile time, and the offline acceptance install is timed
    extra_compile_args=["-Wall", "-Wextra", *_werror(), "-O2", "-g0"],
    cxx_std=17,
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
