"""benchmarks/bench/conv_transpose.py: the ConvTranspose section runs on the CPU (labelled
so, scaled-down U-Net decoder layers), checks that fused, unfused and PyTorch agree before
timing, and reports medians, floors and speedups; its work model is checked by hand."""

from __future__ import annotations

import importlib
import math

import pytest

from convfuse.transpose_geometry import ConvTransposeGeometry
from tests._benchmarks_helpers import BENCH  # noqa: F401  (puts benchmarks/ on sys.path)

conv_transpose = importlib.import_module("bench.conv_transpose")


def test_unet_cases_are_the_issue_layers():
    cases = conv_transpose.unet_cases()
    assert [(c.cin, c.cout, c.kernel) for c in cases] == [
        (512, 256, 2), (512, 256, 4), (256, 128, 2), (256, 128, 4), (128, 64, 2), (128, 64, 4)]
    assert all(c.batch == 32 for c in cases)
    for c in cases:  # stride 2 doubles the size, kernel 2 or kernel 4 with padding 1
        g = ConvTransposeGeometry.create((c.batch, c.cin, c.size, c.size),
                                         (c.cin, c.cout, c.kernel, c.kernel), 2, c.padding)
        assert g.output_spatial == (2 * c.size, 2 * c.size)


def test_work_model_by_hand():
    g = ConvTransposeGeometry.create((2, 8, 4, 4), (8, 4, 2, 2), 2)
    work = conv_transpose._work(g)
    assert work["forward"]["flops"] == 2 * 2 * 8 * 4 * 4 * 4 * 4  # 2 * N*Cin*H*W * Cout*k*k
    x, w, y = 2 * 8 * 16 * 4, 8 * 4 * 4 * 4, 2 * 4 * 64 * 4
    assert work["forward"]["bytes"] == x + w + 16 + y
    assert work["backward"]["flops"] == 2 * work["forward"]["flops"]


def test_quick_cpu_run_checks_and_times_every_form():
    pytest.importorskip("torch")
    result = conv_transpose.run(quick=True)
    assert result["device"] in ("cpu", "cuda")
    if result["device"] != "cpu":  # pragma: gpu
        pytest.skip("the CPU run is what this test checks")
    assert result["label"].startswith("CPU (")
    assert len(result["cases"]) == 6
    for rec in result["cases"]:
        assert rec["status"] == "measured", rec
        assert rec["check"]["ok"] and rec["check"]["max_rel_err"] <= 1e-4
        for phase in ("forward", "backward"):
            assert set(rec[phase]) == {"fused", "unfused", "torch"}
            for t in rec[phase].values():
                assert 0 < t["min_s"] <= t["median_s"] <= t["max_s"]
                assert math.isclose(t["floor/median"], rec["floor_s"][phase] / t["median_s"])
    table = conv_transpose.format_table(result)
    assert "ConvTranspose (U-Net decoder layers)" in table
    assert "nothing here is a GPU result" in table


def test_a_case_that_raises_is_recorded_and_the_run_goes_on(monkeypatch):
    """One case's exception (a cuDNN error on a GPU) ends no run: it is the case's record,
    the other cases are measured, and the table names it; the peaks say their GEMM math."""
    pytest.importorskip("torch")
    real = conv_transpose._case
    cases = []

    def first_raises(eng, torch, case, layout, peaks, quick):
        cases.append(case.name)
        if len(cases) == 1:
            raise RuntimeError("cudnnConvolutionBackwardData failed (stand-in)")
        return real(eng, torch, case, layout, peaks, quick)

    monkeypatch.setattr(conv_transpose, "_case", first_raises)
    result = conv_transpose.run(quick=True)
    if result["device"] != "cpu":  # pragma: gpu
        pytest.skip("the CPU run is what this test checks")
    first, *rest = result["cases"]
    assert first["status"] == "error" and "stand-in" in first["error"]
    assert len(rest) == 5 and all(r["status"] == "measured" for r in rest)
    assert "error: RuntimeError: cudnnConvolutionBackwardData" in \
        conv_transpose.format_table(result)
    assert result["peaks"]["gemm_math"] == "fp32"  # the CPU's GEMM has no TF32
