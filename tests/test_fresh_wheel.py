"""A user's install: convfuse built as a wheel, installed with only its `cu12` (or `cu13`)
extra into a fresh virtual environment, with no CUDA toolkit in sight, compiles every one
of its kernels with NVRTC (Note [kernels need no CUDA headers] in convfuse/kernels/common.cuh).
The extra's cuDNN wheel is left out (`_requirements`): the kernels do not need it, and with
the cuBLAS it brings it is most of the environment's size.

The development and CI machines have a system toolkit under /usr/local/cuda; this test
hides it (CUDA_HOME and CUDA_PATH point nowhere, LD_LIBRARY_PATH and CPATH are dropped),
runs from an empty folder so the checkout's convfuse cannot be imported, and checks that
NVRTC itself was loaded from the fresh environment's wheels. pip's cache (and the local
package index where one is configured) keeps the install to about a minute after the first
run; the test is marked `slow` (it still runs in the README's test command, which selects
no marker). It needs a package index, so the offline GPU acceptance run leaves it out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import venv
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COPIED = ("setup.py", "pyproject.toml", "README.md", "csrc", "convfuse")

_CHECK = textwrap.dedent("""
    import json, os, sys
    import convfuse
    from convfuse import kernels
    assert not convfuse.__file__.startswith({repo!r}), convfuse.__file__
    cubins = {{}}
    for name in kernels.names():
        src = kernels.source(name)
        assert "#include" not in src.replace("// ", ""), name  # every include pasted in
        for arch in kernels.CHECKED_ARCHS:
            cubins[f"{{name}}/{{arch}}"] = len(kernels.nvrtc_compile(name, arch))
    # CuPy's own kernels (astype, fill, arithmetic) need the runtime headers: this raises
    # "Failed to find CUDA headers" unless the extra brought them (Note [kernels need no
    # CUDA headers]); the -I folders it adds are listed
    import cupy._core.core as cupy_core
    cupy_includes = [o[2:] for o in cupy_core.assemble_cupy_compiler_options(())
                     if o.startswith("-I")]
    maps = open("/proc/self/maps").read().split("\\n")
    nvrtc = sorted({{line.split()[-1] for line in maps if "libnvrtc" in line}})
    print(json.dumps({{"module": convfuse.__file__, "cubins": cubins, "nvrtc": nvrtc,
                      "options": kernels.compile_options("sm_90"),
                      "cupy_includes": cupy_includes,
                      "prefix": sys.prefix}}))
""")


def _flavour() -> str:
    """The extra matching this environment's CuPy (never mix the CUDA lines: FACTS)."""
    try:
        metadata.version("cupy-cuda13x")
        return "cu13"
    except metadata.PackageNotFoundError:
        return "cu12"


def _requirements(flavour: str) -> list[str]:
    """What `convfuse[flavour]` requires, from pyproject.toml (the wheel's metadata), but
    the cuDNN wheel: nothing here needs cuDNN, and it brings cuBLAS, 1.9 GB of the 2.5 GB a
    full install takes (CI's disk ran out installing it). Empty before Python 3.11 (no
    tomllib): the wheel's install then brings them all."""
    try:
        import tomllib
    except ImportError:
        return []
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [r for r in (*project["dependencies"], *project["optional-dependencies"][flavour])
            if not r.startswith("nvidia-cudnn")]


#: Free disk the test needs under its temporary folder: the environment without cuDNN
#: (about 0.7 GB), the wheel's build and some margin.
NEEDS_BYTES = 2 * 2**30


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, (f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _hidden_toolkit_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_LIBRARY_PATH", "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH",
                        "PYTHONPATH", "NVRTC_PATH", "CUPY_CACHE_DIR")}
    nowhere = str(tmp / "no-cuda-toolkit-here")
    env.update(CUDA_HOME=nowhere, CUDA_PATH=nowhere, CUPY_CACHE_DIR=str(tmp / "cupy-cache"),
               PATH=os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                    if "cuda" not in p.lower()),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


@pytest.mark.slow  # 2-6 minutes on 2 busy cores, about half of it building csrc/
def test_fresh_wheel_with_only_the_runtime_extra_compiles_every_kernel(tmp_path):
    pytest.importorskip("pybind11", reason="building the wheel needs the build requirements")
    free = shutil.disk_usage(tmp_path).free
    if free < NEEDS_BYTES:
        pytest.skip(f"a fresh environment needs about {NEEDS_BYTES / 2**30:.0f} GiB free "
                    f"under {tmp_path}, and {free / 2**30:.1f} GiB are")
    try:
        _fresh_wheel(tmp_path)
    finally:  # the environment is large: give its space back to the rest of the suite
        shutil.rmtree(tmp_path / "venv", ignore_errors=True)


def _fresh_wheel(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info", "build")
    for name in COPIED:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    env_dir = tmp_path / "venv"
    env = _hidden_toolkit_env(tmp_path)
    flavour = _flavour()
    # --no-compile: byte-compiling CuPy and the nvidia packages is most of a cached install.
    # CONVFUSE_WHEELHOUSE: a folder of downloaded wheels, for machines without a package
    # index (pip download the extra's requirements into it).
    offline = os.environ.get("CONVFUSE_WHEELHOUSE")
    pip_install = ["-m", "pip", "install", "-q", "--no-compile",
                   *(["--no-index", "--find-links", offline] if offline else [])]
    # The build (CPU-bound) and the install of the extra's requirements (mostly unpacking)
    # overlap; the wheel is then installed with the extra, which pip finds satisfied.
    # The build needs the cuDNN headers of this environment (setup.py): no isolation.
    build = subprocess.Popen(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
         "-w", str(tmp_path / "dist"), str(src)], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        venv.create(env_dir, with_pip=True, system_site_packages=False)
        py = str(env_dir / "bin" / "python")
        if requirements := _requirements(flavour):
            _run([py, *pip_install, *requirements], env=env, cwd=tmp_path)
    finally:
        log, _ = build.communicate()
    assert build.returncode == 0, f"building the wheel failed:\n{log[-3000:]}"
    [wheel] = (tmp_path / "dist").glob("convfuse-*.whl")
    if requirements:  # everything but cuDNN is in (_requirements): the wheel alone
        _run([py, *pip_install, "--no-deps", str(wheel)], env=env, cwd=tmp_path)
    else:
        _run([py, *pip_install, f"{wheel}[{flavour}]"], env=env, cwd=tmp_path)

    work = tmp_path / "empty"
    work.mkdir()
    proc = _run([py, "-c", _CHECK.format(repo=str(REPO))], env=env, cwd=work)
    import json

    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["module"].startswith(str(env_dir)), report["module"]
    assert not any(opt.startswith("-I") for opt in report["options"]), report["options"]
    from convfuse import kernels

    expected = {f"{n}/{a}" for n in kernels.names() for a in kernels.CHECKED_ARCHS}
    assert set(report["cubins"]) == expected
    assert all(size > 1000 for size in report["cubins"].values()), report["cubins"]
    # NVRTC came from the fresh environment's wheels, not from a toolkit.
    assert report["nvrtc"], "libnvrtc was never loaded"
    assert all(p.startswith(str(env_dir)) for p in report["nvrtc"]), report["nvrtc"]
    # ...and CuPy finds the CUDA runtime headers in the same environment
    headers = [d for d in report["cupy_includes"] if d.startswith(str(env_dir))
               and (Path(d) / "cuda_fp16.h").is_file()]
    assert headers, report["cupy_includes"]
