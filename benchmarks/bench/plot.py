"""A PNG bar chart of the ratios, one panel per section (log scale; 1 = parity)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use(): the backend must be chosen first

# (ratio key, legend label) per section; a reference line marks what physics expects.
RATIOS = {
    "forward": [("fused/unfused", "fused / unfused"), ("convfuse/pytorch", "convfuse / PyTorch")],
    "backward": [("backward/forward", "backward / forward (physics: ~2)")],
    "biasgrad": [("fused/cudnn", "fused / cuDNN"), ("generic/cudnn", "generic sum / cuDNN")],
    "train": [("fused/unfused", "fused / unfused"), ("graph/fused", "CUDA graph / fused"),
              ("convfuse/pytorch", "convfuse / PyTorch eager")],
    "adam": [("fused/unfused", "fused / unfused"), ("convfuse/pytorch", "convfuse / PyTorch")],
}
REFERENCE = {"backward": 2.0}


def _label(rec: dict) -> str:
    parts = [rec["case"]]
    for key in ("activation", "precision", "layout"):
        if rec["section"] == "biasgrad" or key != "activation":
            value = rec.get(key)
            if value:
                parts.append(str(value))
    return " ".join(parts)


def save(path: Path, results: dict[str, list[dict]], title: str) -> None:
    panels = []
    for section, recs in results.items():
        rows = [r for r in recs if r["status"] == "ok" and r["ratios"]]
        if rows:
            panels.append((section, rows))
    heights = [max(1.5, 0.22 * len(rows) * len(RATIOS[s]) + 1.0) for s, rows in panels] or [2]
    fig, axes = plt.subplots(len(heights), 1, figsize=(11, sum(heights) + 0.8),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    fig.suptitle(title, fontsize=10)
    if not panels:
        axes[0][0].text(0.5, 0.5, "no measured cases", ha="center", va="center")
        axes[0][0].set_axis_off()
    for ax, (section, rows) in zip(axes[:, 0], panels):
        _panel(ax, section, rows)
    total = sum(heights) + 0.8
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / total))  # leave room for the two-line title
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def _panel(ax: plt.Axes, section: str, rows: list[dict]) -> None:
    keys = [(k, lbl) for k, lbl in RATIOS[section] if any(k in r["ratios"] for r in rows)]
    bar = 0.8 / max(1, len(keys))
    span = math.log10(2 * REFERENCE.get(section, 1.25))
    for j, (key, lbl) in enumerate(keys):
        ys = [i + j * bar for i in range(len(rows))]
        values = [r["ratios"].get(key, float("nan")) for r in rows]
        # bars grow from parity (1) to the ratio: left for faster, right for slower
        ax.barh(ys, [v - 1 for v in values], left=1, height=bar, label=lbl)
        span = max([span] + [abs(math.log10(v)) for v in values if v > 0 and math.isfinite(v)])
    ax.set_yticks([i + 0.4 - bar / 2 for i in range(len(rows))])
    ax.set_yticklabels([_label(r) for r in rows], fontsize=6)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(10 ** -(span * 1.1), 10 ** (span * 1.1))
    ax.axvline(1.0, color="black", linewidth=0.8)
    if section in REFERENCE:
        ax.axvline(REFERENCE[section], color="grey", linestyle="--", linewidth=0.8)
    ax.set_title(section, fontsize=9)
    ax.set_xlabel("ratio of median times (log scale): left of 1, the first-named form is faster",
                  fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7, loc="lower right")
