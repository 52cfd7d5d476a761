"""Agreement checks run before anything is timed: two forms that disagree are not compared.

Errors are measured in float64 on the host, relative to the largest magnitude of the
reference, so one tolerance per precision covers outputs of any scale.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def as_f64(a: Any) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def compare(what: str, got: Any, want: Any, tol: float) -> dict[str, Any]:
    """A JSON-able record: max |got - want| / max |want|, and whether it is within `tol`.

    Both arrays are host arrays; NaN or inf anywhere (an element never written) fails.
    """
    g, w = as_f64(got), as_f64(want)
    if g.shape != w.shape:
        return {"what": what, "ok": False, "error": f"shapes differ: {g.shape} vs {w.shape}"}
    finite = bool(np.isfinite(g).all() and np.isfinite(w).all())
    scale = float(np.abs(w).max()) if w.size else 0.0
    diff = float(np.abs(g - w).max()) if g.size and finite else float("nan")
    rel = diff / scale if scale > 0 else diff
    ok = finite and rel <= tol
    return {"what": what, "ok": ok, "max_abs_diff": diff, "scale": scale, "rel_err": rel,
            "tol": tol, "all_finite": finite}


def all_ok(checks: list[dict[str, Any]]) -> bool:
    return all(c.get("ok", False) for c in checks)


def failures(checks: list[dict[str, Any]]) -> str:
    bad = [c for c in checks if not c.get("ok", False)]
    return "; ".join(
        f"{c['what']}: " + (c["error"] if "error" in c else
                            f"rel err {c['rel_err']:.3g} > tol {c['tol']:.3g}"
                            + ("" if c["all_finite"] else " (non-finite values)"))
        for c in bad
    )



def adjoint(what: str, grad: Any, dz: Any, probes: list[tuple[Any, Any]],
            tol: float) -> dict[str, Any]:
    """A gradient g of the linear map L (x -> conv(x, w) for dx, w -> conv(x, w) for dw)
    against L's adjoint identity <g, v> = <dz, L(v)> for random probes v, given as pairs
    (v, L(v)) computed by the forward convolution (host arrays; inner products in
    float64). It holds for the true gradient at any size; a zero, scaled, stale or partly
    missing one (a batch part, a group, a kernel tap never written) breaks it for random
    v. The error is sqrt(sum (a_j - b_j)^2) / sqrt(sum max(a_j, b_j)^2) over the probes: a
    single probe's inner product may come out near zero by chance, all of them hardly."""
    g, d = as_f64(grad), as_f64(dz)
    finite = bool(np.isfinite(g).all())
    pairs = []
    for v, image in probes:
        im = as_f64(image)
        finite = finite and bool(np.isfinite(im).all())
        pairs.append((float(np.sum(g * as_f64(v))), float(np.sum(d * im))))
    err = sum((a - b) ** 2 for a, b in pairs) ** 0.5
    scale = sum(max(a * a, b * b) for a, b in pairs) ** 0.5
    rel = err / scale if scale > 0 else float("inf")
    return {"what": what, "ok": finite and rel <= tol, "rel_err": rel, "tol": tol,
            "all_finite": finite, "probes": pairs}
