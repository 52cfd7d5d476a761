"""scripts/gpu_smoke.py on the CPU: every item runs even after a failure, GPU items are
SKIP with the reason when there is no GPU, the exit status follows the non-GPU items, and
the items that need no GPU pass here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import gpu_smoke  # noqa: E402


def _boom() -> str:
    raise RuntimeError("injected")


def _skip() -> str:
    raise gpu_smoke.Skip("torch not installed")


def test_every_item_runs_after_a_failure_and_gpu_items_skip_without_a_gpu():
    ran = []
    items = [gpu_smoke.Item("a", False, _boom),
             gpu_smoke.Item("b", False, lambda: ran.append("b") or "fine"),
             gpu_smoke.Item("c", True, lambda: ran.append("c") or "never"),
             gpu_smoke.Item("d", False, _skip)]
    results = gpu_smoke.run_items(items, "no driver")
    assert ran == ["b"]
    assert [r.status for r in results] == ["FAIL", "PASS", "SKIP", "SKIP"]
    assert results[0].detail == "RuntimeError: injected" and "_boom" in results[0].traceback
    assert results[2].detail == "no usable GPU: no driver"
    assert gpu_smoke.exit_status(results) == 1
    assert gpu_smoke.exit_status(results[1:]) == 0  # SKIP is not a failure
    text = gpu_smoke.table(results)
    assert text.splitlines()[0].split() == ["item", "result", "seconds", "detail"]
    assert [line.split()[1] for line in text.splitlines()[1:]] == \
        ["FAIL", "PASS", "SKIP", "SKIP"]


def test_each_finished_item_is_written_and_the_time_cap_cuts_the_running_one(tmp_path,
                                                                            monkeypatch):
    """The stage's time cap sends SIGINT: the item it interrupts is recorded as cut, the
    rest do not start, and smoke.json holds every finished item (written after each)."""
    def capped() -> str:
        raise KeyboardInterrupt

    seen = []
    items = [gpu_smoke.Item("a", False, lambda: "fine"), gpu_smoke.Item("b", False, capped),
             gpu_smoke.Item("c", False, lambda: seen.append("c") or "never")]
    written = []
    results = gpu_smoke.run_items(items, None, lambda r: written.append([x.name for x in r]))
    assert [r.status for r in results] == ["PASS", "FAIL"] and seen == []
    assert results[1].detail == "cut by the time cap"
    assert written == [["a"], ["a", "b"]]
    out = tmp_path / "smoke.json"
    monkeypatch.setattr(gpu_smoke, "gpu_unavailable", lambda: None)
    monkeypatch.setattr(gpu_smoke, "items", lambda seed, gpu: items)
    assert gpu_smoke.main(["--json", str(out), "--seed", "1"]) == 1
    data = json.loads(out.read_text())
    assert [i["name"] for i in data["items"]] == ["a", "b"] and data["exit_status"] == 1
    assert not (tmp_path / "smoke.json.tmp").exists()


def test_with_a_gpu_the_gpu_items_run():
    results = gpu_smoke.run_items([gpu_smoke.Item("c", True, lambda: "ran")], None)
    assert results[0].status == "PASS" and results[0].detail == "ran"


def test_the_item_list_is_the_issues():
    names = [i.name for i in gpu_smoke.items(0, gpu=False)]
    assert names == ["versions", "cuDNN handle", "conv fp32 NCHW", "fp16 NHWC identity",
                     "BN+add+ReLU fp16", "kernel compile", "captured step",
                     "torch side stream", "syncs per step"]
    needs = {i.name: i.needs_gpu for i in gpu_smoke.items(0, gpu=False)}
    assert not needs["versions"] and not needs["kernel compile"]
    kernel = {i.name: i.run for i in gpu_smoke.items(0, gpu=False)}["kernel compile"]
    assert kernel is gpu_smoke.kernel_compile_nvrtc  # without a GPU: NVRTC only


def test_errors_count_nan_and_shape_as_infinite():
    want = np.array([1.0, -2.0, 4.0])
    assert gpu_smoke.rel_error(want + 0.04, want) == pytest.approx(0.01)
    assert gpu_smoke.rel_error(np.array([1.0, np.nan, 4.0]), want) == float("inf")
    assert gpu_smoke.rel_error(want[:2], want) == float("inf")
    assert "1.0e-02" in gpu_smoke.check({"y": 0.01}, 0.02)
    with pytest.raises(AssertionError, match=r"error above 0\.001: y 1\.0e-02"):
        gpu_smoke.check({"y": 0.01}, 1e-3)
    with pytest.raises(AssertionError):
        gpu_smoke.check({"y": float("nan")}, 1e-3)


def test_versions_item_reads_cudnn_and_packages_without_a_gpu():
    text = gpu_smoke.versions()
    assert "cuDNN 9" in text and "convfuse" in text and "driver" in text


def test_main_without_a_gpu_skips_every_gpu_item_and_exits_zero(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_smoke, "gpu_unavailable", lambda: "no CUDA driver")
    monkeypatch.setattr(gpu_smoke, "kernel_compile_nvrtc", lambda: "compiled (stubbed)")
    out = tmp_path / "smoke.json"
    assert gpu_smoke.main(["--json", str(out), "--seed", "7"]) == 0
    report = json.loads(out.read_text())
    assert report["seed"] == 7 and report["exit_status"] == 0
    by_name = {i["name"]: i for i in report["items"]}
    assert {n for n, i in by_name.items() if i["status"] == "PASS"} == \
        {"versions", "kernel compile"}
    assert all(i["status"] == "SKIP" and "no CUDA driver" in i["detail"]
               for i in by_name.values() if i["needs_gpu"])
