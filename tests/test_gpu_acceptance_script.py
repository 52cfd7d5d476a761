"""scripts/gpu_acceptance.sh and its helpers, on the CPU: the dry run names every part with
its cap and each stage's cap; OUTDIR keeps to 8 files with safe names; summary.md is
written before the first part and after each, and a SIGKILL leaves it naming the part that
was cut; a .venv in the checkout is never used; the fusion_strict plugin fails a test
exactly when fusion is lost where cuDNN documents it; the stream_results plugin writes one
line per test as it happens; the sync counter classifies nsys rows.

The full offline rehearsal (a fresh clone, no network, the CUDA toolkit hidden, a copy of
the GPU machine's Python) takes minutes and needs root for unshare: docs/VERIFYING.md
section 7 gives the command, and test_offline_rehearsal runs it where
CONVFUSE_REHEARSAL_PYTHON names that copy's bin folder. The stages' arithmetic (the plan,
the warm tree's build, cut chunks, the sanitizer's skip) is tested in
tests/test_gpu_acceptance_stages.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from convfuse._binding import cudnn
from convfuse.errors import CudnnError
from convfuse.geometry import ConvGeometry
from convfuse.plan import clear_plan_cache, get_plan

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
SCRIPT = SCRIPTS / "gpu_acceptance.sh"
sys.path.insert(0, str(SCRIPTS))
import acceptance_plan  # noqa: E402
import acceptance_summary  # noqa: E402
import count_syncs  # noqa: E402
import fusion_strict  # noqa: E402

SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
BENCH_SECTIONS = re.search(r'^BENCH_SECTIONS="([^"]+)"', SCRIPT.read_text(), re.M)[1]


def _run(args, env=None, cwd=None, timeout=120):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, timeout=timeout)


def test_dry_run_sizes_every_chunk_from_the_collected_tests(tmp_path):
    """Issue 23 item 1: one line per chunk with its tests and guaranteed seconds (at least
    15 + 0.1 s per test), every tests/gpu file in exactly one chunk, every stage's
    minimums within its cap, and the stages fit two leases."""
    out = tmp_path / "out"
    proc = _run(["--dry-run", str(out)], env={"PYTHON": sys.executable}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    assert "dry run" in text and not out.exists()
    total = int(re.search(r"^collected (\d+) tests in tests/gpu", text, re.M)[1])
    chunks = {m[0]: (int(m[1]), int(m[2])) for m in
              re.findall(r"^chunk (\S+): (\d+) tests, at least (\d+) s$", text, re.M)}
    assert {"gpu-core", "gpu-ops", "gpu-bn", "gpu-selfcheck"} <= set(chunks)
    assert all(m >= 0.1 * n + 15 for n, m in chunks.values())
    assert sum(n for n, _ in chunks.values()) == total - 1  # the deselected selfcheck CLI
    stage_caps = {m[0]: (int(m[1]), int(m[2])) for m in
                  re.findall(r"^stage (\d): cap (\d+) s, minimums (\d+) s$", text, re.M)}
    assert all(lo <= cap - 5 <= 295 for cap, lo in stage_caps.values())
    blocks = re.split(r"^stage (\d) parts.*$", text, flags=re.M)
    parts = {blocks[i]: blocks[i + 1].split("\nstage ")[0] for i in range(1, len(blocks), 2)}
    assert set(parts) == set(stage_caps)
    rows = {stage: re.findall(r"^  (\S+)\s+(\d+)(-\d+|\+)? s  gpu=(yes|no)\s+(.*)$", block,
                              re.M) for stage, block in parts.items()}
    for stage, found in rows.items():
        assert [r[0] for r in found[:2]] == ["install", "plan"]
        assert sum(int(r[1]) for r in found) == stage_caps[stage][1]
        for name, lo, _, _, cmd in found:
            if name in chunks:
                assert int(lo) == chunks[name][1] and f"chunk {name} {chunks[name][0]} " in cmd
    assert [r[0] for r in rows["1"][:3]] == ["install", "plan", "smoke"]
    # issue 25's host time and the sync count first in stage 2, nothing before them
    assert [r[0] for r in rows["2"][:4]] == ["install", "plan", "host", "syncs"]
    where = {r[0]: stage for stage, found in rows.items() for r in found}
    assert where["gpu-core"] == "1" and set(where) >= set(chunks) | {"bench", "syncs"}
    assert int(where["bench"]) >= 2 and where["sanitizer"] == where["bench"]
    assert f"--sections {BENCH_SECTIONS} " in rows[where["bench"]][
        [r[0] for r in rows[where["bench"]]].index("bench")][4]
    # the cold tests (a timeout marker above 60 s) in a part of their own, said to be
    # outside lease 1, not cut silently at the end of a chunk
    cold = [name for name in where if name.startswith("gpu-cold")]
    assert cold and all(int(where[name]) >= 3 for name in cold)
    assert re.search(r"^\d+ cold tests .* run in gpu-cold, stage [34].*not in lease 1$", text,
                     re.M)
    # every GPU test file is in exactly one chunk
    listed = re.findall(r"tests/gpu/(test_\w+\.py)(?!::)", "".join(
        r[4] for found in rows.values() for r in found if r[0] in chunks))
    assert sorted(listed) == sorted(p.name for p in (REPO / "tests/gpu").glob("test_*.py"))
    leases = re.findall(r"^lease (\d): stages ([\d ]+)$", text, re.M)
    assert leases[0] == ("1", "1 2") and len(leases) <= 2
    collected = tmp_path / "collected.txt"
    collected.write_text("tests/gpu/test_cudnn_ops.py::test_a[1]\n")
    one = _run(["--dry-run", "--stage", "1"], env={"PYTHON": sys.executable,
                                                   "ACCEPT_COLLECTED": str(collected)})
    assert "stage 1: cap" in one.stdout and "stage 2 parts" not in one.stdout
    assert "chunk gpu-ops: 1 tests, at least 16 s" in one.stdout


def test_the_benchmark_sections_are_one_variable_near_the_top():
    lines = SCRIPT.read_text().splitlines()
    found = [i for i, line in enumerate(lines) if line.startswith("BENCH_SECTIONS=")]
    assert len(found) == 1 and found[0] < 60
    assert BENCH_SECTIONS.split(",") == ["forward", "backward", "biasgrad", "adam", "train",
                                         "compile"]
    # the planner's default is the script's
    assert acceptance_plan.script_default("BENCH_SECTIONS") == BENCH_SECTIONS
    assert f"PLAN_STAGE_CAP={acceptance_plan.PLAN_STAGE_CAP}\n" in SCRIPT.read_text()


def test_a_dry_run_without_pytest_fails_loudly(tmp_path):
    proc = _run(["--dry-run"], env={"PYTHON": str(tmp_path / "no-python")}, cwd=tmp_path)
    assert proc.returncode == 1 and "the plan failed" in proc.stderr


@pytest.mark.parametrize("args", [[], ["--stage", "1"], ["--stage", "5", "x"], ["--bogus"]])
def test_usage_errors_exit_2(args):
    proc = _run(args, timeout=60)
    assert proc.returncode == 2 and ("usage" in proc.stderr or "stage" in proc.stderr
                                     or "unknown" in proc.stderr)


def test_outdir_keeps_to_eight_safe_names_no_deeper_than_the_folder(tmp_path):
    text = SCRIPT.read_text()
    files = re.search(r'^FILES="([^"]+)"', text, re.M)[1].split()
    temporaries = re.search(r'^TEMPORARIES="([^"]+)"', text, re.M)[1].split()
    assert all(SAFE_NAME.match(f) for f in files + temporaries)
    # every path the script, its parts or the summary write under $OUT is a listed file
    # or a listed temporary (renamed over its target; a stale one is removed at the start)
    written = set(re.findall(r'\$OUT/([A-Za-z0-9._-]+)',
                             text + (SCRIPTS / "acceptance_plan.py").read_text()))
    written |= set(re.findall(r'out / "([^"]+)"', (SCRIPTS / "acceptance_summary.py")
                              .read_text()))
    assert written <= {*files, *temporaries}, written - set(files)
    assert "/" not in "".join(written)
    # per stage: the files its parts name, the summary and log, and the chunks' two; the
    # temporaries are written one at a time (the summary's between parts, the others
    # inside a part), so a kill leaves at most one: 7 + 1 at most
    collected = tmp_path / "collected.txt"
    collected.write_text("".join(f"{p.relative_to(REPO)}::t\n"
                                 for p in (REPO / "tests/gpu").glob("test_*.py"))
                         + "cold-test 240 tests/gpu/test_torch_backend_gpu.py::t\n")
    proc = _run(["--dry-run"], env={"PYTHON": sys.executable,
                                    "ACCEPT_COLLECTED": str(collected)})
    assert proc.returncode == 0, proc.stderr
    blocks = re.split(r"^stage (\d) parts.*$", proc.stdout, flags=re.M)
    stages = {blocks[i]: blocks[i + 1].split("\nstage ")[0] for i in range(1, len(blocks), 2)}
    assert set(stages) >= {"1", "2", "3"}
    union = set()
    for stage, block in stages.items():
        named = set(re.findall(r'\$OUT/([A-Za-z0-9._-]+)', block))
        if re.search(r"^  gpu-", block, re.M):
            named |= {"tests.jsonl", "junit.xml"}
        named |= {"summary.md", "log.txt"}
        assert named <= set(files) and len(named) + 1 <= 8, (stage, named)
        union |= named
    assert union == set(files)
    assert "smoke.json" in re.findall(r'\$OUT/([A-Za-z0-9._-]+)', stages["1"])
    assert {"host.json", "syncs.json"} <= set(re.findall(r'\$OUT/([A-Za-z0-9._-]+)',
                                                         stages["2"]))


def _parts_file(tmp_path, lines):
    path = tmp_path / "parts.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def _env(tmp_path, parts, **extra):
    return {"ACCEPT_PARTS_FILE": str(parts), "PYTHON": sys.executable,
            "PYTHONPATH": str(REPO), **extra}


def test_summary_streams_and_a_part_past_its_cap_fails(tmp_path):
    out = tmp_path / "out"
    parts = _parts_file(tmp_path, [
        "install|20|no|echo installed; test -z \"$(ls \"$OUT\" | grep -v -e summary.md"
        " -e log.txt)\"",
        "first|20|no|grep -q 'running: first since' \"$OUT/summary.md\" && echo saw-running",
        "slow|8|no|sleep 30",
        "needsgpu|20|yes|echo never",
        "after|20|no|grep -q '| slow | FAIL (time cap reached)' \"$OUT/summary.md\"",
    ])
    proc = _run(["--stage", "1", str(out)], env=_env(tmp_path, parts), timeout=120)
    summary = (out / "summary.md").read_text()
    log = (out / "log.txt").read_text()
    assert "installed" in log and "saw-running" in log, log
    rows = {line.split(" | ")[0].lstrip("| "): line for line in summary.splitlines()
            if line.startswith("| ") and "---" not in line}
    assert "| PASS |" in rows[acceptance_summary.title("install")]
    assert "| PASS |" in rows["first"]
    assert "FAIL (time cap reached)" in rows["slow"]
    assert "| PASS |" in rows["after"]
    from convfuse.backend import gpu_unavailable_reason

    if gpu_unavailable_reason():  # this machine: the GPU part is skipped and says so
        assert "SKIP (no usable GPU)" in rows["needsgpu"] and "GPU parts were skipped" in summary
    assert proc.returncode == 1  # the slow part failed
    assert "running:" not in summary  # finished: nothing is running
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "summary.md"]


def test_a_pytest_chunk_streams_its_tests_and_merges_its_junit(tmp_path):
    tests = tmp_path / "test_chunk.py"
    tests.write_text("def test_ok():\n    pass\n\ndef test_bad():\n    assert 2 + 2 == 5\n")
    out = tmp_path / "out"
    parts = _parts_file(tmp_path, [f"gpu-a|30|no|chunk gpu-a 2 {tests}",
                                   f"gpu-b|30|no|chunk gpu-b 1 {tests}::test_ok"])
    proc = _run(["--stage", "1", str(out)], env=_env(tmp_path, parts), timeout=300)
    assert proc.returncode == 1  # gpu-a has a failing test
    import xml.etree.ElementTree as ET

    suites = {s.get("name"): s for s in ET.parse(out / "junit.xml").getroot().iter("testsuite")}
    assert set(suites) == {"gpu-a", "gpu-b"}
    assert suites["gpu-a"].get("tests") == "2" and suites["gpu-a"].get("failures") == "1"
    assert suites["gpu-b"].get("tests") == "1" and suites["gpu-b"].get("failures") == "0"
    counts, bad, running = acceptance_summary.chunk_results(out, "gpu-a")
    assert counts == {"passed": 1, "failed": 1} and running is None
    assert "assert (2 + 2) == 5" in bad[0] or "assert 4 == 5" in bad[0], bad
    summary = (out / "summary.md").read_text()
    assert "| pytest chunk gpu-a | FAIL |" in summary and "| pytest chunk gpu-b | PASS |" in summary
    assert sorted(p.name for p in out.iterdir()) == ["junit.xml", "log.txt", "summary.md",
                                                     "tests.jsonl"]


def test_a_file_that_fails_to_import_costs_its_own_tests_not_the_chunks(tmp_path):
    good = tmp_path / "test_good.py"
    good.write_text("def test_ok():\n    pass\n")
    broken = tmp_path / "test_broken.py"
    broken.write_text("import no_such_module_here\n")
    out = tmp_path / "out"
    parts = _parts_file(tmp_path, [f"gpu-a|30|no|chunk gpu-a 2 {broken} {good}"])
    proc = _run(["--stage", "1", str(out)], env=_env(tmp_path, parts), timeout=300)
    assert proc.returncode == 1  # the broken file is an error
    counts, _, _ = acceptance_summary.chunk_results(out, "gpu-a")
    assert counts.get("passed") == 1, counts  # the good file still ran


def test_sigkill_leaves_a_summary_naming_the_part_that_was_cut(tmp_path):
    out = tmp_path / "out"
    parts = _parts_file(tmp_path, ["install|20|no|true", "hang|60|no|echo hang-began; sleep 50",
                                   "later|20|no|true"])
    proc = subprocess.Popen(["bash", str(SCRIPT), "--stage", "2", str(out)],
                            env={**os.environ, **_env(tmp_path, parts)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            summary = out / "summary.md"
            log = out / "log.txt"
            if (summary.is_file() and "running: hang" in summary.read_text()
                    and "hang-began" in log.read_text()):  # the log streams, too
                break
            time.sleep(0.2)
        else:
            pytest.fail("the summary never said the part was running, or the log never "
                        "showed its output")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    text = (out / "summary.md").read_text()
    assert "running: hang since" in text and "the run was cut during this part" in text
    assert f"| {acceptance_summary.title('install')} | PASS |" in text
    assert re.search(r"^\| later \| not reached \|", text, re.M)


def test_a_broken_venv_in_the_checkout_is_never_used(tmp_path):
    checkout = tmp_path / "checkout"
    shutil.copytree(SCRIPTS, checkout / "scripts",
                    ignore=shutil.ignore_patterns("__pycache__"))
    broken = checkout / ".venv" / "bin"
    broken.mkdir(parents=True)
    (broken / "python").write_text("#!/bin/sh\necho BROKEN-VENV; exit 3\n")
    (broken / "python").chmod(0o755)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bindir / "python3").chmod(0o755)
    parts = _parts_file(tmp_path, ["install|20|no|\"$PY\" -c 'import sys; print(\"PY=\" + "
                                   "sys.executable)'"])
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update(ACCEPT_PARTS_FILE=str(parts), PYTHONPATH=str(REPO),
               PATH=f"{bindir}{os.pathsep}{env['PATH']}")
    proc = subprocess.run(["bash", str(checkout / "scripts" / "gpu_acceptance.sh"),
                           "--stage", "1", str(tmp_path / "out")], capture_output=True,
                          text=True, env=env, timeout=120)
    log = (tmp_path / "out" / "log.txt").read_text()
    assert "BROKEN-VENV" not in log + proc.stdout
    assert f"PY={sys.executable}" in log, log
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # ...unless PYTHON names it: then it is used, fails, and the stage says so
    env["PYTHON"] = str(broken / "python")
    proc = subprocess.run(["bash", str(checkout / "scripts" / "gpu_acceptance.sh"),
                           "--stage", "1", str(tmp_path / "out2")], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode != 0 and "BROKEN-VENV" in (tmp_path / "out2" / "log.txt").read_text()
    assert (tmp_path / "out2" / "summary.md").is_file()


def test_summary_reads_each_part(tmp_path):
    (tmp_path / "smoke.json").write_text(json.dumps({"items": [
        {"name": "versions", "status": "PASS", "detail": "cuDNN 91900"},
        {"name": "conv fp32 NCHW", "status": "FAIL", "detail": "error above 1e-05"},
        {"name": "torch side stream", "status": "SKIP", "detail": "no torch"}]}))
    lines = [{"chunk": "gpu-core", "start": "t.py::a"},
             {"chunk": "gpu-core", "id": "t.py::a", "outcome": "passed"},
             {"chunk": "gpu-core", "start": "t.py::b"},
             {"chunk": "gpu-core", "id": "t.py::b", "outcome": "failed",
              "message": "AssertionError: 3 != 4"},
             {"chunk": "gpu-core", "start": "t.py::hang"},
             {"chunk": "gpu-ops", "start": "u.py::c"},
             {"chunk": "gpu-ops", "id": "u.py::c", "outcome": "skipped"}]
    (tmp_path / "tests.jsonl").write_text("\n".join(map(json.dumps, lines)) + '\n{"chunk": "gp')
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite name="gpu-ops" tests="1" failures="0" errors="0" skipped="1" '
        'time="0.5"/></testsuites>')
    (tmp_path / "syncs.json").write_text(json.dumps({
        "method": "capture-probe", "capture_probe": "pass",
        "convfuse eager step": {"syncs_per_step": None, "d2h_copies_per_step": None},
        "convfuse captured step": {"syncs_per_step": 1.0, "d2h_copies_per_step": 0.0}}))
    (tmp_path / "bench.jsonl").write_text(json.dumps({
        "section": "forward", "counts": {"ok": 3, "error": 1},
        "environment": {"gpu": {"name": "NVIDIA H100"}}}) + "\n" + json.dumps({
        "section": "host-overhead", "counts": {"ok": 1, "skipped": 1},
        "results": [{"case": "conv_forward_nograd", "status": "ok",
                     "ratios": {"convfuse/pytorch": 1.234},
                     "goal": {"target": 1.5, "met": True}},
                    {"case": "resnet18_step_b8", "status": "skipped"}]}) + "\n")
    status = tmp_path / "status"
    status.write_text("install 0 40 \nsmoke 1 55\ngpu-core 124 60\ngpu-ops 0 20\nbench 0 90\n"
                      "syncs 0 10\nhost 0 30\nsanitizer 127 0 compute-sanitizer not on PATH\n")
    text = acceptance_summary.write(tmp_path, status, "2", ["install", "smoke", "gpu-core",
                                                          "gpu-ops", "bench", "syncs", "host",
                                                          "sanitizer", "extra"],
                                    started=time.time() - 300)
    assert (tmp_path / "summary.md").read_text() == text
    assert not (tmp_path / ".summary.md.tmp").exists()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()
            if line.startswith("| ") and "---" not in line}
    t = acceptance_summary.title
    assert "| PASS |" in rows[t("install")]
    smoke = rows[t("smoke")]
    assert "| FAIL |" in smoke and "failed: conv fp32 NCHW" in smoke and "SKIP=1" in smoke
    core = rows[t("gpu-core")]
    # a chunk cut by its cap after a failure: the failure counts, the cut is said
    assert "FAIL (then cut by its time cap)" in core and "cut while running t.py::hang" in core
    assert "passed=1" in core and "failed=1" in core and "t.py::b (AssertionError" in core
    assert "JUnit: tests=1" in rows[t("gpu-ops")] and "skipped=1" in rows[t("gpu-ops")]
    assert "NVIDIA H100" in rows[t("bench")] and "errors: 1" in rows[t("bench")]
    assert "FAIL (target is zero)" in rows[t("syncs")]
    host = rows[t("host")]
    assert "| PASS |" in host and "conv_forward_nograd: 1.23x (goal <= 1.5: met)" in host
    assert "resnet18_step_b8: skipped" in host
    assert "SKIP (tool missing)" in rows[t("sanitizer")] and "not on PATH" in rows[t("sanitizer")]
    assert "| not reached |" in rows["extra"]
    assert "Failed parts: smoke, gpu-core, syncs." in text
    running = acceptance_summary.render(tmp_path, status, "2", ["extra"], running="extra",
                                        since=time.time() - 5, gpu_reason="no driver")
    assert "**running: extra since" in running and "| RUNNING |" in running
    assert "GPU parts were skipped" in running


def test_stream_results_plugin_writes_a_line_per_test_as_it_happens(tmp_path):
    (tmp_path / "test_s.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_skip(): pass\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('setup broke')\n"
        "def test_setup_error(broken): pass\n")
    out = tmp_path / "tests.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SCRIPTS), str(REPO)]))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "-p", "stream_results", "--stream-results", str(out), "--chunk", "c1",
                    "test_s.py"], capture_output=True, text=True, env=env, cwd=tmp_path,
                   timeout=120)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["chunk"] == "c1" for r in rows)
    starts = [r["start"] for r in rows if "start" in r]
    results = {r["id"].split("::")[1]: r for r in rows if "id" in r}
    assert [s.split("::")[1] for s in starts] == ["test_ok", "test_bad", "test_skip",
                                                  "test_setup_error"]
    assert {k: v["outcome"] for k, v in results.items()} == {
        "test_ok": "passed", "test_bad": "failed", "test_skip": "skipped",
        "test_setup_error": "error"}
    assert "one is not two" in results["test_bad"]["message"]
    assert "not here" in results["test_skip"]["message"]
    counts, bad, running = acceptance_summary.chunk_results(tmp_path, "c1")
    assert counts == {"passed": 1, "failed": 1, "skipped": 1, "error": 1} and running is None
    assert [b.split(" (")[0].split("::")[1] for b in bad] == ["test_bad", "test_setup_error"]


@pytest.mark.skipif(not os.environ.get("CONVFUSE_REHEARSAL_PYTHON"),
                    reason="set CONVFUSE_REHEARSAL_PYTHON to the bin folder of a copy of the "
                           "GPU machine's Python (docs/VERIFYING.md section 7)")
@pytest.mark.slow
def test_offline_rehearsal(tmp_path):  # pragma: no cover (manual, minutes, root)
    """Every stage in one fresh clone, as on a warm machine: each exits 0 and says the GPU
    parts were skipped, and the stages after the first reuse the first one's build."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    (clone / ".venv" / "bin").mkdir(parents=True)  # broken: no interpreter inside
    bindir = os.environ["CONVFUSE_REHEARSAL_PYTHON"]
    for stage in ("1", "2", "3", "4"):
        out = tmp_path / f"out{stage}"
        cmd = (f"mount -t tmpfs none /usr/local/cuda; PATH={bindir}:$PATH "
               f"bash scripts/gpu_acceptance.sh --stage {stage} {out}")
        proc = subprocess.run(["unshare", "-n", "-m", "bash", "-c", cmd], cwd=clone,
                              capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        names = [p.name for p in out.iterdir()]
        assert len(names) <= 8 and all(SAFE_NAME.match(n) for n in names)
        assert "GPU parts were skipped" in (out / "summary.md").read_text()
        install = re.search(r"^gpu_acceptance: install exit 0 after (\d+) s", proc.stdout, re.M)
        if stage != "1":
            assert int(install[1]) <= 8 and "build reused" in (out / "log.txt").read_text()


def _message(geom, dtype, activation):
    from convfuse.ops.cudnn.fused import _fallback_message

    lib = cudnn()
    plan = get_plan(geom, dtype, activation)
    err = CudnnError(3000, "cudnnConvolutionBiasActivationForward", lib.getErrorString(3000))
    return _fallback_message(plan, err, True)


@pytest.mark.parametrize(("x", "w", "layout", "groups", "dtype", "act", "documented"), [
    ((1, 4, 6, 6), (8, 4, 3, 3), "NCHW", 1, "float32", "relu", True),
    ((1, 6, 6, 8), (8, 3, 3, 8), "NHWC", 1, "float16", "identity", True),
    ((1, 6, 6, 8), (8, 3, 3, 8), "NHWC", 1, "float16", "silu", True),  # IDENTITY fused
    ((1, 6, 6, 4), (8, 3, 3, 4), "NHWC", 1, "float16", "identity", False),  # C % 8 != 0
    ((1, 4, 6, 6), (8, 4, 3, 3), "NCHW", 1, "float16", "identity", True),
    ((1, 6, 6, 4), (8, 3, 3, 4), "NHWC", 1, "bfloat16", "relu", False),
    ((1, 4, 6, 6), (8, 4, 3, 3), "NCHW", 1, "float64", "relu", False),
    ((1, 4, 6, 6), (8, 2, 3, 3), "NCHW", 2, "float32", "relu", False),
    ((1, 4, 6), (8, 4, 3), "NCW", 1, "float32", "relu", False),
    ((1, 4, 4, 6, 6), (8, 4, 3, 3, 3), "NCDHW", 1, "float32", "relu", False),
])
def test_fusion_strict_knows_where_fusion_is_documented(x, w, layout, groups, dtype, act,
                                                        documented):
    try:
        geom = ConvGeometry.create(x, w, groups=groups, layout=layout)
        assert fusion_strict.documented(_message(geom, dtype, act)) is documented
    finally:
        clear_plan_cache()


def test_fusion_strict_counts_dilation_as_undocumented():
    doc = ("x[1, 10, 10, 8] w[8, 3, 3, 8] NHWC stride=[1, 1] padding=[2, 2] dilation=[1, 1] "
           "groups=1 dtype=float16 activation=identity")
    assert fusion_strict.documented(doc)
    assert not fusion_strict.documented(doc.replace("dilation=[1, 1]", "dilation=[2, 2]"))
    assert not fusion_strict.documented(doc.replace("w[8, 3, 3, 8]", "w[12, 3, 3, 8]"))


@pytest.mark.parametrize(("shape", "layout", "dtype", "act", "documented"), [
    ((2, 3, 3, 8), "NHWC", "float16", "relu", True),
    ((2, 4, 8), "NHWC", "float16", "relu", True),  # 1-D, lifted to 4-D
    ((2, 3, 3, 6), "NHWC", "float16", "relu", False),  # C % 4 != 0
    ((2, 8, 3, 3), "NCHW", "float16", "relu", False),
    ((2, 3, 3, 8), "NHWC", "float32", "relu", False),
    ((2, 3, 3, 8), "NHWC", "bfloat16", "relu", False),
    ((2, 3, 3, 8), "NHWC", "float16", "identity", False),
    ((4, 8), "NHWC", "float16", "relu", False),  # (N, C): no channels-last
    ((2, 3, 4, 3, 8), "NHWC", "float16", "relu", False),  # NDHWC: 5-d, not NHWC
])
def test_fusion_strict_knows_where_batchnorm_fusion_is_documented(shape, layout, dtype, act,
                                                                  documented):
    """The plugin's reading of a BatchNorm fallback message agrees with the plan's own
    rule (plan.batchnorm.fused_documented) on the message the engine really writes."""
    from convfuse.ops.cudnn import batchnorm as engine
    from convfuse.plan import FusedFallbackWarning
    from convfuse.plan.batchnorm import BatchNormGeometry, fused_documented, get_batchnorm_plan

    try:
        geom = BatchNormGeometry.create(shape, layout)
        plan = get_batchnorm_plan(geom, dtype, act, True)
        assert (fused_documented(geom, dtype) and act == "relu") is documented
        err = CudnnError(3000, "cudnnBatchNormalizationForwardTrainingEx",
                         cudnn().getErrorString(3000))
        with pytest.warns(FusedFallbackWarning) as record:
            engine._warn_fallback(plan, err, "batchNormalizationForwardTrainingEx")
        assert fusion_strict.documented(str(record[0].message)) is documented
    finally:
        clear_plan_cache()


def test_fusion_strict_plugin_fails_only_unexpected_documented_fallbacks(tmp_path):
    doc = ("x[1, 4, 6, 6] w[8, 4, 3, 3] NCHW stride=[1, 1] padding=[0, 0] dilation=[1, 1] "
           "groups=1 dtype=float32 activation=relu")
    undoc = doc.replace("float32", "bfloat16")
    (tmp_path / "test_strict.py").write_text(f'''
import warnings
import pytest
from convfuse.plan import FusedFallbackWarning

def test_documented():
    warnings.warn("fallback for {doc}", FusedFallbackWarning)

def test_undocumented():
    warnings.warn("fallback for {undoc}", FusedFallbackWarning)

def test_expected():
    with pytest.warns(FusedFallbackWarning):
        warnings.warn("fallback for {doc}", FusedFallbackWarning)

def test_other_warning():
    warnings.warn("unrelated", UserWarning)
''')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SCRIPTS), str(REPO)]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "fusion_strict", "-p", "no:randomly", "-rA", "test_strict.py"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    out = proc.stdout
    assert "FAILED test_strict.py::test_documented" in out, out
    assert "fusion lost where cuDNN documents it" in out
    for name in ("test_undocumented", "test_expected", "test_other_warning"):
        assert f"PASSED test_strict.py::{name}" in out, out
    assert "UserWarning: unrelated" in out  # handed back to pytest's warning summary


def test_sync_counter_classifies_calls_inside_the_step_ranges(tmp_path):
    api = tmp_path / "api.csv"
    api.write_text('"Start (ns)","Duration (ns)","Name"\n'
                   "100,5,cudaLaunchKernel\n110,5,cudaStreamSynchronize\n"
                   "120,5,cudaMemcpyAsync\n130,5,cudaMemcpy\n"
                   "500,5,cudaDeviceSynchronize\n"  # between the ranges: not counted
                   "900,5,cudaGraphLaunch\n910,5,cudaEventSynchronize\n")
    gpu = tmp_path / "gpu.csv"
    gpu.write_text('"Start (ns)","Duration (ns)","Name"\n'
                   '121,3,"[CUDA memcpy Device-to-Host]"\n122,3,"[CUDA memcpy Host-to-Device]"\n'
                   "901,3,kernel\n")
    nvtx = tmp_path / "nvtx.csv"
    nvtx.write_text('"Start (ns)","End (ns)","Name"\n'
                    '90,200,"convfuse eager step"\n890,950,"convfuse captured step"\n')
    result = count_syncs.classify(count_syncs.read_csv(api), count_syncs.read_csv(gpu),
                                  count_syncs.read_csv(nvtx), steps=1)
    eager, captured = result["convfuse eager step"], result["convfuse captured step"]
    assert eager["syncs_per_step"] == 2 and eager["d2h_copies_per_step"] == 1
    assert eager["sync_calls"] == ["cudaMemcpy", "cudaStreamSynchronize"]
    assert captured["syncs_per_step"] == 1 and captured["d2h_copies_per_step"] == 0
    assert count_syncs.read_csv(tmp_path / "missing.csv") == []


def test_sync_counter_imports_the_checkout_and_warms_the_capture_stream():
    """Issue 18 item 5: count_syncs puts the checkout first on sys.path (it runs before
    or without an install), and its capture probe runs one eager step on the new stream
    before begin_capture (a first allocation there would cudaMalloc inside the capture)."""
    import inspect

    assert count_syncs.REPO == REPO and str(REPO) in sys.path
    src = inspect.getsource(count_syncs.capture_probe)
    body = src[src.index("with stream:"):]
    assert body.index("step(x, y)") < body.index("stream.synchronize()") \
        < body.index("begin_capture")


def test_sync_counter_names_the_per_thread_and_driver_forms_of_syncs():
    sync = count_syncs._SYNC_API.search
    for name in ("cudaMemcpy_ptds_v7000", "cudaMemcpy_v3020", "cuMemFree_v2", "cudaFreeHost",
                 "cudaFree", "cudaStreamSynchronize_v3020", "cuCtxSynchronize"):
        assert sync(name), name
    for name in ("cudaMemcpyAsync_v3020", "cudaLaunchKernel", "cudaStreamQuery",
                 "cudaMemcpyAsync_ptsz_v7000", "cudaFreeAsync"):
        assert not sync(name), name


def test_the_blocking_probe_reads_each_step_against_its_spin():
    """count_syncs.blocking_probe: a step whose host time took half the spin blocked; one
    the spin outlasted (the host waited for it after the step) did not; a spin over before
    the step ends says nothing. And its kernel compiles (NVRTC, CuPy's options)."""
    from convfuse import kernels

    spin = count_syncs.SPIN_S
    assert count_syncs.blocked(0.9 * spin, 0.0) == "blocked"
    assert count_syncs.blocked(0.002, 0.9 * spin) == "free"
    assert count_syncs.blocked(0.002, 0.0) == "inconclusive"
    assert count_syncs.summarize_blocking(["free", "blocked", "free"]) == {
        "steps": 3, "blocked": 1, "free": 2, "inconclusive": 0}
    lib = kernels.nvrtc()
    prog = lib.createProgram(count_syncs.SPIN_SOURCE, "spin.cu", [], [])
    try:
        lib.compileProgram(prog, kernels.nvrtc_options("compute_80"))
        assert "globaltimer" in (lambda p: p.decode() if isinstance(p, bytes) else p)(
            lib.getPTX(prog))
    finally:
        lib.destroyProgram(prog)


@pytest.mark.parametrize(("probe", "verdict"), [
    ({"steps": 5, "blocked": 0, "free": 5, "inconclusive": 0}, "PASS"),
    ({"steps": 5, "blocked": 1, "free": 4, "inconclusive": 0}, "FAIL (a step blocked"),
    ({"steps": 5, "blocked": 0, "free": 0, "inconclusive": 5}, "FAIL (the blocking probe saw"),
])
def test_the_sync_verdict_reads_the_blocking_probe(tmp_path, probe, verdict):
    (tmp_path / "syncs.json").write_text(json.dumps({
        "method": "capture-probe", "capture_probe": "pass",
        "blocking_probe": {"convfuse eager step": probe,
                           "convfuse captured step": {"steps": 5, "blocked": 0, "free": 5,
                                                      "inconclusive": 0}},
        "convfuse eager step": {"syncs_per_step": None, "d2h_copies_per_step": None},
        "convfuse captured step": {"syncs_per_step": None, "d2h_copies_per_step": None}}))
    assert acceptance_summary.verdict("syncs", 0, tmp_path).startswith(verdict)
    assert "blocking probe, eager:" in acceptance_summary.details("syncs", tmp_path)
