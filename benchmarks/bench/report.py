"""The printed tables and the JSON file.

Times are medians in milliseconds with [min-max] of the repetitions and the spread of the
median (the relative width of its ~95% interval). Ratios are of medians, with their
interval's relative width: below 1 means the first-named form is faster. A trailing "!"
marks an unstable figure (Note [spread and unstable figures] in timing.py). "roofline" is
floor / median time: the fraction of the physical floor achieved (1 = at the floor).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

Column = tuple[str, Callable[[dict], str]]

SECTION_TITLES = {
    "forward": "Layer forward: fused vs unfused (conv, then bias, [residual] and act passes)",
    "backward": "Layer backward: convfuse's full backward vs its fused forward",
    "biasgrad": "Bias gradient: three paths on the same dy",
    "train": "Training step (digits net: forward, loss, backward, Adam)",
    "adam": "Optimizer: fused Adam vs separate array operations",
    "goals": "Goals of issue #14 (CPU engine against PyTorch CPU, same thread count)",
    "host-overhead": "Host time per call at tiny shapes, and ResNet-18 steps (issue #25)",
    "compile": "ResNet-18 training step: torch.compile(backend='convfuse') vs Inductor vs eager",
}

# What each form is on each engine: the CPU forms stand in for the GPU ones by name only.
FORMS = {
    "gpu": {
        "forward": "fused = ops.conv_bias_act: one cudnnConvolutionBiasActivationForward; "
                   "unfused = cudnnConvolutionForward, then CuPy passes: += bias, "
                   "+= residual, relu; PyTorch = F.conv2d(x, w, b), += z, relu_()",
        "backward": "convfuse.functional.conv_bias_act_backward (dz, db, dw, dx); "
                    "fwd = the fused forward above",
        "biasgrad": "cudnn = relu kernel + cudnnConvolutionBackwardBias; generic = the same "
                    "relu kernel + CuPy dz.sum(axis); fused = one act-backward + bias kernel "
                    "(with identity it still writes dz = dy: ops.activation_backward_bias "
                    "always returns dz)",
        "train": "fused = convfuse layers + CrossEntropyLoss + fused Adam; unfused = "
                 "cuDNN convolutions, CuPy passes, cuBLAS matmul, per-tensor CuPy Adam; graph "
                 "= the fused step as one CUDA graph",
        "adam": "fused = convfuse.optim.Adam (one kernel over the flat buffer); unfused = "
                "separate CuPy operations; PyTorch = torch.optim.Adam(fused=True)",
        "goals": "the goals are CPU goals: skipped on a GPU run",
        "host-overhead": "GPU: convfuse.torch vs torch.nn on CUDA tensors, host time per call "
                         "(perf_counter, no sync); ASPP in CUDA events; ResNet-18 steps eager "
                         "and as torch.cuda.graph replays",
        "compile": "convfuse = torch.compile(backend='convfuse'): convfuse's cuDNN ops for the "
                   "conv/BN chains, Inductor for the rest; inductor = torch.compile's default; "
                   "eager = torch.nn (channels_last, fp32)",
    },
    "cpu": {
        "forward": "CPU: fused = ops.conv_bias_act on the reference engine; unfused = its "
                   "conv_forward, then NumPy passes: += bias, += residual, relu",
        "backward": "CPU: the reference engine's conv_bias_act_backward",
        "biasgrad": "CPU: 'cudnn' = the reference engine's conv_backward_bias, 'fused' = its "
                    "activation_backward_bias, 'generic' = NumPy's sum (named for the GPU "
                    "paths they stand in for)",
        "train": "CPU: fused = convfuse layers on the reference engine; unfused = the same net "
                 "from reference-engine convolutions and NumPy passes",
        "adam": "CPU: fused = convfuse.optim.Adam's blocked, threaded NumPy pass; unfused = "
                "separate NumPy operations",
        "goals": "CPU: convfuse NumPy engine vs PyTorch CPU eager, interleaved, same thread "
                 "count; Adam against np.copyto bandwidth (256 MiB); full-size shapes "
                 "(not scaled down)",
        "host-overhead": "CPU, one thread each: convfuse.torch vs torch.nn eager (and "
                         "convfuse.Conv2d on NumPy vs torch.nn), us per call at tiny shapes, "
                         "interleaved; the ASPP conv forward+backward",
        "compile": "CPU: convfuse = torch.compile(backend='convfuse') with the NumPy reference "
                   "engine in the graph; inductor = torch.compile's default (C++); eager = "
                   "torch.nn on PyTorch's CPU kernels; batch 2 at 64x64",
    },
}


def _spread(t: dict) -> str:
    spread = t.get("spread")
    if spread is None:
        return ""
    return f" ±{50 * spread:.0f}%" + ("!" if t.get("unstable") else "")


def ms(rec: dict, form: str) -> str:
    t = rec["timings"].get(form)
    if t is None:
        return "-"
    return (f"{_num(t['median_s'] * 1e3)} [{_num(t['min_s'] * 1e3)}-"
            f"{_num(t['max_s'] * 1e3)}]{_spread(t)}")


def ms_only(rec: dict, form: str) -> str:
    t = rec["timings"].get(form)
    return "-" if t is None else _num(t["median_s"] * 1e3) + _spread(t)


def _num(x: float) -> str:
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    digits = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:.{digits}f}"


def ratio(rec: dict, key: str) -> str:
    r = rec["ratios"].get(key)
    if r is None:
        return "-"
    iv = rec.get("ratio_intervals", {}).get(key)
    if iv is None:
        return f"{r:.2f}"
    return f"{r:.2f} ±{50 * iv['spread']:.0f}%" + ("!" if iv["unstable"] else "")


def _goal_value(rec: dict) -> str:
    g = rec.get("goal", {})
    if "measured" not in g:
        return "-"
    return f"{g['measured']:.3g} [{g['low']:.3g}-{g['high']:.3g}]"


def _goal_met(rec: dict) -> str:
    g = rec.get("goal", {})
    if "met" not in g:
        return "-"
    return ("yes" if g["met"] else "NO") + (" (unstable)" if g.get("unstable") else "")


def us(rec: dict, form: str) -> str:
    t = rec["timings"].get(form)
    return "-" if t is None else _num(t["median_s"] * 1e6) + _spread(t)


def _steps(rec: dict) -> str:
    forms = ("convfuse_eager", "convfuse_graph", "torch_eager", "torch_graph")
    if not any(f in rec["timings"] for f in forms):
        return "-"
    return " ".join(ms_only(rec, f) for f in forms)


def frac(rec: dict, form: str) -> str:
    f = rec["roofline"].get(form)
    return "-" if f is None else f"{100 * f:.1f}%"


def floor_ms(rec: dict) -> str:
    f = rec.get("floor_s")
    return "-" if f is None else _num(f * 1e3)


def _best_roofline(rec: dict) -> str:
    best = max(rec["roofline"].values(), default=None)
    return "-" if best is None else f"{100 * best:.1f}%"


COLUMNS: dict[str, list[Column]] = {
    "forward": [
        ("case", lambda r: r["case"]), ("prec", lambda r: r["precision"]),
        ("layout", lambda r: r["layout"]), ("fused ms", lambda r: ms(r, "fused")),
        ("unfused ms", lambda r: ms(r, "unfused")),
        ("fused/unfused", lambda r: ratio(r, "fused/unfused")),
        ("PyTorch ms", lambda r: ms_only(r, "torch")),
        ("convfuse/PyTorch", lambda r: ratio(r, "convfuse/pytorch")),
        ("floor ms", floor_ms), ("roofline fused", lambda r: frac(r, "fused")),
        ("roofline unfused", lambda r: frac(r, "unfused")),
    ],
    "backward": [
        ("case", lambda r: r["case"]), ("prec", lambda r: r["precision"]),
        ("layout", lambda r: r["layout"]),
        ("fwd ms", lambda r: "-" if "forward_median_s" not in r
         else _num(r["forward_median_s"] * 1e3)),
        ("bwd ms", lambda r: ms(r, "backward")),
        ("bwd/fwd", lambda r: ratio(r, "backward/forward")),
        ("floor ms", floor_ms), ("roofline bwd", lambda r: frac(r, "backward")),
    ],
    "biasgrad": [
        ("dy", lambda r: f"{r['case']} {r['shape']}"), ("act", lambda r: r["activation"]),
        ("prec", lambda r: r["precision"]), ("layout", lambda r: r["layout"]),
        ("cudnn ms", lambda r: ms_only(r, "cudnn")),
        ("generic ms", lambda r: ms_only(r, "generic")),
        ("fused ms", lambda r: ms_only(r, "fused")), ("winner", lambda r: r.get("winner", "-")),
        ("fused/cudnn", lambda r: ratio(r, "fused/cudnn")),
        ("generic/cudnn", lambda r: ratio(r, "generic/cudnn")),
        ("floor ms", floor_ms), ("roofline best", _best_roofline),
    ],
    "train": [
        ("batch", lambda r: str(r["batch"])), ("fused ms", lambda r: ms(r, "fused")),
        ("unfused ms", lambda r: ms_only(r, "unfused")),
        ("graph ms", lambda r: ms_only(r, "graph")),
        ("torch eager ms", lambda r: ms_only(r, "torch_eager")),
        ("torch compile ms", lambda r: ms_only(r, "torch_compile")),
        ("fused/unfused", lambda r: ratio(r, "fused/unfused")),
        ("graph/fused", lambda r: ratio(r, "graph/fused")),
        ("convfuse/PyTorch", lambda r: ratio(r, "convfuse/pytorch")),
        ("floor ms", floor_ms), ("roofline fused", lambda r: frac(r, "fused")),
        ("roofline graph", lambda r: frac(r, "graph")),
    ],
    "adam": [
        ("params", lambda r: f"{r['params']:,}"), ("fused ms", lambda r: ms(r, "fused")),
        ("unfused ms", lambda r: ms_only(r, "unfused")),
        ("PyTorch ms", lambda r: ms_only(r, "torch")),
        ("fused/unfused", lambda r: ratio(r, "fused/unfused")),
        ("convfuse/PyTorch", lambda r: ratio(r, "convfuse/pytorch")),
        ("floor ms", floor_ms), ("roofline fused", lambda r: frac(r, "fused")),
        ("GB/s fused", lambda r: "-" if "achieved_GBps" not in r
         else f"{r['achieved_GBps'].get('fused', 0):.1f}"),
    ],
    "compile": [
        ("case", lambda r: r["case"]), ("convfuse ms", lambda r: ms(r, "convfuse")),
        ("inductor ms", lambda r: ms(r, "inductor")), ("eager ms", lambda r: ms(r, "eager")),
        ("inductor/convfuse", lambda r: ratio(r, "inductor/convfuse")),
        ("eager/convfuse", lambda r: ratio(r, "eager/convfuse")),
        ("compile s", lambda r: ", ".join(f"{k} {v:.0f}" for k, v in
                                          r.get("compile_s", {}).items())),
    ],
    "goals": [
        ("goal", lambda r: r["case"]),
        ("target", lambda r: f"{r['goal']['comparison']} {r['goal']['target']:g} "
                             f"{r['goal']['unit']}"),
        ("measured [~95% interval]", _goal_value), ("met?", _goal_met),
        ("convfuse ms", lambda r: ms(r, "convfuse")), ("PyTorch ms", lambda r: ms(r, "torch")),
        ("threads", lambda r: str(r.get("threads", "-"))),
        ("what", lambda r: r.get("shape", "")),
    ],
    "host-overhead": [
        ("case", lambda r: r["case"]),
        ("target", lambda r: "-" if "goal" not in r else f"<= {r['goal']['target']:g}x"),
        ("measured [~95% interval]", _goal_value), ("met?", _goal_met),
        ("convfuse us", lambda r: us(r, "convfuse")), ("PyTorch us", lambda r: us(r, "torch")),
        ("steps ms (eager/graph, convfuse/torch)", lambda r: _steps(r)),
        ("what", lambda r: r.get("shape", "")),
    ],
}


def table(section: str, recs: list[dict]) -> str:
    """One section's table: measured rows, then failures, then skips grouped by reason."""
    cols = COLUMNS[section]
    shown = [r for r in recs if r["status"] == "ok"]
    rows = [[get(r) for _, get in cols] for r in shown]
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, (h, _) in enumerate(cols)]
    lines = ["  ".join(h.ljust(w) for (h, _), w in zip(cols, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    for r in recs:
        if r["status"] in ("error", "check_failed"):
            where = " ".join(str(r.get(k)) for k in ("case", "precision", "layout", "activation")
                             if r.get(k) is not None)
            lines.append(f"{r['status'].upper()}: {where}: {r['reason']}")
    skipped: dict[str, int] = {}
    for r in recs:
        if r["status"] == "skipped":
            skipped[r["reason"]] = skipped.get(r["reason"], 0) + 1
    lines += [f"skipped {n} case(s): {reason}" for reason, n in skipped.items()]
    notes = sorted({n for r in shown for n in r["notes"]})
    lines += [f"note: {n}" for n in notes]
    for r in shown:
        for form, how in r.get("forms", {}).items():
            if not how.startswith("measured"):
                lines.append(f"{r['case']}: {form}: {how}")
    return "\n".join(lines)


def print_report(results: dict[str, list[dict]], engine_kind: str, footer: list[str]) -> None:
    for section, recs in results.items():
        print()
        print(f"== {SECTION_TITLES[section]} ==")
        print(FORMS[engine_kind][section])
        print(table(section, recs))
    print()
    print(STABILITY_LEGEND)
    print()
    for line in footer:
        print(line)


STABILITY_LEGEND = (
    "±x%: half the relative width of the ~95% interval of a median (times) or of a ratio of "
    "medians; '!' = unstable: a time's interval wider than 10% of its median, a ratio's wider "
    "than 20% (timing.py, Note [spread and unstable figures]). Compared forms were timed "
    "interleaved."
)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=_jsonable) + "\n")


def _jsonable(obj: Any) -> Any:
    """numpy scalars and arrays (e.g. a device count) as plain JSON values."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


def counts(results: dict[str, list[dict]]) -> dict[str, int]:
    out = {"ok": 0, "skipped": 0, "error": 0, "check_failed": 0}
    for recs in results.values():
        for r in recs:
            out[r["status"]] = out.get(r["status"], 0) + 1
    return out
