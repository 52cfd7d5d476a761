"""The GPU part of the selfcheck: every case of gpu_checks.py, gpu_training.py and
gpu_batchnorm.py for every dtype the device supports with TF32 off; the float32 convolution
cases again with TF32 at its default (on, as in PyTorch); and a report of which forward path
each plan took."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

from .. import config
from .gpu_arrays import supported_dtypes
from .gpu_batchnorm import BATCHNORM_CASES
from .gpu_checks import OP_CASES
from .gpu_training import TRAINING_CASES
from .report import PASS, CheckResult
from .runner import Outcome, run_check

Cases = tuple[tuple[str, Callable[[str], Outcome]], ...]


def tf32_cases() -> Cases:
    """The float32 convolution op cases, run again with TF32 at its default."""
    return tuple((f"{name} (TF32 default)", fn) for name, fn in OP_CASES
                 if name.startswith("conv_"))


def run_gpu_checks(cases: Cases | None = None,
                   tf32: Cases | None = None) -> list[CheckResult]:  # pragma: gpu
    """Run `cases` (default: every case) for every dtype this device supports with TF32
    off, then `tf32` (default: tf32_cases() when `cases` is the default, else none) in
    float32 with TF32 allowed; the full run ends with the forward-path report."""
    import cupy as cp

    from ..plan import FusedFallbackWarning

    full = cases is None
    if tf32 is None:
        tf32 = tf32_cases() if full else ()
    results = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", FusedFallbackWarning)
        with config.flags(allow_tf32=False):
            for name, fn in cases or (*OP_CASES, *TRAINING_CASES, *BATCHNORM_CASES):
                for dtype in supported_dtypes(cp):
                    fixed = getattr(fn, "dtypes", None)
                    if fixed is not None and dtype not in fixed:
                        continue
                    results.append(run_check("gpu", name,
                                             functools.partial(_synced, cp, fn, dtype), dtype))
        with config.flags(allow_tf32=True):
            for name, fn in tf32:
                results.append(run_check("gpu", name,
                                         functools.partial(_synced, cp, fn, "float32"),
                                         "float32"))
    fallbacks = [w for w in seen if issubclass(w.category, FusedFallbackWarning)]
    for w in seen:  # the others were not ours to swallow
        if w not in fallbacks:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if full:
        results.append(forward_path_report(len(fallbacks)))
    return results


def forward_path_report(fallback_warnings: int) -> CheckResult:
    """Informational: how many plans ran the fused call and which ran unfused, and why
    (ForwardPath in plan/choice.py). Never fails: cuDNN may refuse legitimately."""
    from ..plan import forward_paths

    paths = forward_paths()
    fused = sum(p.path == "fused" for _, p in paths)
    unfused = [(d, p) for d, p in paths if p.path == "unfused"]
    detail = f"{fused} plan(s) fused, {len(unfused)} unfused; {fallback_warnings} " \
             "FusedFallbackWarning(s)"
    if unfused:
        detail += "; unfused: " + "; ".join(
            f"{d} ({p.reason}" + (f", fused {p.fused_ms:.3f} ms vs unfused "
                                  f"{p.unfused_ms:.3f} ms" if p.reason == "timed" else "")
            + ")" for d, p in unfused)
    return CheckResult("gpu", "fused forward paths", PASS, detail)


def _synced(cp: Any, fn: Callable[[str], Outcome], dtype: str) -> Outcome:  # pragma: gpu
    """Run a case and wait for the device, so an asynchronous fault lands on this case.
    Every allocation inside it starts as NaN (all bits set: NaN in every float dtype), so
    an output the engine leaves partly unwritten cannot pass on an earlier case's identical
    values that the pool handed back."""
    with cp.cuda.using_allocator(_nan_filled(cp)):
        out = fn(dtype)
    cp.cuda.get_current_stream().synchronize()
    return out


def _nan_filled(cp: Any) -> Callable[[int], Any]:  # pragma: gpu
    pool_malloc = cp.get_default_memory_pool().malloc

    def malloc(nbytes: int) -> Any:
        mem = pool_malloc(nbytes)
        if nbytes:  # on the current stream: ordered before whatever the caller writes
            cp.cuda.runtime.memsetAsync(mem.ptr, 0xFF, nbytes,
                                        cp.cuda.get_current_stream().ptr)
        return mem

    return malloc
