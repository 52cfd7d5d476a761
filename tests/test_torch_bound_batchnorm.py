"""Bound batch-norm calls on the eager CUDA path (Note [bound batch-norm calls] in
convfuse/ops/cudnn/bound_batchnorm.py), on tests/_fake_cuda.py's fake device: from a
signature's second call on, a convfuse.torch batch norm hands the tensors' addresses to the
call the engine bound, which must make exactly the calls the engine makes (the same plan's
descriptors, modes, factors and sizes; the tensors' own addresses), skip the engine's
entries, and give way to the engine wherever the engine would find something else: a
cleared plan cache, another stream, a spy. Its decisions (the fused call, a refusal) and
errors are the engine body's own."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")

import convfuse.torch as cft  # noqa: E402
from convfuse import ops  # noqa: E402
from convfuse.errors import CudnnError  # noqa: E402
from convfuse.ops.cudnn import batchnorm as bn_engine  # noqa: E402
from convfuse.plan import FusedFallbackWarning  # noqa: E402
from convfuse.plan.batchnorm import _plans as bn_plans  # noqa: E402
from convfuse.plan.batchnorm import clear_batchnorm_plan_cache  # noqa: E402
from convfuse.torch import _arrays  # noqa: E402
from tests._engine_calls import count_plan_lookups  # noqa: E402
from tests._fake_cuda import forget_signatures, install, named_calls, train_step  # noqa: E402
from tests.test_batchnorm_cudnn_wiring import BWD, BWD_EX, FWD, FWD_EX  # noqa: E402

ENTRIES = ("batchnorm_forward_training", "batchnorm_forward_inference", "training_backward")
INFER = "batchNormalizationForwardInference"


@pytest.fixture
def cuda(monkeypatch):
    yield install(monkeypatch)
    clear_batchnorm_plan_cache()
    forget_signatures()


@pytest.fixture
def entries(monkeypatch):
    """How often the engine ran each op (a bound call skips it): tests/_engine_calls.py."""
    return count_plan_lookups(monkeypatch, bn_engine, "get_batchnorm_plan", ENTRIES)


def _stable(bn, x, residual):
    named = {"x": x, "residual": residual, "weight": bn.weight, "bias": bn.bias,
             "running_mean": bn.running_mean, "running_var": bn.running_var}
    return {t.data_ptr(): name for name, t in named.items() if t is not None}


CASES = {
    "identity": (dict(), False, torch.float32, torch.contiguous_format),
    "relu-residual": (dict(activation="relu"), True, torch.float32, torch.contiguous_format),
    "silu": (dict(activation="silu"), False, torch.float32, torch.contiguous_format),
    "no-running-stats": (dict(track_running_stats=False), False, torch.float32,
                         torch.contiguous_format),
    "cumulative": (dict(momentum=None), True, torch.float32, torch.contiguous_format),
    "fused-half-nhwc": (dict(activation="relu"), True, torch.float16, torch.channels_last),
}


@pytest.mark.parametrize("case", CASES)
def test_later_steps_make_the_engines_calls_without_the_engine(cuda, entries, case):
    kwargs, with_residual, dtype, fmt = CASES[case]
    bn = cft.BatchNorm2d(4, **kwargs)
    x = torch.randn(2, 4, 3, 3).to(dtype).contiguous(memory_format=fmt).requires_grad_()
    res = torch.randn(2, 4, 3, 3).to(dtype).contiguous(memory_format=fmt).requires_grad_() \
        if with_residual else None
    stable = _stable(bn, x, res)
    _, first = train_step(cuda, bn, x, res)
    assert entries == {"batchnorm_forward_training": 1, "batchnorm_forward_inference": 0,
                       "training_backward": 1}
    fused = case == "fused-half-nhwc"
    fwd, bwd = (FWD_EX, BWD_EX) if fused else (FWD, BWD)
    assert [n for n, _ in first if n in (fwd, bwd)] == [fwd, bwd]
    for _ in range(2):
        y, later = train_step(cuda, bn, x, res)
        assert named_calls(later, stable) == named_calls(first, stable)
        a = dict(later)[fwd]
        if fwd == FWD:  # silu's y is a new tensor after the call's own output z
            assert a[5] == x.data_ptr() and (case == "silu" or a[7] == y.data_ptr())
        b = dict(later)[bwd]
        if fused:  # Note [the fused backward on the eager path]: the forward's reserve
            assert (b[8], b[16], b[14]) == (x.data_ptr(), x.grad.data_ptr(),
                                            res.grad.data_ptr())
            assert (b[20], b[21]) == (bn.weight.grad.data_ptr(), bn.bias.grad.data_ptr())
            assert (b[28], b[29]) == (a[23], 4096) and "activation_backward" not in \
                dict(later)
        else:
            assert (b[7], b[11]) == (x.data_ptr(), x.grad.data_ptr())
            assert (b[14], b[15]) == (bn.weight.grad.data_ptr(), bn.bias.grad.data_ptr())
    assert entries == {"batchnorm_forward_training": 1, "batchnorm_forward_inference": 0,
                       "training_backward": 1}  # bound from the second step on
    assert bn.num_batches_tracked is None if case == "no-running-stats" else \
        int(bn.num_batches_tracked) == 3


def test_the_fused_call_gets_workspace_and_reserve_from_torch_each_step(cuda, entries):
    """fp16 channels-last relu with a residual: cudnnBatchNormalizationForwardTrainingEx,
    given a fresh workspace and reserve space of the sizes the plan asked once."""
    bn = cft.BatchNorm2d(4, activation="relu")
    x = torch.randn(2, 4, 3, 3).half().contiguous(memory_format=torch.channels_last)
    res = torch.randn_like(x)
    for _ in range(3):
        cuda.gpu.calls.clear()
        with torch.no_grad():
            bn.train()
            y = bn(x, res)
        [(name, a)] = cuda.gpu.calls
        assert name == FWD_EX
        assert (a[6], a[8], a[10]) == (x.data_ptr(), res.data_ptr(), y.data_ptr())
        assert (a[22], a[24]) == (1024, 4096)  # tests/test_batchnorm_cudnn_wiring.SIZES
    assert entries["batchnorm_forward_training"] == 1


def test_inference_without_statistics_is_bound(cuda, entries):
    bn = cft.BatchNorm2d(3, activation="relu").eval()
    x = torch.randn(2, 3, 4, 4)
    res = torch.randn(2, 3, 4, 4)
    first = None
    for _ in range(3):
        cuda.gpu.calls.clear()
        with torch.no_grad():
            y = bn(x, res)
        calls = named_calls(cuda.gpu.calls, _stable(bn, x, res))
        assert first is None or calls == first
        first = calls
        a = cuda.call(INFER)
        assert (a[5], a[7]) == (x.data_ptr(), y.data_ptr())
        assert (a[11], a[12]) == (bn.running_mean.data_ptr(), bn.running_var.data_ptr())
    assert [n for n, _ in first] == [INFER, "addTensor", "activation_forward"]
    assert entries["batchnorm_forward_inference"] == 1


def test_a_half_layers_parameters_cross_as_copies_each_step(cuda, entries):
    """A .half() layer's weight and bias are not in the compute dtype: each step hands the
    bound call fresh float32 copies, as the engine path hands the op."""
    bn = cft.BatchNorm2d(4).half()
    x = torch.randn(2, 4, 3, 3).half().requires_grad_()
    for _ in range(3):
        _, calls = train_step(cuda, bn, x)
        a = dict(calls)[FWD]
        assert a[9] not in (bn.weight.data_ptr(), bn.bias.data_ptr())
        assert bn.weight.grad.dtype == torch.float16
    assert entries["batchnorm_forward_training"] == 1 and entries["training_backward"] == 1


def test_a_cleared_plan_cache_another_stream_or_a_spy_takes_the_engine(cuda, entries,
                                                                       monkeypatch):
    bn = cft.BatchNorm2d(4, activation="relu")
    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    for _ in range(2):
        train_step(cuda, bn, x)
    assert entries["batchnorm_forward_training"] == 1
    alive = bn_plans.values()  # (kept alive: the cache's word decides, not the collector)
    clear_batchnorm_plan_cache()  # the plan went: found again, then bound again
    for _ in range(2):
        train_step(cuda, bn, x)
    assert entries["batchnorm_forward_training"] == 2 and entries["training_backward"] == 2
    assert alive and all(p not in bn_plans.values() for p in alive)
    monkeypatch.setattr(_arrays, "_current_raw_stream", lambda index: 0xB000 + index)
    for _ in range(2):
        train_step(cuda, bn, x)
    assert entries["batchnorm_forward_training"] == 3 and entries["training_backward"] == 3
    seen = []
    real = bn_engine.batchnorm_forward_training
    monkeypatch.setattr(bn_engine, "batchnorm_forward_training",
                        lambda *a: seen.append("engine") or real(*a))
    for _ in range(2):
        train_step(cuda, bn, x)
    assert seen == ["engine"] * 2  # a spy on the engine sees every call
    real_op = ops.batchnorm_forward_training
    monkeypatch.setattr(ops, "batchnorm_forward_training",
                        lambda *a, **k: seen.append("ops") or real_op(*a, **k))
    for _ in range(2):
        train_step(cuda, bn, x)
    assert seen == ["engine"] * 2 + ["ops", "engine"] * 2  # and one on convfuse.ops


def test_a_bound_calls_cudnn_error_is_the_engines(cuda, entries, monkeypatch):
    """An error inside the engine's body reaches the caller as on the engine path (named
    with the plan), the running statistics' call made once: nothing reruns."""
    bn = cft.BatchNorm2d(4)
    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    train_step(cuda, bn, x)
    lib = cuda.gpu.lib
    calls = []

    def fail(*a):
        calls.append(a)
        raise CudnnError(int(lib.CUDNN_STATUS_EXECUTION_FAILED), FWD,
                         "CUDNN_STATUS_EXECUTION_FAILED")

    monkeypatch.setattr(lib, FWD, fail)
    with pytest.raises(CudnnError, match=r"EXECUTION_FAILED.*batchnorm x=\[2, 4, 3, 3\]"):
        bn(x)
    assert len(calls) == 1 and entries["batchnorm_forward_training"] == 1  # the bound call


def test_a_refusal_inside_the_bound_call_falls_back_as_the_engine_does(cuda, entries,
                                                                      monkeypatch):
    bn = cft.BatchNorm2d(4, activation="relu")
    x = torch.randn(2, 4, 3, 3).half().contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        bn(x)
        bn(x)
    lib = cuda.gpu.lib

    def refuse(*a):
        raise CudnnError(int(lib.CUDNN_STATUS_NOT_SUPPORTED), FWD_EX,
                         "CUDNN_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(lib, FWD_EX, refuse)
    with warnings.catch_warnings(record=True) as got, torch.no_grad():
        warnings.simplefilter("always")
        cuda.gpu.calls.clear()
        bn(x)
    assert [w.category for w in got] == [FusedFallbackWarning]
    assert cuda.names() == [FWD, "activation_forward"]
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        cuda.gpu.calls.clear()
        bn(x)  # the plan remembers: plain, silently, still bound
    assert cuda.names() == [FWD, "activation_forward"]
    assert entries["batchnorm_forward_training"] == 1


def test_a_bound_call_declines_another_context_before_running_anything(cuda):
    """The bridge keys bound calls by context, so this is the engine-level promise: a call
    handed another ExecContext (another stream's handle) runs nothing and says so."""
    from convfuse.ops.cudnn import bound_batchnorm

    bn = cft.BatchNorm2d(4)
    x = torch.randn(2, 4, 3, 3)
    bn(x)
    ctx = _arrays.torch_context(0)
    bound = bound_batchnorm.bind(bn_engine, "batchnorm_forward_training",
                                 bn_plans.values()[0].key.geometry, _arrays._NUMPY_DTYPES[
                                     torch.float32], ctx, "identity", False)
    other = _arrays.TorchContext(0, 0xC000)
    cuda.gpu.calls.clear()
    ptr = x.data_ptr()
    assert bound(other, ptr, bn.weight.data_ptr(), bn.bias.data_ptr(), 0, 0, 0, 1e-5,
                 0.1) is None
    assert cuda.gpu.calls == []
    y, saved = bound(ctx, ptr, bn.weight.data_ptr(), bn.bias.data_ptr(), 0, 0, 0, 1e-5, 0.1)
    assert cuda.names() == [FWD] and cuda.call(FWD)[7] == y.ptr and saved.training
    assert bound_batchnorm.bind(bn_engine, "batchnorm_forward_inference_stats", None, None,
                                ctx, "identity", False) is bound_batchnorm.NEVER


@pytest.mark.parametrize("residual_grad", [True, False], ids=["its-gradient", "no-gradient"])
def test_a_fused_forwards_backward_is_fused_only_with_the_forwards_bnops(cuda, entries,
                                                                          residual_grad):
    """Note [the fused backward on the eager path]: after BN_ADD_ACTIVATION's forward, a
    backward that wants the residual's gradient runs BackwardEx with the forward's own
    reserve space; one that does not (the backward's plan is BN_ACTIVATION's) runs the
    ReLU kernel's backward and the plain call, as before."""
    bn = cft.BatchNorm2d(4, activation="relu")
    x = torch.randn(2, 4, 3, 3).half().contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    res = torch.randn(2, 4, 3, 3).half().contiguous(memory_format=torch.channels_last)
    res.requires_grad_(residual_grad)
    for _ in range(3):
        _, calls = train_step(cuda, bn, x, res)
        names = [n for n, _ in calls]
        if residual_grad:
            assert names == [FWD_EX, BWD_EX]
            assert dict(calls)[BWD_EX][28] == dict(calls)[FWD_EX][23]
            assert dict(calls)[BWD_EX][14] == res.grad.data_ptr()
        else:
            assert names == [FWD_EX, "activation_backward", BWD]
            assert res.grad is None
    assert entries["training_backward"] == 1


def test_the_backward_lets_the_fused_forwards_reserve_space_go(cuda):
    """Note [the fused backward on the eager path]: the reserve space goes with the
    backward, as autograd frees saved tensors, not with the graph (a loop's `loss` keeps
    the graph into the next forward); a retained graph's second backward takes the plain
    call, whose numbers need no reserve space."""
    bn = cft.BatchNorm2d(4, activation="relu")
    x = torch.randn(2, 4, 3, 3).half().contiguous(memory_format=torch.channels_last)
    res = torch.randn(2, 4, 3, 3).half().contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    res.requires_grad_()
    cuda.gpu.calls.clear()
    y = bn(x, res)
    assert y.grad_fn.kept[3] is not None and y.grad_fn.kept[3].fused
    y.backward(torch.ones_like(y), retain_graph=True)
    assert [n for n, _ in cuda.gpu.calls] == [FWD_EX, BWD_EX]
    assert y.grad_fn.kept[3] is None
    cuda.gpu.calls.clear()
    y.backward(torch.ones_like(y))
    assert [n for n, _ in cuda.gpu.calls] == ["activation_backward", BWD]
