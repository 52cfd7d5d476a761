"""benchmarks/fused_vs_unfused.py --stream: one JSON line per section, appended as each
finishes, each naming the environment (device, driver, versions), so that the acceptance
run's benchmark part keeps every finished section when it is cut."""

from __future__ import annotations

import json
import subprocess
import sys

from tests._benchmarks_helpers import SCRIPT


def test_stream_writes_a_line_per_section_with_the_environment(tmp_path):
    stream = tmp_path / "bench.jsonl"
    stream.write_text('{"section": "earlier run"}\n')  # appended to, never rewritten
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--quiet", "--device", "cpu", "--no-torch",
         "--sections", "adam,biasgrad", "--stream", str(stream), "--out",
         str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in stream.read_text().splitlines()]
    assert [line["section"] for line in lines] == [
        "earlier run", "biasgrad", "adam", "conv_transpose"]  # the last one is on by default
    full = json.loads((tmp_path / "r.json").read_text())
    for line in lines[1:]:
        env = line["environment"]
        assert env["engine"] == "cpu" and env["cudnn"] and env["convfuse"]
        assert {"gpu", "cupy", "torch", "git_commit"} <= set(env)
    for line in lines[1:3]:
        assert line["results"] == full["results"][line["section"]]
        assert sum(line["counts"].values()) == len(line["results"]) > 0
    assert lines[3]["results"] == full["conv_transpose"] and full["conv_transpose"]


def test_a_time_caps_sigterm_streams_the_cases_the_section_finished(tmp_path):
    """timeout(1) sends SIGTERM: the running section's finished cases are streamed, marked
    cut, and written into the run's JSON before the run ends, still with a failing exit."""
    import signal

    stream = tmp_path / "bench.jsonl"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--no-torch",
         "--no-conv-transpose", "--sections", "biasgrad", "--stream", str(stream),
         "--out", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        done = 0
        for line in proc.stderr:  # the log: one line per finished case
            if line.startswith("biasgrad") and ": ok" in line:
                done += 1
                if done == 2:
                    proc.send_signal(signal.SIGTERM)
                    break
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert done == 2 and proc.returncode != 0
    [line] = [json.loads(t) for t in stream.read_text().splitlines()]
    assert line["section"] == "biasgrad" and line["cut"] is True
    assert len(line["results"]) >= 2 and all(r["status"] == "ok" for r in line["results"])
    assert sum(line["counts"].values()) == len(line["results"])
    # the run ended there, and its JSON holds what it finished, marked cut (it used to
    # write none)
    payload = json.loads((tmp_path / "r.json").read_text())
    assert payload["cut"] is True
    assert [r["case"] for r in payload["results"]["biasgrad"]] == \
        [r["case"] for r in line["results"]]


def test_a_section_or_extra_that_raises_outside_a_case_is_an_error_record(tmp_path,
                                                                          monkeypatch):
    """A section raising outside its cases (records.guarded keeps those) and an extra
    raising become error records; the other sections run and the JSON is written."""
    import importlib

    sys.path.insert(0, str(SCRIPT.parent))
    fvu = importlib.import_module("fused_vs_unfused")

    def broken(ctx):
        raise RuntimeError("no such shape")

    monkeypatch.setitem(fvu.SECTIONS, "adam", broken)
    monkeypatch.setattr(fvu.conv_transpose, "run", lambda quick: 1 / 0)
    out = tmp_path / "r.json"
    code = fvu.main(["--quick", "--quiet", "--device", "cpu", "--no-torch", "--sections",
                     "adam,biasgrad", "--out", str(out), "--plot", str(tmp_path / "r.png")])
    payload = json.loads(out.read_text())
    assert code == 1 and payload["cut"] is False
    [rec] = payload["results"]["adam"]
    assert rec["status"] == "error" and rec["reason"] == "RuntimeError: no such shape"
    assert payload["results"]["biasgrad"] and \
        all(r["status"] in ("ok", "skipped") for r in payload["results"]["biasgrad"])
    assert payload["conv_transpose"]["error"] == "ZeroDivisionError: division by zero"
    assert payload["counts"]["error"] == 2
