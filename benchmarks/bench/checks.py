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
