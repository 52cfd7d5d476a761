"""benchmarks/fused_vs_unfused.py end to end: one `--quick` run on the CPU, its report, JSON
and plot, and the GPU run as a `gpu`-marked test (written, and skipped here). The script's
arithmetic, timing, peak table, cases and recommendation are checked against hand-worked
values and small synthetic inputs in tests/test_benchmarks_*.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from convfuse.backend import gpu_unavailable_reason
from tests._benchmarks_helpers import SCRIPT

SECTIONS = ("forward", "backward", "biasgrad", "train", "adam", "goals", "host-overhead")
STATUSES = {"ok", "skipped"}


# -- the CPU run, end to end --------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One `--quick` run on the CPU (forced with --device cpu when a GPU is present)."""
    out = tmp_path_factory.mktemp("bench")
    args = [sys.executable, str(SCRIPT), "--quick", "--quiet", "--out", str(out / "r.json"),
            "--plot", str(out / "r.png")]
    if gpu_unavailable_reason() is None:  # pragma: gpu
        args += ["--device", "cpu"]
    # The reference engine's timings mean nothing, so one BLAS thread costs nothing and
    # keeps the run fast when other work shares the two cores.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=out, env=env)
    return proc, out


def test_quick_cpu_run_exits_0_and_says_cpu(cpu_run):
    proc, _ = cpu_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "CPU (convfuse NumPy reference engine)" in text
    assert "say nothing about GPU performance" in text
    if gpu_unavailable_reason() is not None:
        assert "NO GPU:" in text and gpu_unavailable_reason() in text
    for title in ("Layer forward", "Layer backward", "Bias gradient", "Training step",
                  "Optimizer", "Goals of issue #14"):
        assert f"== {title}" in text
    for column in ("fused/unfused", "convfuse/PyTorch", "roofline fused", "bwd/fwd", "winner"):
        assert column in text


def test_quick_cpu_run_writes_a_png(cpu_run):
    _, out = cpu_run
    data = (out / "r.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_quick_cpu_json_structure_and_labelling(cpu_run):
    _, out = cpu_run
    d = json.loads((out / "r.json").read_text())
    assert d["engine"] == "cpu" and "CPU" in d["label"]
    assert "CPU reference engine" in d["notice"]
    env = d["environment"]
    assert env["engine"] == "cpu" and env["gpu"] is None
    for key in ("numpy", "cupy", "convfuse", "cudnn", "python", "timestamp_utc", "timer",
                "git_dirty"):
        assert key in env
    # PyTorch's own versions and switches beside convfuse's, and the flags each timed row
    # ran with (its label names the intended precision)
    assert set(env["torch_side"]) == {"cuda", "cudnn", "cudnn_allow_tf32", "cudnn_benchmark",
                                      "matmul_allow_tf32"}
    assert d["method"]["torch_cudnn_benchmark"] is False  # a CPU run sets no cuDNN switch
    timed = [r for sec in ("forward", "backward") for r in d["results"][sec]
             if r["status"] == "ok"]
    assert timed and all(set(r["flags_in_force"]) == {"allow_tf32", "benchmark",
                                                      "deterministic"} for r in timed)
    assert all(any("after timing" in c["what"] for c in r["checks"]) for r in timed)
    # no GPU number may appear: the floors come from measurements on this CPU
    assert d["peaks"]["datasheet"] is None and d["peaks"]["used"]["measured"] is True
    assert d["peaks"]["used"]["device"] == "CPU"
    assert d["bias_grad_recommendation"]["recommendation"] is None
    assert set(d["results"]) == set(SECTIONS)
    counted = {"ok": 0, "skipped": 0, "error": 0, "check_failed": 0}
    for section, recs in d["results"].items():
        assert recs, section
        for rec in recs:
            counted[rec["status"]] += 1
            assert rec["section"] == section
            assert rec["status"] in STATUSES, rec.get("reason")
            if rec["status"] == "skipped":
                assert rec["reason"].startswith("CPU")
                continue
            _check_measured(rec)
    assert counted == d["counts"]
    assert sum(r["status"] == "ok" for recs in d["results"].values() for r in recs) >= 30


def _check_measured(rec: dict) -> None:
    assert rec["checks"] and all(c["ok"] for c in rec["checks"])
    assert rec["timings"]
    for stats in rec["timings"].values():
        # Note [spread and unstable figures]: every time carries its interval and flag
        assert stats["ci_low_s"] <= stats["median_s"] <= stats["ci_high_s"]
        assert stats["unstable"] == (stats["spread"] > 0.10)
    for key, iv in rec["ratio_intervals"].items():
        assert iv["low"] <= rec["ratios"][key] <= iv["high"]
    if rec["section"] in ("goals", "host-overhead"):
        g = rec["goal"]
        assert {"target", "measured", "low", "high", "met", "unstable"} <= set(g)
        assert g["met"] == (g["measured"] <= g["target"] if g["comparison"] == "<="
                            else g["measured"] >= g["target"])
        assert rec["threads"] >= 1
        return
    for stats in rec["timings"].values():
        assert stats["min_s"] <= stats["median_s"] <= stats["max_s"]
        assert stats["reps"] == len(stats["samples_s"]) >= 3
        assert min(stats["samples_s"]) == stats["min_s"] > 0
    assert "graph" not in rec["timings"]  # no CUDA graph without a GPU
    for key, value in rec["ratios"].items():
        num, den = {"fused/unfused": ("fused", "unfused"), "fused/cudnn": ("fused", "cudnn"),
                    "generic/cudnn": ("generic", "cudnn")}.get(key, (None, None))
        if num:
            want = rec["timings"][num]["median_s"] / rec["timings"][den]["median_s"]
            assert value == pytest.approx(want)
    assert rec["floor_s"] > 0 and rec["work"]["bytes"] > 0
    for form, fraction in rec["roofline"].items():
        assert fraction == pytest.approx(rec["floor_s"] / rec["timings"][form]["median_s"])


def test_quick_cpu_run_reports_the_goals(cpu_run):
    proc, out = cpu_run
    d = json.loads((out / "r.json").read_text())
    goals = {r["case"]: r for r in d["results"]["goals"]}
    assert set(goals) == {"mnist_step", "resnet_block_step", "adam_bandwidth"}
    for name in ("mnist_step", "resnet_block_step", "adam_bandwidth"):
        assert goals[name]["status"] == "ok", goals[name].get("reason")
    assert goals["mnist_step"]["goal"]["target"] == 1.5
    assert goals["resnet_block_step"]["goal"]["target"] == 1.3
    adam = goals["adam_bandwidth"]
    assert adam["goal"]["target"] == 0.4 and "256 MiB" in adam["memcpy_source"]
    assert d["method"]["unstable_threshold"] == {"time": 0.10, "ratio": 0.20}
    assert d["method"]["cpu_shape_caps"] == {"batch": 8, "spatial": 14, "channels": 32}
    assert "met?" in proc.stdout and "unstable" in proc.stdout


def test_from_json_redraws_without_measuring(cpu_run):
    _, out = cpu_run
    proc = subprocess.run([sys.executable, str(SCRIPT), "--from-json", str(out / "r.json"),
                           "--plot", str(out / "again.png")], capture_output=True, text=True,
                          timeout=120, cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== Layer forward" in proc.stdout and "CPU" in proc.stdout
    assert (out / "again.png").read_bytes()[:4] == b"\x89PNG"


def test_result_names_carry_the_device():
    import datetime

    import fused_vs_unfused

    when = datetime.datetime(2026, 11, 21, 21, 30)
    assert fused_vs_unfused.result_name("NVIDIA H100 80GB HBM3", when) == \
        "nvidia-h100-80gb-hbm3-20261121-2130"


def test_quick_cpu_json_covers_every_precision_and_layout(cpu_run):
    _, out = cpu_run
    recs = json.loads((out / "r.json").read_text())["results"]["forward"]
    seen = {(r["precision"], r["layout"]) for r in recs}
    assert seen == {(p, lay) for p in ("fp32", "tf32", "fp16", "bf16") for lay in ("NCHW", "NHWC")}
    tf32 = [r for r in recs if r["precision"] == "tf32"]
    assert all(r["status"] == "skipped" and "TF32" in r["reason"] for r in tf32)
    names = {r["case"] for r in recs}
    assert {"mnist.conv1", "mbv2.dw3x3", "r18.layer1.3x3+res"} <= names
    assert all(r["scaled_from"] for r in recs if r["case"].startswith("r18"))


# -- the GPU run (written; skipped without a GPU) -----------------------------------------

@pytest.mark.gpu
def test_quick_gpu_run_forward_and_bias(tmp_path):  # pragma: gpu
    out = tmp_path / "g.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--quiet", "--device", "cuda", "--no-torch",
         "--sections", "forward,biasgrad,adam", "--precisions", "fp32,fp16", "--out", str(out),
         "--plot", str(tmp_path / "g.png")],
        capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["engine"] == "gpu" and d["environment"]["gpu"]["name"]
    assert d["environment"]["gpu"]["driver_version"] > 0
    assert d["bias_grad_recommendation"]["recommendation"] in ("cudnn", "fused")
    for recs in d["results"].values():
        for rec in recs:
            assert rec["status"] == "ok", rec.get("reason")
            _check_measured(rec)
