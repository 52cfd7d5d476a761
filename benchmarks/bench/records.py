"""One JSON-able record per measured case, and the context every section receives."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .engine import Engine
from .peaks import Peaks
from .timing import UNSTABLE_RATIO_SPREAD, Budget, Stats, Timer, measure_interleaved


@dataclass
class Context:
    engine: Engine
    peaks: Peaks
    quick: bool
    budget: Budget
    seed: int
    log: Callable[[str], None]
    torch: Any = None  # torch_cmp.TorchSide, or None
    torch_note: str = ""
    precisions: tuple[str, ...] = ("fp32", "tf32", "fp16", "bf16")
    layouts: tuple[str, ...] = ("NCHW", "NHWC")
    # fused forward medians by (case, precision, layout), for backward/forward ratios
    forward_medians: dict[tuple[str, str, str], float] = field(default_factory=dict)
    # the running section's finished records (`guarded` adds each), which a time cap's
    # interrupt streams as the section's cut result
    finished: list[dict[str, Any]] = field(default_factory=list)
    # a time cap's interrupt the running section caught itself, keeping what it measured
    # (host-overhead's ResNet rows): its streamed line is marked cut all the same
    interrupted: bool = False

    def time(self, fn: Callable[[int], Any], n_sets: int) -> Stats:
        return measure_interleaved({"only": (self.engine.timer, fn)}, n_sets,
                                   self.budget)["only"]

    def time_many(self, forms: dict[str, Callable[[int], Any] | tuple[Timer, Callable]],
                  n_sets: int) -> dict[str, Stats]:
        """Time compared forms interleaved (Note [spread and unstable figures], timing.py);
        a bare callable runs under the engine's timer."""
        full = {k: (v if isinstance(v, tuple) else (self.engine.timer, v))
                for k, v in forms.items()}
        return measure_interleaved(full, n_sets, self.budget)


def new(section: str, case: str, **fields: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {"section": section, "case": case, "status": "ok"}
    rec.update(fields)
    rec.setdefault("timings", {})
    rec.setdefault("checks", [])
    rec.setdefault("ratios", {})
    rec.setdefault("roofline", {})
    rec.setdefault("notes", [])
    rec.setdefault("ratio_intervals", {})
    return rec


def skip(rec: dict[str, Any], reason: str) -> dict[str, Any]:
    rec["status"] = "skipped"
    rec["reason"] = reason
    return rec


def fail(rec: dict[str, Any], exc: BaseException) -> dict[str, Any]:
    rec["status"] = "error"
    rec["reason"] = f"{type(exc).__name__}: {exc}"
    rec["traceback"] = traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:]
    return rec


def guarded(ctx: Context, rec: dict[str, Any], label: str, measure: Callable[[], None],
            flags: Any = None) -> dict[str, Any]:
    """Run one case's measurement: an exception marks the record failed instead of ending
    the run, the engine's buffers are released either way, and the outcome is logged."""
    try:
        if flags is None:
            measure()
        else:
            with flags:
                measure()
    except Exception as exc:
        fail(rec, exc)
    finally:
        ctx.engine.release()
    ctx.finished.append(rec)  # before the log line: a cut right after it keeps this case
    ctx.log(f"{label}: {rec['status']}{_medians(rec)}")
    return rec


def _medians(rec: dict[str, Any]) -> str:
    """' [form median, ...]' for the log line: a run killed inside C code (SIGKILL after a
    hang) writes no JSON, and the log is then all that keeps the measured numbers."""
    timings = rec.get("timings") or {}
    parts = [f"{form} {t['median_s'] * 1e6:.4g} us" for form, t in timings.items()
             if isinstance(t, dict) and isinstance(t.get("median_s"), (int, float))]
    return f" [{', '.join(parts)}]" if parts else ""


def check_failed(rec: dict[str, Any], why: str) -> dict[str, Any]:
    rec["status"] = "check_failed"
    rec["reason"] = f"outputs disagree, so nothing was timed: {why}"
    return rec


def put_flags(rec: dict[str, Any]) -> None:
    """The flags convfuse's calls ran with (its own combined with a framework's switches,
    convfuse.config.get()): a row's label names its intended precision, this its actual."""
    import convfuse as cf

    flags = cf.config.get()
    rec["flags_in_force"] = {"allow_tf32": flags.allow_tf32, "benchmark": flags.benchmark,
                             "deterministic": flags.deterministic}


def put_timing(rec: dict[str, Any], name: str, stats: Stats) -> None:
    rec["timings"][name] = stats.to_json()


def median(rec: dict[str, Any], name: str) -> float | None:
    t = rec["timings"].get(name)
    return None if t is None else t["median_s"]


def ratio(rec: dict[str, Any], label: str, num: str, den: str) -> None:
    """The ratio of medians, and its interval and flag (Note [spread and unstable figures])."""
    a, b = rec["timings"].get(num), rec["timings"].get(den)
    if a is None or b is None or not b["median_s"]:
        return
    r = a["median_s"] / b["median_s"]
    rec["ratios"][label] = r
    if "ci_low_s" in a and "ci_low_s" in b and b["ci_low_s"] > 0:
        lo, hi = a["ci_low_s"] / b["ci_high_s"], a["ci_high_s"] / b["ci_low_s"]
        rec.setdefault("ratio_intervals", {})[label] = {
            "low": lo, "high": hi, "spread": (hi - lo) / r,
            "unstable": (hi - lo) / r > UNSTABLE_RATIO_SPREAD}


def put_floor(rec: dict[str, Any], work: Any, floor_s: float, precision_key: str,
              forms: tuple[str, ...]) -> None:
    """Record the work, the floor, and floor/time (the fraction of roofline) per form."""
    rec["work"] = {"flops": work.flops, "bytes": work.bytes, "peak_key": precision_key}
    rec["floor_s"] = floor_s
    for form in forms:
        t = median(rec, form)
        if t:
            rec["roofline"][form] = floor_s / t
