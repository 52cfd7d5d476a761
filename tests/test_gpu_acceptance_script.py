"""scripts/gpu_acceptance.sh and its helpers, on the CPU: the dry run names every part
and file; the fusion_strict plugin fails a test exactly when fusion is lost where cuDNN
documents it; the summary reads each part's file; the sync counter classifies nsys rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from convfuse._binding import cudnn
from convfuse.errors import CudnnError
from convfuse.geometry import ConvGeometry
from convfuse.plan import clear_plan_cache, get_plan

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))
import acceptance_summary  # noqa: E402
import count_syncs  # noqa: E402
import fusion_strict  # noqa: E402

PARTS = ("fresh-wheel", "selfcheck", "pytest-gpu", "benchmark", "syncs", "sanitizer")
FILES = ("summary.md", "selfcheck.json", "pytest-gpu.xml", "benchmark.json", "benchmark.png",
         "syncs.json", "sanitizer.txt", "log.txt")


def test_dry_run_names_every_part_and_file_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu_acceptance.sh"), "--dry-run", str(out)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "dry run" in text and not out.exists()
    for part in PARTS:
        assert f"  {part} " in text, part
    for name in FILES:
        assert name in text
    assert len(FILES) <= 8
    for needle in ("tests/test_fresh_wheel.py", "selfcheck --json", "-p fusion_strict tests/gpu",
                   "--junitxml", "benchmarks/fused_vs_unfused.py", "--plot",
                   "scripts/count_syncs.py", "compute-sanitizer --tool memcheck"):
        assert needle in text, needle
    # every GPU test file is collected by the pytest-gpu part, this round's included
    listed = text.split("pytest-gpu collects these files:")[1]
    for path in sorted((REPO / "tests" / "gpu").glob("test_*.py")):
        assert f"tests/gpu/{path.name}" in listed, path.name
    for name in ("test_batchnorm_gpu.py", "test_models_gpu.py", "test_torch_gpu.py",
                 "test_torch_batchnorm_gpu.py", "test_edge_values_gpu.py", "test_robust_gpu.py"):
        assert f"tests/gpu/{name}" in listed, name
    shares = [int(line.split()[1].rstrip("s")) for line in text.splitlines()
              if line.startswith("  ") and line.split()[0] in PARTS]
    assert len(shares) == len(PARTS) and sum(shares) <= 1140 < 20 * 60  # one H100, 20 minutes


def test_without_outdir_it_says_how_to_call_it():
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu_acceptance.sh")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr


def _message(geom, dtype, activation):
    from convfuse.ops.cudnn.fused import _fallback_message

    lib = cudnn()
    plan = get_plan(geom, dtype, activation)
    err = CudnnError(3000, "cudnnConvolutionBiasActivationForward", lib.getErrorString(3000))
    return _fallback_message(plan, err, True)


@pytest.mark.parametrize(("x", "w", "layout", "groups", "dtype", "act", "documented"), [
    ((1, 4, 6, 6), (8, 4, 3, 3), "NCHW", 1, "float32", "relu", True),
    ((1, 6, 6, 4), (8, 3, 3, 4), "NHWC", 1, "float16", "identity", True),
    ((1, 6, 6, 4), (8, 3, 3, 4), "NHWC", 1, "float16", "silu", True),  # IDENTITY fused
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


@pytest.mark.parametrize(("shape", "layout", "dtype", "act", "documented"), [
    ((2, 3, 3, 8), "NHWC", "float16", "relu", True),
    ((2, 4, 8), "NHWC", "float16", "relu", True),  # 1-D, lifted to 4-D
    ((2, 3, 3, 6), "NHWC", "float16", "relu", False),  # C % 4 != 0
    ((2, 8, 3, 3), "NCHW", "float16", "relu", False),
    ((2, 3, 3, 8), "NHWC", "float32", "relu", False),
    ((2, 3, 3, 8), "NHWC", "bfloat16", "relu", False),
    ((2, 3, 3, 8), "NHWC", "float16", "identity", False),
    ((4, 8), "NHWC", "float16", "relu", False),  # (N, C): no channels-last
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


def test_summary_reports_each_part(tmp_path):
    (tmp_path / "selfcheck.json").write_text(json.dumps({
        "ok": False, "counts": {"pass": 3, "fail": 1},
        "checks": [{"name": "conv_forward", "dtype": "float16", "status": "fail"},
                   {"name": "fused forward paths", "status": "pass",
                    "detail": "9 plan(s) fused, 1 unfused"}]}))
    (tmp_path / "pytest-gpu.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0" time="4.2">'
        '<testcase classname="tests.gpu.a" name="t1"/>'
        '<testcase classname="tests.gpu.a" name="t2"><failure message="x"/></testcase>'
        '</testsuite></testsuites>')
    (tmp_path / "syncs.json").write_text(json.dumps({
        "method": "nsys", "capture_probe": "pass",
        "convfuse eager step": {"syncs_per_step": 0.0, "d2h_copies_per_step": 0.0},
        "convfuse captured step": {"syncs_per_step": 1.0, "d2h_copies_per_step": 0.0,
                                   "sync_calls": ["cudaStreamSynchronize"]}}))
    status = tmp_path / "status"
    status.write_text("fresh-wheel 0 50\nselfcheck 1 60\npytest-gpu 1 300\nbenchmark 124 210\n"
                      "syncs 0 30\nsanitizer 127 0\n")
    text = acceptance_summary.write(tmp_path, status)
    assert (tmp_path / "summary.md").read_text() == text
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()
            if line.startswith("| ") and "---" not in line}
    assert "| PASS |" in rows["Fresh wheel with only the runtime extra compiles every kernel"]
    selfcheck = rows["convfuse selfcheck --json"]
    assert "| FAIL |" in selfcheck and "conv_forward [float16]" in selfcheck
    assert "9 plan(s) fused, 1 unfused" in selfcheck
    assert "failures=1" in rows[acceptance_summary.PARTS["pytest-gpu"][0]]
    assert "tests.gpu.a::t2" in rows[acceptance_summary.PARTS["pytest-gpu"][0]]
    assert "time share exhausted" in rows[acceptance_summary.PARTS["benchmark"][0]]
    syncs = rows[acceptance_summary.PARTS["syncs"][0]]
    assert "FAIL (target is zero)" in syncs and "cudaStreamSynchronize" in syncs
    assert "| SKIP |" in rows[acceptance_summary.PARTS["sanitizer"][0]]
    assert "Total: 650 s" in text


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
