"""Issue 23: the GPU acceptance run's own arithmetic, on the CPU. The planner packs chunks
sized from the collected counts into stages whose minimums fit their caps (a grown chunk
moves on or is split, too many stages fail loudly), with the host time and sync count
first in stage 2 and the cold tests (a timeout marker above 60 s) in a chunk of their own
in lease 2; a warm tree's second install reuses the build and a changed csrc/ rebuilds it
(pip stubbed); a sanitizer cut by its cap is a SKIP; a chunk cut by its cap names the test
it reached and how many it never reached, in summary.md and tests.jsonl, and is not a
failure; a shrunk stage cap keeps each part's minimum in order; a machine that shows a GPU
convfuse cannot use fails the stage at once."""

from __future__ import annotations

import json
import os
import re
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
    # the files with cold tests (COLD below), each with quick tests too
    counts.update({"tests/gpu/test_torch_backend_gpu.py": 6,
                   "tests/gpu/test_torch_conv_transpose_gpu.py": 10,
                   "tests/gpu/test_torch_graphs_gpu.py": 12,
                   "tests/gpu/test_distributed_gpu.py": 2})
    return counts


# The cold tests of 2026-11-28 (timeout markers of 240 s and NCCL's 90 s)
COLD = ["tests/gpu/test_torch_backend_gpu.py::test_resnet18_training_steps_match_float64_cpu"
        "[None]",
        "tests/gpu/test_torch_backend_gpu.py::test_resnet18_training_steps_match_float64_cpu"
        "[reduce-overhead]",
        "tests/gpu/test_torch_backend_gpu.py::test_channels_last_and_autocast_with_inductor",
        "tests/gpu/test_torch_conv_transpose_gpu.py::test_compile_fullgraph_on_the_gpu",
        "tests/gpu/test_distributed_gpu.py::test_nccl_allreduce_of_a_cupy_flat_buffer_world_one",
        "tests/gpu/test_torch_graphs_gpu.py::test_compile_reduce_overhead",
        "tests/gpu/test_distributed_gpu.py::test_allreduce_gradients_is_captured_in_a_graph"
        "_with_nccl"]


def _check(result: plan.Plan, counts: Counter, cold: list[str] = ()) -> dict[str, int]:
    """Every file in exactly one chunk, every cold test left out of its file's chunk and in
    exactly one gpu-cold part, every chunk's minimum 15 + 0.1 s per test (a cold test's
    COLD_TEST_S), every stage's minimums within its room; returns each part's stage."""
    where: dict[str, int] = {}
    seen: list[str] = []
    left_out: list[str] = []
    ran_cold: list[str] = []
    for stage, parts in result.stages.items():
        assert sum(p.lo for p in parts) <= ROOM, (stage, [(p.name, p.lo) for p in parts])
        for p in parts:
            where[p.name] = stage
            if p.name.startswith("gpu-cold"):
                assert stage >= 3 and p.lo >= 15 + plan.COLD_TEST_S * p.tests
                ids = [c for c in cold if f"'{c}'" in p.command or f" {c}" in p.command]
                assert len(ids) == p.tests and "--deselect" not in p.command
                ran_cold += ids
            elif p.tests is not None:
                assert p.lo >= 15 + 0.1 * p.tests
                assert p.tests == sum(counts[f] for f in p.files) - (
                    p.name == "gpu-selfcheck") - len(p.deselect)
                assert all(c.split("::")[0] in p.files and f"--deselect {c}" in
                           p.command.replace("'", "") for c in p.deselect)
                seen += p.files
                left_out += p.deselect
    assert sorted(seen) == _files(counts)
    assert sorted(left_out) == sorted(ran_cold) == sorted(cold)
    return where


def test_todays_counts_fill_lease_1_with_tests_and_host_time_and_lease_2_with_the_rest():
    counts = _today()
    result = plan.pack(counts, _files(counts), ROOM, "forward,adam", COLD)
    assert result.errors == []
    where = _check(result, counts, COLD)
    assert result.stages[1][0].name == "smoke"
    assert where["gpu-core"] == 1 and where["gpu-ops"] == 1
    assert {where[c] for c in ("gpu-bn", "gpu-rest", "gpu-selfcheck")} <= {1, 2}
    rest = next(p for p in result.stages[where["gpu-rest"]] if p.name == "gpu-rest")
    assert "tests/gpu/test_new_helper_gpu.py" in rest.files  # named by no chunk
    # issue 25's GPU figures first in stage 2, with time to finish; the bench part never
    # times them again
    assert [p.name for p in result.stages[2][:2]] == ["host", "syncs"]
    host = result.stages[2][0]
    assert host.lo >= 50 and host.hi >= 90 and "--sections host-overhead " in host.command
    assert '--stream "$OUT/bench.jsonl"' in host.command and '--out "$OUT/host.json"' in \
        host.command
    # the cold tests in one part of their own in lease 2, NCCL last (a hang ends it)
    assert where["gpu-cold"] == 3 and [g for g in plan.leases(result) if 3 in g] == [[3, 4]]
    cold = result.stages[3][0]
    assert cold.tests == 7 and cold.lo == 15 + 7 * plan.COLD_TEST_S
    assert cold.command.rindex("test_distributed_gpu.py") > cold.command.rindex("graphs_gpu")
    assert where["bench"] == 4 and where["sanitizer"] == 4
    assert "host-overhead" not in plan.pack(counts, _files(counts), ROOM, "forward,host-"
                                            "overhead", COLD).stages[4][0].command
    bench = next(p for p in result.stages[4] if p.name == "bench")
    assert "--sections forward,adam " in bench.command and '"$OUT/bench.json"' in bench.command
    assert plan.leases(result) == [[1, 2], [3, 4]]
    # with fewer tests the benchmarks take a place in stage 2; the cold tests still not
    few = Counter({f: max(1, n // 8) for f, n in counts.items()})
    result = plan.pack(few, _files(few), ROOM, "forward", COLD[:1])
    where = _check(result, few, COLD[:1])
    assert where["bench"] == 2 and where["sanitizer"] == 2 and where["gpu-cold"] == 3
    assert plan.leases(result) == [[1, 2], [3]]


def test_the_cold_tests_that_outgrow_a_stage_are_split_and_counted_honestly():
    counts = _today()
    cold = [*COLD, "tests/gpu/test_torch_graphs_gpu.py::test_more"]  # 8 x 30 s: 2 pieces
    result = plan.pack(counts, _files(counts), ROOM, "forward", cold)
    where = _check(result, counts, cold)
    pieces = sorted(name for name in where if name.startswith("gpu-cold-"))
    assert pieces == ["gpu-cold-1", "gpu-cold-2"] and all(where[p] >= 3 for p in pieces)
    assert result.errors == [] and len(result.stages) == plan.MAX_STAGES
    # two more, and lease 2 cannot hold them beside the benchmarks: loud, not a silent cut
    cold += [f"tests/gpu/test_torch_graphs_gpu.py::test_even_more[{i}]" for i in range(2)]
    result = plan.pack(counts, _files(counts), ROOM, "forward", cold)
    assert any("stages; at most 4" in e for e in result.errors)


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
  echo "build $*" >>"$PIP_LOG"; echo "fake so $(date +%s%N)" >convfuse/_cudnn.fake.so; exit 0
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
    assert " -v " in pip_log.read_text()  # the log keeps setup.py's chosen folders
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


def test_the_collection_names_the_tests_whose_timeout_marker_makes_them_cold(tmp_path):
    """The planner's own plugin (-p acceptance_plan) reads each test's timeout marker: above
    COLD_COMPILE_S, which equals tests/conftest.py's, the test is cold."""
    from tests import conftest

    assert plan.COLD_COMPILE_S == conftest.COLD_COMPILE_S
    (tmp_path / "tests" / "gpu").mkdir(parents=True)
    (tmp_path / "tests" / "gpu" / "test_x_gpu.py").write_text(
        "import pytest\n"
        "def test_plain(): pass\n"
        "@pytest.mark.timeout(30)\ndef test_quick(): pass\n"
        "@pytest.mark.timeout(240)\ndef test_compile(): pass\n"
        "@pytest.mark.timeout(timeout=90)\n@pytest.mark.parametrize('p', [1, 2])\n"
        "def test_nccl(p): pass\n")
    found = plan.collect(root=tmp_path)
    assert found.errors == "" and found.counts == {"tests/gpu/test_x_gpu.py": 5}
    assert found.cold == ["tests/gpu/test_x_gpu.py::test_compile",
                          "tests/gpu/test_x_gpu.py::test_nccl[1]",
                          "tests/gpu/test_x_gpu.py::test_nccl[2]"]


def test_a_shrunk_stage_cap_keeps_the_plan_and_says_what_will_be_cut(tmp_path):
    """ACCEPT_STAGE_CAP changes the time a stage runs, not its parts: the dry run says
    which parts a cap too small for the minimums cuts; a bad value is a usage error."""
    collected = tmp_path / "collected.txt"
    collected.write_text("".join(f"tests/gpu/test_cudnn_ops.py::t[{i}]\n" for i in range(400))
                         + "".join(f"tests/gpu/test_selfcheck_gpu.py::t{i}\n" for i in range(8))
                         + "cold-test 240 tests/gpu/test_torch_backend_gpu.py::test_c\n"
                         + "tests/gpu/test_torch_backend_gpu.py::test_c\n")
    env = {**os.environ, "ACCEPT_COLLECTED": str(collected), "PYTHON": sys.executable}

    def dry(**extra):
        return subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True,
                               text=True, timeout=60, env={**env, **extra})

    full, small = dry(), dry(ACCEPT_STAGE_CAP="150")
    assert full.returncode == 0 and small.returncode == 0, small.stderr
    parts = lambda text: [ln for ln in text.splitlines() if ln.startswith("  ")]  # noqa: E731
    assert parts(full.stdout) == parts(small.stdout)
    assert "stage 2: cap 150 s, minimums" in small.stdout
    assert "cut or not start" not in full.stdout
    said = {ln.split(":")[0]: ln.split("): ")[1].removesuffix(" will be cut or not start")
            .split(", ") for ln in small.stdout.splitlines() if "cap allows (ACCEPT_STAGE" in ln}
    assert "than a 150 s cap allows" in small.stdout and set(said) >= {"stage 1", "stage 2"}
    blocks = re.split(r"^(stage \d) parts.*$", small.stdout, flags=re.M)
    for stage, cut in said.items():
        names = re.findall(r"^  (\S+) ", blocks[blocks.index(stage) + 1], re.M)
        # the last parts, in order (the sanitizer, 0 s, is not counted), never the first
        assert cut == [n for n in names if n != "sanitizer"][-len(cut):], (stage, cut, names)
        assert not {"install", "plan", "smoke", "host", "syncs"} & set(cut)
    assert "1 cold tests" in small.stdout and "not in lease 1" in small.stdout
    for bad in ("abc", "30", "700"):
        proc = dry(ACCEPT_STAGE_CAP=bad)
        assert proc.returncode == 2 and "ACCEPT_STAGE_CAP" in proc.stderr


def test_an_overcommitted_stage_gives_each_part_its_minimum_in_order(tmp_path):
    """With a cap that cannot hold every minimum, the first parts keep theirs (the install
    above all) and only the last are cut; before, the install itself was refused."""
    parts = tmp_path / "parts.txt"
    parts.write_text('install|30-240|no|echo "install cap=$PART_CAP"\n'
                     'host|40-120|no|echo "host cap=$PART_CAP"\n'
                     "rest|40+|no|true\n")
    proc = subprocess.run(["bash", str(SCRIPT), "--stage", "2", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ACCEPT_PARTS_FILE": str(parts),
                               "PYTHON": sys.executable, "PYTHONPATH": str(REPO),
                               "ACCEPT_STAGE_CAP": "60"})
    log = (tmp_path / "out" / "log.txt").read_text()
    assert "install cap=30" in log and "host cap=40" in log, log
    assert proc.returncode == 0 and "rest exit 0" in proc.stdout


FAKE_GPU_PY = """#!/bin/sh
case "$2" in
  *gpu_unavailable_reason*) echo "REASON:no usable CUDA device or driver was found (fake)";
                            exit 0 ;;
  *show_config*) echo "CuPy Version : fake-14.2"; exit 0 ;;
  *"import torch"*) echo "torch.cuda.is_available() True"; exit 0 ;;
esac
exec "{real}" "$@"
"""


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="this machine shows a GPU")
def test_a_machine_that_shows_a_gpu_convfuse_cannot_use_fails_the_stage_at_once(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text(FAKE_GPU_PY.replace("{real}", sys.executable))
    fake.chmod(0o755)
    parts = tmp_path / "parts.txt"
    parts.write_text("install|20|no|true\nsmoke|20|no|echo smoke-ran\n"
                     "gpu-a|20|yes|echo never\n")
    env = {**os.environ, "ACCEPT_PARTS_FILE": str(parts), "PYTHON": str(fake),
           "PYTHONPATH": str(REPO)}
    # no GPU shown: the GPU parts are skipped and the stage passes, as before
    proc = subprocess.run(["bash", str(SCRIPT), "--stage", "1", str(tmp_path / "o1")],
                          capture_output=True, text=True, timeout=120,
                          env={**env, "PATH": f"{tmp_path / 'none'}{os.pathsep}"
                                              f"{os.environ['PATH']}"})
    if shutil.which("nvidia-smi") is None:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "GPU parts were skipped" in (tmp_path / "o1" / "summary.md").read_text()
    # a GPU shown (nvidia-smi -L answers) that convfuse cannot use: FAIL, diagnosis, end
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-x)'\n")
    (bindir / "nvidia-smi").chmod(0o755)
    proc = subprocess.run(["bash", str(SCRIPT), "--stage", "1", str(tmp_path / "o2")],
                          capture_output=True, text=True, timeout=120,
                          env={**env, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (tmp_path / "o2" / "summary.md").read_text()
    log = (tmp_path / "o2" / "log.txt").read_text()
    assert "FAILED: the machine shows an NVIDIA GPU" in summary
    rows = {line.split(" | ")[0].lstrip("| "): line for line in summary.splitlines()
            if line.startswith("| ") and "---" not in line}
    probe = rows[acceptance_summary.title("gpu-probe")]
    assert "| FAIL |" in probe and "NVIDIA H200" in probe and "(fake)" in probe
    assert "NOT RUN (GPU probe failed)" in rows[acceptance_summary.title("smoke")]
    assert "NOT RUN (GPU probe failed)" in rows["pytest chunk gpu-a"]
    assert "smoke-ran" not in log and "Failed parts: gpu-probe." in summary
    assert "CuPy Version : fake-14.2" in log and "torch.cuda.is_available()" in log


@pytest.mark.parametrize(("cores", "given", "unity"), [("16", "", "0"), ("2", "", "1"),
                                                       ("16", "1", "1")])
def test_the_build_is_split_across_many_cores_and_unified_on_few(tmp_path, cores, given,
                                                                 unity):
    """setup.py compiles csrc/ file by file in parallel (pybind11's ParallelCompile, a job a
    core): on 8 cores or more that beats the one translation unit; the caller decides if
    it sets CONVFUSE_UNITY_BUILD."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nproc").write_text(f"#!/bin/sh\necho {cores}\n")
    (bindir / "nproc").chmod(0o755)
    parts = tmp_path / "parts.txt"
    parts.write_text('install|20|no|echo "unity=$CONVFUSE_UNITY_BUILD"\n')
    env = {k: v for k, v in os.environ.items() if k != "CONVFUSE_UNITY_BUILD"}
    env.update(ACCEPT_PARTS_FILE=str(parts), PYTHON=sys.executable, PYTHONPATH=str(REPO),
               PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
    if given:
        env["CONVFUSE_UNITY_BUILD"] = given
    subprocess.run(["bash", str(SCRIPT), "--stage", "1", str(tmp_path / "out")],
                   capture_output=True, text=True, timeout=120, env=env)
    assert f"unity={unity}" in (tmp_path / "out" / "log.txt").read_text()


def test_setup_says_which_folders_it_chose_and_the_install_keeps_it():
    """docs/VERIFYING.md: the install's log shows the cuDNN and CUDA folders setup.py
    chose: setup.py prints them on stderr, and the acceptance install runs pip -v."""
    proc = subprocess.run([sys.executable, "setup.py", "--name"], cwd=REPO, capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "CONVFUSE_UNITY_BUILD": "0"})
    assert proc.returncode == 0, proc.stderr
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("convfuse setup: ")]
    kinds = [ln.split(": ")[1] for ln in said]
    assert kinds[:2] == ["cuDNN include", "cuDNN library"] and "CUDA include" in kinds
    assert any("(from " in ln for ln in said) and "csrc/" in kinds
    assert "pip install -v " in SCRIPT.read_text()


def test_files_that_compile_with_inductor_come_last_in_their_chunk():
    """A cold compile that outruns its timeout ends the chunk: nothing may come after it."""
    counts = _today()
    for name in plan.COMPILE_LAST:
        counts[f"tests/gpu/{name}"] = 3
    counts["tests/gpu/test_zzz_after_them_gpu.py"] = 2  # sorted after them by name
    result = plan.pack(counts, _files(counts), ROOM, "forward,adam")
    assert result.errors == []
    rest = next(p for parts in result.stages.values() for p in parts if p.name == "gpu-rest")
    assert rest.files[-1] == f"tests/gpu/{plan.LAST}"  # NCCL after even the compiles
    tail = [f.split("/")[-1] for f in rest.files[-len(plan.COMPILE_LAST) - 1:-1]]
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
