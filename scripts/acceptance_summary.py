"""Write summary.md for scripts/gpu_acceptance.sh: one row per part (done, running or still
to come), with its verdict and key numbers read from the files the parts leave in OUTDIR.

  python scripts/acceptance_summary.py OUTDIR STATUSFILE --stage N --plan "a b c"
         [--running NAME --since EPOCH] [--gpu-reason TEXT] [--started EPOCH]
  python scripts/acceptance_summary.py OUTDIR STATUSFILE --cut CHUNK --expected N --why TEXT
  python scripts/acceptance_summary.py OUTDIR STATUSFILE --failed

The script calls it before the first part and after every part, so a run killed at any
second leaves a summary naming the part that was cut. It writes summary.md atomically
(a temporary file renamed over it) and uses only the standard library.

--cut appends a `cut` line for a chunk that ended before its last test to tests.jsonl
(the test it reached, how many it never reached) and prints the same as a note; --failed
prints the parts that count as failures, one a line.

STATUSFILE has one line per finished part: `name exit_code seconds [note...]`. Exit codes
with a meaning of their own: 122 skipped, out of time (the sanitizer, whose time is what
the stage has left); 123 not run, because the GPU probe failed (the `gpu-probe` row, a
FAIL, says why); 124 the part ran out of its time cap (a pytest chunk cut so, with no
failing test, is CUT, not a failure: its tests were not reached, not wrong); 125 skipped,
no usable GPU; 126 not run, because the install failed; 127 skipped, a tool is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

TITLES = {
    "plan": "plan: collect tests/gpu, size the chunks (scripts/acceptance_plan.py)",
    "install": "offline install (pip --no-index --no-build-isolation --no-deps -e .)",
    "smoke": "scripts/gpu_smoke.py: does the core work?",
    "collect": "pytest tests/gpu --collect-only",
    "bench": "headline numbers (benchmarks/fused_vs_unfused.py --stream)",
    "syncs": "device-to-host syncs per training step (scripts/count_syncs.py)",
    "host": "host time per call against PyTorch eager (benchmarks' host-overhead, issue 25)",
    "sanitizer": "compute-sanitizer memcheck: one eager step and one replay",
    "gpu-probe": "GPU probe: does convfuse see the GPU the machine shows?",
}
SKIP_CODES = {122: "SKIP (out of time)", 123: "NOT RUN (GPU probe failed)",
              125: "SKIP (no usable GPU)", 126: "NOT RUN (install failed)",
              127: "SKIP (tool missing)"}
MAX_BYTES = 16 * 1024 * 1024


def title(name: str) -> str:
    if name.startswith("gpu-") and name not in TITLES:
        return f"pytest chunk {name}"
    return TITLES.get(name, name)


def _load(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _host_case(c: dict) -> str:
    """One host-overhead row: its ratio to PyTorch and goal, or why it has none."""
    goal = c.get("goal") or {}
    ratio = (c.get("ratios") or {}).get("convfuse/pytorch")
    if ratio is None:
        return f"{c.get('case')}: {c.get('status')}"
    verdict = "" if not goal else (f" (goal <= {goal.get('target')}: "
                                   f"{'met' if goal.get('met') else 'NOT met'})")
    extra = [f"{k} {v:.2f}x" for k, v in (c.get("ratios") or {}).items()
             if k != "convfuse/pytorch" and isinstance(v, (int, float))]
    # a form that could not be measured (a CUDA-graph capture that failed) is a finding
    extra += [f"{form}: {how}" for form, how in (c.get("forms") or {}).items()
              if how != "measured"]
    return f"{c.get('case')}: {ratio:.2f}x{verdict}" + "".join(f", {e}" for e in extra)


def _jsonl(path: Path) -> list[dict]:
    """Every complete line of a streamed JSON-lines file (a cut last line is ignored)."""
    rows: list[dict] = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return rows
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict):
                rows.append(row)
    return rows


def chunk_results(out: Path, chunk: str) -> tuple[Counter, list[str], str | None]:
    """Outcome counts, the failing test ids and the test still running (if any) of one
    pytest chunk, from the streamed tests.jsonl."""
    outcomes, messages, started, _ = _chunk_rows(out, chunk)
    counts = Counter(outcomes.values())
    bad = [f"{t} ({messages.get(t, '')[:120]})" for t, o in outcomes.items()
           if o in ("failed", "error")]
    running = started[-1] if started and started[-1] not in outcomes else None
    return counts, bad, running


def _chunk_rows(out: Path, chunk: str
                ) -> tuple[dict[str, str], dict[str, str], list[str], dict | None]:
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    started: list[str] = []
    cut = None
    for row in _jsonl(out / "tests.jsonl"):
        if row.get("chunk") != chunk:
            continue
        if "cut" in row:
            cut = row
        elif "start" in row:
            started.append(str(row["start"]))
        elif "id" in row:
            test = str(row["id"])
            new = str(row.get("outcome"))
            if outcomes.get(test) not in ("failed", "error"):  # a teardown error keeps
                outcomes[test] = new
            if new in ("failed", "error"):
                messages[test] = str(row.get("message", ""))
    return outcomes, messages, started, cut


def record_cut(out: Path, chunk: str, expected: int, why: str) -> str:
    """Append the `cut` line of a chunk that ended early to tests.jsonl; return its note.
    The test it reached is the one running when it ended, else the last one that finished."""
    outcomes, _, started, _ = _chunk_rows(out, chunk)
    running = started[-1] if started and started[-1] not in outcomes else None
    reached = running or (started[-1] if started else None)
    missing = max(expected - len(outcomes), 0)
    if not missing and running is None:  # it ran to its end (a failure, not a cut)
        return ""
    row = {"chunk": chunk, "cut": reached, "running": running is not None,
           "finished": len(outcomes), "not_reached": missing, "expected": expected,
           "why": why}
    with open(out / "tests.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    return cut_text(row)


def cut_text(row: dict) -> str:
    where = (f"{'running' if row.get('running') else 'last finished'} {row.get('cut')}"
             if row.get("cut") else "before its first test")
    return (f"{row.get('why')}: {where}; {row.get('not_reached')} of "
            f"{row.get('expected')} tests not reached")


def _junit_chunk(out: Path, chunk: str) -> str:
    try:
        root = ET.parse(out / "junit.xml").getroot()
    except (OSError, ET.ParseError):
        return ""
    for suite in root.iter("testsuite"):
        if suite.get("name") == chunk:
            a = suite.attrib
            return (f"JUnit: tests={a.get('tests')} failures={a.get('failures')} "
                    f"errors={a.get('errors')} skipped={a.get('skipped')} time={a.get('time')}s")
    return ""


def details(name: str, out: Path, note: str = "") -> str:
    """The key numbers of one part, from its file."""
    text = note
    if _is_chunk(name):
        counts, bad, running = chunk_results(out, name)
        cut = _chunk_rows(out, name)[3]
        parts = [", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "no results"]
        if cut and cut_text(cut) not in note:
            parts.append(cut_text(cut))
        elif running and not cut:
            parts.append(f"cut while running {running}")
        if bad:
            parts.append("failing: " + "; ".join(bad[:10]) + (" ..." if len(bad) > 10 else ""))
        junit = _junit_chunk(out, name)
        if junit:
            parts.append(junit)
        text = " ".join(filter(None, [text, "; ".join(parts)]))
    elif name == "smoke" and (d := _load(out / "smoke.json")):
        items = d.get("items", [])
        counts = Counter(i.get("status") for i in items)
        failed = [i.get("name") for i in items if i.get("status") == "FAIL"]
        text = ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
        if failed:
            text += "; failed: " + ", ".join(map(str, failed))
        numbers = [f"{i.get('name')}: {i.get('detail')}" for i in items
                   if i.get("name") in ("versions", "kernel compile", "syncs per step")]
        if numbers:
            text += "; " + "; ".join(numbers)
    elif name == "bench":
        rows = _jsonl(out / "bench.jsonl")
        if rows:
            env = rows[0].get("environment") or {}
            gpu = env.get("gpu") or {}
            names = [str(r.get("section")) + (" (cut)" if r.get("cut") else "") for r in rows]
            text = (f"sections: {', '.join(names)}; "
                    f"device: {gpu.get('name') or env.get('label')}; "
                    f"errors: {sum(int((r.get('counts') or {}).get('error', 0)) for r in rows)}")
    elif name == "host":
        rows = [r for r in _jsonl(out / "bench.jsonl") if r.get("section") == "host-overhead"]
        cases = [c for r in rows for c in (r.get("results") or [])]
        text = "; ".join(_host_case(c) for c in cases) or "no host-overhead section written"
        if any(r.get("cut") for r in rows):
            text = f"cut by its time cap after {len(cases)} rows: {text}"
    elif name == "syncs" and (d := _load(out / "syncs.json")):
        parts = [f"method: {d.get('method')}"]
        for key in ("convfuse eager step", "convfuse captured step"):
            r = d.get(key) or {}
            parts.append(f"{key.split()[1]}: syncs/step={r.get('syncs_per_step')} "
                         f"D2H/step={r.get('d2h_copies_per_step')}"
                         + (f" {r.get('sync_calls')}" if r.get("sync_calls") else ""))
        parts.append(f"capture probe: {d.get('capture_probe')}")
        for key, r in (d.get("blocking_probe") or {}).items():
            parts.append(f"blocking probe, {key.split()[1]}: {r.get('blocked')} of "
                         f"{r.get('steps')} steps blocked ({r.get('inconclusive')} "
                         "inconclusive)")
        text = "; ".join(parts)
    elif name == "sanitizer" and (out / "log.txt").is_file():
        lines = (out / "log.txt").read_text(errors="replace").splitlines()
        text = "; ".join(ln for ln in lines if "ERROR SUMMARY" in ln) or \
            "no ERROR SUMMARY line (see log.txt)"
    return text


#: The benchmark parts, which stream one JSON line per finished section to bench.jsonl.
STREAMED = ("host", "bench")


def _is_chunk(name: str) -> bool:
    return name.startswith("gpu-") and name not in TITLES


def verdict(name: str, rc: int, out: Path) -> str:
    if rc in SKIP_CODES:
        return SKIP_CODES[rc]
    if rc == 124 and _is_chunk(name):
        if chunk_results(out, name)[1]:
            return "FAIL (then cut by its time cap)"
        return "CUT (time cap reached; not a failure)"
    if rc == 124 and name == "smoke" and (d := _load(out / "smoke.json")):
        # the smoke rewrites smoke.json after each item: cut with every finished item
        # passed (its cap is what stage 1 has left), the rest were not reached
        items = d.get("items") or []
        if items and not any(i.get("status") == "FAIL" for i in items):
            return (f"CUT (time cap reached after {len(items)} items, all passed or "
                    "skipped; the rest were not reached)")
    if rc == 124 and name in STREAMED and _jsonl(out / "bench.jsonl"):
        # the benchmarks stream each finished section: a cut keeps them (the later ones,
        # the likeliest cut, come last); the time cap is the plan's, not a finding
        return "CUT (time cap reached; the finished sections are in bench.jsonl)"
    if rc == 124:
        return "FAIL (time cap reached)"
    if rc != 0:
        return "FAIL"
    if name == "syncs" and (d := _load(out / "syncs.json")):
        counts = [(d.get(k) or {}).get(m) for k in ("convfuse eager step",
                                                   "convfuse captured step")
                  for m in ("syncs_per_step", "d2h_copies_per_step")]
        if any(c for c in counts if c is not None):
            return "FAIL (target is zero)"
        if d.get("error"):
            # nsys itself failed: no step ran under it, so nothing was counted
            return "FAIL (the sync counter's profiler failed)"
        if "capture_probe" not in d:
            return "FAIL (no capture probe ran)"
        if str(d["capture_probe"]).startswith("fail"):
            return "FAIL (capture probe)"
        probes = (d.get("blocking_probe") or {}).values()
        if any(r.get("blocked") for r in probes):
            return "FAIL (a step blocked on the device: blocking probe)"
        if any(not r.get("free") for r in probes):
            return "FAIL (the blocking probe saw nothing: its spin never outlasted a step)"
    return "PASS"


def read_status(status_file: Path) -> list[tuple[str, int, float, str]]:
    rows: list[tuple[str, int, float, str]] = []
    with contextlib.suppress(OSError):
        for line in status_file.read_text().splitlines():
            fields = line.split(maxsplit=3)
            if len(fields) >= 3:
                rows.append((fields[0], int(fields[1]), float(fields[2]),
                             fields[3] if len(fields) > 3 else ""))
    return rows


def failed_parts(out: Path, rows: list[tuple[str, int, float, str]]) -> list[str]:
    """The parts that count as failures: not passed, not skipped, and not a chunk its cap
    cut before it found anything wrong; a part that exited 0 counts where its verdict
    reads its output as a failure (the sync counter exits 0 and reports its numbers)."""
    return [name for name, rc, *_ in rows
            if rc == 126 or (rc not in SKIP_CODES
                             and verdict(name, rc, out).startswith("FAIL"))]


def _utc(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).strftime("%H:%M:%S")


def render(out: Path, status_file: Path, stage: str, plan: list[str],
           running: str | None = None, since: float | None = None,
           gpu_reason: str | None = None, started: float | None = None) -> str:
    rows = read_status(status_file)
    done = {name for name, *_ in rows}
    lines = [f"# convfuse GPU acceptance run, stage {stage}", ""]
    if started is not None:
        lines.append(f"Started {_utc(started)} UTC; updated {_utc(_now())} UTC "
                     f"({_now() - started:.0f} s in).")
    if any(name == "gpu-probe" and rc for name, rc, *_ in rows):
        lines.append(f"**FAILED: the machine shows an NVIDIA GPU, but convfuse cannot use "
                     f"it ({gpu_reason}); the stage ended after the install.** log.txt "
                     "holds the diagnosis (nvidia-smi, cupy.show_config(), torch.cuda).")
    elif gpu_reason:
        lines.append(f"**No usable GPU ({gpu_reason}): the GPU parts were skipped.** "
                     "Nothing below is a GPU result.")
    if running:
        lines.append(f"**running: {running} since {_utc(since or _now())} UTC** "
                     "(if this line is still here, the run was cut during this part).")
    lines += ["", "| part | result | seconds | key numbers |", "| --- | --- | --- | --- |"]
    for name, rc, seconds, note in rows:
        text = note if rc in SKIP_CODES else details(name, out, note)
        text = text.replace("|", "/").replace("\n", " ")
        lines.append(f"| {title(name)} | {verdict(name, rc, out)} | {seconds:.0f} | {text} |")
    if running and running not in done:
        text = details(running, out).replace("|", "/").replace("\n", " ")
        lines.append(f"| {title(running)} | RUNNING | {(_now() - (since or _now())):.0f} | "
                     f"{text} |")
    lines += [f"| {title(name)} | not reached | | |" for name in plan
              if name not in done and name != running]
    failed = failed_parts(out, rows)
    big = [p.name for p in out.iterdir() if p.is_file() and p.stat().st_size >= MAX_BYTES]
    lines += ["", f"Failed parts: {', '.join(failed) or 'none'}. Full output of every part: "
              "log.txt; per-test results: tests.jsonl (one JSON line per test) and junit.xml."]
    if big:
        lines.append(f"Files at the 16 MiB cap (truncated): {', '.join(big)}")
    return "\n".join(lines) + "\n"


def _now() -> float:
    return datetime.datetime.now(datetime.timezone.utc).timestamp()


def write(out: Path, status_file: Path, stage: str = "?", plan: list[str] | None = None,
          **kw) -> str:
    text = render(out, status_file, stage, plan or [], **kw)
    tmp = out / ".summary.md.tmp"
    tmp.write_text(text)
    os.replace(tmp, out / "summary.md")
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("status", type=Path)
    p.add_argument("--stage", default="?")
    p.add_argument("--plan", default="")
    p.add_argument("--running")
    p.add_argument("--since", type=float)
    p.add_argument("--started", type=float)
    p.add_argument("--gpu-reason")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--cut", metavar="CHUNK")
    p.add_argument("--expected", type=int, default=0)
    p.add_argument("--why", default="cut by its time cap")
    p.add_argument("--failed", action="store_true")
    a = p.parse_args(argv)
    if a.cut:
        print(record_cut(a.out, a.cut, a.expected, a.why))
        return 0
    if a.failed:
        print("".join(f"{n}\n" for n in failed_parts(a.out, read_status(a.status))), end="")
        return 0
    text = write(a.out, a.status, a.stage, a.plan.split(), running=a.running, since=a.since,
                 gpu_reason=a.gpu_reason, started=a.started)
    if not a.quiet:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
