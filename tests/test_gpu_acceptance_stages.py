"""Issue 23: the GPU acceptance run's own arithmetic, on the CPU. The planner packs chunks
sized from the collected counts into stages whose minimums fit their caps (a grown chunk
moves on or is split, too many stages fail loudly); a warm tree's second install reuses
the build and a changed csrc/ rebuilds it (pip stubbed); a sanitizer cut by its cap is a
SKIP; a chunk cut by its cap names the test it reached and how many it never reached, in
summary.md and tests.jsonl, and is not a failure."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
SCRIPT = SCRIPTS / "gpu_acceptance.sh"
sys.path.insert(0, str(SCRIPTS))
import acceptance_plan as plan  # noqa: E402
import acceptance_summary  # noqa: E402

ROOM = 295 - 5 - 30 - 20  # a stage's cap, less the reserve, the install and the plan


def _files(counts: Counter) -> list[str]:
    return sorted(counts)


def _today() -> Counter:
    """The counts of 2026-11-27 (2117 tests) and one file no chunk names."""
    counts = Counter({
        "tests/gpu/test_binding_gpu_handle.py": 1, "tests/gpu/test_fused_path_gpu.py": 128,
        "tests/gpu/test_layers_gpu.py": 151, "tests/gpu/test_graph_gpu.py": 8,
        "tests/gpu/test_optim_gpu.py": 25, "tests/gpu/test_torch_gpu.py": 19,
        "tests/gpu/test_torch_batchnorm_gpu.py": 9, "tests/gpu/test_models_gpu.py": 37,
        "tests/gpu/test_loss_gpu.py": 29, "tests/gpu/test_cudnn_ops.py": 581,
        "tests/gpu/test_batchnorm_gpu.py": 141, "tests/gpu/test_elementwise_gpu.py": 267,
        "tests/gpu/test_edge_values_gpu.py": 20, "tests/gpu/test_robust_gpu.py": 5,
        "tests/gpu/test_fused_fallback_gpu.py": 288, "tests/gpu/test_binding_gpu_conv.py": 54,
        "tests/gpu/test_binding_gpu_conv_fused.py": 34,
        "tests/gpu/test_binding_gpu_conv_layouts.py": 6,
        "tests/gpu/test_binding_gpu_activation_pooling.py": 30,
        "tests/gpu/test_padding_gpu.py": 130, "tests/gpu/test_selfcheck_gpu.py": 8})
    counts["tests/gpu/test_new_helper_gpu.py"] = 99
    return counts


def _check(result: plan.Plan, counts: Counter) -> dict[str, int]:
    """Every file in exactly one chunk, every chunk's minimum 15 + 0.1 s per test, every
    stage's minimums within its room; returns each part's stage."""
    where: dict[str, int] = {}
    seen: list[str] = []
    for stage, parts in result.stages.items():
        assert sum(p.lo for p in parts) <= ROOM, (stage, [(p.name, p.lo) for p in parts])
        for p in parts:
            where[p.name] = stage
            if p.tests is not None:
                assert p.lo >= 15 + 0.1 * p.tests
                assert p.tests == sum(counts[f] for f in p.files) - (p.name == "gpu-selfcheck")
                seen += p.files
    assert sorted(seen) == _files(counts)
    return where


def test_todays_counts_fill_stages_1_and_2_with_tests_and_stage_3_with_the_benchmarks():
    counts = _today()
    result = plan.pack(counts, _files(counts), ROOM, "forward,adam")
    assert result.errors == []
    where = _check(result, counts)
    assert result.stages[1][0].name == "smoke"
    assert where["gpu-core"] == 1 and where["gpu-ops"] == 1
    assert {where[c] for c in ("gpu-bn", "gpu-rest", "gpu-selfcheck")} <= {1, 2}
    rest = next(p for p in result.stages[where["gpu-rest"]] if p.name == "gpu-rest")
    assert "tests/gpu/test_new_helper_gpu.py" in rest.files  # named by no chunk
    assert where["bench"] == 3 and where["sanitizer"] == 3 and where["syncs"] == 2
    # issue 25's GPU figure in the first lease; the bench part never times it again
    host = next(p for p in result.stages[2] if p.name == "host")
    assert where["host"] == 2 and "--sections host-overhead " in host.command
    assert '--stream "$OUT/bench.jsonl"' in host.command
    assert "host-overhead" not in plan.pack(counts, _files(counts), ROOM,
                                            "forward,host-overhead").stages[3][0].command
    bench = next(p for p in result.stages[3] if p.name == "bench")
    assert "--sections forward,adam " in bench.command
    assert plan.leases(result) == [[1, 2], [3]]
    # with fewer tests the benchmarks keep their place in stage 2
    few = Counter({f: max(1, n // 8) for f, n in counts.items()})
    result = plan.pack(few, _files(few), ROOM, "forward")
    where = _check(result, few)
    assert where["bench"] == 2 and where["sanitizer"] == 2 and plan.leases(result) == [[1, 2]]


def test_a_chunk_that_grows_gets_its_time_and_pushes_the_others_on():
    counts = _today()
    counts["tests/gpu/test_cudnn_ops.py"] = 1500  # 165 s: no longer fits beside gpu-core
    result = plan.pack(counts, _files(counts), ROOM, "forward")
    assert result.errors == []
    where = _check(result, counts)
    assert where["gpu-core"] == 1 and where["gpu-ops"] == 2
    ops = next(p for p in result.stages[2] if p.name == "gpu-ops")
    assert ops.tests == 1500 and ops.lo == 165
    assert where["bench"] >= 3


def test_a_chunk_too_big_for_any_stage_is_split_by_files_and_too_many_stages_fail():
    counts = _today()
    for i in range(4):  # gpu-rest: 4 x 1000 unnamed tests, 400 s of minimums
        counts[f"tests/gpu/test_big{i}_gpu.py"] = 1000
    result = plan.pack(counts, _files(counts), ROOM, "forward")
    where = _check(result, counts)
    pieces = [name for name in where if name.startswith("gpu-rest-")]
    assert len(pieces) >= 2 and "gpu-rest" not in where
    assert any("stages; at most 4" in e for e in result.errors)  # 5 stages: loud
    one = Counter({"tests/gpu/test_huge_gpu.py": 3000})  # one file past a stage: loud
    assert any("test_huge_gpu" in e or "gpu-rest" in e
               for e in plan.pack(one, _files(one), ROOM, "forward").errors)


def test_the_planner_exits_1_and_says_why_when_the_stages_overflow(tmp_path):
    collected = tmp_path / "collected.txt"
    collected.write_text("".join(f"tests/gpu/test_cudnn_ops.py::t[{i}]\n"
                                 for i in range(9000)))
    proc = subprocess.run([sys.executable, str(SCRIPTS / "acceptance_plan.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ACCEPT_COLLECTED": str(collected)})
    assert proc.returncode == 1 and "acceptance_plan: gpu-ops needs 915 s" in proc.stderr


# A stand-in for the machine's python3: pip "builds" (logs, writes the .so), the binding
# check prints a version, everything else is the real interpreter.
FAKE_PY = """#!/bin/sh
if [ "$1" = -m ] && [ "$2" = pip ]; then
  echo build >>"$PIP_LOG"; echo "fake so $(date +%s%N)" >convfuse/_cudnn.fake.so; exit 0
fi
case "$2" in *"_binding as b"*)
  [ -f convfuse/_cudnn.fake.so ] && { echo "cuDNN 91900"; exit 0; }; exit 1 ;;
esac
exec "{real}" "$@"
"""


def _checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    shutil.copytree(SCRIPTS, root / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "csrc").mkdir()
    (root / "csrc" / "module.cpp").write_text("// v1\n")
    (root / "convfuse").mkdir()
    for name in ("setup.py", "pyproject.toml"):
        (root / name).write_text("# stand-in\n")
    return root


def _stage(root: Path, tmp_path: Path, out: str, parts: list[str], **env) -> tuple:
    parts_file = tmp_path / f"{out}.parts"
    parts_file.write_text("\n".join(parts) + "\n")
    proc = subprocess.run(["bash", str(root / "scripts" / "gpu_acceptance.sh"), "--stage", "1",
                           str(tmp_path / out)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ACCEPT_PARTS_FILE": str(parts_file),
                               "PYTHONPATH": str(REPO), **env})
    return proc, (tmp_path / out / "log.txt").read_text(), \
        (tmp_path / out / "summary.md").read_text()


def test_a_warm_tree_reuses_its_build_until_csrc_changes(tmp_path):
    root = _checkout(tmp_path)
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PY.replace("{real}", sys.executable))
    fake.chmod(0o755)
    pip_log = tmp_path / "pip.log"
    env = {"PYTHON": str(fake), "PIP_LOG": str(pip_log)}
    builds = lambda: len(pip_log.read_text().splitlines()) if pip_log.exists() else 0  # noqa: E731

    proc, log, _ = _stage(root, tmp_path, "o1", ["install|30|no|offline_install"], **env)
    assert proc.returncode == 0, log + proc.stderr
    assert builds() == 1 and (root / ".cache" / "acceptance" / "install.stamp").is_file()
    proc, log, _ = _stage(root, tmp_path, "o2", ["install|30|no|offline_install"], **env)
    assert proc.returncode == 0 and builds() == 1 and "build reused" in log, log
    spent = int(next(line for line in proc.stdout.splitlines()
                     if line.startswith("gpu_acceptance: install exit 0")).split()[-2])
    assert spent <= 8
    (root / "csrc" / "module.cpp").write_text("// v2\n")
    proc, log, _ = _stage(root, tmp_path, "o3", ["install|30|no|offline_install"], **env)
    assert proc.returncode == 0 and builds() == 2 and "build reused" not in log
    (root / "convfuse" / "_cudnn.fake.so").unlink()  # the binding is gone: build again
    proc, log, _ = _stage(root, tmp_path, "o4", ["install|30|no|offline_install"], **env)
    assert proc.returncode == 0 and builds() == 3
    proc, log, _ = _stage(root, tmp_path, "o5", ["install|30|no|offline_install"],
                          CONVFUSE_CUDA_INCLUDE="/elsewhere", **env)  # a build flag changed
    assert builds() == 4


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_a_sanitizer_out_of_time_is_a_skip_and_a_cut_chunk_says_what_it_reached(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "compute-sanitizer").write_text("#!/bin/sh\nsleep 30\n")
    (bindir / "compute-sanitizer").chmod(0o755)
    tests = tmp_path / "test_slow.py"
    tests.write_text("import time\n\ndef test_quick():\n    pass\n\n"
                     "def test_slow():\n    time.sleep(60)\n\n"
                     "def test_never_a():\n    pass\n\ndef test_never_b():\n    pass\n")
    out = tmp_path / "out"
    parts = tmp_path / "parts.txt"
    # the chunk gets 8 s and is cut in its second test; the sanitizer gets 2 s and is cut
    parts.write_text(f"gpu-x|8|no|chunk gpu-x 4 {tests}\nsanitizer|2|no|sanitizer\n"
                     "late|20|no|true\n")
    proc = subprocess.run(["bash", str(SCRIPT), "--stage", "2", str(out)], capture_output=True,
                          text=True, timeout=180,
                          env={**os.environ, "ACCEPT_PARTS_FILE": str(parts),
                               "PYTHON": sys.executable, "PYTHONPATH": str(REPO),
                               "ACCEPT_SANITIZER_MIN": "2", "ACCEPT_PART_MIN": "2",
                               "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"})
    summary = (out / "summary.md").read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in summary.splitlines()
            if line.startswith("| ") and "---" not in line}
    chunk = rows["pytest chunk gpu-x"]
    assert "CUT (time cap reached; not a failure)" in chunk, summary
    assert "running " in chunk and "test_slow.py::test_slow" in chunk
    assert "3 of 4 tests not reached" in chunk and "passed=1" in chunk
    assert "SKIP (out of time)" in rows[acceptance_summary.title("sanitizer")]
    assert "cut by its" in rows[acceptance_summary.title("sanitizer")]
    assert "| PASS |" in rows["late"]
    assert "Failed parts: none." in summary
    assert proc.returncode == 0, proc.stdout + proc.stderr  # neither is a failure
    cut = [json.loads(line) for line in (out / "tests.jsonl").read_text().splitlines()
           if '"cut"' in line]
    assert len(cut) == 1 and cut[0]["cut"].endswith("test_slow.py::test_slow")
    assert cut[0]["running"] is True and cut[0]["not_reached"] == 3 and cut[0]["finished"] == 1


def test_a_sanitizer_with_too_little_time_left_is_skipped_before_it_starts(tmp_path):
    status = tmp_path / "status"
    status.write_text("sanitizer 122 0 only 12 s left in the stage's 295 s; it needs 30\n"
                      "gpu-y 124 60 cut by its 60 s cap: before its first test; "
                      "5 of 5 tests not reached\n")
    text = acceptance_summary.write(tmp_path, status, "3", ["sanitizer", "gpu-y"])
    assert "| SKIP (out of time) | 0 | only 12 s left" in text
    assert "CUT (time cap reached; not a failure)" in text and "5 of 5 tests not reached" in text
    assert "Failed parts: none." in text
    assert acceptance_summary.failed_parts(tmp_path, acceptance_summary.read_status(status)) \
        == []


def test_files_that_compile_with_inductor_come_last_in_their_chunk():
    """A cold compile that outruns its timeout ends the chunk: nothing may come after it."""
    counts = _today()
    for name in plan.COMPILE_LAST:
        counts[f"tests/gpu/{name}"] = 3
    counts["tests/gpu/test_zzz_after_them_gpu.py"] = 2  # sorted after them by name
    result = plan.pack(counts, _files(counts), ROOM, "forward,adam")
    assert result.errors == []
    rest = next(p for parts in result.stages.values() for p in parts if p.name == "gpu-rest")
    tail = [f.split("/")[-1] for f in rest.files[-len(plan.COMPILE_LAST):]]
    assert sorted(tail) == sorted(plan.COMPILE_LAST)
    assert "tests/gpu/test_zzz_after_them_gpu.py" in rest.files


def test_a_part_that_exits_zero_but_reads_as_failed_is_a_failed_part(tmp_path):
    """The sync counter exits 0 and reports its numbers: a failed capture probe, or a sync
    per step where the target is zero, is a failure of the stage, not a PASS footnote."""
    status = tmp_path / "status"
    status.write_text("syncs 0 10\nhost 0 30\n")
    (tmp_path / "syncs.json").write_text(json.dumps({
        "method": "capture-probe", "capture_probe": "fail: cudaErrorStreamCaptureUnsupported",
        "convfuse eager step": {"syncs_per_step": None, "d2h_copies_per_step": None},
        "convfuse captured step": {"syncs_per_step": None, "d2h_copies_per_step": None}}))
    rows = acceptance_summary.read_status(status)
    assert acceptance_summary.failed_parts(tmp_path, rows) == ["syncs"]
    text = acceptance_summary.write(tmp_path, status, "2", ["syncs", "host"])
    assert "FAIL (capture probe)" in text and "Failed parts: syncs" in text
    (tmp_path / "syncs.json").write_text(json.dumps({
        "method": "capture-probe", "capture_probe": "pass",
        "convfuse eager step": {"syncs_per_step": 0.0, "d2h_copies_per_step": 0.0},
        "convfuse captured step": {"syncs_per_step": 0.0, "d2h_copies_per_step": 0.0}}))
    assert acceptance_summary.failed_parts(tmp_path, rows) == []
    # with nsys on PATH, a profiler that failed counted nothing: no counts is not zero
    (tmp_path / "syncs.json").write_text(json.dumps({"method": "nsys", "error": "boom"}))
    assert acceptance_summary.failed_parts(tmp_path, rows) == ["syncs"]
    assert "profiler failed" in acceptance_summary.verdict("syncs", 0, tmp_path)
    (tmp_path / "syncs.json").write_text(json.dumps({
        "method": "nsys", "convfuse eager step": {"syncs_per_step": 0.0},
        "convfuse captured step": {"syncs_per_step": 0.0}}))
    assert acceptance_summary.verdict("syncs", 0, tmp_path) == "FAIL (no capture probe ran)"


def test_tests_that_compile_on_a_cold_cache_run_last_on_a_gpu():
    """tests/conftest.py's cold_compiles_last: a test with a timeout marker above 60 s (an
    Inductor compile) moves to the end, after the quick tests of its own file, which keep
    their order."""
    from types import SimpleNamespace

    from tests.conftest import cold_compiles_last

    def item(name, timeout=None):
        mark = None if timeout is None else SimpleNamespace(args=(timeout,))
        return SimpleNamespace(name=name, get_closest_marker=lambda m, _k=mark:
                               _k if m == "timeout" else None)

    items = [item("compile_a", 240), item("quick_1"), item("quick_2", 30),
             item("compile_b", 240), item("quick_3")]
    cold_compiles_last(items)
    assert [i.name for i in items] == ["quick_1", "quick_2", "quick_3", "compile_a",
                                       "compile_b"]


def test_the_host_row_shows_graph_ratios_and_forms_that_were_not_measured():
    row = {"case": "resnet18_step_b8", "status": "ok",
           "ratios": {"convfuse/pytorch": 1.1, "convfuse_graph/torch_graph": 0.9},
           "forms": {"convfuse_eager": "measured", "torch_graph": "measured",
                     "convfuse_graph": "error: CaptureError: a sync inside the capture"}}
    text = acceptance_summary._host_case(row)
    assert text.startswith("resnet18_step_b8: 1.10x")
    assert "convfuse_graph/torch_graph 0.90x" in text
    assert "convfuse_graph: error: CaptureError: a sync inside the capture" in text


def test_a_benchmark_cut_by_its_cap_keeps_its_streamed_sections(tmp_path):
    """host and bench stream each finished section: cut by the cap with sections written,
    the part is CUT, not failed; cut before any, it failed."""
    status = tmp_path / "status"
    status.write_text("bench 124 250\n")
    rows = acceptance_summary.read_status(status)
    assert acceptance_summary.verdict("bench", 124, tmp_path) == "FAIL (time cap reached)"
    assert acceptance_summary.failed_parts(tmp_path, rows) == ["bench"]
    (tmp_path / "bench.jsonl").write_text(json.dumps({"section": "forward", "results": []})
                                          + "\n")
    assert acceptance_summary.verdict("bench", 124, tmp_path).startswith("CUT")
    assert acceptance_summary.failed_parts(tmp_path, rows) == []
    assert acceptance_summary.verdict("smoke", 124, tmp_path) == "FAIL (time cap reached)"


def test_a_section_cut_midway_says_so_with_the_rows_it_finished(tmp_path):
    """benchmarks/fused_vs_unfused.py streams a cut section's finished cases marked `cut`:
    the summary's host and bench rows say it was cut, with the rows there are."""
    row = {"case": "conv_forward_nograd", "status": "ok", "ratios": {"convfuse/pytorch": 1.2}}
    (tmp_path / "bench.jsonl").write_text(json.dumps(
        {"section": "host-overhead", "cut": True, "results": [row]}) + "\n")
    host = acceptance_summary.details("host", tmp_path)
    assert host.startswith("cut by its time cap after 1 rows: conv_forward_nograd: 1.20x")
    assert "sections: host-overhead (cut);" in acceptance_summary.details("bench", tmp_path)


def test_a_smoke_cut_after_items_that_passed_is_cut_not_failed(tmp_path):
    """The smoke's cap is what stage 1 has left; it rewrites smoke.json after each item:
    cut with every finished item passed, it reads CUT; with one failed, or none written,
    FAIL."""
    status = tmp_path / "status"
    status.write_text("smoke 124 45\n")
    rows = acceptance_summary.read_status(status)
    assert acceptance_summary.verdict("smoke", 124, tmp_path) == "FAIL (time cap reached)"
    items = [{"name": "versions", "status": "PASS"}, {"name": "cuDNN handle", "status": "SKIP"}]
    (tmp_path / "smoke.json").write_text(json.dumps({"items": items}))
    assert acceptance_summary.verdict("smoke", 124, tmp_path).startswith("CUT (time cap "
                                                                         "reached after 2")
    assert acceptance_summary.failed_parts(tmp_path, rows) == []
    items.append({"name": "conv fp32 NCHW", "status": "FAIL"})
    (tmp_path / "smoke.json").write_text(json.dumps({"items": items}))
    assert acceptance_summary.failed_parts(tmp_path, rows) == ["smoke"]
