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
