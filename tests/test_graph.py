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
