"""Graph capture on a machine without a GPU: a clear refusal, and the failure explanations."""

from __future__ import annotations

import numpy as np
import pytest

from convfuse import graph
from convfuse.backend import gpu_unavailable_reason
from convfuse.errors import DeviceUnavailableError


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
    step = graph.CapturedStep(rec, None, None, statics, "outputs")
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
