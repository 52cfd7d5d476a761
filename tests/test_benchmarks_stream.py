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
    cut, before the run ends (a cut section used to leave no line at all)."""
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
            if line.startswith("biasgrad") and line.rstrip().endswith(": ok"):
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
    assert not (tmp_path / "r.json").exists()  # the run ended there
