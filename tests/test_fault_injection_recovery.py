"""Recovery after a fault, and the plan decisions issue #13 added, on the numeric fake GPU:
- a transient out-of-memory does not demote an algorithm (or the fused call) for good: the
  best one is retried after a back-off that doubles while memory stays short
  (Note [transient out-of-memory] in convfuse/plan/choice.py);
- config.benchmark times the forced-algorithm fused call against the unfused path and
  keeps the faster (Note [forced algorithm versus speed] in ops/cudnn/fused.py);
- inside a graph capture, choosing an algorithm or creating the zero bias is refused with
  a CaptureError, while a plan chosen before the capture runs with no query at all."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import convfuse.ops as ops
from convfuse import config
from convfuse.errors import CaptureError
from convfuse.plan import FusedFallbackWarning, WorkspaceFallbackWarning, get_plan
from convfuse.plan import capture as plan_capture
from convfuse.plan import conv as plan_conv
from tests._fault_injection import BIG, FORCED, make_gpu  # noqa: F401  (fixture)
from tests._ops_dispatch_helpers import GEOMS

FUSED = "convolutionBiasActivationForward"
FWD = "convolutionForward"


def _put(gpu, rng, *shapes):
    host = [rng.standard_normal(s) for s in shapes]
    return host, [gpu.put(h) for h in host]


def _quiet_calls(fn, n):
    """Run fn n times; return the warning categories seen."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(n):
            fn()
    return [w.category for w in record]


def test_out_of_memory_retries_the_best_algorithm_with_backoff(make_gpu, rng):  # noqa: F811
    geom = GEOMS[0]
    gpu = make_gpu(geom)
    (x, w), (dx, dw) = _put(gpu, rng, geom.input_shape, geom.weight_shape)
    want = ops.conv_forward(x, w, geom)
    gpu.oom_call_at = BIG  # algo 6 wants BIG bytes
    algos, big_allocs = [], []
    for _ in range(60):
        gpu.calls.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", WorkspaceFallbackWarning)
            y = ops.conv_forward(dx, dw, geom)
        np.testing.assert_allclose(gpu.get(y), want, rtol=1e-12)
        algos.append([a[7] for n, a in gpu.calls if n == FWD][-1])
        big_allocs.append(("alloc", (BIG,)) in gpu.calls)
    assert set(algos) == {2}  # memory stays short: the next ranked one runs every time
    tries = [i for i, tried in enumerate(big_allocs) if tried]
    # first try, then retries after 8, 16 and 32 calls (the failed try's own call counts):
    # a lasting shortage costs log(calls) failed allocations
    gaps = np.diff(tries).tolist()
    assert plan_conv.OOM_RETRY_FIRST == 8
    assert tries[0] == 0 and gaps == [7, 15, 31], tries
    # Memory comes back: the best algorithm returns at the next retry and stays.
    gpu.oom_call_at = None
    categories = _quiet_calls(lambda: algos.append(
        (ops.conv_forward(dx, dw, geom), [a[7] for n, a in gpu.calls if n == FWD][-1])[1]),
        70)
    assert categories == []
    assert algos[-1] == 6 and algos[-2] == 6
    assert get_plan(geom, "float64").choice("fwd", "H").algo == 6


@pytest.mark.filterwarnings("ignore::convfuse.plan.WorkspaceFallbackWarning")  # the unfused fwd's
def test_out_of_memory_on_the_forced_workspace_retries_the_fused_call(make_gpu, rng):  # noqa: F811
    geom = GEOMS[1]
    gpu = make_gpu(geom)
    (x, w, b), (dx, dw, db) = _put(gpu, rng, geom.input_shape, geom.weight_shape,
                                   geom.bias_shape)
    want, _ = ops.conv_bias_act(x, w, b, geom, "identity")
    gpu.oom_call_at = BIG  # the forced algorithm's workspace is BIG bytes
    with pytest.warns(FusedFallbackWarning, match="retried after a back-off"):
        y, _ = ops.conv_bias_act(dx, dw, db, geom, "identity")
    np.testing.assert_allclose(gpu.get(y), want, rtol=1e-12)
    plan = get_plan(geom, "float64", "identity")
    assert plan.fused_refusal is None  # not for good
    gpu.oom_call_at = None
    paths = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedFallbackWarning)  # warned once per plan
        for _ in range(plan_conv.OOM_RETRY_FIRST + 2):
            gpu.calls.clear()
            y, _ = ops.conv_bias_act(dx, dw, db, geom, "identity")
            np.testing.assert_allclose(gpu.get(y), want, rtol=1e-12)
            paths.append(FUSED in gpu.names())
    assert paths[:plan_conv.OOM_RETRY_FIRST] == [False] * plan_conv.OOM_RETRY_FIRST
    assert paths[-1] and [a[7] for n, a in gpu.calls if n == FUSED] == [FORCED]


class _FakeEvent:
    def __init__(self, *a, **k):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


@pytest.mark.parametrize(("fused_ms", "unfused_ms", "path"), [(3.0, 6.0, "fused"),
                                                              (9.0, 6.0, "unfused")])
def test_benchmark_keeps_the_faster_forward(make_gpu, rng, monkeypatch,  # noqa: F811
                                            fused_ms, unfused_ms, path):
    cp = pytest.importorskip("cupy")
    geom = GEOMS[0]
    gpu = make_gpu(geom)
    times = [fused_ms * 3, unfused_ms * 3]  # elapsed over 3 repetitions each
    monkeypatch.setattr(cp.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(cp.cuda, "get_elapsed_time", lambda a, b: times.pop(0))
    (x, w, b, r), dev = _put(gpu, rng, geom.input_shape, geom.weight_shape, geom.bias_shape,
                             geom.output_shape)
    want, _ = ops.conv_bias_act(x, w, b, geom, "tanh", r, 0.5)
    with config.flags(benchmark=True), warnings.catch_warnings():
        warnings.simplefilter("error")  # a timed choice is no fallback: no warning
        y, _ = ops.conv_bias_act(*dev[:3], geom, "tanh", dev[3], 0.5)
        np.testing.assert_allclose(gpu.get(y), want, rtol=1e-12)
        plan = get_plan(geom, "float64", "tanh", True)
        assert plan.forward_path == plan_conv.ForwardPath(path, "timed", fused_ms, unfused_ms)
        gpu.calls.clear()
        y, _ = ops.conv_bias_act(*dev[:3], geom, "tanh", dev[3], 0.5)
    np.testing.assert_allclose(gpu.get(y), want, rtol=1e-12)
    assert (FUSED in gpu.names()) == (path == "fused")
    assert times == []  # timed once per plan
    assert "findConvolutionForwardAlgorithmEx" not in gpu.names()


def test_heuristics_keep_the_fused_call_and_say_so(make_gpu, rng):  # noqa: F811
    geom = GEOMS[0]
    gpu = make_gpu(geom)
    _, dev = _put(gpu, rng, geom.input_shape, geom.weight_shape, geom.bias_shape)
    for act in ("identity", "relu"):
        ops.conv_bias_act(dev[0], dev[1], dev[2], geom, act)
        assert get_plan(geom, "float64", act).forward_path == plan_conv.ForwardPath(
            "fused", "heuristics")


def test_capture_refuses_algorithm_choice_and_zero_bias(make_gpu, rng, monkeypatch):  # noqa: F811
    geom = GEOMS[1]
    gpu = make_gpu(geom)
    _, (dx, dw, db) = _put(gpu, rng, geom.input_shape, geom.weight_shape, geom.bias_shape)
    ops.conv_bias_act(dx, dw, db, geom, "relu")  # the warm-up: plans and algorithms exist
    monkeypatch.setattr(plan_capture, "stream_is_capturing", lambda: True)
    gpu.calls.clear()
    ops.conv_bias_act(dx, dw, db, geom, "relu")  # recorded: no query, no allocation trial
    # the workspace, then the one call (between the copies of Note [float64 runs
    # channels-first], kernels a capture records like any other)
    assert gpu.names() == ["to_channels_first", "to_channels_first", "alloc", FUSED,
                           "to_channels_last"]
    with pytest.raises(CaptureError, match=r"choosing the fwd algorithm .* before capture"):
        ops.conv_forward(dx, dw, geom.__class__.create(
            geom.input_shape, geom.weight_shape, 2, 1, 1, 1, geom.layout))
    with pytest.raises(CaptureError, match=r"cached zero bias"):
        ops.conv_bias_act(dx, dw, None, geom, "relu")  # first bias-free call


def test_no_timing_inside_a_capture(make_gpu, rng, monkeypatch):  # noqa: F811
    geom = GEOMS[0]
    gpu = make_gpu(geom)
    _, (dx, dw, db) = _put(gpu, rng, geom.input_shape, geom.weight_shape, geom.bias_shape)
    monkeypatch.setattr(plan_capture, "stream_is_capturing", lambda: True)
    with config.flags(benchmark=True), pytest.raises(CaptureError, match="timing the fused"):
        ops.conv_bias_act(dx, dw, db, geom, "identity")
    assert gpu.names() == []  # refused before any cuDNN call
