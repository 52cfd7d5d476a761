"""`convfuse selfcheck`: what this install can be trusted to do, in one command.

It prints the environment, names install problems with their fixes, runs the CPU-side
checks (libcudnn and the binding load, descriptors, cuDNN's shape rules, plans, the custom
kernels' NVRTC compile, the reference engine against a tiny oracle) and, when a GPU is
usable, every cuDNN-backed op, layer, an autotuned plan, the fused optimizers and a
captured training step against the float64 reference. It exits 0 only if all of it passes.
"""

from __future__ import annotations

import sys
from typing import TextIO

from ..backend import gpu_unavailable_reason
from . import cpu_checks, environment, install, reference_checks
from .report import SKIP, CheckResult, Problem, Report, write_text
from .runner import run_check

#: What only a GPU can show; listed in the report whenever the GPU checks did not run.
GPU_ONLY = (
    "cuDNN compute calls (fused conv+bias+activation, backward data/filter/bias, "
    "activation, pooling) give the reference engine's results",
    "algorithm choice, workspace sizes and autotuning (they need a cuDNN handle)",
    "the custom CUDA kernels' results (activations, loss, optimizers): without a GPU "
    "they can only be compiled",
    "float16/bfloat16 tensor-core paths and TF32",
    "the fused optimizers and CUDA-graph capture of a training step",
)
#: Listed as not checked where the kernels' compile was skipped (--no-kernels).
NO_KERNELS = "the custom CUDA kernels' NVRTC compile (--no-kernels)"


def run(cpu_only: bool = False, kernels: bool = True) -> Report:
    """Run every check this machine allows and return the report (never raises)."""
    report = Report()
    report.problems.extend(install.static_problems(environment.driver_version()))
    load_error = None
    try:
        path, lib, problems = install.load_binding()
    except Exception as exc:  # an unforeseen way to break: still a named problem
        path, lib, problems = None, None, []
        load_error = f"{type(exc).__name__}: {exc}"
        report.problems.append(Problem(f"loading cuDNN failed unexpectedly ({load_error})",
                                       "reinstall the GPU wheels (pip install "
                                       "--force-reinstall cupy-cuda12x nvidia-cudnn-cu12, or "
                                       "the cu13 pair), then rerun selfcheck"))
    report.problems.extend(problems)
    report.environment = environment.collect(path, lib, load_error)

    reason = gpu_unavailable_reason()
    gpu_usable = reason is None  # what the binding's checks expect of cudnnCreate
    if reason is None and cpu_only:  # (a GPU is usable, but the user asked us not to use it)
        reason = "GPU checks skipped (--cpu-only)"
    report.gpu_reason = reason
    if reason is not None:
        report.not_checked = list(GPU_ONLY)

    checks = report.checks
    checks.append(run_check("binding", "libcudnn and convfuse._cudnn load",
                            lambda: cpu_checks.library_loaded(path, lib)))
    if lib is not None:
        for name, fn in cpu_checks.binding_checks(lib, gpu=gpu_usable):
            checks.append(run_check("binding", name, fn))
    else:
        checks.append(CheckResult("binding", "descriptors, shape rules, plans", SKIP,
                                  "need convfuse._cudnn (see install problems)"))
    if kernels:
        checks.append(run_check("kernels", "CUDA kernels compile (NVRTC)",
                                cpu_checks.kernels_compile))
    else:
        report.not_checked.append(NO_KERNELS)
    for name, fn in reference_checks.REFERENCE_CHECKS:
        checks.append(run_check("reference", name, fn))
    if reason is None and lib is not None:  # pragma: gpu
        from .gpu_suite import run_gpu_checks

        checks.extend(run_gpu_checks())
    elif reason is None:  # pragma: gpu
        report.gpu_reason = "the cuDNN binding did not load, so no GPU check ran"
        report.not_checked[:0] = ["every GPU check: the cuDNN binding did not load",
                                  *GPU_ONLY]
    return report


def gpu_unusable_reason() -> str | None:
    """None when convfuse can run on a GPU here, else a sentence saying why not, with the
    fix: no usable CUDA device (convfuse.backend.gpu_unavailable_reason), or an install the
    GPU path cannot use (the problems `selfcheck` names: mismatched or doubled wheels, a
    driver too old for them, libcudnn or convfuse._cudnn that do not load, a cuDNN major
    the binding was not built for). Nothing runs on the device. A script choosing its
    device asks this rather than gpu_available(): with a GPU but a broken install, the
    first layer call would raise CudnnLoadError where the CPU engine would have run."""
    reason = gpu_unavailable_reason()
    if reason is not None:
        return reason
    problems = install.static_problems(environment.driver_version())
    if not problems:
        try:
            problems = install.load_binding()[2]
        except Exception as exc:  # as run() does: an unforeseen way to break, still named
            return f"loading cuDNN failed unexpectedly ({type(exc).__name__}: {exc})"
    if not problems:
        return None
    first = problems[0]
    more = (f" (and {len(problems) - 1} more problem(s): run `convfuse selfcheck`)"
            if len(problems) > 1 else "")
    return f"the GPU install is broken: {first.what}{more}; fix: {first.fix}"


def selfcheck(json_path: str | None = None, out: TextIO | None = None,
              cpu_only: bool = False, kernels: bool = True) -> int:
    """Run, print the text report to `out` (stdout), write JSON if asked; the exit code."""
    out = out or sys.stdout
    report = run(cpu_only=cpu_only, kernels=kernels)
    failed = None
    if json_path:  # first: a closed or broken stdout must not cost the file
        try:
            report.write_json(json_path)
        except OSError as exc:  # and a failed write must not cost the text (a full disk)
            failed = OSError(exc.errno, f"could not write the JSON report to {json_path!r}: "
                                        f"{exc.strerror or exc}")
    try:
        write_text(report, out)
        if json_path and failed is None:
            out.write(f"Full report written to {json_path}\n")
    except BrokenPipeError:  # `| head`: the reader left; the checks' verdict still counts
        pass
    if failed is not None:
        raise failed
    return report.exit_code


__all__ = ["GPU_ONLY", "NO_KERNELS", "Report", "gpu_unusable_reason", "run", "selfcheck"]
