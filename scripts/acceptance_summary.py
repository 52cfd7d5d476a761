"""Write summary.md for scripts/gpu_acceptance.sh: pass or fail per part with its key
numbers, read from the files the parts left in OUTDIR.

  python scripts/acceptance_summary.py OUTDIR STATUSFILE

STATUSFILE has one line per part: `name exit_code seconds`. Exit code 124 means the part
ran out of its time share; 127 that it did not run (a tool is missing: skipped).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

PARTS = {  # name -> (title, the file it leaves in OUTDIR)
    "fresh-wheel": ("Fresh wheel with only the runtime extra compiles every kernel", None),
    "selfcheck": ("convfuse selfcheck --json", "selfcheck.json"),
    "pytest-gpu": ("pytest tests/gpu (fusion lost where documented = failure)", "pytest-gpu.xml"),
    "benchmark": ("benchmarks/fused_vs_unfused.py (full)", "benchmark.json"),
    "syncs": ("Device-to-host copies and syncs per training step", "syncs.json"),
    "sanitizer": ("compute-sanitizer memcheck: one eager step and one replay", "sanitizer.txt"),
}
MAX_BYTES = 16 * 1024 * 1024


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def details(name: str, out: Path) -> str:
    """The key numbers of one part, from its file."""
    if name == "selfcheck" and (d := _load(out / "selfcheck.json")):
        counts = d.get("counts", {})
        failed = [f"{c.get('name')} [{c.get('dtype')}]" for c in d.get("checks", [])
                  if c.get("status") == "fail"]
        paths = [c.get("detail") for c in d.get("checks", [])
                 if c.get("name") == "fused forward paths"]
        text = f"ok={d.get('ok')} counts={counts}"
        if failed:
            text += f"; failed: {', '.join(failed[:20])}"
        if paths:
            text += f"; forward paths: {paths[0]}"
        return text
    if name == "pytest-gpu" and (out / "pytest-gpu.xml").is_file():
        try:
            root = ET.parse(out / "pytest-gpu.xml").getroot()
        except ET.ParseError as exc:
            return f"unreadable JUnit XML: {exc}"
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        if suite is None:
            return "no testsuite in the JUnit XML"
        a = suite.attrib
        bad = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
               if c.find("failure") is not None or c.find("error") is not None]
        text = (f"tests={a.get('tests')} failures={a.get('failures')} errors={a.get('errors')} "
                f"skipped={a.get('skipped')} time={a.get('time')}s")
        if bad:
            text += "; failing: " + ", ".join(bad[:15]) + (" ..." if len(bad) > 15 else "")
        return text
    if name == "benchmark" and (d := _load(out / "benchmark.json")):
        rec = (d.get("bias_grad_recommendation") or {}).get("text")
        return (f"engine={d.get('engine')} device={d.get('device_name')} "
                f"cases={d.get('counts')}" + (f"; bias gradient: {rec}" if rec else ""))
    if name == "syncs" and (d := _load(out / "syncs.json")):
        parts = [f"method: {d.get('method')}"]
        for key in ("convfuse eager step", "convfuse captured step"):
            r = d.get(key) or {}
            parts.append(f"{key.split()[1]}: syncs/step={r.get('syncs_per_step')} "
                         f"D2H/step={r.get('d2h_copies_per_step')}"
                         + (f" {r.get('sync_calls')}" if r.get("sync_calls") else ""))
        parts.append(f"capture probe: {d.get('capture_probe')}")
        return "; ".join(parts)
    if name == "sanitizer" and (out / "sanitizer.txt").is_file():
        lines = (out / "sanitizer.txt").read_text(errors="replace").splitlines()
        summary = [ln for ln in lines if "ERROR SUMMARY" in ln]
        return "; ".join(summary) or "no ERROR SUMMARY line (see sanitizer.txt)"
    return ""


def verdict(name: str, rc: int, out: Path) -> str:
    if rc == 127:
        return "SKIP"
    if rc == 124:
        return "FAIL (time share exhausted)"
    if rc != 0:
        return "FAIL"
    if name == "syncs" and (d := _load(out / "syncs.json")):
        counts = [(d.get(k) or {}).get(m) for k in ("convfuse eager step",
                                                   "convfuse captured step")
                  for m in ("syncs_per_step", "d2h_copies_per_step")]
        if any(c for c in counts if c is not None):
            return "FAIL (target is zero)"
        if str(d.get("capture_probe", "pass")).startswith("fail"):
            return "FAIL (capture probe)"
    return "PASS"


def write(out: Path, status_file: Path) -> str:
    rows = []
    for line in status_file.read_text().splitlines():
        name, rc, seconds = line.split()[:3]
        rows.append((name, int(rc), float(seconds)))
    lines = ["# convfuse GPU acceptance run", "",
             "| part | result | seconds | key numbers |", "| --- | --- | --- | --- |"]
    for name, rc, seconds in rows:
        title = PARTS.get(name, (name, None))[0]
        lines.append(f"| {title} | {verdict(name, rc, out)} | {seconds:.0f} | "
                     f"{details(name, out).replace('|', '/')} |")
    total = sum(s for _, _, s in rows)
    big = [p.name for p in out.iterdir() if p.is_file() and p.stat().st_size >= MAX_BYTES]
    lines += ["", f"Total: {total:.0f} s. Exit codes: 124 = out of time, 127 = tool missing "
              "(skipped). Full logs: log.txt."]
    if big:
        lines.append(f"Files at the 16 MB cap (truncated): {', '.join(big)}")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


if __name__ == "__main__":
    print(write(Path(sys.argv[1]), Path(sys.argv[2])), end="")
