"""Bias gradient: three paths on the same dy, and which one the library should default to.

- cudnn:   cudnnConvolutionBackwardBias (after a separate activation backward for relu);
- generic: the array library's dz.sum(axis=...) (after the same activation backward);
- fused:   convfuse's activation-backward + bias-gradient kernel, which reads dy and the
           saved output once and writes dz and db (convfuse.config bias_grad="fused").
With identity there is no activation backward, and every path is a pure reduction.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from convfuse import config, ops

from . import cases, checks, records, roofline, unfused
from .cases import BiasCase, Precision
from .records import Context

PATHS = ("cudnn", "generic", "fused")
# The fused kernel must beat cuDNN's by this much (geometric mean) to move the default.
SWITCH_MARGIN = 0.95


def run(ctx: Context) -> list[dict[str, Any]]:
    out = []
    precisions = [p for p in cases.BIAS_PRECISIONS if p in ctx.precisions]
    for case in cases.bias_cases(ctx.quick, not ctx.engine.is_gpu):
        for pname in precisions:
            for layout in ctx.layouts:
                for act in cases.BIAS_ACTIVATIONS:
                    out.append(run_one(ctx, case, cases.PRECISIONS[pname], layout, act))
    return out


def run_one(ctx: Context, case: BiasCase, prec: Precision, layout: str,
            act: str) -> dict[str, Any]:
    rec = records.new("biasgrad", case.name, precision=prec.name, layout=layout,
                      shape=case.describe(), origin=case.origin, scaled_from=case.scaled_from,
                      activation=act)
    if not ctx.engine.is_gpu:
        reason, note = cases.cpu_skip_reason(prec, ctx.quick), cases.cpu_note(prec)
        if note:
            rec["notes"].append(note)
        if reason:
            return records.skip(rec, reason)
    return records.guarded(ctx, rec, f"biasgrad {case.name} {act} {prec.name} {layout}",
                           lambda: _measure(ctx, case, prec, layout, act, rec))


def _inputs(ctx: Context, shape: tuple[int, ...], dtype: str, act: str, seed: int) -> dict:
    eng = ctx.engine
    dy = eng.uniform(shape, dtype, seed)
    if act == "identity":
        return {"dy": dy, "y": None}
    # a relu output: about half exact zeros, the rest positive
    return {"dy": dy, "y": eng.xp.maximum(eng.uniform(shape, dtype, seed + 1), 0)}


def _measure(ctx: Context, case: BiasCase, prec: Precision, layout: str, act: str,
             rec: dict) -> None:
    eng, xp = ctx.engine, ctx.engine.xp
    geom = case.geometry(layout)
    shape = case.shape(layout)
    work = roofline.bias_grad(shape, case.k, prec.dtype, act)
    n_sets = eng.rotation((2 if act == "identity" else 3) * math.prod(shape)
                          * roofline.itemsize(prec.dtype))
    sets = [_inputs(ctx, shape, prec.dtype, act, ctx.seed + 10 * i) for i in range(n_sets)]
    rec["input_sets"] = n_sets

    def dz_of(s: dict) -> Any:
        return s["dy"] if act == "identity" else ops.activation_backward(s["dy"], s["y"], act)

    def cudnn(i: int) -> Any:
        dz = dz_of(sets[i])
        return dz, ops.conv_backward_bias(dz, geom)

    def generic(i: int) -> Any:
        dz = dz_of(sets[i])
        return dz, unfused.bias_grad_generic(xp, dz, geom)

    def fused(i: int) -> Any:
        s = sets[i]
        return ops.activation_backward_bias(s["dy"], s["y"], act, geom)

    fns = {"cudnn": (cudnn, "cudnn"), "generic": (generic, "cudnn"), "fused": (fused, "fused")}
    rec["checks"].extend(_checks(ctx, sets[0], act, geom, prec, fns, rec["notes"]))
    if not checks.all_ok(rec["checks"]):
        records.check_failed(rec, checks.failures(rec["checks"]))
        return
    timer = ctx.engine.timer
    stats = ctx.time_many({path: (_FlagTimer(timer, flag), _under(fn, flag))
                           for path, (fn, flag) in fns.items()}, n_sets)
    for path, st in stats.items():
        records.put_timing(rec, path, st)
    medians = {p: records.median(rec, p) for p in fns}
    rec["winner"] = min(medians, key=medians.__getitem__)
    records.ratio(rec, "fused/cudnn", "fused", "cudnn")
    records.ratio(rec, "generic/cudnn", "generic", "cudnn")
    records.put_floor(rec, work, ctx.peaks.floor(work, prec.name), prec.name, PATHS)


class _FlagTimer:
    """The engine's timer with config bias_grad set to one path's flag around each sample.

    Switching flags costs microseconds of host time (a new Flags snapshot), the size of a
    small case's whole call: switched inside the timed region it would add the same
    constant to every path and pull their ratios towards 1. Set here, outside the sample,
    the timed calls (`_under`) find the flag in force and only compare it."""

    def __init__(self, timer: Any, flag: str) -> None:
        self.timer, self.flag, self.kind = timer, flag, timer.kind

    def sync(self) -> None:
        self.timer.sync()

    def sample(self, fn: Any, n_sets: int, start: int, reps: int, **kw: Any) -> list[float]:
        with config.flags(bias_grad=self.flag):
            return self.timer.sample(fn, n_sets, start, reps, **kw)


def _under(fn: Any, flag: str) -> Any:
    """fn under config bias_grad=flag: a comparison where _FlagTimer set it (every timed
    call), a switch where not (the warm-up calls)."""
    def timed(i: int) -> Any:
        if config.get().bias_grad == flag:
            return fn(i)
        with config.flags(bias_grad=flag):
            return fn(i)
    return timed


def _checks(ctx: Context, s: dict, act: str, geom: Any, prec: Precision, fns: dict,
            notes: list[str]) -> list:
    """Every path's db (and dz) against float64 sums of the same dy on the host.

    The generic path is the array library's, not convfuse's: should the library be unable
    to reduce this dtype, that path is dropped with a note (and `fns` loses it).
    """
    eng = ctx.engine
    dy64 = eng.to_host(s["dy"]).astype(np.float64)
    dz64 = dy64 if act == "identity" else np.where(eng.to_host(s["y"]) > 0, dy64, 0.0)
    db64 = dz64.sum(axis=geom.reduce_axes)
    out = []
    for path, (fn, flag) in list(fns.items()):
        try:
            with config.flags(bias_grad=flag):
                dz, db = fn(0)
        except Exception as exc:
            if path != "generic":
                raise
            notes.append(f"generic path not measured: {type(exc).__name__}: {exc}")
            del fns[path]
            continue
        out.append(checks.compare(f"{path} db vs float64 sum", eng.to_host(db), db64, prec.tol))
        if act != "identity":
            out.append(checks.compare(f"{path} dz vs float64 relu'", eng.to_host(dz), dz64,
                                      prec.tol))
    return out


def recommendation(recs: list[dict[str, Any]], on_gpu: bool) -> dict[str, Any]:
    """Which bias_grad default the measurements support (GPU runs only), and why.

    Only activations other than identity count: the switch chooses how
    activation_backward_bias works, while a layer without an activation always takes
    conv_backward_bias, which is cuDNN's call (the identity rows show how that call fares).
    """
    current = config.Flags().bias_grad
    timed = [r for r in recs if r["section"] == "biasgrad" and r["status"] == "ok"]
    governed = [r for r in timed if r["activation"] != "identity"]
    wins = {p: sum(r.get("winner") == p for r in governed) for p in PATHS}
    summary: dict[str, Any] = {"config_default": current, "cases_timed": len(timed),
                               "cases_governed_by_switch": len(governed), "wins": wins,
                               "geomean_fused_over_cudnn": {}, "geomean_generic_over_cudnn": {}}
    for act in cases.BIAS_ACTIVATIONS:
        for key, name in (("fused/cudnn", "geomean_fused_over_cudnn"),
                          ("generic/cudnn", "geomean_generic_over_cudnn")):
            # a ratio is missing where a path's check dropped it (a failed form)
            ratios = [r["ratios"][key] for r in timed
                      if r["activation"] == act and r.get("ratios", {}).get(key) is not None]
            if ratios:
                summary[name][act] = _geomean(ratios)
    summary["recommendation"] = None
    if not on_gpu:
        summary["text"] = ("no recommendation: CPU timings of the reference engine cannot "
                           f"choose a GPU default (config default stays {current!r})")
        return summary
    if not governed:
        summary["text"] = "no recommendation: no case with an activation was timed"
        return summary
    overall = _geomean([r["ratios"]["fused/cudnn"] for r in governed])
    choice = "fused" if overall < SWITCH_MARGIN else "cudnn"
    verdict = ("matches" if choice == current else "CHANGE") + f" the config default {current!r}"
    text = (f"recommend bias_grad={choice!r} ({verdict}): fused/cudnn geometric mean "
            f"{overall:.2f} over {len(governed)} cases with an activation; wins cudnn "
            f"{wins['cudnn']}, fused {wins['fused']}, generic {wins['generic']}")
    if wins["generic"]:
        text += ("; the generic reduction won some cases, but the library never uses one "
                 "(DESIGN): improve the fused kernel instead")
    identity = summary["geomean_generic_over_cudnn"].get("identity")
    if identity is not None and identity < SWITCH_MARGIN:
        text += (f". Layers without an activation always use cuDNN's bias call, which a plain "
                 f"sum beats (generic/cudnn {identity:.2f}): the switch cannot help them")
    summary["recommendation"], summary["text"] = choice, text
    return summary


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))
