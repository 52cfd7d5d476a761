"""benchmarks/bench/torch_compile.py (section `compile`): the ResNet-18 training step with
torch.compile(backend=convfuse), torch.compile's default and eager runs on the CPU, checks
the compiled forms against eager before timing, and emits its records. Inductor is swapped
for inner "eager" here: its C++ compilation of ResNet-18 takes minutes."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from tests._benchmarks_helpers import engine, peaks
from tests._zoo import import_torchvision


@pytest.fixture
def ctx():
    from bench.records import Context
    from fused_vs_unfused import budget_for

    eng, _ = engine.make_engine("cpu")
    used, _ = peaks.resolve(eng, True)
    return Context(eng, used, True, budget_for(eng, True), 0, lambda msg: None)


def test_section_runs_checks_and_emits_its_records(ctx, monkeypatch):
    import fused_vs_unfused
    from bench import report, torch_compile

    import_torchvision()
    monkeypatch.setattr(torch_compile, "INNER", {"inductor": "eager", "convfuse": "eager"})
    recs = torch_compile.run(ctx)
    assert len(recs) == 1
    rec = recs[0]
    assert rec["section"] == "compile" and rec["status"] == "ok", rec.get("reason")
    assert rec["device"] == "cpu" and any("not a GPU result" in n for n in rec["notes"])
    assert [c["form"] for c in rec["checks"]] == ["inductor", "convfuse",
                                                  "convfuse, after timing"]
    assert all(c["ok"] and c.get("grad_rel_err", 0) < 2e-3 for c in rec["checks"])
    assert set(rec["timings"]) == {"eager", "inductor", "convfuse"}
    assert set(rec["ratios"]) == {"eager/inductor", "eager/convfuse", "inductor/convfuse"}
    assert set(rec["compile_s"]) == set(torch_compile.FORMS)
    table = report.table("compile", recs)
    assert "resnet18 training step" in table
    assert "compile" in fused_vs_unfused.SECTIONS
    assert "compile" not in fused_vs_unfused.parse_args([]).sections  # opt-in
    assert fused_vs_unfused.parse_args(["--sections", "compile"]).sections == ("compile",)
