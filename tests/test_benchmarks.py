"""benchmarks/fused_vs_unfused.py: the CPU run end to end, and its arithmetic by hand.

The FLOP and byte counts are checked against values worked out on paper for two layers;
the timing, rotation, peak-table and recommendation logic against small synthetic inputs.
The GPU run is a `gpu`-marked test: written, and skipped here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from convfuse.backend import gpu_unavailable_reason
from convfuse.geometry import ConvGeometry

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCH / "fused_vs_unfused.py"
sys.path.insert(0, str(BENCH))

from bench import biasgrad, cases, checks, engine, peaks, roofline, timing  # noqa: E402

SECTIONS = ("forward", "backward", "biasgrad", "train", "adam")
STATUSES = {"ok", "skipped"}


# -- the CPU run, end to end --------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One `--quick` run on the CPU (forced with --device cpu when a GPU is present)."""
    out = tmp_path_factory.mktemp("bench")
    args = [sys.executable, str(SCRIPT), "--quick", "--quiet", "--out", str(out / "r.json"),
            "--plot", str(out / "r.png")]
    if gpu_unavailable_reason() is None:  # pragma: gpu
        args += ["--device", "cpu"]
    # The reference engine's timings mean nothing, so one BLAS thread costs nothing and
    # keeps the run fast when other work shares the two cores.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=out, env=env)
    return proc, out


def test_quick_cpu_run_exits_0_and_says_cpu(cpu_run):
    proc, _ = cpu_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "CPU (convfuse NumPy reference engine)" in text
    assert "say nothing about GPU performance" in text
    if gpu_unavailable_reason() is not None:
        assert "NO GPU:" in text and gpu_unavailable_reason() in text
    for title in ("Layer forward", "Layer backward", "Bias gradient", "Training step",
                  "Optimizer"):
        assert f"== {title}" in text
    for column in ("fused/unfused", "convfuse/PyTorch", "roofline fused", "bwd/fwd", "winner"):
        assert column in text


def test_quick_cpu_run_writes_a_png(cpu_run):
    _, out = cpu_run
    data = (out / "r.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_quick_cpu_json_structure_and_labelling(cpu_run):
    _, out = cpu_run
    d = json.loads((out / "r.json").read_text())
    assert d["engine"] == "cpu" and "CPU" in d["label"]
    assert "CPU reference engine" in d["notice"]
    env = d["environment"]
    assert env["engine"] == "cpu" and env["gpu"] is None
    for key in ("numpy", "cupy", "convfuse", "cudnn", "python", "timestamp_utc", "timer"):
        assert key in env
    # no GPU number may appear: the floors come from measurements on this CPU
    assert d["peaks"]["datasheet"] is None and d["peaks"]["used"]["measured"] is True
    assert d["peaks"]["used"]["device"] == "CPU"
    assert d["bias_grad_recommendation"]["recommendation"] is None
    assert set(d["results"]) == set(SECTIONS)
    counted = {"ok": 0, "skipped": 0, "error": 0, "check_failed": 0}
    for section, recs in d["results"].items():
        assert recs, section
        for rec in recs:
            counted[rec["status"]] += 1
            assert rec["section"] == section
            assert rec["status"] in STATUSES, rec.get("reason")
            if rec["status"] == "skipped":
                assert rec["reason"].startswith("CPU")
                continue
            _check_measured(rec)
    assert counted == d["counts"]
    assert sum(r["status"] == "ok" for recs in d["results"].values() for r in recs) >= 30


def _check_measured(rec: dict) -> None:
    assert rec["checks"] and all(c["ok"] for c in rec["checks"])
    assert rec["timings"]
    for stats in rec["timings"].values():
        assert stats["min_s"] <= stats["median_s"] <= stats["max_s"]
        assert stats["reps"] == len(stats["samples_s"]) >= 3
        assert min(stats["samples_s"]) == stats["min_s"] > 0
    assert "graph" not in rec["timings"]  # no CUDA graph without a GPU
    for key, value in rec["ratios"].items():
        num, den = {"fused/unfused": ("fused", "unfused"), "fused/cudnn": ("fused", "cudnn"),
                    "generic/cudnn": ("generic", "cudnn")}.get(key, (None, None))
        if num:
            want = rec["timings"][num]["median_s"] / rec["timings"][den]["median_s"]
            assert value == pytest.approx(want)
    assert rec["floor_s"] > 0 and rec["work"]["bytes"] > 0
    for form, fraction in rec["roofline"].items():
        assert fraction == pytest.approx(rec["floor_s"] / rec["timings"][form]["median_s"])


def test_from_json_redraws_without_measuring(cpu_run):
    _, out = cpu_run
    proc = subprocess.run([sys.executable, str(SCRIPT), "--from-json", str(out / "r.json"),
                           "--plot", str(out / "again.png")], capture_output=True, text=True,
                          timeout=120, cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== Layer forward" in proc.stdout and "CPU" in proc.stdout
    assert (out / "again.png").read_bytes()[:4] == b"\x89PNG"


def test_result_names_carry_the_device():
    import datetime

    import fused_vs_unfused

    when = datetime.datetime(2026, 11, 21, 21, 30)
    assert fused_vs_unfused.result_name("NVIDIA H100 80GB HBM3", when) == \
        "nvidia-h100-80gb-hbm3-20261121-2130"


def test_quick_cpu_json_covers_every_precision_and_layout(cpu_run):
    _, out = cpu_run
    recs = json.loads((out / "r.json").read_text())["results"]["forward"]
    seen = {(r["precision"], r["layout"]) for r in recs}
    assert seen == {(p, lay) for p in ("fp32", "tf32", "fp16", "bf16") for lay in ("NCHW", "NHWC")}
    tf32 = [r for r in recs if r["precision"] == "tf32"]
    assert all(r["status"] == "skipped" and "TF32" in r["reason"] for r in tf32)
    names = {r["case"] for r in recs}
    assert {"mnist.conv1", "mbv2.dw3x3", "r18.layer1.3x3+res"} <= names
    assert all(r["scaled_from"] for r in recs if r["case"].startswith("r18"))


# -- FLOPs and bytes, against hand-computed values ----------------------------------------

def test_conv_counts_nchw_fp32_relu_bias():
    # x (2,3,5,5), w (4,3,3,3), pad 1 -> y (2,4,5,5): 200 outputs, 27 MACs each.
    g = ConvGeometry.create((2, 3, 5, 5), (4, 3, 3, 3), padding=1)
    fwd = roofline.conv_forward(g, "float32", "relu", bias=True)
    assert fwd.flops == 2 * 200 * 27 + 200 + 200 == 11_200
    assert fwd.bytes == 4 * (150 + 108 + 200 + 4) == 1_848
    bwd = roofline.conv_backward(g, "float32", "relu", bias=True, need_dx=True)
    # dx and dw: 10,800 each; relu backward and the bias sum: 200 each
    assert bwd.flops == 2 * 10_800 + 200 + 200 == 22_000
    # reads dy 200, y 200, x 150, w 108; writes dw 108, dx 150, db 4
    assert bwd.bytes == 4 * 920 == 3_680
    no_dx = roofline.conv_backward(g, "float32", "relu", bias=True, need_dx=False)
    assert (no_dx.flops, no_dx.bytes) == (11_200, 4 * 770)


def test_conv_counts_nhwc_fp16_depthwise_stride2_residual():
    # x (1,8,8,6) NHWC, depthwise w (6,3,3,1), stride 2, pad 1 -> y (1,4,4,6): 96 outputs,
    # 9 MACs each (one input channel per group).
    g = ConvGeometry.create((1, 8, 8, 6), (6, 3, 3, 1), stride=2, padding=1, groups=6,
                            layout="NHWC")
    assert g.output_shape == (1, 4, 4, 6)
    fwd = roofline.conv_forward(g, "float16", "relu", bias=True, residual=True)
    assert fwd.flops == 2 * 96 * 9 + 3 * 96 == 2_016
    assert fwd.bytes == 2 * (384 + 54 + 96 + 6 + 96) == 1_272
    ident = roofline.conv_forward(g, "float16", "identity", bias=False)
    assert (ident.flops, ident.bytes) == (1_728, 2 * (384 + 54 + 96))
    bwd = roofline.conv_backward(g, "float16", "identity", bias=True)
    # identity saves nothing: reads dy 96, x 384, w 54; writes dw 54, dx 384, db 6
    assert (bwd.flops, bwd.bytes) == (2 * 1_728 + 96, 2 * 978)


def test_bias_grad_adam_and_linear_counts():
    shape = (2, 3, 4, 5)  # 120 elements, 3 channels
    assert roofline.bias_grad(shape, 3, "float32", "identity") == roofline.Work(120, 4 * 123)
    assert roofline.bias_grad(shape, 3, "bfloat16", "relu") == roofline.Work(240, 2 * 363)
    assert roofline.adam(1_000_000) == roofline.Work(14_000_000, 28_000_000)
    assert roofline.linear_forward(8, 128, 10, "float32") == roofline.Work(
        2 * 8 * 128 * 10 + 80, 4 * (1024 + 1280 + 10 + 80))
    assert roofline.linear_backward(8, 128, 10, "float32") == roofline.Work(
        4 * 8 * 128 * 10 + 80, 4 * (80 + 2048 + 2560 + 10))


def test_floor_is_the_slower_of_compute_and_memory_and_sums_over_steps():
    w = roofline.Work(flops=1_000, bytes=10)
    assert w.floor_seconds(peak_flops=100.0, peak_bandwidth=100.0) == 10.0  # compute-bound
    assert w.floor_seconds(peak_flops=1e6, peak_bandwidth=1.0) == 10.0  # memory-bound
    m = roofline.Work(flops=1, bytes=50)
    assert roofline.floor_seconds([w, m], 100.0, 10.0) == pytest.approx(10.0 + 5.0)
    assert roofline.total([w, m]) == roofline.Work(1_001, 60)


# -- peak table ---------------------------------------------------------------------------

@pytest.mark.parametrize("name, bandwidth, fp32, tf32, fp16", [
    ("NVIDIA A100-SXM4-80GB", 2.039, 19.5, 156, 312),
    ("NVIDIA A100-SXM4-40GB", 1.555, 19.5, 156, 312),
    ("NVIDIA A100 80GB PCIe", 1.935, 19.5, 156, 312),
    ("NVIDIA A100-PCIE-40GB", 1.555, 19.5, 156, 312),
    ("NVIDIA H100 80GB HBM3", 3.35, 67, 494.5, 989.5),
    ("NVIDIA H100 PCIe", 2.0, 51, 378, 756),
    ("NVIDIA H200", 4.8, 67, 494.5, 989.5),
])
def test_datasheet_peaks_by_device_name(name, bandwidth, fp32, tf32, fp16):
    p = peaks.datasheet_entry(name).peaks(name)
    assert not p.measured and "datasheet" in p.source
    assert p.bandwidth == pytest.approx(bandwidth * 1e12)
    assert p.flops == pytest.approx({"fp32": fp32 * 1e12, "tf32": tf32 * 1e12,
                                     "fp16": fp16 * 1e12, "bf16": fp16 * 1e12})


@pytest.mark.parametrize("name", ["NVIDIA H200 NVL", "NVIDIA GH200 480GB", "NVIDIA H100 NVL",
                                  "NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB"])
def test_unknown_devices_fall_back_to_measurement(name):
    assert peaks.datasheet_entry(name) is None


def test_h100_floor_of_the_v100_bias_case():
    # dy 128x64x74x74 fp32, identity: 44,859,392 elements read + 64 written, 4 bytes each
    p = peaks.datasheet_entry("NVIDIA H100 80GB HBM3").peaks("H100")
    work = roofline.bias_grad((128, 64, 74, 74), 64, "float32", "identity")
    assert work.bytes == 4 * (128 * 64 * 74 * 74 + 64)
    assert p.floor(work, "fp32") == pytest.approx(work.bytes / 3.35e12)  # ~53.6 us


# -- timing -------------------------------------------------------------------------------

def test_summarize_and_budget():
    s = timing.summarize([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.min, s.max, s.mean, s.reps) == (2.5, 1.0, 10.0, 4.0, 4)
    b = timing.Budget(warmup=1, min_reps=5, max_reps=50, seconds=1.0)
    assert (b.reps_for(1.0), b.reps_for(0.04), b.reps_for(1e-6), b.reps_for(0.0)) == (5, 25, 50, 50)
    with pytest.raises(ValueError, match="no timing samples"):
        timing.summarize([])


def test_measure_rotates_inputs_and_counts_calls():
    calls = []
    budget = timing.Budget(warmup=2, min_reps=7, max_reps=7, seconds=0.0)
    stats = timing.measure(timing.CpuTimer(), calls.append, 3, budget)
    assert stats.reps == 7
    n = 2 + timing.PILOT_REPS + 7
    assert len(calls) == n and calls == [i % 3 for i in range(n)]
    with pytest.raises(ValueError, match="n_sets"):
        timing.measure(timing.CpuTimer(), calls.append, 0, budget)


@pytest.mark.parametrize("ws, budget, want", [
    (0, 10**9, 1),  # nothing to rotate
    (50_000, 10**9, 1), (60_000, 10**9, 1),  # as large as the cache: no rotation
    (3_000, 10**9, 34),  # ceil(2 * 50,000 / 3,000) sets add up to twice the cache
    (100, 10**9, 40),  # capped by max_sets
    (1_000, 4_000, 4),  # capped by the memory budget
])
def test_rotation_sets(ws, budget, want):
    assert timing.rotation_sets(ws, 50_000, max_sets=40, memory_budget_bytes=budget) == want


class _FakeEvent:
    """Stands in for cupy.cuda.Event / torch.cuda.Event: remembers when it was recorded."""

    def __init__(self, *args, **kwargs):
        self.at = None

    def record(self, stream=None):
        self.at = time.perf_counter()

    def synchronize(self):
        assert self.at is not None

    def elapsed_time(self, end):  # torch's API, in milliseconds
        return (end.at - self.at) * 1e3


def test_gpu_event_timers_bracket_each_call_and_report_seconds():
    # The GPU timers' logic (one event pair per call, ms -> s) on fake event objects.
    fake_cuda = types.SimpleNamespace(
        Event=_FakeEvent, get_elapsed_time=lambda a, b: (b.at - a.at) * 1e3,
        get_current_stream=lambda: types.SimpleNamespace(synchronize=lambda: None),
        synchronize=lambda: None)
    fake = types.SimpleNamespace(cuda=fake_cuda)
    for timer in (timing.CupyEventTimer(fake), timing.TorchEventTimer(fake)):
        seen = []

        def work(i, seen=seen):
            seen.append(i)
            time.sleep(0.002)

        samples = timer.sample(work, n_sets=2, start=1, reps=3)
        assert seen == [1, 0, 1]
        assert all(0.0015 < t < 0.5 for t in samples)
        timer.sync()


def test_gpu_engine_reads_the_device_properties(monkeypatch):
    props = {"name": b"NVIDIA H100 80GB HBM3", "major": 9, "minor": 0,
             "multiProcessorCount": 132, "l2CacheSize": 50 << 20, "totalGlobalMem": 80 << 30}
    runtime = types.SimpleNamespace(getDeviceProperties=lambda i: props)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda: types.SimpleNamespace(id=0), runtime=runtime))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    eng = engine.gpu_engine()
    assert eng.is_gpu and eng.device == "cuda" and eng.label == "GPU NVIDIA H100 80GB HBM3"
    assert eng.info["compute_capability"] == "9.0" and eng.cache_bytes == 50 << 20
    assert eng.rotation(1 << 20) == 64  # 1 MiB sets: twice the L2 would be 100, capped at 64
    assert peaks.datasheet_entry(eng.info["name"]).name == "H100 SXM5"


def test_asking_for_a_gpu_without_one_exits_with_the_reason():
    if gpu_unavailable_reason() is None:  # pragma: gpu
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="no GPU to benchmark"):
        engine.make_engine("cuda")
    eng, notice = engine.make_engine(None)
    assert eng.kind == "cpu" and notice.startswith("NO GPU")


# -- checks and cases ---------------------------------------------------------------------

def test_compare_relative_to_the_reference_scale():
    import numpy as np

    want = np.array([[2.0, -4.0], [1.0, 0.0]])
    ok = checks.compare("y", want + 2e-5, want, 1e-5)
    assert ok["ok"] and ok["rel_err"] == pytest.approx(5e-6)
    bad = checks.compare("y", want + 1e-3, want, 1e-5)
    assert not bad["ok"] and "rel err" in checks.failures([bad])
    nan = want.copy()
    nan[0, 0] = np.nan
    assert not checks.compare("y", nan, want, 1.0)["ok"]
    assert "shapes differ" in checks.failures([checks.compare("y", want[0], want, 1.0)])


def test_cpu_scaling_keeps_depthwise_and_records_the_original():
    dw = next(c for c in cases.LAYERS if c.name == "mbv2.dw3x3")
    small = dw.scaled(8, 14, 32)
    assert (small.batch, small.cin, small.cout, small.groups, small.size) == (8, 32, 32, 32, 14)
    assert small.scaled_from == dw.describe()
    assert small.geometry("NHWC").output_shape == (8, 14, 14, 32)
    tiny = cases.LayerCase("t", "", 2, 1, 4, 5, 3, padding=1)
    assert tiny.scaled(8, 14, 32) == tiny and tiny.scaled(8, 14, 32).scaled_from is None


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_bias_case_geometry_outputs_dy(layout):
    for case in cases.BIAS_CASES:
        g = case.geometry(layout)
        assert g.output_shape == case.shape(layout)
        assert g.out_channels == case.k


def test_every_gpu_layer_case_is_a_valid_geometry():
    for case in cases.LAYERS:
        for layout in cases.LAYOUTS:
            g = case.geometry(layout)
            assert math.prod(g.output_shape) > 0
    assert len(cases.layer_cases(quick=True, cpu=False)) == len(cases.QUICK_LAYERS)


# -- the bias-gradient recommendation -----------------------------------------------------

def _bias_rec(act, cudnn, generic, fused):
    medians = {"cudnn": cudnn, "generic": generic, "fused": fused}
    return {"section": "biasgrad", "status": "ok", "activation": act,
            "winner": min(medians, key=medians.get),
            "ratios": {"fused/cudnn": fused / cudnn, "generic/cudnn": generic / cudnn}}


def test_recommendation_follows_the_numbers_on_gpu():
    fast_fused = [_bias_rec("relu", 2.0, 1.5, 0.5), _bias_rec("relu", 1.0, 0.9, 0.25),
                  _bias_rec("identity", 1.0, 0.5, 4.0)]
    rec = biasgrad.recommendation(fast_fused, on_gpu=True)
    # only relu counts (geometric mean of 0.25 and 0.25); identity is not the switch's
    assert rec["recommendation"] == "fused" and "CHANGE" in rec["text"]
    assert rec["geomean_fused_over_cudnn"] == pytest.approx({"relu": 0.25, "identity": 4.0})
    assert "always use cuDNN's bias call" in rec["text"]  # the sum beat cuDNN on identity
    slow_fused = [_bias_rec("relu", 1.0, 3.0, 1.2), _bias_rec("relu", 1.0, 3.0, 0.9),
                  _bias_rec("identity", 1.0, 3.0, 0.1)]
    rec = biasgrad.recommendation(slow_fused, on_gpu=True)
    assert rec["recommendation"] == "cudnn" and "matches" in rec["text"]
    assert rec["wins"] == {"cudnn": 1, "generic": 0, "fused": 1}
    generic_wins = [_bias_rec("relu", 1.0, 0.1, 0.5)]
    rec = biasgrad.recommendation(generic_wins, on_gpu=True)
    assert rec["wins"]["generic"] == 1 and "never uses one" in rec["text"]
    assert biasgrad.recommendation(fast_fused, on_gpu=False)["recommendation"] is None
    assert biasgrad.recommendation([], on_gpu=True)["recommendation"] is None
    identity_only = [_bias_rec("identity", 1.0, 1.0, 0.1)]
    assert biasgrad.recommendation(identity_only, on_gpu=True)["recommendation"] is None


# -- the GPU run (written; skipped without a GPU) -----------------------------------------

@pytest.mark.gpu
def test_quick_gpu_run_forward_and_bias(tmp_path):  # pragma: gpu
    out = tmp_path / "g.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--quiet", "--device", "cuda", "--no-torch",
         "--sections", "forward,biasgrad,adam", "--precisions", "fp32,fp16", "--out", str(out),
         "--plot", str(tmp_path / "g.png")],
        capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["engine"] == "gpu" and d["environment"]["gpu"]["name"]
    assert d["environment"]["gpu"]["driver_version"] > 0
    assert d["bias_grad_recommendation"]["recommendation"] in ("cudnn", "fused")
    for recs in d["results"].values():
        for rec in recs:
            assert rec["status"] == "ok", rec.get("reason")
            _check_measured(rec)
