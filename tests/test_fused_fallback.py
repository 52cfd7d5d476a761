"""The unfused fallback of the cuDNN engine (Note [unfused fallback] in
convfuse/ops/cudnn/fused.py), on the faked GPU of tests/test_ops_cudnn_wiring.py: when
cuDNN refuses convolutionBiasActivationForward for every algorithm a plan may use, the
engine warns once, runs convolutionForward + addTensor (+ ReLU) instead, and later calls
go straight there. Other errors still raise. tests/gpu covers the numbers on a device."""

from __future__ import annotations

import warnings

import pytest

import convfuse.ops as ops
from convfuse.errors import CudnnError
from convfuse.ops.cudnn import fused
from convfuse.plan import FusedFallbackWarning, clear_plan_cache, get_plan
from tests._ops_dispatch_helpers import GEOMS
from tests.test_ops_cudnn_wiring import FUSED, FakeGpu, ptr

FWD = "convolutionForward"


@pytest.fixture
def gpu(monkeypatch):
    fake = FakeGpu(monkeypatch)
    monkeypatch.setattr(fused, "_zero_bias", {})  # zero biases here live at fake addresses
    yield fake
    clear_plan_cache()  # plans here remember refusals; no other test should meet them


def refusal(lib, status):
    # As the binding raises it: the status, the C name, cudnnGetErrorString's text.
    return CudnnError(status, "cudnnConvolutionBiasActivationForward", lib.getErrorString(status))


def fallback_warnings(record):
    return [w for w in record if issubclass(w.category, FusedFallbackWarning)]


def unfused_calls(gpu, geom, x, w, b, res, scale, act, y, z):
    """The binding and launcher calls the fallback makes for one forward, in order."""
    p = get_plan(geom, "float32")  # conv_forward's plan and its best-ranked algorithm
    cand = p.choice("fwd", "H")
    conv_out = z if z is not None else y
    calls = [(FWD, ("H", 1.0, p.x_desc, ptr(x), p.w_desc, ptr(w), p.conv_desc_for(cand),
                    cand.algo, 0, 0, 0.0, p.y_desc, ptr(conv_out)))]
    fused_mode = "relu" if act == "relu" else "identity"
    if b is not None or res is not None or act == "relu":  # one bias + activation pass
        calls.append(("bias_act_forward", (conv_out, b, res, scale, fused_mode, geom)))
    if act not in ("identity", "relu"):  # applied by conv_bias_act after the fallback
        calls.append(("activation_forward", (conv_out, act, y)))
    return calls


CASES = [  # activation, bias, residual, refusal statuses (one per algorithm tried)
    ("identity", True, True, [3000]),
    ("identity", True, False, [3004]),  # (no bias, no residual: Note [nothing to fuse])
    ("relu", True, True, [3000, 3000, 3004]),  # walks cuDNN's ranking 6, 2, 0 first
    ("relu", False, True, [3004, 3000, 3000]),
    ("relu", False, False, [3000, 3000, 3000]),
    ("silu", True, False, [3000]),  # silu runs IDENTITY fused, then its own kernel
]


@pytest.mark.parametrize(("act", "has_bias", "has_res", "statuses"), CASES)
def test_refused_fused_call_falls_back_and_warns_once(gpu, act, has_bias, has_res, statuses):
    lib, geom = gpu.lib, GEOMS[0]
    x, w = gpu.array(geom.input_shape, "float32"), gpu.array(geom.weight_shape, "float32")
    b = gpu.array(geom.bias_shape, "float32") if has_bias else None
    res = gpu.array(geom.output_shape, "float32") if has_res else None
    gpu.fail[FUSED] = [refusal(lib, s) for s in statuses]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")  # count every warn() call, not once per location
        y1, z1 = ops.conv_bias_act(x, w, b, geom, act, res, 0.5)
        first = list(gpu.calls)
        gpu.calls.clear()
        y2, z2 = ops.conv_bias_act(x, w, b, geom, act, res, 0.5)
    fused, rest = first[:len(statuses)], first[len(statuses):]
    assert [name for name, _ in fused] == [FUSED] * len(statuses)
    forced = lib.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM
    assert [a[7] for _, a in fused] == ([6, 2, 0] if act == "relu" else [forced])
    assert rest == unfused_calls(gpu, geom, x, w, b, res, 0.5, act, y1, z1)
    # The plan remembers: no fused call is tried again.
    assert gpu.calls == unfused_calls(gpu, geom, x, w, b, res, 0.5, act, y2, z2)
    assert (z1 is None) == (z2 is None) == (act != "silu")
    [warning] = fallback_warnings(record)
    msg = str(warning.message)
    last = statuses[-1]
    assert f"{lib.getErrorString(last)} ({last})" in msg
    assert geom.describe() in msg and "dtype=float32" in msg
    assert f"residual={has_res}" in msg and "extra kernels" in msg
    assert ("bias + residual + activation pass" in msg) == has_res
    assert warning.filename == __file__  # stacklevel points at the caller of the op
    fused_mode = "relu" if act == "relu" else "identity"
    plan = get_plan(geom, "float32", fused_mode, has_res)
    assert plan.fused_refusal is not None and plan.fused_refusal.status == last
    # The zero bias exists only for the fused attempt, and is never added.
    zero_ptrs = {ptr(zb) for zb in gpu.zeros}
    assert len(gpu.zeros) == (0 if has_bias else 1)
    assert not any(name == "bias_act_forward" and a[1] is not None and ptr(a[1]) in zero_ptrs
                   for name, a in first + gpu.calls)


def test_refusal_is_remembered_per_plan(gpu):
    lib, geom = gpu.lib, GEOMS[1]
    x, w = gpu.array(geom.input_shape, "float32"), gpu.array(geom.weight_shape, "float32")
    b = gpu.array(geom.bias_shape, "float32")
    gpu.fail[FUSED] = [refusal(lib, 3000)]
    with pytest.warns(FusedFallbackWarning, match=r"activation=identity"):
        ops.conv_bias_act(x, w, b, geom)
    # A relu plan of the same geometry has its own record: it tries the fused call.
    gpu.calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.conv_bias_act(x, w, None, geom, "relu")
    assert [name for name, _ in gpu.calls] == [FUSED]
    # A fresh plan (after the cache is cleared) tries again, and warns again if refused.
    clear_plan_cache()
    gpu.fail[FUSED] = [refusal(lib, 3004)]
    with pytest.warns(FusedFallbackWarning, match=r"NOT_SUPPORTED_LAYOUT \(3004\)"):
        ops.conv_bias_act(x, w, b, geom)


def test_a_refusal_another_thread_recorded_first_is_not_warned_again(gpu, monkeypatch):
    """Two threads refused at once: the plan keeps one record, and only its recorder warns."""
    lib, geom = gpu.lib, GEOMS[0]
    x, w = gpu.array(geom.input_shape, "float32"), gpu.array(geom.weight_shape, "float32")
    plan = get_plan(geom, "float32")
    other = refusal(lib, 3004)

    def refused_while_another_thread_records(*args):
        gpu.calls.append((FUSED, args))
        plan.refuse_fused(other)  # the other thread, between our check and our refusal
        raise refusal(lib, 3000)

    monkeypatch.setattr(lib, FUSED, refused_while_another_thread_records)
    res = gpu.array(geom.output_shape, "float32")
    plan = get_plan(geom, "float32", "identity", True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, _ = ops.conv_bias_act(x, w, None, geom, "identity", res)
    assert plan.fused_refusal is other
    assert [name for name, _ in gpu.calls] == [FUSED, FWD, "bias_act_forward"]
    assert gpu.calls[-2][1][-1] == ptr(y)


def test_other_errors_still_raise_with_context(gpu):
    lib, geom = gpu.lib, GEOMS[2]
    x, w = gpu.array(geom.input_shape, "float32"), gpu.array(geom.weight_shape, "float32")
    gpu.fail[FUSED] = [CudnnError(2000, "cudnnConvolutionBiasActivationForward",
                                  lib.getErrorString(2000))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FusedFallbackWarning either
        with pytest.raises(CudnnError) as info:
            ops.conv_bias_act(x, w, None, geom, "relu")
    assert info.value.status == 2000
    msg = str(info.value)
    assert "CUDNN_STATUS_BAD_PARAM (2000)" in msg and geom.describe() in msg
    assert "dtype=float32 activation=relu algo=6 workspace=0" in msg
    assert [name for name, _ in gpu.calls] == [FUSED]  # neither retried nor worked around
    assert get_plan(geom, "float32", "relu").fused_refusal is None
    gpu.calls.clear()
    ops.conv_bias_act(x, w, None, geom, "relu")  # the next call tries the fused call again
    assert [name for name, _ in gpu.calls] == [FUSED]


@pytest.mark.parametrize(("failing", "where"), [
    (FWD, r"conv_bias_act unfused convolutionForward for .* activation=relu algo=6"),
])
def test_errors_in_the_fallback_carry_context(gpu, failing, where):
    lib, geom = gpu.lib, GEOMS[3]
    x, w = gpu.array(geom.input_shape, "float32"), gpu.array(geom.weight_shape, "float32")
    b = gpu.array(geom.bias_shape, "float32")
    gpu.fail[FUSED] = [refusal(lib, 3000)] * 3
    gpu.fail[failing] = [CudnnError(2000, "cudnnX", lib.getErrorString(2000))]
    with pytest.warns(FusedFallbackWarning), pytest.raises(CudnnError, match=where) as info:
        ops.conv_bias_act(x, w, b, geom, "relu")
    assert info.value.status == 2000 and geom.describe() in str(info.value)


def test_plan_records_the_first_refusal_only():
    # Descriptor-only plans need no GPU.
    plan = get_plan(GEOMS[0], "float64", "relu")
    try:
        assert plan.fused_refusal is None
        first, second = CudnnError(3000, "cudnnA"), CudnnError(3004, "cudnnB")
        assert plan.refuse_fused(first) is True
        assert plan.refuse_fused(second) is False  # another thread got there first
        assert plan.fused_refusal is first
        assert get_plan(GEOMS[0], "float64", "identity").fused_refusal is None
    finally:
        clear_plan_cache()


def test_the_fallback_warning_quotes_cudnns_own_message(gpu):
    """CudnnError.detail (cudnnGetLastErrorString where the call failed) ends the warning:
    the reason the status alone does not give."""
    lib, geom = gpu.lib, GEOMS[0]
    x, w = gpu.array(geom.input_shape, "float32"), gpu.array(geom.weight_shape, "float32")
    b = gpu.array(geom.bias_shape, "float32")
    gpu.fail[FUSED] = [CudnnError(3000, "cudnnConvolutionBiasActivationForward",
                                  lib.getErrorString(3000), "", "No valid engine config")]
    with pytest.warns(FusedFallbackWarning) as record:
        ops.conv_bias_act(x, w, b, geom, "identity")
    assert str(record[0].message).endswith("cuDNN said: No valid engine config")
