"""Fault injection, forward: each cuDNN call a conv plan makes for conv_bias_act refuses or
fails in turn (NOT_SUPPORTED, BAD_PARAM, ALLOC_FAILED, a workspace over the limit, an
out-of-memory) at each stage (algorithm query, workspace query, allocation at choice and
at call time, the call itself). Every case must end on a documented fallback, with the
right numbers (float64 reference engine) and exactly the warnings listed, or on a typed
convfuse error naming the call; never anything else (issue #13).

The fallbacks: Note [unfused fallback] in convfuse/ops/cudnn/fused.py (FusedFallbackWarning),
Note [transient out-of-memory] in convfuse/plan/choice.py (WorkspaceFallbackWarning), and a
silent walk down cuDNN's ranking when it refuses one algorithm (as PyTorch's search does).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import convfuse.ops as ops
from convfuse import config
from convfuse.errors import CudnnError
from convfuse.plan import (
    FusedFallbackWarning,
    NoAlgorithmError,
    WorkspaceFallbackWarning,
    get_plan,
)
from tests._fault_injection import (
    ALLOC_FAILED,
    BAD_PARAM,
    BIG,
    FORCED,
    NOT_SUPPORTED,
    make_gpu,  # noqa: F401  (fixture)
)
from tests._ops_dispatch_helpers import GEOMS

FUSED = "convolutionBiasActivationForward"
FWD = "convolutionForward"
V7 = "getConvolutionForwardAlgorithm_v7"
WSQ = "getConvolutionForwardWorkspaceSize"


def fused_ok(algo_identity=FORCED, algo_relu=6, warn=()):
    return ("fused", {"identity": algo_identity, "relu": algo_relu}, list(warn))


def unfused(fwd_algo=6, warn=(FusedFallbackWarning,)):
    return ("unfused", fwd_algo, list(warn))


def raises(exc, call):
    return ("raises", exc, call)


def _status_setup(name, status):
    return lambda gpu: gpu.inject(name, status)


def _forced_query(status):
    """The forced IDENTITY algorithm's workspace query fails (Note [IDENTITY needs
    IMPLICIT_PRECOMP_GEMM]); the ranked algorithms' queries still answer."""
    return lambda gpu: gpu.inject(WSQ, status, algo=FORCED)


def _limit(gpu):
    return {"workspace_limit": 8192}


def _oom_choice(gpu):
    gpu.oom_choice_at = BIG


def _oom_call(gpu):
    gpu.oom_call_at = BIG


def _records_refused(gpu):
    gpu.perfs = [(a, m, NOT_SUPPORTED) for a, m, _ in gpu.perfs]


def _fused_and_one_forward_refused(gpu):
    gpu.inject(FUSED, NOT_SUPPORTED)
    gpu.inject(FWD, NOT_SUPPORTED, times=1)


# (id, setup, outcome for identity/silu (forced algorithm), outcome for relu)
CASES = [
    ("query-not-supported", _status_setup(V7, NOT_SUPPORTED), fused_ok(),
     raises(CudnnError, "cudnnGetConvolutionForwardAlgorithm_v7")),
    ("query-bad-param", _status_setup(V7, BAD_PARAM), fused_ok(),
     raises(CudnnError, "cudnnGetConvolutionForwardAlgorithm_v7")),
    ("query-alloc-failed", _status_setup(V7, ALLOC_FAILED), fused_ok(),
     raises(CudnnError, "cudnnGetConvolutionForwardAlgorithm_v7")),
    ("query-records-refused", _records_refused, fused_ok(),
     raises(NoAlgorithmError, "0 runnable")),
    ("workspace-query-not-supported", _forced_query(NOT_SUPPORTED), unfused(), fused_ok()),
    ("workspace-query-bad-param", _forced_query(BAD_PARAM),
     raises(CudnnError, "cudnnGetConvolutionForwardWorkspaceSize"), fused_ok()),
    ("workspace-query-alloc-failed", _forced_query(ALLOC_FAILED),
     raises(CudnnError, "cudnnGetConvolutionForwardWorkspaceSize"), fused_ok()),
    ("workspace-over-limit", _limit, unfused(fwd_algo=2), fused_ok(algo_relu=2)),
    ("oom-at-choice", _oom_choice,
     unfused(fwd_algo=2, warn=(FusedFallbackWarning, WorkspaceFallbackWarning)),
     fused_ok(algo_relu=2, warn=(WorkspaceFallbackWarning,))),
    ("oom-at-call", _oom_call,
     unfused(fwd_algo=2, warn=(FusedFallbackWarning, WorkspaceFallbackWarning)),
     fused_ok(algo_relu=2, warn=(WorkspaceFallbackWarning,))),
    ("call-not-supported", _status_setup(FUSED, NOT_SUPPORTED), unfused(), unfused()),
    ("call-bad-param", _status_setup(FUSED, BAD_PARAM),
     raises(CudnnError, "cudnnConvolutionBiasActivationForward"),
     raises(CudnnError, "cudnnConvolutionBiasActivationForward")),
    ("call-alloc-failed", _status_setup(FUSED, ALLOC_FAILED),
     raises(CudnnError, "cudnnConvolutionBiasActivationForward"),
     raises(CudnnError, "cudnnConvolutionBiasActivationForward")),
    ("call-and-one-forward-refused", _fused_and_one_forward_refused, unfused(fwd_algo=2),
     unfused(fwd_algo=2)),
]


def _inputs(gpu, geom, rng, with_bias=True, with_res=True):
    host = {"x": rng.standard_normal(geom.input_shape),
            "w": rng.standard_normal(geom.weight_shape),
            "b": rng.standard_normal(geom.bias_shape) if with_bias else None,
            "res": rng.standard_normal(geom.output_shape) if with_res else None}
    dev = {k: None if v is None else gpu.put(v) for k, v in host.items()}
    return host, dev


def _run(gpu, dev, geom, act, flags):
    with config.flags(**flags), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")  # count every warn() call
        y, _ = ops.conv_bias_act(dev["x"], dev["w"], dev["b"], geom, act, dev["res"], 0.5)
    return y, [w.category for w in record]


@pytest.mark.parametrize("geom", GEOMS[:2], ids=lambda g: g.layout)
@pytest.mark.parametrize("act", ["identity", "relu", "silu"])
@pytest.mark.parametrize(("case", "setup", "forced", "ranked"), CASES,
                         ids=[c[0] for c in CASES])
def test_forward_fault(make_gpu, rng, geom, act, case, setup, forced, ranked):  # noqa: F811
    gpu = make_gpu(geom)
    flags = setup(gpu) or {}
    host, dev = _inputs(gpu, geom, rng)
    want, _ = ops.conv_bias_act(host["x"], host["w"], host["b"], geom, act, host["res"], 0.5)
    kind, detail, warned = forced if act != "relu" else ranked
    if kind == "raises":
        with config.flags(**flags), warnings.catch_warnings():
            warnings.simplefilter("error")  # a typed error, and no warning on the way
            with pytest.raises(detail) as info:
                ops.conv_bias_act(dev["x"], dev["w"], dev["b"], geom, act, dev["res"], 0.5)
        assert warned in str(info.value) and geom.describe() in str(info.value)
        return
    for attempt in range(2):  # the second call takes the same path, silently
        gpu.calls.clear()
        y, categories = _run(gpu, dev, geom, act, flags)
        np.testing.assert_allclose(gpu.get(y), want, rtol=1e-12, atol=1e-12)
        assert categories == (warned if attempt == 0 else [])
        names = gpu.names()
        computed = [(n, a) for n, a in gpu.calls if n in (FUSED, FWD)]
        if kind == "fused":
            assert computed[-1][0] == FUSED
            assert computed[-1][1][7] == detail["relu" if act == "relu" else "identity"]
            assert "bias_act_forward" not in names
        else:
            assert computed[-1][0] == FWD and computed[-1][1][7] == detail
            assert names.count("bias_act_forward") == 1
            if attempt == 1:
                assert FUSED not in names  # the plan remembers (or is backing off)
        assert names.count("activation_forward") == (act == "silu")


def test_no_bias_no_residual_identity_never_tries_the_fused_call(make_gpu, rng):  # noqa: F811
    """Note [nothing to fuse]: a forced algorithm the fused call would refuse is never
    asked for; one convolutionForward, no pass, no warning, no zero bias."""
    geom = GEOMS[1]
    gpu = make_gpu(geom)
    gpu.inject(WSQ, NOT_SUPPORTED, algo=FORCED)
    host, dev = _inputs(gpu, geom, rng, with_bias=False, with_res=False)
    y, categories = _run(gpu, dev, geom, "identity", {})
    np.testing.assert_allclose(gpu.get(y), ops.conv_forward(host["x"], host["w"], geom),
                               rtol=1e-12)
    assert categories == []
    assert FUSED not in gpu.names() and "bias_act_forward" not in gpu.names()


def test_fallback_warning_names_the_refused_call(make_gpu, rng):  # noqa: F811
    geom = GEOMS[0]
    gpu = make_gpu(geom)
    gpu.inject(WSQ, NOT_SUPPORTED, algo=FORCED)
    _, dev = _inputs(gpu, geom, rng)
    with pytest.warns(FusedFallbackWarning) as record:
        ops.conv_bias_act(dev["x"], dev["w"], dev["b"], geom, "gelu", dev["res"], 0.5)
    msg = str(record[0].message)
    assert "cudnnGetConvolutionForwardWorkspaceSize" in msg and "(3000)" in msg
    assert "forced algorithm" in msg and geom.describe() in msg
    assert "does not try the fused call again" in msg
    assert record[0].filename == __file__  # points at the caller of the op
    plan = get_plan(geom, "float64", "identity", True)
    assert plan.fused_refusal.status == NOT_SUPPORTED
    assert plan.forward_path.path == "unfused" and plan.forward_path.reason == "refused"


def test_limit_fallback_says_why(make_gpu, rng):  # noqa: F811
    geom = GEOMS[0]
    gpu = make_gpu(geom)
    _, dev = _inputs(gpu, geom, rng)
    with config.flags(workspace_limit=8192), pytest.warns(FusedFallbackWarning) as record:
        ops.conv_bias_act(dev["x"], dev["w"], dev["b"], geom, "identity", dev["res"], 0.5)
    msg = str(record[0].message)
    assert "NoAlgorithmError" in msg and "workspace_limit=8192" in msg
    with config.flags(workspace_limit=8192):  # the limit is part of the plan's key
        plan = get_plan(geom, "float64", "identity", True)
    assert isinstance(plan.fused_refusal, NoAlgorithmError)
