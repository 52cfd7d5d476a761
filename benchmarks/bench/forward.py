"""Layer forward: one fused cuDNN call against conv + bias pass + (residual pass) + act pass."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from convfuse import ops

from . import cases, checks, records, roofline, unfused
from .cases import LayerCase, Precision
from .records import Context


def make_inputs(ctx: Context, case: LayerCase, layout: str, dtype: str, seed: int) -> dict:
    """x, w, b (and the residual z): uniform, scaled so the output is O(1), never zero."""
    eng = ctx.engine
    geom = case.geometry(layout)
    fan_in = (case.cin // case.groups) * case.kernel**2
    bound = math.sqrt(3.0 / fan_in)
    inputs = {
        "x": eng.uniform(geom.input_shape, dtype, seed),
        "w": eng.uniform(geom.weight_shape, dtype, seed + 1, -bound, bound),
        "b": eng.uniform((case.cout,), dtype, seed + 2, -0.5, 0.5),
        "z": eng.uniform(geom.output_shape, dtype, seed + 3) if case.residual else None,
    }
    return inputs


def input_bytes(case: LayerCase, layout: str, dtype: str) -> int:
    geom = case.geometry(layout)
    work = roofline.conv_forward(geom, dtype, case.activation, True, case.residual)
    # the output is written, not read: what a warm cache would serve is the inputs
    return work.bytes - math.prod(geom.output_shape) * roofline.itemsize(dtype)


def precision_skip(ctx: Context, prec: Precision) -> tuple[str | None, str | None]:
    """(reason to skip, note to attach) for this precision on this engine."""
    if ctx.engine.is_gpu:  # pragma: gpu
        return None, None
    return cases.cpu_skip_reason(prec, ctx.quick), cases.cpu_note(prec)


def each_layer_case(ctx: Context, run_one: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
    """run_one(ctx, case, precision, layout) over the layer table (shared with backward)."""
    return [
        run_one(ctx, case, cases.PRECISIONS[pname], layout)
        for case in cases.layer_cases(ctx.quick, not ctx.engine.is_gpu)
        for pname in ctx.precisions
        for layout in ctx.layouts
    ]


def run(ctx: Context) -> list[dict[str, Any]]:
    return each_layer_case(ctx, run_one)


def run_one(ctx: Context, case: LayerCase, prec: Precision, layout: str) -> dict[str, Any]:
    rec = records.new("forward", case.name, precision=prec.name, layout=layout,
                      shape=case.describe(), origin=case.origin, scaled_from=case.scaled_from,
                      activation=case.activation, residual=case.residual)
    reason, note = precision_skip(ctx, prec)
    if note:
        rec["notes"].append(note)
    if reason:
        return records.skip(rec, reason)
    return records.guarded(ctx, rec, f"forward {case.name} {prec.name} {layout}",
                           lambda: _measure(ctx, case, prec, layout, rec), prec.flags())


def _measure(ctx: Context, case: LayerCase, prec: Precision, layout: str, rec: dict) -> None:
    if ctx.torch is not None:  # before either side plans anything
        ctx.torch.set_precision(prec.allow_tf32)
    eng, xp = ctx.engine, ctx.engine.xp
    geom = case.geometry(layout)
    act = case.activation
    n_sets = eng.rotation(input_bytes(case, layout, prec.dtype))
    sets = [make_inputs(ctx, case, layout, prec.dtype, ctx.seed + 10 * i) for i in range(n_sets)]
    rec["input_sets"] = n_sets

    def fused(i: int) -> Any:
        s = sets[i]
        return ops.conv_bias_act(s["x"], s["w"], s["b"], geom, activation=act, residual=s["z"])

    def unfused_passes(i: int) -> Any:
        s = sets[i]
        return unfused.forward(xp, s["x"], s["w"], s["b"], geom, act, s["z"])

    y_fused = eng.to_host(fused(0)[0])
    y_unfused = eng.to_host(unfused_passes(0))
    rec["checks"].append(checks.compare("fused vs unfused y", y_fused, y_unfused, prec.tol))
    if not checks.all_ok(rec["checks"]):
        records.check_failed(rec, checks.failures(rec["checks"]))
        return
    forms: dict[str, Any] = {"fused": fused, "unfused": unfused_passes}
    if ctx.torch is not None:
        torch_form = _torch(ctx, case, prec, layout, sets, y_fused, rec)
        if torch_form is not None:
            forms["torch"] = torch_form
    try:
        stats = ctx.time_many(forms, n_sets)
    finally:
        if ctx.torch is not None:
            ctx.torch.release()
    # the timed calls may take another path than the checked first one (a plan's choice
    # made at its first call, a bound call): the last one is checked too
    rec["checks"].append(checks.compare("fused vs unfused y, after timing",
                                        eng.to_host(fused(0)[0]), y_unfused, prec.tol))
    if not checks.all_ok(rec["checks"]):
        records.check_failed(rec, checks.failures(rec["checks"]))
        return
    records.put_flags(rec)  # as the timed calls found them
    rec["forward_paths"] = _paths(geom, prec.dtype, case.residual)
    if rec["forward_paths"] and all(p["path"] != "fused" for p in rec["forward_paths"]):
        rec["notes"].append("'fused' ran unfused here (its plan's forward path: "
                            "forward_paths): fused/unfused compares two unfused forms")
    for name, st in stats.items():
        records.put_timing(rec, name, st)
    records.ratio(rec, "fused/unfused", "fused", "unfused")
    records.ratio(rec, "convfuse/pytorch", "fused", "torch")
    ctx.forward_medians[(case.name, prec.name, layout)] = records.median(rec, "fused")
    work = roofline.conv_forward(geom, prec.dtype, act, True, case.residual)
    records.put_floor(rec, work, ctx.peaks.floor(work, prec.name), prec.name,
                      ("fused", "unfused", "torch"))


def _paths(geom: Any, dtype: str, residual: bool) -> list[dict[str, Any]]:
    """The forward path (fused or unfused, and why) of this case's conv plans, by their
    keys (its geometry, dtype and residual; each plan's math type says which precision):
    autotuning may time the fused call slower than an unfused one for identity, and a
    refusal or an out-of-memory falls back (convfuse.plan.forward_paths)."""
    from dataclasses import asdict

    from convfuse import plan as plans
    from convfuse.dtypes import canonical

    want = canonical(dtype).name
    return [{"plan": p.describe(), "math_type": p.key.math_type, **asdict(p.forward_path)}
            # the cache's plans with their keys: forward_paths() gives descriptions only
            for p in plans._conv_plans.values()
            if p.forward_path is not None and p.key.geometry == geom
            and str(p.key.dtype) == want and p.key.residual == residual]


def _torch(ctx: Context, case: LayerCase, prec: Precision, layout: str, sets: list,
           y_fused: Any, rec: dict) -> Any:
    """PyTorch's form to time alongside, once its output agrees; None (with a note) if not."""
    host_sets = [{k: (None if v is None else ctx.engine.to_host(v)) for k, v in s.items()}
                 for s in sets]
    try:
        form, y_torch = ctx.torch.conv_forward(case, layout, prec, host_sets)
    except Exception as exc:  # PyTorch's own failure is a note, not a convfuse error
        rec["notes"].append(f"PyTorch: {type(exc).__name__}: {exc}")
        return None
    check = checks.compare("PyTorch vs fused y", y_torch, y_fused, prec.tol)
    rec["checks"].append(check)
    if not check["ok"]:
        rec["notes"].append("PyTorch output disagrees with convfuse; its time is not reported")
        return None
    rec["torch"] = ctx.torch.label
    return form
