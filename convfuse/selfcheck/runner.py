"""Running one check: timing it, and turning its outcome or exception into a CheckResult."""

from __future__ import annotations

import contextlib
import math
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .report import FAIL, PASS, SKIP, CheckResult


@dataclass
class Outcome:
    """What a passing check reports: a detail line and, if it compared numbers, the worst
    relative error it measured against its tolerance."""

    detail: str
    error: float | None = None
    tolerance: float | None = None


class CheckFailed(AssertionError):
    def __init__(self, detail: str, error: float | None = None,
                 tolerance: float | None = None) -> None:
        super().__init__(detail)
        self.detail, self.error, self.tolerance = detail, error, tolerance


class CheckSkipped(Exception):
    """The check cannot run here (e.g. it needs something an earlier failure explains)."""


def relative_error(got: Any, ref: Any) -> float:
    """max |got - ref| / max |ref|: normwise, so entries near zero do not dominate.

    A shape mismatch or a NaN/inf anywhere in `got` counts as an infinite error, which is
    how outputs poisoned with NaN and never written show up.
    """
    g = np.asarray(got, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    if g.shape != r.shape or not np.all(np.isfinite(g)):
        return math.inf
    if g.size == 0:
        return 0.0
    scale = float(np.max(np.abs(r)))
    diff = float(np.max(np.abs(g - r)))
    return diff / scale if scale > 0 else diff


class Worst:
    """The largest error over many comparisons; raises at the first one out of tolerance.
    Inside `attempt(what)`, cuDNN's refusal of one geometry (NOT_SUPPORTED, or no algorithm
    left) is recorded and the case goes on to the next: `outcome` then fails naming every
    refused geometry, with the worst error of the others (one refusal used to end the case
    and hide what the remaining geometries measured)."""

    def __init__(self, tolerance: float) -> None:
        self.tolerance = tolerance
        self.error = 0.0
        self.count = 0
        self.refused: list[str] = []

    @contextlib.contextmanager
    def attempt(self, what: str) -> Iterator[None]:
        from ..errors import CudnnError
        from ..plan.algorithms import NoAlgorithmError

        try:
            yield
        except (CudnnError, NoAlgorithmError) as err:
            if isinstance(err, CudnnError) and err.status // 1000 != 3:  # not a refusal
                raise
            self.refused.append(f"{what}: {type(err).__name__}: {err}"[:300])

    def compare(self, got: Any, ref: Any, what: str) -> float:
        err = relative_error(got, ref)
        self.record(err, what)
        return err

    def record(self, err: float, what: str) -> None:
        self.count += 1
        if not err <= self.tolerance:  # also catches NaN
            raise CheckFailed(f"{what}: relative error {err:.2e} > {self.tolerance:.0e}",
                              err, self.tolerance)
        self.error = max(self.error, err)

    def outcome(self, detail: str) -> Outcome:
        if self.refused:
            raise CheckFailed(
                f"cuDNN refused {len(self.refused)} geometr"
                f"{'y' if len(self.refused) == 1 else 'ies'}: " + "; ".join(self.refused)
                + f" (the other {self.count} results within {self.tolerance:.0e}, worst "
                f"{self.error:.2e})", self.error, self.tolerance)
        return Outcome(detail, self.error, self.tolerance)


def run_check(group: str, name: str, fn: Callable[[], Outcome], dtype: str | None = None
              ) -> CheckResult:
    """Run `fn`; any exception becomes a failed result naming it (never a traceback on
    screen: the traceback goes to the JSON report's `trace` field)."""
    start = time.perf_counter()
    try:
        out = fn()
    except CheckSkipped as exc:
        return CheckResult(group, name, SKIP, str(exc), dtype=dtype,
                           seconds=time.perf_counter() - start)
    except CheckFailed as exc:
        return CheckResult(group, name, FAIL, exc.detail, exc.error, exc.tolerance, dtype,
                           time.perf_counter() - start, traceback.format_exc())
    except Exception as exc:
        return CheckResult(group, name, FAIL, f"{type(exc).__name__}: {exc}", dtype=dtype,
                           seconds=time.perf_counter() - start, trace=traceback.format_exc())
    return CheckResult(group, name, PASS, out.detail, out.error, out.tolerance, dtype,
                       time.perf_counter() - start)
