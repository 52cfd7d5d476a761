"""benchmarks/bench/host_overhead.py (the `host-overhead` section) at a tiny repeat count:
every row runs, checks its forms agree, and emits a well-formed record with its goal and
verdict; the GPU-only rows are skipped on the CPU with the reason. No timing is asserted."""

from __future__ import annotations

import importlib
import json

import pytest

from tests._benchmarks_helpers import engine, timing  # also puts benchmarks/ on sys.path

host_overhead = importlib.import_module("bench.host_overhead")
records = importlib.import_module("bench.records")
report = importlib.import_module("bench.report")
Peaks = importlib.import_module("bench.peaks").Peaks

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def recs():
    torch_cmp = importlib.import_module("bench.torch_cmp")
    eng = engine.cpu_engine()
    side, note = torch_cmp.load(eng, False)
    peaks = Peaks("CPU", "test", 1e10, {"fp32": 1e10}, True)
    ctx = records.Context(eng, peaks, True, timing.Budget(0, 3, 3, 0.0), 0, lambda m: None,
                          side, note)
    saved = host_overhead.budget, host_overhead.INNER
    host_overhead.budget = lambda quick, gpu: timing.Budget(0, 3, 3, 0.0)
    host_overhead.INNER = 2
    try:
        return host_overhead.run(ctx)
    finally:
        host_overhead.budget, host_overhead.INNER = saved


def test_every_row_is_measured_or_skipped_for_a_cpu_reason(recs):
    by_case = {r["case"]: r for r in recs}
    assert set(by_case) == {*host_overhead.CPU_TARGETS,
                            *(f"resnet18_step_b{b}" for b in host_overhead.RESNET_BATCHES)}
    for name in host_overhead.CPU_TARGETS:
        assert by_case[name]["status"] == "ok", by_case[name].get("reason")
    for b in host_overhead.RESNET_BATCHES:
        rec = by_case[f"resnet18_step_b{b}"]
        assert rec["status"] == "skipped" and rec["reason"].startswith("CPU")


def test_measured_rows_carry_checks_times_ratio_and_verdict(recs):
    for rec in recs:
        if rec["status"] != "ok":
            continue
        assert rec["section"] == "host-overhead" and rec["device"] == "CPU"
        assert rec["threads"] == 1
        assert rec["checks"] and all(c["ok"] for c in rec["checks"])
        assert set(rec["timings"]) == {"convfuse", "torch"}
        for st in rec["timings"].values():
            assert st["reps"] == 3 and st["ci_low_s"] <= st["median_s"] <= st["ci_high_s"]
            assert st["unstable"] == (st["spread"] > timing.UNSTABLE_SPREAD)
        r = rec["ratios"]["convfuse/pytorch"]
        assert r == pytest.approx(rec["timings"]["convfuse"]["median_s"]
                                  / rec["timings"]["torch"]["median_s"])
        g = rec["goal"]
        assert g["target"] == host_overhead.CPU_TARGETS[rec["case"]]
        assert g["measured"] == r and g["met"] == (r <= g["target"])
        assert rec["ratios"]["goal_ratio"] == pytest.approx(r / g["target"])


def test_the_report_prints_the_section_and_the_json_round_trips(recs, capsys):
    text = report.table("host-overhead", recs)
    assert "convfuse us" in text and "numpy_conv2d_forward" in text
    assert "skipped 3 case(s): CPU" in text
    assert "host-overhead" in report.FORMS["cpu"] and "host-overhead" in report.FORMS["gpu"]
    json.loads(json.dumps(recs, default=str))
