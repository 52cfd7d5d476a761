"""Bound calls on the eager CUDA path (Note [bound calls] in convfuse/ops/cudnn/bound.py),
on tests/_fake_cuda.py's fake device: from a signature's second call on, the bridge hands
the tensors' addresses to the call the engine bound, which must make exactly the cuDNN calls
the engine makes (same descriptors, algorithm, workspace size and factors; the tensors' own
addresses), skip the engine (its validated entries are not called), and give way to the
engine wherever the engine would decide differently: new flags, a cleared plan cache, a
refusal, an error, no memory, another stream, a spy."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")

import convfuse.torch as cft  # noqa: E402
from convfuse import config, ops  # noqa: E402
from convfuse.errors import CudnnError  # noqa: E402
from convfuse.ops import elementwise, validated  # noqa: E402
from convfuse.ops.cudnn import conv as cudnn_conv  # noqa: E402
from convfuse.ops.cudnn import fused, handle  # noqa: E402
from convfuse.plan import (  # noqa: E402
    BiasGradFallbackWarning,
    FusedFallbackWarning,
    WorkspaceFallbackWarning,
    clear_plan_cache,
    plan_cache_info,
)
from convfuse.plan.batchnorm import clear_batchnorm_plan_cache  # noqa: E402
from convfuse.torch import _arrays  # noqa: E402
from tests._engine_calls import count_plan_lookups  # noqa: E402
from tests._fake_cuda import WS, forget_signatures, install, named_calls, train_step  # noqa: E402

FUSED = "convolutionBiasActivationForward"
ENTRIES = ("conv_bias_act", "conv_backward_bias", "conv_backward_filter", "conv_backward_data")


@pytest.fixture
def cuda(monkeypatch):
    yield install(monkeypatch)
    clear_batchnorm_plan_cache()
    forget_signatures()
    clear_plan_cache()


@pytest.fixture
def entries(monkeypatch):
    """How often the engine ran each op (a bound call skips it)."""
    return count_plan_lookups(monkeypatch, cudnn_conv, "get_plan", ENTRIES)


@pytest.mark.parametrize("kwargs, bound_entries", [
    ({"activation": "relu"}, ("conv_bias_act", "conv_backward_filter", "conv_backward_data")),
    ({}, ENTRIES),
    ({"bias": False}, ("conv_bias_act", "conv_backward_filter", "conv_backward_data")),
], ids=["relu-bias", "identity-bias", "nothing-to-fuse"])
def test_later_calls_make_the_engines_cudnn_calls_without_the_engine(cuda, entries, kwargs,
                                                                     bound_entries):
    conv = cft.Conv2d(4, 6, 3, padding=1, **kwargs)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    stable = {x.data_ptr(): "x", conv.weight.data_ptr(): "w"}
    if conv.bias is not None:
        stable[conv.bias.data_ptr()] = "b"
    _, first = train_step(cuda, conv, x)
    ran_first = dict(entries)
    for _ in range(2):
        y, later = train_step(cuda, conv, x)
        assert named_calls(later, stable) == named_calls(first, stable)
        for name, args in later:  # the tensors' own addresses, fresh outputs included
            if name == FUSED:
                assert (args[3], args[5], args[17]) == (x.data_ptr(), conv.weight.data_ptr(),
                                                       y.data_ptr())
                assert args[14] == conv.bias.data_ptr()
            elif name == "convolutionForward":
                assert (args[3], args[5], args[12]) == (x.data_ptr(), conv.weight.data_ptr(),
                                                       y.data_ptr())
            elif name == "convolutionBackwardFilter":
                assert (args[3], args[12]) == (x.data_ptr(), conv.weight.grad.data_ptr())
            elif name == "convolutionBackwardData":
                assert (args[3], args[12]) == (conv.weight.data_ptr(), x.grad.data_ptr())
            elif name == "convolutionBackwardBias":
                assert args[6] == conv.bias.grad.data_ptr()
            elif name == "activation_backward":  # its dz feeds the convolution backwards
                dz = args[3].ptr
                assert all(a[5] == dz for n, a in later if n.startswith("convolutionBackwardF"))
    for name in ENTRIES:  # the bound ones ran once (to bind), the others at every step
        assert entries[name] == (ran_first[name] if name in bound_entries
                                 else 3 * ran_first[name]), name
    assert ran_first["conv_bias_act"] == 1


def test_a_bias_free_fused_call_binds_once_the_zero_bias_is_complete(cuda, entries):
    conv = cft.Conv2d(3, 3, 1, bias=False)
    x, res = torch.randn(1, 3, 4, 4), torch.randn(1, 3, 4, 4)
    with torch.no_grad():
        conv(x, res)
        conv(x, res)
        assert entries["conv_bias_act"] == 2  # its fill may still be running
        [(_, constant)] = fused._zero_bias.items()
        constant.event.done = True
        conv(x, res)  # sees the fill complete, then binds
        cuda.gpu.calls.clear()
        ops_before = len(cuda.gpu.stream_ops)
        y = conv(x, res)
    assert entries["conv_bias_act"] == 3
    [(name, a)] = cuda.gpu.calls
    assert name == FUSED and (a[10], a[12], a[17]) == (1.0, res.data_ptr(), y.data_ptr())
    assert a[14] == constant.arrays[0].data.ptr  # the zero bias, with no wait added
    assert len(cuda.gpu.stream_ops) == ops_before


def _bound_conv(cuda, entries):
    conv = cft.Conv2d(2, 2, 3, padding=1, activation="relu")
    x = torch.randn(1, 2, 4, 4)
    with torch.no_grad():
        conv(x)
        conv(x)
    assert entries["conv_bias_act"] == 1
    return conv, x


def test_new_flags_or_a_cleared_cache_go_through_the_engine_once(cuda, entries):
    conv, x = _bound_conv(cuda, entries)
    with torch.no_grad():
        with config.flags(deterministic=True):
            conv(x)
            conv(x)
        assert entries["conv_bias_act"] == 2  # the new plan's first call, then bound again
        conv(x)
        assert entries["conv_bias_act"] == 3
        clear_plan_cache()
        conv(x)
        conv(x)
    assert entries["conv_bias_act"] == 4


def _error(cuda, status):
    return CudnnError(status, FUSED, cuda.lib.getErrorString(status))


def test_a_refusal_of_the_bound_algorithm_is_the_engines_to_handle(cuda, entries):
    conv, x = _bound_conv(cuda, entries)
    cuda.gpu.fail[FUSED] = [_error(cuda.gpu, 3000), _error(cuda.gpu, 3000)]
    cuda.gpu.calls.clear()
    with torch.no_grad():
        y = conv(x)  # bound: refused; the engine: refused, moves down the ranking
        assert [a[7] for n, a in cuda.gpu.calls if n == FUSED] == [6, 6, 2]
        assert cuda.gpu.calls[-1][1][17] == y.data_ptr()
        cuda.gpu.calls.clear()
        conv(x)
        conv(x)
    assert [a[7] for n, a in cuda.gpu.calls if n == FUSED] == [2, 2]
    assert entries["conv_bias_act"] == 2  # the refusal's call only


@pytest.mark.parametrize("status", [4000, 5000])
def test_an_error_is_raised_at_once_with_the_engines_context(cuda, entries, status):
    """A failure other than a refusal is raised from the bound call itself, named as the
    engine names it: the failing call is not made a second time."""
    conv, x = _bound_conv(cuda, entries)
    cuda.gpu.fail[FUSED] = [_error(cuda.gpu, status)]
    cuda.gpu.calls.clear()
    name = cuda.gpu.lib.getErrorString(status)
    with torch.no_grad(), pytest.raises(CudnnError, match=rf"{name} \({status}\): "
                                        r"conv_bias_act for x\[1, 2, 4, 4\] .*algo=6"):
        conv(x)
    assert [n for n, _ in cuda.gpu.calls].count(FUSED) == 1
    assert entries["conv_bias_act"] == 1  # the first (engine) call only
    with torch.no_grad():
        conv(x)  # the bound call again: the error kept nothing
        conv(x)
    assert entries["conv_bias_act"] == 1


def test_a_device_memory_failure_in_cudnn_is_a_memory_error(cuda, entries):
    conv, x = _bound_conv(cuda, entries)
    cuda.gpu.fail[FUSED] = [_error(cuda.gpu, 4004)]
    with torch.no_grad(), pytest.raises(MemoryError) as info:
        conv(x)
    assert isinstance(info.value, CudnnError) and info.value.status == 4004


def test_no_workspace_memory_is_the_engines_to_handle(cuda, entries, monkeypatch):
    conv, x = _bound_conv(cuda, entries)
    real = _arrays.TorchContext.allocate
    failures = [True]

    def allocate(self, nbytes):
        if failures:
            failures.pop()
            raise cupy.cuda.memory.OutOfMemoryError(nbytes, 0, 0)
        return real(self, nbytes)

    monkeypatch.setattr(_arrays.TorchContext, "allocate", allocate)
    with torch.no_grad():
        conv(x)  # bound: no memory; the engine allocates
    assert entries["conv_bias_act"] == 2 and not failures


def test_another_stream_goes_through_the_engine(cuda, entries, monkeypatch):
    conv, x = _bound_conv(cuda, entries)
    monkeypatch.setattr(_arrays, "_current_raw_stream", lambda index: 0xB000 + index)
    with torch.no_grad():
        conv(x)
        conv(x)
    assert entries["conv_bias_act"] == 2  # the engine on the new stream, then bound
    [h] = handle._all_handles
    assert h.streams == [0xA000, 0xB000]


def test_a_spy_on_the_op_sees_every_call(cuda, entries, monkeypatch):
    conv, x = _bound_conv(cuda, entries)
    seen = []
    real = ops.conv_bias_act
    monkeypatch.setattr(ops, "conv_bias_act", lambda *a, **k: seen.append(1) or real(*a, **k))
    with torch.no_grad():
        conv(x)
        conv(x)
    assert len(seen) == 2


def test_fallback_warnings_still_come_from_the_engine(cuda, entries):
    conv, x = _bound_conv(cuda, entries)
    # every algorithm refused: the engine falls back to the unfused path and warns once
    cuda.gpu.fail[FUSED] = [_error(cuda.gpu, 3000) for _ in range(4)]
    with torch.no_grad(), pytest.warns(FusedFallbackWarning):
        conv(x)
    cuda.gpu.calls.clear()
    with torch.no_grad():
        conv(x)
    assert FUSED not in cuda.names() and "convolutionForward" in cuda.names()


@pytest.mark.parametrize("kwargs, residual", [({}, False), ({"activation": "relu"}, True)],
                         ids=["identity-bias", "relu-residual"])
def test_a_plan_unfused_for_good_binds_its_unfused_path(cuda, entries, kwargs, residual):
    """Note [unfused fallback]: once cuDNN refused the fused call for every algorithm, the
    plan runs convolutionForward and the bias + activation pass for good; a bound call
    makes those same calls (the plain plan's algorithm, the tensors' own addresses) without
    the engine, where it used to be Declined and leave the engine to run every call."""
    conv = cft.Conv2d(2, 3, 3, padding=1, **kwargs)
    x = torch.randn(1, 2, 4, 4)
    res = torch.randn(1, 3, 4, 4) if residual else None
    stable = {x.data_ptr(): "x", conv.weight.data_ptr(): "w", conv.bias.data_ptr(): "b"}
    if residual:
        stable[res.data_ptr()] = "res"
    cuda.gpu.fail[FUSED] = [_error(cuda.gpu, 3000) for _ in range(4)]
    with torch.no_grad(), pytest.warns(FusedFallbackWarning):
        conv(x, res)
    cuda.gpu.calls.clear()
    with torch.no_grad():
        conv(x, res)  # the engine's unfused path; binds after it
        engine_calls = list(cuda.gpu.calls)
        ran = entries["conv_bias_act"]
        for _ in range(2):
            cuda.gpu.calls.clear()
            y = conv(x, res)
            assert named_calls(cuda.gpu.calls, stable) == named_calls(engine_calls, stable)
    assert entries["conv_bias_act"] == ran  # the later calls never reached the engine
    names = [n for n, _ in engine_calls]
    assert names == ["convolutionForward", "bias_act_forward"]
    [(_, fwd)] = [c for c in cuda.gpu.calls if c[0] == "convolutionForward"]
    assert (fwd[3], fwd[5], fwd[12]) == (x.data_ptr(), conv.weight.data_ptr(), y.data_ptr())


def test_a_plan_changed_by_another_signature_is_seen(cuda, entries):
    """Two signatures (x contiguous, and a strided view of the same shape) share a plan:
    what the engine decides for one reaches the other's bound call."""
    conv, x = _bound_conv(cuda, entries)
    strided = torch.randn(1, 2, 4, 8)[..., ::2]
    cuda.gpu.fail[FUSED] = [_error(cuda.gpu, 3000)]
    cuda.gpu.calls.clear()
    with torch.no_grad():
        conv(strided)  # the engine: algo 6 refused, algo 2 runs
        conv(x)  # bound to algo 6: the engine again
    assert [a[7] for n, a in cuda.gpu.calls if n == FUSED] == [6, 2, 2]
    # algo 2, the one left, refused (to the strided call's bound call, then to the
    # engine's): the plan goes unfused for good
    cuda.gpu.fail[FUSED] = [_error(cuda.gpu, 3000), _error(cuda.gpu, 3000)]
    with torch.no_grad(), pytest.warns(FusedFallbackWarning):
        conv(strided)
    assert not cuda.gpu.fail[FUSED]
    for _ in range(2):
        cuda.gpu.calls.clear()
        with torch.no_grad():
            conv(x)  # x's call was bound to the fused call: it declines
        assert FUSED not in cuda.names() and "convolutionForward" in cuda.names()


def test_a_fused_call_turned_off_by_another_signature_is_seen(cuda, entries):
    """identity with a bias: the fused call's algorithm is forced, so a refusal turns the
    fused call off for the plan without touching its ranking."""
    conv = cft.Conv2d(2, 2, 3, padding=1)
    x, strided = torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 8)[..., ::2]
    with torch.no_grad():
        for t in (x, x, strided, strided):
            conv(t)
    assert entries["conv_bias_act"] == 2  # each signature bound after its first call
    cuda.gpu.fail[FUSED] = [_error(cuda.gpu, 3000), _error(cuda.gpu, 3000)]
    with torch.no_grad(), pytest.warns(FusedFallbackWarning):
        conv(strided)  # its bound call, then the engine: refused, unfused from now on
    assert not cuda.gpu.fail[FUSED]
    for _ in range(2):
        cuda.gpu.calls.clear()
        with torch.no_grad():
            conv(x)
        assert FUSED not in cuda.names() and "convolutionForward" in cuda.names()


def test_a_refused_backward_algorithm_is_the_engines_to_handle(cuda, entries):
    conv = cft.Conv2d(2, 2, 3, padding=1)
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    train_step(cuda, conv, x)
    bwd = "convolutionBackwardFilter"
    cuda.gpu.fail[bwd] = [CudnnError(3000, bwd, "CUDNN_STATUS_NOT_SUPPORTED")] * 2
    _, calls = train_step(cuda, conv, x)  # bound: refused; the engine: refused, then algo 2
    assert [a[7] for n, a in calls if n == bwd] == [6, 6, 2]
    assert calls[-2][1][12] == conv.weight.grad.data_ptr()  # the engine's wrote the grad
    _, calls = train_step(cuda, conv, x)
    assert [a[7] for n, a in calls if n == bwd] == [2]
    assert entries["conv_backward_filter"] == 2 and entries["conv_backward_data"] == 1


def test_spies_installed_before_the_first_call_see_every_call(cuda, monkeypatch):
    seen = []
    for module, name in ((cudnn_conv, "conv_bias_act"), (cudnn_conv, "conv_backward_filter"),
                         (validated, "conv_backward_data")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _r=real, _n=name, **k:
                            seen.append(_n) or _r(*a, **k))
    conv = cft.Conv2d(2, 2, 3, padding=1)
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    for _ in range(3):
        train_step(cuda, conv, x)
    assert sorted(seen) == sorted(["conv_bias_act", "conv_backward_filter",
                                   "conv_backward_data"] * 3)


def test_a_workspace_back_off_runs_the_engine_until_its_retry(cuda, entries, monkeypatch):
    """Note [transient out-of-memory]: the bound call's workspace and then the engine's
    cannot be allocated, so the plan runs algo 2 and retries algo 6 after 8 calls; bound
    calls resume only once that retry is over (Chosen.holds)."""
    conv, x = _bound_conv(cuda, entries)
    real = _arrays.TorchContext.allocate
    failures = [True, True]

    def allocate(self, nbytes):
        if failures and nbytes == WS:
            failures.pop()
            raise cupy.cuda.memory.OutOfMemoryError(nbytes, 0, 0)
        return real(self, nbytes)

    monkeypatch.setattr(_arrays.TorchContext, "allocate", allocate)
    cuda.gpu.calls.clear()
    with torch.no_grad(), pytest.warns(WorkspaceFallbackWarning):
        conv(x)
    with torch.no_grad():
        for _ in range(12):
            conv(x)
    algos = [a[7] for n, a in cuda.gpu.calls if n == FUSED]
    assert algos == [2] * 7 + [6] * 6 and not failures
    # the engine: once to bind, then the back-off's 7 calls and the retry's; bound after
    assert entries["conv_bias_act"] == 1 + 7 + 1


def test_the_bias_gradient_follows_config_and_refusals(cuda, entries):
    conv = cft.Conv2d(2, 2, 3, padding=1)
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    train_step(cuda, conv, x)
    train_step(cuda, conv, x)
    assert entries["conv_backward_bias"] == 1
    with config.flags(bias_grad="fused"):
        for step in range(2):  # the engine's kernel (it asks no plan), at every step
            hits = plan_cache_info().hits
            _, calls = train_step(cuda, conv, x)
            names = [n for n, _ in calls]
            assert "activation_backward_bias" in names
            assert "convolutionBackwardBias" not in names
            if step:  # bound: forward, filter, data; the Declined's check counts no hit
                assert plan_cache_info().hits - hits == 3
    train_step(cuda, conv, x)
    _, calls = train_step(cuda, conv, x)
    assert "convolutionBackwardBias" in [n for n, _ in calls]
    assert entries["conv_backward_bias"] == 2  # back to cuDNN: bound again after one
    bias = "convolutionBackwardBias"
    cuda.gpu.fail[bias] = [CudnnError(3000, bias, "CUDNN_STATUS_NOT_SUPPORTED")] * 2
    with pytest.warns(BiasGradFallbackWarning):
        train_step(cuda, conv, x)
    for _ in range(2):
        _, calls = train_step(cuda, conv, x)
        assert bias not in [n for n, _ in calls]  # the plan's refusal holds: the kernel
    assert entries["conv_backward_bias"] == 5  # the refusal's step and each after it


def test_each_stream_keeps_its_own_bound_calls(cuda, entries, monkeypatch):
    conv, x = _bound_conv(cuda, entries)
    streams = {"now": 0xA000}
    monkeypatch.setattr(_arrays, "_current_raw_stream", lambda index: streams["now"] + index)
    with torch.no_grad():
        streams["now"] = 0xB000
        conv(x)  # the engine, then bound on this stream too
        conv(x)
        streams["now"] = 0xA000
        conv(x)
        streams["now"] = 0xB000
        conv(x)
    assert entries["conv_bias_act"] == 2
    [h] = handle._all_handles
    assert h.streams == [0xA000, 0xB000, 0xA000, 0xB000]


def test_spies_installed_after_binding_see_every_call(cuda, monkeypatch):
    conv = cft.Conv2d(2, 2, 3, padding=1)
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    train_step(cuda, conv, x)
    seen = []
    for name in ("conv_bias_act", "conv_backward_bias", "conv_backward_filter"):
        real = getattr(cudnn_conv, name)
        monkeypatch.setattr(cudnn_conv, name, lambda *a, _r=real, _n=name, **k:
                            seen.append(_n) or _r(*a, **k))
    for _ in range(2):
        train_step(cuda, conv, x)
    assert sorted(seen) == sorted(["conv_bias_act", "conv_backward_bias",
                                   "conv_backward_filter"] * 2)


def test_a_bias_gradient_refused_for_another_signature_is_seen(cuda, entries):
    conv = cft.Conv2d(2, 2, 3, padding=1)
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    strided = torch.randn(1, 2, 4, 8)[..., ::2].requires_grad_()
    train_step(cuda, conv, x)
    bias = "convolutionBackwardBias"
    cuda.gpu.fail[bias] = [CudnnError(3000, bias, "CUDNN_STATUS_NOT_SUPPORTED")]
    with pytest.warns(BiasGradFallbackWarning):
        train_step(cuda, conv, strided)  # the engine, refused: the plan's kernel from now on
    _, calls = train_step(cuda, conv, x)  # x's bound bias call declines
    assert bias not in [n for n, _ in calls]
    assert "activation_backward_bias" in [n for n, _ in calls]


def test_a_cleared_plan_is_not_kept_alive_by_its_bound_calls(cuda, entries):
    import gc
    import weakref

    from convfuse.torch import conv as torch_conv

    conv, x = _bound_conv(cuda, entries)
    [bound] = [b for call in torch_conv.CALLS.values() if call is not torch_conv.GENERAL
               for b in call.prep.bound.values() if b]
    plan = weakref.ref(bound.plan())
    assert plan() is not None
    clear_plan_cache()
    gc.collect()
    assert plan() is None  # its descriptors went with it
    with torch.no_grad():
        conv(x)  # the engine, then bound to the new plan
        conv(x)
    assert entries["conv_bias_act"] == 2


def _transposed(monkeypatch, kwargs, act):
    """A ConvTranspose2d, and how often the engine ran its three ops."""
    from convfuse.ops.cudnn import conv_transpose as cudnn_transpose

    counts = count_plan_lookups(monkeypatch, cudnn_transpose, "get_transpose_plan",
                                ("forward", "backward_data", "backward_filter"))
    layer = cft.ConvTranspose2d(4, 6, 3, padding=1, **kwargs)
    if act is not None:
        layer.activation = act
    return layer, counts


@pytest.mark.parametrize("kwargs, act, residual", [
    ({}, None, False), ({"bias": False}, None, False), ({}, "relu", False),
    ({"bias": False}, "relu", False), ({}, None, True), ({"bias": False}, "relu", True)],
    ids=["identity-bias", "identity", "relu-bias", "relu", "identity-bias-residual",
         "relu-residual"])
def test_transposed_calls_are_bound_too(cuda, monkeypatch, kwargs, act, residual):
    """A ConvTranspose2d's forward (G's data gradient, then the engine's bias + activation
    pass, whose arrays' shapes and dtypes are recorded too) and its data and filter
    gradients: the engine's calls, with the tensors' own addresses, from the second step on
    without the engine."""
    layer, counts = _transposed(monkeypatch, kwargs, act)
    epilogues = []
    recorded = elementwise.bias_act_forward  # the fake's recorder

    def bias_act(y, bias, res, scale, activation, geom):
        epilogues.append([None if a is None else (a.ptr, tuple(a.shape), a.dtype)
                          for a in (y, bias, res)] + [scale, activation])
        return recorded(y, bias, res, scale, activation, geom)

    monkeypatch.setattr(elementwise, "bias_act_forward", bias_act)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    r = torch.randn(2, 6, 5, 5) if residual else None
    stable = {x.data_ptr(): "x", layer.weight.data_ptr(): "w"}
    if layer.bias is not None:
        stable[layer.bias.data_ptr()] = "b"
    if r is not None:
        stable[r.data_ptr()] = "r"

    def step():
        for t in (x, *layer.parameters()):
            t.grad = None
        cuda.gpu.calls.clear()
        epilogues.clear()
        y = layer(x) if r is None else layer(x, residual=r)
        y.backward(torch.ones_like(y))
        return y, list(cuda.gpu.calls)

    _, first = step()
    first_epilogues = list(epilogues)
    assert counts == {"forward": 1, "backward_data": 1, "backward_filter": 1}
    for _ in range(2):
        y, later = step()
        assert named_calls(later, stable) == named_calls(first, stable)
        [fwd] = [a for n, a in later if n == "convolutionBackwardData"]
        assert (fwd[3], fwd[5], fwd[12]) == (layer.weight.data_ptr(), x.data_ptr(),
                                            y.data_ptr())
        [data] = [a for n, a in later if n == "convolutionForward"]
        assert (data[5], data[12]) == (layer.weight.data_ptr(), x.grad.data_ptr())
        [filt] = [a for n, a in later if n == "convolutionBackwardFilter"]
        assert (filt[5], filt[12]) == (x.data_ptr(), layer.weight.grad.data_ptr())
        # the epilogue: the engine's arrays (shape, dtype) on the tensors' own addresses
        assert len(epilogues) == len(first_epilogues) == \
            (layer.bias is not None or act is not None or r is not None)
        for got, want in zip(epilogues, first_epilogues):
            assert got[0][1:] == want[0][1:] and got[0][0] == y.data_ptr()
            assert got[1:] == want[1:]
            if layer.bias is not None:
                assert got[1] == (layer.bias.data_ptr(), (6,), np.dtype(np.float32))
            if r is not None:
                assert got[2] == (r.data_ptr(), (2, 6, 5, 5), np.dtype(np.float32))
    assert counts == {"forward": 1, "backward_data": 1, "backward_filter": 1}


@pytest.mark.parametrize("call", ["convolutionBackwardData", "convolutionForward",
                                  "convolutionBackwardFilter"])
def test_a_refused_transposed_algorithm_is_the_engines_to_handle(cuda, monkeypatch, call):
    layer, counts = _transposed(monkeypatch, {}, None)
    x = torch.randn(1, 4, 5, 5, requires_grad=True)
    train_step(cuda, layer, x)
    cuda.gpu.fail[call] = [CudnnError(3000, call, "CUDNN_STATUS_NOT_SUPPORTED")] * 2
    _, calls = train_step(cuda, layer, x)  # bound: refused; the engine: refused, then algo 2
    assert [a[7] for n, a in calls if n == call] == [6, 6, 2]
    _, calls = train_step(cuda, layer, x)
    assert [a[7] for n, a in calls if n == call] == [2]
    assert sum(counts.values()) == 4  # the first step's three, the refusal's one


def test_a_spy_on_a_transposed_op_sees_every_call(cuda, monkeypatch):
    from convfuse.ops.cudnn import conv_transpose as cudnn_transpose

    layer = cft.ConvTranspose2d(4, 6, 3, padding=1)
    x = torch.randn(1, 4, 5, 5, requires_grad=True)
    train_step(cuda, layer, x)
    seen = []
    names = ("conv_transpose_bias_act", "conv_transpose_backward_data",
             "conv_transpose_backward_filter")
    for name in names:
        real = getattr(cudnn_transpose, name)
        monkeypatch.setattr(cudnn_transpose, name, lambda *a, _r=real, _n=name, **k:
                            seen.append(_n) or _r(*a, **k))
    for _ in range(2):
        train_step(cuda, layer, x)
    assert sorted(seen) == sorted(names * 2)


@pytest.mark.parametrize("kind", ["conv", "transpose"])
def test_short_of_memory_a_bound_forward_allocates_as_the_engine_does(cuda, monkeypatch, kind):
    """With room for the large workspace of the bound algorithm, or for y and the small one,
    but not for y and the large one: the bound forward allocates y first, as the engine
    does, declines when the workspace does not fit, and the engine walks down to the small
    workspace with a warning. Allocating the workspace first, it would fail on y with
    PyTorch's out-of-memory, which nothing catches."""
    import cupy as cp

    lib = cuda.gpu.lib
    cuda.gpu.perfs = [lib.AlgoPerf(a, 0, 1.0, ws, lib.CUDNN_DETERMINISTIC,
                                   lib.CUDNN_DEFAULT_MATH) for a, ws in ((6, 4096), (2, 512))]
    live = {"bytes": 0, "cap": 1 << 40}
    real_allocate, real_empty = _arrays.TorchContext.allocate, _arrays.TorchContext.empty

    def take(owner, nbytes, error):
        if live["bytes"] + nbytes > live["cap"]:
            raise error
        live["bytes"] += nbytes
        weakref.finalize(owner, lambda: live.__setitem__("bytes", live["bytes"] - nbytes))

    def allocate(self, nbytes):
        block = real_allocate(self, nbytes)
        take(block.tensor, nbytes, cp.cuda.memory.OutOfMemoryError(nbytes, 0, 0))
        return block

    def empty(self, shape, dtype):
        a = real_empty(self, shape, dtype)
        take(a.owner, a.nbytes, torch.OutOfMemoryError("fake: no room for an output"))
        return a

    monkeypatch.setattr(_arrays.TorchContext, "allocate", allocate)
    monkeypatch.setattr(_arrays.TorchContext, "empty", empty)
    layer = cft.Conv2d(2, 2, 3, padding=1, activation="relu") if kind == "conv" else \
        cft.ConvTranspose2d(2, 2, 3, padding=1)
    x = torch.randn(1, 2, 4, 4)
    with torch.no_grad():
        layer(x)
        layer(x)  # bound from here
        gc.collect()
        y_bytes = 2 * 4 * 4 * 4
        live["cap"] = live["bytes"] + y_bytes + 4096 - 64
        cuda.gpu.calls.clear()
        with pytest.warns(WorkspaceFallbackWarning):
            y = layer(x)
    want = "convolutionBiasActivationForward" if kind == "conv" else "convolutionBackwardData"
    [args] = [a for n, a in cuda.gpu.calls if n == want]  # the engine's one call
    assert (args[7], args[9]) == (2, 512) and args[-1] == y.data_ptr()
