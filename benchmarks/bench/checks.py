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


def adjoint(what: str, grad: Any, dz: Any, image: Any, tol: float) -> dict[str, Any]:
    """A gradient g of the linear map L (x -> conv(x, w) for dx, w -> conv(x, w) for dw)
    against L's adjoint identity <g, g> = <dz, L(g)>, `image` being L(g) computed by the
    forward convolution (host arrays; inner products in float64). It holds for the true
    gradient at any size, and fails for a zero, stale or wrong one (a zero g is refused
    outright: dz, x and w are random, so the true gradient is not zero)."""
    g, d, im = as_f64(grad), as_f64(dz), as_f64(image)
    finite = bool(np.isfinite(g).all() and np.isfinite(im).all())
    a, b = float(np.sum(g * g)), float(np.sum(d * im))
    scale = max(abs(a), abs(b))
    rel = abs(a - b) / scale if scale > 0 else float("inf")
    return {"what": what, "ok": finite and a > 0 and rel <= tol, "rel_err": rel, "tol": tol,
            "all_finite": finite, "norm_sq": a, "adjoint": b}
