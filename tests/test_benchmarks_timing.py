"""benchmarks/bench timing and engines, on small synthetic inputs: summaries and budgets,
input rotation, the GPU event timers on fake events, the GPU engine's reading of device
properties, and asking for a GPU without one."""

from __future__ import annotations

import sys
import time
import types

import pytest

from convfuse.backend import gpu_unavailable_reason
from tests._benchmarks_helpers import engine, peaks, timing

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


def _fake_gpu_timers():
    """CupyEventTimer and TorchEventTimer on a module whose `cuda` has fake events."""
    fake_cuda = types.SimpleNamespace(
        Event=_FakeEvent, get_elapsed_time=lambda a, b: (b.at - a.at) * 1e3,
        get_current_stream=lambda: types.SimpleNamespace(synchronize=lambda: None),
        synchronize=lambda: None)
    fake = types.SimpleNamespace(cuda=fake_cuda)
    return timing.CupyEventTimer(fake), timing.TorchEventTimer(fake)


def _sleeper(seen):
    """A 2 ms call that records the input set it was given."""
    def work(i):
        seen.append(i)
        time.sleep(0.002)
    return work


def test_gpu_event_timers_bracket_each_call_and_report_seconds():
    # The GPU timers' logic (one event pair per call, ms -> s) on fake event objects.
    for timer in _fake_gpu_timers():
        seen = []
        samples = timer.sample(_sleeper(seen), n_sets=2, start=1, reps=3)
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


# -- interleaving, spread and the unstable flag (Note [spread and unstable figures]) --------

def test_median_interval_and_spread():
    assert timing.median_interval([5.0, 1.0, 3.0, 2.0, 4.0]) == (1.0, 5.0)  # n=5: min..max
    xs = [float(i) for i in range(1, 101)]
    lo, hi = timing.median_interval(xs)
    assert 39 <= lo < 50.5 < hi <= 62
    steady = timing.summarize([1.0] * 20 + [1.01] * 20)
    assert steady.spread <= 0.011 and not steady.unstable
    noisy = timing.summarize([1.0, 3.0] * 10)
    assert noisy.unstable and noisy.to_json()["unstable"] is True


def test_measure_interleaved_rotates_forms_and_stops_when_pinned_down():
    order = []
    clock = iter(range(10_000)).__next__  # one "second" per clock read
    timer = timing.CpuTimer()
    forms = {"a": (timer, lambda i: order.append("a")), "b": (timer, lambda i: order.append("b"))}
    budget = timing.Budget(warmup=1, min_reps=4, max_reps=50, seconds=1e9)
    stats = timing.measure_interleaved(forms, 2, budget, clock=clock)
    assert order[:2] == ["a", "b"]  # warm-up, one each
    rounds = order[2:]
    assert rounds[:4] == ["a", "b", "b", "a"]  # the order rotates every round
    assert stats["a"].reps == stats["b"].reps >= 4
    # a budget of 0 seconds stops right after min_reps rounds
    order.clear()
    stats = timing.measure_interleaved(forms, 1, timing.Budget(0, 3, 50, 0.0), clock=clock)
    assert stats["a"].reps == 3 and len(order) == 6
    with pytest.raises(ValueError, match="no forms"):
        timing.measure_interleaved({}, 1, budget)


def test_ratio_interval_combines_both_intervals():
    a = timing.summarize([2.0] * 10)
    b = timing.summarize([1.0] * 9 + [1.5])
    r, lo, hi, unstable = timing.ratio_interval(a, b)
    assert r == 2.0 and lo <= r <= hi and not unstable
    c = timing.summarize([1.0, 2.0] * 5)
    assert timing.ratio_interval(a, c)[3] is True


def test_chart_has_parity_line_values_whiskers_and_a_legend_off_the_bars(tmp_path):
    import matplotlib.pyplot as plt
    from bench import plot

    recs = [{"section": "forward", "case": f"c{i}", "status": "ok", "precision": "fp32",
             "layout": "NCHW", "ratios": {"fused/unfused": 0.8 + 0.3 * i,
                                          "convfuse/pytorch": 1.5},
             "ratio_intervals": {"fused/unfused": {"low": 0.7, "high": 1.9, "spread": 0.5,
                                                   "unstable": True},
                                 "convfuse/pytorch": {"low": 1.4, "high": 1.6,
                                                      "spread": 0.13, "unstable": False}}}
            for i in range(3)]
    fig, ax = plt.subplots()
    plot._panel(ax, "forward", recs, plot.RATIOS["cpu"]["forward"])
    texts = [t.get_text() for t in ax.texts]
    assert "1.00" in texts and " 1.50 " in texts and " 0.80! " in texts
    assert any(line.get_xdata()[0] == 1.0 for line in ax.get_lines())
    legend = ax.get_legend()
    assert legend.get_bbox_to_anchor().y0 < ax.get_window_extent().y0  # below the axes
    assert all("cuDNN" not in t.get_text() for t in legend.get_texts())
    assert ax.containers and any(c.has_xerr for c in ax.containers if hasattr(c, "has_xerr"))
    plt.close(fig)
    for section, pairs in plot.RATIOS["cpu"].items():
        assert all("cuDNN" not in label and "CUDA" not in label for _, label in pairs), section


def test_gpu_timers_bracket_several_calls_per_sample_when_asked():
    """Note [a GPU sample starts from an idle queue]: with `calls`, one event pair brackets
    that many consecutive calls (input sets rotating on) and the sample is per call."""
    for timer in _fake_gpu_timers():
        seen = []
        samples = timer.sample(_sleeper(seen), n_sets=2, start=1, reps=2, calls=3)
        assert seen == [1, 0, 1, 0, 1, 0] and len(samples) == 2
        assert all(0.0015 < t < 0.2 for t in samples)  # per call, not per bracket


def test_interleaved_gpu_samples_bracket_enough_calls_and_cpu_ones_one():
    """A GPU form whose call takes 1e-4 s gets ceil(GPU_SAMPLE_S / 1e-4) = 5 calls per
    sample (from a pilot); a CPU form one; a slow GPU form one."""
    class Fake:
        def __init__(self, kind, per_call):
            self.kind, self.per_call, self.asked = kind, per_call, []

        def sync(self):
            pass

        def sample(self, fn, n_sets, start, reps, calls=1):
            self.asked.append((reps, calls))
            return [self.per_call] * reps

    gpu, cpu, slow = Fake("gpu: fake", 1e-4), Fake("cpu: fake", 1e-4), Fake("gpu: fake", 1e-2)
    forms = {"gpu": (gpu, lambda i: None), "cpu": (cpu, lambda i: None),
             "slow": (slow, lambda i: None)}
    stats = timing.measure_interleaved(forms, 1, timing.Budget(0, 3, 3, 10.0))
    assert gpu.asked == [(timing.PILOT_REPS, 1)] + [(1, 5)] * 3
    assert cpu.asked == [(1, 1)] * 3
    assert slow.asked == [(timing.PILOT_REPS, 1)] + [(1, 1)] * 3
    assert stats["gpu"].median == 1e-4


def test_the_gpu_host_timer_starts_every_sample_from_an_idle_device():
    """host_overhead's GPU rows time host time with HostTimer: the device is synchronised
    before each timed call, outside the timed span (a sync inside it would time the GPU)."""
    events = []
    timer = timing.HostTimer(lambda: events.append("sync"))
    samples = timer.sample(lambda i: events.append(f"call {i}"), 2, 1, 3)
    assert events == ["sync", "call 1", "sync", "call 0", "sync", "call 1"]
    assert len(samples) == 3 and all(s >= 0 for s in samples)
    timer.sync()
    assert events[-1] == "sync" and "synchronised" in timer.kind


def test_resnet_forms_rotate_their_order_between_repeats():
    from bench import resnet

    order = []
    forms = {name: (lambda n=name: order.append(n)) for name in ("a", "b", "c")}
    out = resnet._interleaved(forms, lambda: None, repeats=3, steps=1, reference="a")
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert set(out) == {"a", "b", "c"} and "ratio_to_pytorch" in out["b"]
