"""benchmarks/bench/torch_convert.py: the torch.nn vs convfuse.torch.convert training-step
comparison runs on the CPU, checks the two agree before timing, and reports spreads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench import torch_convert


def test_quick_run_measures_both_models_interleaved():
    result = torch_convert.run(quick=True)
    assert result["status"] == "measured" and result["device"] == "cpu"
    assert "CPU" in result["label"]
    assert [c["name"] for c in result["cases"]] == ["contiguous float32",
                                                    "channels_last float32"]
    for case in result["cases"]:
        assert case["status"] == "measured", case
        assert case["fused_convs"] == 4
        assert case["check"]["ok"] and case["check"]["grad_rel_err"] < 2e-3
        for side in ("plain", "convert"):
            s = case["steps_per_s"][side]
            assert 0 < s["min"] <= s["median"] <= s["max"]
            assert s["rounds"] == len(s["samples"]) == 5
        sp = case["speedup"]
        assert sp["min"] <= sp["median_of_round_ratios"] <= sp["max"]
    table = torch_convert.format_table(result)
    assert "nothing here is a GPU result" in table and "channels_last float32" in table


def test_a_disagreement_is_reported_not_timed(monkeypatch):
    monkeypatch.setattr(torch_convert, "_check",
                        lambda *a: {"ok": False, "loss_rel_err": 1.0, "grad_rel_err": 1.0,
                                    "rtol": 0.0})
    result = torch_convert.run(quick=True)
    assert all(c["status"] == "check_failed" and "steps_per_s" not in c
               for c in result["cases"])
    assert "check_failed" in torch_convert.format_table(result)
