"""Layer backward: convfuse's full backward (dz, db, dw, dx) and its ratio to the forward.

Physics says about 2: the data and filter gradients are each a convolution of the
forward's size. The bias-gradient path is whatever convfuse.config holds (recorded).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from convfuse import config, functional, ops

from . import checks, forward, records, roofline
from .cases import LayerCase, Precision
from .records import Context

# On the GPU, dx and dw are also checked against the NumPy reference engine when the
# layer is small enough for the host to compute them quickly.
REFERENCE_FLOPS_LIMIT = 2e9
# Random probes of the adjoint check of dx and dw (checks.adjoint), at every layer size.
ADJOINT_PROBES = 4


def run(ctx: Context) -> list[dict[str, Any]]:
    return forward.each_layer_case(ctx, run_one)


def run_one(ctx: Context, case: LayerCase, prec: Precision, layout: str) -> dict[str, Any]:
    rec = records.new("backward", case.name, precision=prec.name, layout=layout,
                      shape=case.describe(), origin=case.origin, scaled_from=case.scaled_from,
                      activation=case.activation, residual=case.residual,
                      bias_grad=config.get().bias_grad)
    reason, note = forward.precision_skip(ctx, prec)
    if note:
        rec["notes"].append(note)
    if reason:
        return records.skip(rec, reason)
    return records.guarded(ctx, rec, f"backward {case.name} {prec.name} {layout}",
                           lambda: _measure(ctx, case, prec, layout, rec), prec.flags())


def _measure(ctx: Context, case: LayerCase, prec: Precision, layout: str, rec: dict) -> None:
    if ctx.torch is not None:  # before either side plans anything
        ctx.torch.set_precision(prec.allow_tf32)
    eng = ctx.engine
    geom = case.geometry(layout)
    act = case.activation
    ws = forward.input_bytes(case, layout, prec.dtype) * 3  # + dy, saved y, and dw
    n_sets = eng.rotation(ws)
    rec["input_sets"] = n_sets
    sets, contexts, dys = [], [], []
    for i in range(n_sets):
        s = forward.make_inputs(ctx, case, layout, prec.dtype, ctx.seed + 10 * i)
        _, fctx = functional.conv_bias_act_forward(
            s["x"], s["w"], s["b"], activation=act, residual=s["z"], geom=geom)
        sets.append(s)
        contexts.append(fctx)
        dys.append(eng.uniform(geom.output_shape, prec.dtype, ctx.seed + 10 * i + 7))

    def backward(i: int) -> Any:
        return functional.conv_bias_act_backward(dys[i], contexts[i])

    grads = backward(0)
    rec["checks"].extend(_checks(ctx, case, prec, sets[0], dys[0], contexts[0], grads))
    if not checks.all_ok(rec["checks"]):
        records.check_failed(rec, checks.failures(rec["checks"]))
        return
    timed = ctx.time(backward, n_sets)
    after = backward(0)  # the timed calls' path, which the first call may not have taken
    for name in ("dx", "dweight", "dbias"):
        rec["checks"].append(checks.compare(f"{name} after timing vs the first call",
                                            eng.to_host(getattr(after, name)),
                                            eng.to_host(getattr(grads, name)), prec.tol))
    if not checks.all_ok(rec["checks"]):
        records.check_failed(rec, checks.failures(rec["checks"]))
        return
    records.put_flags(rec)  # as the timed calls found them
    records.put_timing(rec, "backward", timed)

    key = (case.name, prec.name, layout)
    if key not in ctx.forward_medians:  # the forward section did not run: time it here
        def fwd(i: int) -> Any:
            s = sets[i]
            return ops.conv_bias_act(s["x"], s["w"], s["b"], geom, activation=act,
                                     residual=s["z"])
        ctx.forward_medians[key] = ctx.time(fwd, n_sets).median
    rec["forward_median_s"] = ctx.forward_medians[key]
    rec["ratios"]["backward/forward"] = records.median(rec, "backward") / rec["forward_median_s"]
    work = roofline.conv_backward(geom, prec.dtype, act, bias=True, need_dx=True)
    records.put_floor(rec, work, ctx.peaks.floor(work, prec.name), prec.name, ("backward",))


def _checks(ctx: Context, case: LayerCase, prec: Precision, inputs: dict, dy: Any,
            fctx: Any, grads: Any) -> list[dict]:
    """db against a float64 sum of dz on the host; every gradient finite and of the right
    shape; on the GPU, small layers' dx and dw against the NumPy reference engine."""
    eng = ctx.engine
    geom = fctx.geom
    dy64 = eng.to_host(dy).astype(np.float64)
    if case.activation == "relu":
        y64 = eng.to_host(fctx.saved).astype(np.float64)
        dz64 = np.where(y64 > 0, dy64, 0.0)
    else:
        dz64 = dy64
    out = [checks.compare("db vs float64 sum of dz", eng.to_host(grads.dbias),
                          dz64.sum(axis=geom.reduce_axes), prec.tol)]
    for name, got, shape in (("dx", grads.dx, geom.input_shape),
                             ("dw", grads.dweight, geom.weight_shape)):
        h = eng.to_host(got).astype(np.float64)
        finite = bool(np.isfinite(h).all())
        out.append({"what": f"{name} shape and finiteness", "ok": finite and h.shape == shape,
                    "all_finite": finite, "rel_err": 0.0, "tol": 0.0})
    # every layer, whatever its size: dx and dw against the convolution's adjoint
    # identities, through the forward convolution (checked against unfused and PyTorch)
    tol = max(prec.tol, 1e-3)
    for name, got, shape, image in (
            ("dx", grads.dx, geom.input_shape, lambda v: ops.conv_forward(v, inputs["w"], geom)),
            ("dw", grads.dweight, geom.weight_shape,
             lambda v: ops.conv_forward(inputs["x"], v, geom))):
        probes = []
        for j in range(ADJOINT_PROBES):
            v = eng.uniform(shape, prec.dtype, ctx.seed + 1000 + j)
            probes.append((eng.to_host(v), eng.to_host(image(v))))
        out.append(checks.adjoint(f"{name} by the adjoint identity", eng.to_host(got), dz64,
                                  probes, tol))
    if eng.is_gpu and geom.flops() <= REFERENCE_FLOPS_LIMIT:  # pragma: gpu
        # From the GPU's own dz (its relu mask), so that outputs rounding to either side of
        # zero on the two engines cannot make them disagree.
        dz32 = dz64.astype(np.float32)
        x32 = eng.to_host(inputs["x"]).astype(np.float32)
        w32 = eng.to_host(inputs["w"]).astype(np.float32)
        tol = max(prec.tol, 1e-3)
        out.append(checks.compare("dx vs reference engine", eng.to_host(grads.dx),
                                  ops.conv_backward_data(dz32, w32, geom), tol))
        out.append(checks.compare("dw vs reference engine", eng.to_host(grads.dweight),
                                  ops.conv_backward_filter(x32, dz32, geom), tol))
    return out
