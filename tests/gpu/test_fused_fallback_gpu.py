"""The unfused fallback (Note [unfused fallback] in convfuse/ops/cudnn/fused.py) against
the float64 reference on a real GPU: cuDNN's fused call is made to refuse every
algorithm, so every forward runs convolutionForward + convfuse's one bias + residual +
activation pass (Note [bias + activation pass] in convfuse/kernels/activation.cu).
Outputs are poisoned with NaN and must come back finite (tests/gpu/test_cudnn_ops.py)."""

from __future__ import annotations

import warnings

import pytest

import convfuse.ops as ops
from convfuse import activations
from convfuse._binding import cudnn
from convfuse.errors import CudnnError
from convfuse.ops.cudnn.layout import cudnn_geometry
from convfuse.plan import FusedFallbackWarning, get_plan
from tests.gpu.test_cudnn_ops import (  # noqa: F401  (the autouse fixture is used by name)
    DTYPES,
    GEOMS,
    Data,
    assert_close,
    full_precision_fresh_plans,
    gid,
    host,
    poison_outputs,
)

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


@pytest.fixture
def fused_call_refused(monkeypatch):
    lib = cudnn()
    calls = []

    def refuse(*args):
        calls.append(args[7])
        raise CudnnError(lib.CUDNN_STATUS_NOT_SUPPORTED, "cudnnConvolutionBiasActivationForward",
                         lib.getErrorString(lib.CUDNN_STATUS_NOT_SUPPORTED))

    monkeypatch.setattr(lib, "convolutionBiasActivationForward", refuse)
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geom", GEOMS, ids=gid)
@pytest.mark.parametrize("activation", ["identity", "relu", "silu"])
@pytest.mark.parametrize(("with_bias", "with_res"), [(True, True), (False, False)])
def test_unfused_fallback_matches_the_reference(monkeypatch, rng, fused_call_refused, geom,
                                                dtype, activation, with_bias, with_res):
    x, w = Data(rng, geom.input_shape, dtype), Data(rng, geom.weight_shape, dtype)
    b = Data(rng, geom.bias_shape, dtype) if with_bias else None
    res = Data(rng, geom.output_shape, dtype) if with_res else None
    y_ref, z_ref = ops.conv_bias_act(x.ref, w.ref, b and b.ref, geom, activation,
                                     res and res.ref, 0.5)
    # Note [nothing to fuse]: without bias, residual or ReLU the fused call is not tried
    fusing = with_bias or with_res or activation == "relu"
    # NOT_SUPPORTED from the stand-in (3000), or from cuDNN itself before the call (the
    # forced algorithm's workspace query, for a configuration it does not take: 30xx)
    refused = pytest.warns(FusedFallbackWarning,
                           match=r"CUDNN_STATUS_NOT_SUPPORTED\w* \(30\d\d\)") \
        if fusing else warnings.catch_warnings()
    with refused, poison_outputs(monkeypatch):
        if not fusing:
            warnings.simplefilter("error", FusedFallbackWarning)
        y, z = ops.conv_bias_act(x.dev, w.dev, b and b.dev, geom, activation,
                                 res and res.dev, 0.5)
    tried = len(fused_call_refused)
    # refused exactly when tried, whoever refused it; never called when not fusing
    # the plan that ran: float64 channels-last runs its channels-first twin (Note [float64
    # runs channels-first]), whose plan recorded the refusal
    ran = get_plan(cudnn_geometry(geom, dtype), dtype, activation, with_res)
    assert (ran.fused_refusal is not None) == fusing
    assert fusing or tried == 0
    # Two roundings to the storage dtype instead of one: RTOL's 1e-2 still holds for
    # float16/bfloat16 at these sizes.
    assert_close(y, y_ref, dtype, "y")
    if activation == "identity":
        assert (host(y) < 0).any()  # no ReLU slipped in
    if activations.saves(activation) == "preactivation":
        assert_close(z, z_ref, dtype, "z")
    else:
        assert z is None
    # The second call goes straight to the fallback: no fused call is tried.
    with poison_outputs(monkeypatch):
        y2, _ = ops.conv_bias_act(x.dev, w.dev, b and b.dev, geom, activation,
                                  res and res.dev, 0.5)
    assert len(fused_call_refused) == tried
    assert_close(y2, y_ref, dtype, "y (second call)")
    for a in (x, w, b, res):
        if a is not None:
            a.unchanged()
