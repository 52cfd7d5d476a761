"""What a selfcheck found, as a short text report and as JSON.

A report holds the environment, install problems, and one `CheckResult` per check. The
text form is meant to be pasted into a bug report; the JSON form keeps every number.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

PASS, FAIL, SKIP = "pass", "fail", "skip"

# Tolerances (relative to the largest reference magnitude) for GPU results against the
# float64 reference engine. float32 assumes config.allow_tf32=False (full FMA math).
TOLERANCES = {"float64": 1e-10, "float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}


@dataclass
class CheckResult:
    """One check: `error` is the measured relative error when the check compares numbers."""

    group: str
    name: str
    status: str
    detail: str = ""
    error: float | None = None
    tolerance: float | None = None
    dtype: str | None = None
    seconds: float = 0.0
    trace: str = ""  # the traceback of an unexpected exception; JSON only, never printed

    @property
    def failed(self) -> bool:
        return self.status == FAIL


@dataclass
class Problem:
    """A broken install: what is wrong and the command or step that fixes it."""

    what: str
    fix: str


@dataclass
class Report:
    environment: dict[str, Any] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    checks: list[CheckResult] = field(default_factory=list)
    gpu_reason: str | None = None  # why the GPU checks did not run; None when they did
    not_checked: list[str] = field(default_factory=list)

    @property
    def gpu_ran(self) -> bool:
        return self.gpu_reason is None

    @property
    def failures(self) -> list[CheckResult]:
        return [c for c in self.checks if c.failed]

    @property
    def ok(self) -> bool:
        return not self.problems and not self.failures

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def counts(self) -> dict[str, int]:
        out = {PASS: 0, FAIL: 0, SKIP: 0}
        for c in self.checks:
            out[c.status] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "exit_code": self.exit_code,
            "gpu_checks_ran": self.gpu_ran,
            "gpu_reason": self.gpu_reason,
            "counts": self.counts(),
            "environment": self.environment,
            "problems": [asdict(p) for p in self.problems],
            "checks": [_jsonable(asdict(c)) for c in self.checks],
            "not_checked": list(self.not_checked),
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN or infinity; a failed comparison may measure either.
    return {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in d.items()}


def fmt_error(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _table(rows: list[list[str]], out: TextIO, indent: str = "  ") -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")


def write_environment(env: dict[str, Any], out: TextIO) -> None:
    out.write("Environment\n")
    width = max(len(k) for k in env) if env else 0
    for key, value in env.items():
        out.write(f"  {key.ljust(width)}  {value}\n")


def write_problems(problems: list[Problem], out: TextIO) -> None:
    if not problems:
        return
    out.write("\nInstall problems\n")
    for p in problems:
        out.write(f"  PROBLEM: {p.what}\n    fix: {p.fix}\n")


def write_checks(title: str, checks: Iterable[CheckResult], out: TextIO) -> None:
    checks = list(checks)
    if not checks:
        return
    out.write(f"\n{title}\n")
    rows = [["result", "check", "error", "tol", "detail"]]
    for c in checks:
        rows.append([c.status.upper(), c.name, fmt_error(c.error), fmt_error(c.tolerance),
                     _one_line(c.detail)])
    _table(rows, out)


def write_gpu_matrix(checks: Iterable[CheckResult], out: TextIO) -> None:
    """One row per case, one column per dtype: the worst error of the case's sub-cases."""
    checks = [c for c in checks if c.group.startswith("gpu")]
    if not checks:
        return
    dtypes = [d for d in TOLERANCES if any(c.dtype == d for c in checks)]
    cases: dict[str, dict[str, list[CheckResult]]] = {}
    for c in checks:
        cases.setdefault(c.name, {}).setdefault(c.dtype or "-", []).append(c)
    out.write("\nGPU checks against the float64 reference (worst relative error per case)\n")
    rows = [["case", *dtypes, *(["other"] if any("-" in v for v in cases.values()) else [])]]
    for name, by_dtype in cases.items():
        cells = []
        for d in rows[0][1:]:
            key = "-" if d == "other" else d
            cells.append(_cell(by_dtype.get(key, [])))
        rows.append([name, *cells])
    _table(rows, out)
    for c in checks:
        if c.failed:
            out.write(f"  FAIL {c.name} [{c.dtype}]: {_one_line(c.detail)}\n")


def _cell(results: list[CheckResult]) -> str:
    if not results:
        return "n/a"
    if any(r.failed for r in results):
        worst = max((r.error for r in results if r.failed and r.error is not None), default=None)
        return f"FAIL {fmt_error(worst)}" if worst is not None else "FAIL"
    if all(r.status == SKIP for r in results):
        return "skip"
    errors = [r.error for r in results if r.error is not None]
    return f"ok {fmt_error(max(errors))}" if errors else "ok"


def _one_line(text: str, limit: int = 110) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def write_text(report: Report, out: TextIO) -> None:
    out.write("convfuse selfcheck\n\n")
    write_environment(report.environment, out)
    write_problems(report.problems, out)
    if report.gpu_reason is not None:
        out.write(f"\nGPU checks not run: {report.gpu_reason}.\n"
                  "Only the CPU-side checks ran; nothing below says a GPU result is right.\n")
    write_checks("CPU-side checks", (c for c in report.checks if not c.group.startswith("gpu")),
                 out)
    write_gpu_matrix(report.checks, out)
    if report.not_checked:
        out.write("\nNot checked here\n")
        for item in report.not_checked:
            out.write(f"  - {item}\n")
    n = report.counts()
    verdict = "PASS" if report.ok else "FAIL"
    scope = "CPU-side checks only" if report.gpu_reason is not None else "CPU and GPU checks"
    out.write(f"\nResult: {verdict} ({n[PASS]} passed, {n[FAIL]} failed, {n[SKIP]} skipped, "
              f"{len(report.problems)} install problem(s); {scope})\n")
