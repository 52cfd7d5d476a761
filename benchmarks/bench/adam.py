"""Optimizer: convfuse's fused Adam (one kernel over the flat buffer) against the same
update as separate array operations, and torch.optim.Adam(fused=True) when available.

Adam's floor is memory: read p, g, m, v and write p, m, v, 28 bytes per fp32 parameter.
"""

from __future__ import annotations

from typing import Any

import convfuse as cf

from . import cases, checks, records, roofline, unfused
from .records import Context

LR = 1e-3


def run(ctx: Context) -> list[dict[str, Any]]:
    return [run_one(ctx, n) for n in cases.adam_sizes(ctx.quick, not ctx.engine.is_gpu)]


def run_one(ctx: Context, n: int) -> dict[str, Any]:
    rec = records.new("adam", f"adam {n / 1e6:g}M", params=n, precision="fp32",
                      shape=f"{n:,} fp32 parameters in one tensor")
    return records.guarded(ctx, rec, f"adam {n}", lambda: _measure(ctx, n, rec))


class _UnfusedState:
    def __init__(self, xp: Any, p: Any, g: Any) -> None:
        self.xp, self.p, self.g = xp, xp.array(p, copy=True), g
        self.m, self.v = xp.zeros_like(self.p), xp.zeros_like(self.p)
        self.t = 0

    def step(self) -> None:
        self.t += 1
        unfused.adam_step(self.xp, self.p, self.g, self.m, self.v, self.t, LR)


def _fused(xp: Any, p: Any, g: Any) -> tuple[Any, Any]:
    param = cf.Parameter(xp.array(p, copy=True), "p")
    param.grad[...] = g
    return param, cf.optim.Adam([param], lr=LR)


def _measure(ctx: Context, n: int, rec: dict) -> None:
    eng, xp = ctx.engine, ctx.engine.xp
    n_sets = eng.rotation(4 * 4 * n)  # p, g, m, v
    rec["input_sets"] = n_sets
    ps = [eng.uniform((n,), "float32", ctx.seed + 2 * i) for i in range(n_sets)]
    gs = [eng.uniform((n,), "float32", ctx.seed + 2 * i + 1, -1e-2, 1e-2) for i in range(n_sets)]
    fused = [_fused(xp, p, g) for p, g in zip(ps, gs)]
    slow = [_UnfusedState(xp, p, g) for p, g in zip(ps, gs)]

    # One step from the same state: the updates (not just the parameters) must agree.
    p0 = eng.to_host(ps[0]).astype("float64")
    fused[0][1].step()
    slow[0].step()
    delta_f = eng.to_host(fused[0][0].data).astype("float64") - p0
    delta_u = eng.to_host(slow[0].p).astype("float64") - p0
    rec["checks"].append(checks.compare("fused vs unfused update", delta_f, delta_u, 1e-3))
    if not checks.all_ok(rec["checks"]):
        records.check_failed(rec, checks.failures(rec["checks"]))
        return
    forms: dict[str, Any] = {"fused": lambda i: fused[i][1].step(),
                             "unfused": lambda i: slow[i].step()}
    try:
        if ctx.torch is not None:
            try:
                form = ctx.torch.adam(ctx, ps, gs, LR, delta_f, rec)
                if form is not None:
                    forms["torch"] = form
            except Exception as exc:  # PyTorch's own failure is a note, not a convfuse error
                rec["notes"].append(f"PyTorch: {type(exc).__name__}: {exc}")
        for name, st in ctx.time_many(forms, n_sets).items():
            records.put_timing(rec, name, st)
    finally:
        if ctx.torch is not None:
            ctx.torch.release()
    records.ratio(rec, "fused/unfused", "fused", "unfused")
    records.ratio(rec, "convfuse/pytorch", "fused", "torch")
    work = roofline.adam(n)
    records.put_floor(rec, work, ctx.peaks.floor(work, "fp32"), "fp32",
                      ("fused", "unfused", "torch"))
    for form in ("fused", "unfused", "torch"):
        t = records.median(rec, form)
        if t:
            rec.setdefault("achieved_GBps", {})[form] = work.bytes / t / 1e9
