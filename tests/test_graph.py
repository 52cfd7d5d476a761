"""Graph capture on a machine without a GPU: a clear refusal, and the failure explanations."""

from __future__ import annotations

import numpy as np
import pytest

from convfuse import graph
from convfuse.backend import gpu_unavailable_reason
from convfuse.errors import CaptureError, DeviceUnavailableError


@pytest.mark.skipif(gpu_unavailable_reason() is None, reason="a GPU is present")
def test_capture_without_gpu_says_why():
    with pytest.raises(DeviceUnavailableError, match=r"graph\.capture needs a CUDA GPU"):
        graph.capture(lambda x: x, np.zeros(3))


def test_explanations_name_the_cause():
    sync = RuntimeError(
        "cudaErrorStreamCaptureUnsupported: operation not permitted when stream is capturing"
    )
    assert "device-to-host sync" in graph._explain(sync)
    # CuPy 14.2's own refusal of a host read (float(loss), .get()) inside a capture
    d2h = RuntimeError("the current stream is capturing, so D2H transfers are disallowed")
    assert "device-to-host sync" in graph._explain(d2h)
    blas = RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED during capture")
    assert "vendor-library wrappers" in graph._explain(blas)
    other = ValueError("something else")
    text = graph._explain(other)
    assert "ValueError: something else" in text and "module notes" in text


@pytest.mark.parametrize("warmup", [0, -1, 1.5, True])
def test_capture_needs_a_warm_up_step(warmup):
    with pytest.raises(ValueError, match="warmup must be an int >= 1"):
        graph.capture(lambda x: x, np.zeros(3), warmup=warmup)


def test_capture_needs_a_callable():
    with pytest.raises(TypeError, match="step_fn must be callable"):
        graph.capture("step", np.zeros(3))


class _Recorder:
    """A graph and stream that record what a replay does to them."""

    def __init__(self) -> None:
        self.launched = 0

    def launch(self, stream) -> None:
        self.launched += 1


def _step(monkeypatch):
    """A CapturedStep over two static inputs whose replay is recorded, not run."""
    statics = [np.arange(6.0).reshape(2, 3), np.zeros(4, np.float32)]
    rec = _Recorder()
    step = graph.CapturedStep(rec, None, None, statics, "outputs", lambda *a: None)
    replays = []
    monkeypatch.setattr(step, "_replay", lambda inputs: replays.append(inputs) or "outputs")
    return step, statics, replays


@pytest.mark.parametrize("second, error, match", [
    (np.zeros(5, np.float32), ValueError, r"input 1 has shape \(5,\)"),
    (np.zeros(4, np.float64), ValueError, r"input 1 has shape \(4,\) and dtype float64"),
    ([0.0, 0.0, 0.0, 0.0], TypeError, r"input 1 must be a NumPy or CuPy array, got list"),
])
def test_replay_checks_every_input_before_copying_any(monkeypatch, second, error, match):
    step, statics, replays = _step(monkeypatch)
    before = [a.copy() for a in statics]
    with pytest.raises(error, match=match):
        step(np.ones((2, 3)), second)
    assert replays == []  # nothing copied, nothing launched
    for a, b in zip(statics, before):
        np.testing.assert_array_equal(a, b)


def test_replay_takes_all_inputs_or_none(monkeypatch):
    step, _, replays = _step(monkeypatch)
    with pytest.raises(TypeError, match="captured step takes 2 inputs, got 1"):
        step(np.ones((2, 3)))
    assert step() == "outputs" and step(np.ones((2, 3)), np.ones(4, np.float32)) == "outputs"
    assert [len(r) for r in replays] == [0, 2]


class _FakeCapture:
    """Just enough of CuPy for graph._capture, recording the order of what it does."""

    def __init__(self, log):
        self.log = log
        fake = self

        class Stream:
            def __init__(self, non_blocking=False):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def synchronize(self):
                fake.log.append("synchronize")

            def begin_capture(self):
                fake.log.append("begin_capture")

            def end_capture(self):
                fake.log.append("end_capture")
                return "graph"

            def wait_event(self, event):
                pass

        class MemoryPool:
            def __init__(self, allocator=None):
                fake.log.append(("private pool", allocator))
                self.malloc = allocator

        self.cuda = type("cuda", (), {
            "Stream": Stream, "MemoryPool": MemoryPool,
            "get_current_stream": staticmethod(lambda: Stream()),
            "using_allocator": staticmethod(lambda malloc: _null()),
        })
        self.array = lambda a, copy=True: np.array(a, copy=True)
        self.get_default_memory_pool = lambda: type("pool", (), {
            "free_all_blocks": staticmethod(lambda: fake.log.append("free_all_blocks"))})()


def _null():
    import contextlib

    return contextlib.nullcontext()


def test_capture_frees_the_warm_ups_cached_blocks_and_keeps_the_step_alive(monkeypatch):
    """The capture allocates the step's temporaries again from its private pool: the
    default pool's free blocks go back between warm-up and capture. The CapturedStep holds
    step_fn (what its graph reads and writes), and its private pool allocates through
    _capture_malloc."""
    import gc
    import weakref

    log = []
    monkeypatch.setattr(graph, "_event", lambda: type("E", (), {"record": lambda s, on: None})())

    class Step:
        def __call__(self, x):
            log.append("step")
            return x

    step_fn = Step()
    alive = weakref.ref(step_fn)
    captured = graph._capture(_FakeCapture(log), step_fn, (np.zeros(3),), warmup=2)
    assert log == [("private pool", graph._capture_malloc), "step", "step", "synchronize",
                   "free_all_blocks", "begin_capture", "step", "end_capture"]
    del step_fn
    gc.collect()
    assert alive() is not None and isinstance(captured.static_inputs, tuple)


def test_out_of_memory_while_capturing_is_a_capture_error(monkeypatch):
    """Not the CUDARuntimeError CuPy's pool would answer by freeing blocks the recorded
    graph may still use."""
    cupy = pytest.importorskip("cupy")
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    def no_memory(size):
        raise CUDARuntimeError(2)  # cudaErrorMemoryAllocation

    monkeypatch.setattr(cupy.cuda, "Memory", no_memory)
    with pytest.raises(CaptureError, match=r"out of device memory while capturing the step "
                                           r"\(1,024 bytes more"):
        graph._capture_malloc(1024)
