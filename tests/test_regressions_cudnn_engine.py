"""Regressions found by reviewing the cuDNN engine against cuDNN 9 and CuPy 14, checked
without a GPU: the engine's GPU-only functions run on stand-in plans, arrays and
binding calls."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from convfuse._binding import cudnn
from convfuse.errors import CudnnError
from convfuse.ops.cudnn import conv as engine
from convfuse.ops.cudnn import fused
from convfuse.ops.cudnn.device import CupyContext
from convfuse.plan import Candidate, FusedFallbackWarning

lib = cudnn()


# ------------------------------------------------- cuDNN 9 status categories

@pytest.mark.parametrize("name", [
    "CUDNN_STATUS_NOT_SUPPORTED", "CUDNN_STATUS_NOT_SUPPORTED_SHAPE",
    "CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE", "CUDNN_STATUS_NOT_SUPPORTED_LAYOUT",
    "CUDNN_STATUS_NOT_SUPPORTED_PADDING",
])
def test_every_not_supported_code_is_a_refusal(name):
    # cudnn_graph.h: CUDNN_STATUS_CATEGORY(s) = s / 1000 * 1000; NOT_SUPPORTED is 3000.
    assert engine.refused(CudnnError(getattr(lib, name), "cudnnX"), lib)


@pytest.mark.parametrize("name", [
    "CUDNN_STATUS_BAD_PARAM", "CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER",
    "CUDNN_STATUS_INTERNAL_ERROR", "CUDNN_STATUS_EXECUTION_FAILED", "CUDNN_STATUS_NOT_INITIALIZED",
])
def test_other_codes_are_not_refusals(name):
    assert not engine.refused(CudnnError(getattr(lib, name), "cudnnX"), lib)


class StandInPlan:
    """The parts of a ConvPlan that _fused_forward touches, with a ranked list of
    relu candidates that reject() walks down."""

    def __init__(self, algos):
        self.cands = [Candidate(a, 0, lib.CUDNN_DEFAULT_MATH, True) for a in algos]
        self.x_desc = self.w_desc = self.y_desc = self.bias_desc = self.act_desc = "desc"
        self.key = SimpleNamespace(activation="relu", residual=False, benchmark=False)
        self.fused_refusal = None
        self.forward_path = None

    def refuse_fused(self, err):
        first = self.fused_refusal is None
        self.fused_refusal = self.fused_refusal or err
        return first

    def fused_off(self):
        return self.fused_refusal is not None

    def fused_ran(self):
        pass

    def set_forward_path(self, path, replace=False):
        self.forward_path = path if replace else self.forward_path or path

    def workspace_allocated(self, direction, fused=False):
        pass

    def choice(self, direction, handle, inputs=(0, 0), fused=False, allocate=None, stream=None):
        return self.cands[0]

    def reject(self, direction, cand, fused=False, out_of_memory=False, allocate=None):
        assert cand == self.cands[0] and not out_of_memory
        self.cands.pop(0)
        return bool(self.cands)

    def conv_desc_for(self, cand):
        return "conv"

    def describe(self):
        return "stand-in geometry"


def array(ptr):
    return SimpleNamespace(data=SimpleNamespace(ptr=ptr))


#: The call's stream and allocator (Note [the pointer path]): device 0, stream 1.
CTX = CupyContext(0, 1)


@pytest.mark.parametrize("status", ["CUDNN_STATUS_NOT_SUPPORTED_LAYOUT",
                                    "CUDNN_STATUS_NOT_SUPPORTED_SHAPE"])
def test_fused_forward_moves_on_after_a_specific_refusal(monkeypatch, status):
    pytest.importorskip("cupy")  # Workspace(0) imports it; it allocates nothing
    tried = []

    def fused_call(*args):
        tried.append(args[7])
        if len(tried) == 1:
            raise CudnnError(getattr(lib, status), "cudnnConvolutionBiasActivationForward")

    fake = SimpleNamespace(CUDNN_STATUS_NOT_SUPPORTED=lib.CUDNN_STATUS_NOT_SUPPORTED,
                           convolutionBiasActivationForward=fused_call)
    monkeypatch.setattr(fused, "cudnn", lambda: fake)
    plan = StandInPlan([6, 1])
    fused.fused_forward(plan, "H", CTX, array(16), array(32), array(48), None, 1.0, array(64))
    assert tried == [6, 1] and plan.fused_refusal is None


def test_fused_forward_falls_back_when_no_algorithm_is_left(monkeypatch):
    """Note [unfused fallback]: the refusal is recorded with context, warned once, and the
    unfused path runs instead (tests/test_fused_fallback.py checks that path's calls)."""
    pytest.importorskip("cupy")

    def fused_call(*args):
        raise CudnnError(lib.CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE, "cudnnX")

    fake = SimpleNamespace(CUDNN_STATUS_NOT_SUPPORTED=lib.CUDNN_STATUS_NOT_SUPPORTED,
                           convolutionBiasActivationForward=fused_call)
    monkeypatch.setattr(fused, "cudnn", lambda: fake)
    unfused = []
    monkeypatch.setattr(fused, "_unfused_forward", lambda *a: unfused.append(a))
    plan = StandInPlan([6])
    with pytest.warns(FusedFallbackWarning,
                      match=rf"\({lib.CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE}\).*stand-in"):
        fused.fused_forward(plan, "H", CTX, array(16), array(32), array(48), None, 1.0, array(64))
    assert plan.fused_refusal.status == lib.CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE
    assert "stand-in geometry" in str(plan.fused_refusal)
    assert len(unfused) == 1


# ------------------------------------------------- the cached zero bias owns its memory

def test_zero_bias_never_comes_from_the_current_allocator(monkeypatch):
    """graph.capture's warm-up runs under a private pool (using_allocator(pool.malloc)).
    A pooled array does not keep its pool alive, so a zero bias cached from there would
    point at freed memory once the captured step is dropped."""
    cp = pytest.importorskip("cupy")
    seen = []

    def zeros(shape, dtype=float):
        seen.append(cp.cuda.get_allocator())
        return np.zeros(shape, dtype)

    monkeypatch.setattr(cp.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(cp, "zeros", zeros)
    monkeypatch.setattr(fused, "_zero_bias", {})
    # the fill's event (Note [cached constants across streams]) needs a device: stand-ins
    from tests.test_ops_cudnn_wiring import FakeEvent, FakeStream

    fake = type("Fake", (), {"stream": FakeStream(1), "stream_ops": []})()
    monkeypatch.setattr(cp.cuda, "Event", lambda **kw: FakeEvent(fake))
    monkeypatch.setattr(cp.cuda, "get_current_stream", lambda: fake.stream)
    monkeypatch.setattr(cp.cuda.runtime, "streamWaitEvent", lambda *a: None)

    def private_pool_malloc(nbytes):
        raise AssertionError("the zero bias was taken from the private pool")

    with cp.cuda.using_allocator(private_pool_malloc):
        bias = fused.zero_bias(cp, "float32", 5, CTX)
        again = fused.zero_bias(cp, np.float32, 5, CTX)
        assert cp.cuda.get_allocator() is private_pool_malloc  # restored afterwards
    assert again is bias and bias.shape == (5,) and not bias.any()
    # Made once, from CuPy's default pool (issue #13: freeing raw memory is a cudaFree).
    assert seen == [cp.get_default_memory_pool().malloc]
