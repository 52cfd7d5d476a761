"""Fault injection for the plain convolution calls (conv_forward, conv_backward_data,
conv_backward_filter) and the bias gradient: each stage of each call fails in turn; every
case ends on a documented fallback with the right numbers (beta = 1 outputs accumulate
exactly once, even after a refused attempt) and exactly the warnings listed, or on a typed
convfuse error naming the call. See tests/test_fault_injection.py for the forward."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import convfuse.ops as ops
from convfuse import config
from convfuse.errors import CudnnError
from convfuse.ops.cudnn.layout import cudnn_geometry
from convfuse.plan import (
    BiasGradFallbackWarning,
    NoAlgorithmError,
    WorkspaceFallbackWarning,
    WorkspaceUnavailableError,
    get_plan,
)
from convfuse.plan.descriptors import lift, packed_strides
from tests._fault_injection import (
    ALLOC_FAILED,
    BAD_PARAM,
    BIG,
    NOT_SUPPORTED,
    make_gpu,  # noqa: F401  (fixture)
)
from tests._ops_dispatch_helpers import GEOMS

DIRECTIONS = {  # direction -> (heuristics query, compute call)
    "fwd": ("getConvolutionForwardAlgorithm_v7", "convolutionForward"),
    "bwd_data": ("getConvolutionBackwardDataAlgorithm_v7", "convolutionBackwardData"),
    "bwd_filter": ("getConvolutionBackwardFilterAlgorithm_v7", "convolutionBackwardFilter"),
}


def _cname(name):
    return f"cudnn{name[0].upper()}{name[1:]}"


def _op(gpu, geom, direction, rng):
    """Run the op of `direction` once: (device result, float64 reference)."""
    x, w = rng.standard_normal(geom.input_shape), rng.standard_normal(geom.weight_shape)
    dz = rng.standard_normal(geom.output_shape)
    dx, dw = gpu.put(x), gpu.put(w)
    ddz = gpu.put(dz)
    if direction == "fwd":
        return lambda: ops.conv_forward(dx, dw, geom), ops.conv_forward(x, w, geom)
    if direction == "bwd_data":
        start = rng.standard_normal(geom.input_shape)
        out = gpu.put(start)
        return (lambda: ops.conv_backward_data(ddz, dw, geom, out=out, beta=1.0),
                ops.conv_backward_data(dz, w, geom) + start)
    start = rng.standard_normal(geom.weight_shape)
    out = gpu.put(start)
    return (lambda: ops.conv_backward_filter(dx, ddz, geom, out=out, beta=1.0),
            ops.conv_backward_filter(x, dz, geom) + start)


def _cases():
    out = []
    for d, (query, call) in DIRECTIONS.items():
        out += [
            (d, "query-not-supported", {"inject": [(query, NOT_SUPPORTED, None)]},
             ("raises", CudnnError, _cname(query))),
            (d, "query-bad-param", {"inject": [(query, BAD_PARAM, None)]},
             ("raises", CudnnError, _cname(query))),
            (d, "query-alloc-failed", {"inject": [(query, ALLOC_FAILED, None)]},
             ("raises", CudnnError, _cname(query))),
            (d, "records-refused", {"refuse_records": True},
             ("raises", NoAlgorithmError, "0 runnable")),
            (d, "limit-keeps-small", {"flags": {"workspace_limit": 100}}, ("ran", 0, [])),
            (d, "limit-below-all", {"flags": {"workspace_limit": 10}, "min_ws": 64},
             ("raises", NoAlgorithmError, "within workspace_limit=10")),
            (d, "oom-at-choice", {"oom_choice_at": BIG},
             ("ran", 2, [WorkspaceFallbackWarning])),
            (d, "oom-at-choice-all", {"oom_choice_at": 1, "min_ws": 64},
             ("raises", WorkspaceUnavailableError, "out of memory for every")),
            (d, "oom-at-call", {"oom_call_at": BIG}, ("ran", 2, [WorkspaceFallbackWarning])),
            (d, "oom-at-call-all", {"oom_call_at": 1, "min_ws": 64},
             ("raises", WorkspaceUnavailableError, "no other algorithm is left")),
            (d, "call-refused-once", {"inject": [(call, NOT_SUPPORTED, 1)]}, ("ran", 2, [])),
            (d, "call-refused-always", {"inject": [(call, NOT_SUPPORTED, None)]},
             ("raises", CudnnError, _cname(call))),
            (d, "call-bad-param", {"inject": [(call, BAD_PARAM, None)]},
             ("raises", CudnnError, _cname(call))),
            (d, "call-alloc-failed", {"inject": [(call, ALLOC_FAILED, None)]},
             ("raises", CudnnError, _cname(call))),
        ]
    return out


CASES = _cases()


@pytest.mark.parametrize("geom", [GEOMS[0], GEOMS[3]], ids=lambda g: g.layout)
@pytest.mark.parametrize(("direction", "case", "setup", "outcome"), CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_convolution_fault(make_gpu, rng, geom, direction, case, setup, outcome):  # noqa: F811
    gpu = make_gpu(geom)
    for name, status, times in setup.get("inject", []):
        gpu.inject(name, status, times)
    if setup.get("refuse_records"):
        gpu.perfs = [(a, m, NOT_SUPPORTED) for a, m, _ in gpu.perfs]
    if "min_ws" in setup:
        gpu.perfs = [(a, max(m, setup["min_ws"]), s) for a, m, s in gpu.perfs]
    gpu.oom_choice_at = setup.get("oom_choice_at")
    gpu.oom_call_at = setup.get("oom_call_at")
    flags = setup.get("flags", {})
    run, want = _op(gpu, geom, direction, rng)
    kind, detail, warned = outcome
    with config.flags(**flags):
        if kind == "raises":
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                with pytest.raises(detail) as info:
                    run()
            msg = str(info.value)
            assert warned in msg and geom.describe() in msg
            # at most the one warning of a call-time walk that then ran out of candidates
            assert len(record) <= 1
            return
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            got = run()
        np.testing.assert_allclose(gpu.get(got), want, rtol=1e-12, atol=1e-12)
        assert [w.category for w in record] == warned
        call = DIRECTIONS[direction][1]
        used = [a[7] for n, a in gpu.calls if n == call]
        assert used[-1] == detail
        # the plan that ran (Note [float64 runs channels-first] for NDHWC)
        ran = get_plan(cudnn_geometry(geom, "float64"), "float64")
        assert ran.choice(direction, "H").algo == detail


@pytest.mark.parametrize("geom", [GEOMS[1], GEOMS[2]], ids=lambda g: g.layout)
@pytest.mark.parametrize(("status", "outcome"), [
    (NOT_SUPPORTED, "kernel"), (BAD_PARAM, "raises"), (ALLOC_FAILED, "raises"),
])
def test_backward_bias_fault(make_gpu, rng, geom, status, outcome):  # noqa: F811
    gpu = make_gpu(geom)
    gpu.inject("convolutionBackwardBias", status)
    dz = rng.standard_normal(geom.output_shape)
    start = rng.standard_normal(geom.bias_shape)
    out = gpu.put(start)
    ddz = gpu.put(dz)
    if outcome == "raises":
        with pytest.raises(CudnnError) as info:
            ops.conv_backward_bias(ddz, geom, out=out, beta=1.0)
        assert "cudnnConvolutionBackwardBias" in str(info.value)
        assert f"({status})" in str(info.value) and geom.describe() in str(info.value)
        np.testing.assert_array_equal(gpu.get(out), start)  # untouched
        return
    with pytest.warns(BiasGradFallbackWarning, match=r"CUDNN_STATUS_NOT_SUPPORTED \(3000\)"):
        ops.conv_backward_bias(ddz, geom, out=out, beta=1.0)
    want = ops.conv_backward_bias(dz, geom) + start
    np.testing.assert_allclose(gpu.get(out), want, rtol=1e-12)
    gpu.calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per plan
        db = ops.conv_backward_bias(ddz, geom)
    np.testing.assert_allclose(gpu.get(db), ops.conv_backward_bias(dz, geom), rtol=1e-12)
    assert gpu.names() == ["activation_backward_bias"]  # straight to the kernel
    assert get_plan(geom, "float64").bias_grad_refusal.status == status


SIZE_QUERIES = {"fwd": "getConvolutionForwardWorkspaceSize",
                "bwd_data": "getConvolutionBackwardDataWorkspaceSize",
                "bwd_filter": "getConvolutionBackwardFilterWorkspaceSize"}


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_the_queried_workspace_size_is_allocated_and_passed(make_gpu, rng, direction):  # noqa: F811
    """Note [workspace sizes are queried]: the heuristics' record says BIG bytes for algo 6;
    the size query (with the descriptor the call runs with) says 12345, and that is what
    the pool is asked for and what cuDNN is told."""
    geom = GEOMS[0]
    gpu = make_gpu(geom)
    gpu.queried = {6: 12345}
    run, want = _op(gpu, geom, direction, rng)
    got = run()
    np.testing.assert_allclose(gpu.get(got), want, rtol=1e-12, atol=1e-12)
    call = DIRECTIONS[direction][1]
    [(_, args)] = [(n, a) for n, a in gpu.calls if n == call]
    assert (args[7], args[9]) == (6, 12345)  # algo, workSpaceSizeInBytes
    sizes = [a[0] for n, a in gpu.calls if n == "alloc"]
    assert sizes == [12345, 12345]  # at choice (first_allocatable) and for the call
    plan = get_plan(geom, "float64")
    cand = plan.choice(direction, "H")
    assert cand.workspace == 12345
    queries = [a for n, a in gpu.calls if n == SIZE_QUERIES[direction]]
    assert [q[-1] for q in queries] == [6, 2, 0]  # every usable record, once
    assert queries[0][3] is plan.conv_desc_for(cand)  # the descriptor the call ran with
    assert args[6] is plan.conv_desc_for(cand)


def test_workspace_limit_sees_the_queried_size(make_gpu, rng):  # noqa: F811
    geom = GEOMS[0]
    gpu = make_gpu(geom)
    gpu.queried = {2: 1 << 16}  # the record said 4096
    run, want = _op(gpu, geom, "bwd_data", rng)
    with config.flags(workspace_limit=8192):
        got = run()
    np.testing.assert_allclose(gpu.get(got), want, rtol=1e-12, atol=1e-12)
    assert [a[7] for n, a in gpu.calls if n == "convolutionBackwardData"] == [0]


@pytest.mark.parametrize("geom", [GEOMS[1], GEOMS[3]], ids=lambda g: g.layout)
@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_float64_channels_last_runs_channels_first(make_gpu, rng, geom, direction):  # noqa: F811
    """Note [float64 runs channels-first]: the right numbers (beta = 1 accumulating once),
    and every cuDNN call of the op carries the channels-first plan's descriptors."""
    gpu = make_gpu(geom)
    run, want = _op(gpu, geom, direction, rng)
    got = run()
    np.testing.assert_allclose(gpu.get(got), want, rtol=1e-12, atol=1e-12)
    assert got.shape == want.shape
    cf = get_plan(cudnn_geometry(geom, "float64"), "float64")
    [(_, args)] = [(n, a) for n, a in gpu.calls if n == DIRECTIONS[direction][1]]
    want_descs = {"fwd": (cf.x_desc, cf.w_desc, cf.y_desc),
                  "bwd_data": (cf.w_desc, cf.y_desc, cf.x_desc),
                  "bwd_filter": (cf.x_desc, cf.y_desc, cf.w_desc)}[direction]
    assert (args[2], args[4], args[11]) == want_descs
    dims = lift(geom.input_shape_cf)
    assert tuple(cf.x_desc.getNd()[1]) == dims
    assert tuple(cf.x_desc.getNd()[2]) == packed_strides(dims, channels_last=False)
    assert gpu.names().count("to_channels_last") == 1  # the result, copied back once


@pytest.mark.parametrize("geom", [GEOMS[0], GEOMS[3]], ids=lambda g: g.layout)
@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_nothing_left_to_run_is_a_typed_error(make_gpu, rng, geom, direction):  # noqa: F811
    """An empty ranking (every record refused) and a ranking cuDNN refuses at every call
    both end in a typed error naming the op, the caller's geometry and what was tried."""
    op = {"fwd": "conv_forward", "bwd_data": "conv_backward_data",
          "bwd_filter": "conv_backward_filter"}[direction]
    gpu = make_gpu(geom)
    gpu.perfs = [(a, m, NOT_SUPPORTED) for a, m, _ in gpu.perfs]
    run, _ = _op(gpu, geom, direction, rng)
    with pytest.raises(NoAlgorithmError) as info:
        run()
    msg = str(info.value)
    assert msg.startswith(f"{op}: ") and geom.describe() in msg
    assert "cuDNN reported 3 algorithm(s), 0 runnable" in msg

    gpu = make_gpu(geom)
    gpu.inject(DIRECTIONS[direction][1], NOT_SUPPORTED)
    run, _ = _op(gpu, geom, direction, rng)
    with pytest.raises(CudnnError) as info:
        run()
    msg = str(info.value)
    assert _cname(DIRECTIONS[direction][1]) in msg and op in msg and geom.describe() in msg
    assert f"refused every {direction} algorithm this call tried (algo 6, 2, 0)" in msg


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_a_plan_whose_every_algorithm_was_refused_says_so_at_later_calls(
        make_gpu, rng, direction):  # noqa: F811
    """cuDNN refused every ranked algorithm: the first call raises the refusal, each later
    one a NoAlgorithmError naming the plan (the exhausted slot used to raise IndexError)."""
    geom = GEOMS[0]
    gpu = make_gpu(geom)
    gpu.inject(DIRECTIONS[direction][1], NOT_SUPPORTED, None)
    run, _ = _op(gpu, geom, direction, rng)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CudnnError, match="NOT_SUPPORTED"):
            run()
        for _ in range(2):
            with pytest.raises(NoAlgorithmError, match="refused every") as info:
                run()
            assert geom.describe() in str(info.value)
