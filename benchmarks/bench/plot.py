"""A PNG bar chart of the ratios, one panel per section (log scale; 1.00 = parity).

Every bar carries its value and a whisker for the ratio's interval; a bar whose ratio is
unstable (Note [spread and unstable figures], timing.py) is hatched and its value marked
"!". The legend sits below each panel, never over the bars, and every label names the
engine that ran (the CPU run never says cuDNN).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use(): the backend must be chosen first
from matplotlib.transforms import ScaledTranslation

# (ratio key, legend label) per section and engine; a reference line marks parity.
RATIOS = {
    "gpu": {
        "forward": [("fused/unfused", "fused cuDNN call / unfused cuDNN + CuPy passes"),
                    ("convfuse/pytorch", "convfuse (cuDNN) / PyTorch (CUDA)")],
        "backward": [("backward/forward", "convfuse (cuDNN) backward / forward "
                                          "(physics: ~2)")],
        "biasgrad": [("fused/cudnn", "fused kernel / cuDNN BackwardBias"),
                     ("generic/cudnn", "CuPy sum / cuDNN BackwardBias")],
        "train": [("fused/unfused", "convfuse (cuDNN) fused / unfused"),
                  ("graph/fused", "CUDA graph / eager (cuDNN)"),
                  ("convfuse/pytorch", "convfuse (cuDNN) / PyTorch eager (CUDA)")],
        "adam": [("fused/unfused", "fused kernel / CuPy passes"),
                 ("convfuse/pytorch", "convfuse kernel / PyTorch fused (CUDA)")],
        "goals": [("goal_ratio", "measured / target (<= 1: met)")],
    },
    "cpu": {
        "forward": [("fused/unfused", "reference conv_bias_act / reference conv + NumPy "
                                      "passes (CPU)"),
                    ("convfuse/pytorch", "convfuse NumPy engine / PyTorch CPU")],
        "backward": [("backward/forward", "convfuse NumPy engine backward / forward "
                                          "(physics: ~2)")],
        "biasgrad": [("fused/cudnn", "reference activation_backward_bias / "
                                     "conv_backward_bias (CPU)"),
                     ("generic/cudnn", "NumPy sum / reference conv_backward_bias (CPU)")],
        "train": [("fused/unfused", "convfuse NumPy engine fused / unfused (CPU)"),
                  ("convfuse/pytorch", "convfuse NumPy engine / PyTorch CPU eager")],
        "adam": [("fused/unfused", "convfuse blocked NumPy Adam / NumPy passes (CPU)"),
                 ("convfuse/pytorch", "convfuse NumPy Adam / PyTorch CPU Adam")],
        "goals": [("goal_ratio", "CPU goal: measured / target (<= 1: met)")],
    },
}
REFERENCE = {"backward": 2.0}


def _label(rec: dict) -> str:
    parts = [rec["case"]]
    for key in ("activation", "precision", "layout"):
        if rec["section"] == "biasgrad" or key != "activation":
            value = rec.get(key)
            if value:
                parts.append(str(value))
    if rec["section"] == "goals" and rec.get("goal"):
        g = rec["goal"]
        parts.append(f"({g['comparison']} {g['target']:g} {g['unit']})")
    return " ".join(parts)


def save(path: Path, results: dict[str, list[dict]], title: str, engine: str = "cpu") -> None:
    ratios = RATIOS["gpu" if engine == "gpu" else "cpu"]
    panels = []
    for section, recs in results.items():
        rows = [r for r in recs if r["status"] == "ok" and r["ratios"]]
        if rows and section in ratios:
            panels.append((section, rows))
    heights = [max(2.0, 0.26 * len(rows) * len(ratios[s]) + 1.8) for s, rows in panels] or [2]
    fig, axes = plt.subplots(len(heights), 1, figsize=(12, sum(heights) + 1.2),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    fig.suptitle(title, fontsize=9)
    if not panels:
        axes[0][0].text(0.5, 0.5, "no measured cases", ha="center", va="center")
        axes[0][0].set_axis_off()
    for ax, (section, rows) in zip(axes[:, 0], panels):
        _panel(ax, section, rows, ratios[section])
    total = sum(heights) + 1.2
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.75 / total))  # room for the multi-line title
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def _panel(ax: plt.Axes, section: str, rows: list[dict], ratios: list) -> None:
    keys = [(k, lbl) for k, lbl in ratios if any(k in r["ratios"] for r in rows)]
    bar = 0.8 / max(1, len(keys))
    span = math.log10(2 * REFERENCE.get(section, 1.25))
    for j, (key, lbl) in enumerate(keys):
        ys = [i + j * bar for i in range(len(rows))]
        values = [r["ratios"].get(key, float("nan")) for r in rows]
        ivs = [r.get("ratio_intervals", {}).get(key) for r in rows]
        lo = [v - iv["low"] if iv else 0.0 for v, iv in zip(values, ivs)]
        hi = [iv["high"] - v if iv else 0.0 for v, iv in zip(values, ivs)]
        shaky = [bool(iv and iv["unstable"]) for iv in ivs]
        # bars grow from parity (1) to the ratio: left for faster, right for slower
        bars = ax.barh(ys, [v - 1 for v in values], left=1, height=bar, label=lbl,
                       xerr=[lo, hi], error_kw={"elinewidth": 0.8, "capsize": 2})
        for b, v, s, y in zip(bars, values, shaky, ys):
            if s:
                b.set_hatch("///")
            if math.isfinite(v):
                ax.text(v, y, f" {v:.2f}{'!' if s else ''} ", va="center", fontsize=6,
                        ha="left" if v >= 1 else "right")
        finite = [x for v, iv in zip(values, ivs)
                  for x in ((iv["low"], iv["high"]) if iv else (v,))
                  if x > 0 and math.isfinite(x)]
        span = max([span] + [abs(math.log10(x)) for x in finite])
    ax.set_yticks([i + 0.4 - bar / 2 for i in range(len(rows))])
    ax.set_yticklabels([_label(r) for r in rows], fontsize=6)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(10 ** -(span * 1.25), 10 ** (span * 1.25))
    ax.axvline(1.0, color="black", linewidth=1.0)
    ax.text(1.0, 1.0, "1.00", transform=ax.get_xaxis_transform(), ha="center", va="bottom",
            fontsize=7)
    if section in REFERENCE:
        ax.axvline(REFERENCE[section], color="grey", linestyle="--", linewidth=0.8)
    ax.set_title(section, fontsize=9, loc="left")
    what = ("measured / target (log scale; 1.00 = the target, left of it the goal is met)"
            if section == "goals" else "ratio of median times (log scale; 1.00 = parity, left "
                                       "of it the first-named form is faster)")
    ax.set_xlabel(f"{what}; whiskers: ~95% interval; hatched / '!': unstable", fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    # below the x label, a fixed distance in inches whatever the panel's height
    below = ax.transAxes + ScaledTranslation(0, -0.5, ax.figure.dpi_scale_trans)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=below,
              ncol=2, frameon=False)
