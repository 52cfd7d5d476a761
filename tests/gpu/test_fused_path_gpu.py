"""Which path ran, on a real GPU: wherever cuDNN documents the fused call as supported
(scripts/fusion_strict.py `conv_fusion_documented`, which cites the documentation: ReLU
and IDENTITY, float32 and float16, 2-D NCHW and NHWC, groups 1, dilation 1, float16 NHWC
with channel counts that are multiples of 8), the fused call must run, exactly
convolutionBiasActivationForward and no convolutionForward, with no FusedFallbackWarning,
over a grid of geometries, biases and residuals. A silent loss of fusion fails there. The
rest of the grid (float16 NHWC with C = 4, dilation 2) may fall back: fused, or one
FusedFallbackWarning and the unfused path, and numerically right either way.
scripts/gpu_acceptance.sh also runs tests/gpu with FusedFallbackWarning as an error where
documented.

Numbers are checked against the float64 reference with NaN-poisoned outputs
(tests/gpu/test_cudnn_ops.py's helpers)."""

from __future__ import annotations

import itertools
import sys
import warnings
from pathlib import Path

import pytest

import convfuse.ops as ops
from convfuse import config
from convfuse._binding import cudnn
from convfuse.geometry import ConvGeometry
from convfuse.plan import (
    BiasGradFallbackWarning,
    ForwardPath,
    FusedFallbackWarning,
    WorkspaceFallbackWarning,
    get_plan,
)
from tests.gpu.test_cudnn_ops import (  # noqa: F401  (the autouse fixture is used by name)
    Data,
    assert_close,
    full_precision_fresh_plans,
    host,
    poison_outputs,
)

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from fusion_strict import conv_fusion_documented  # noqa: E402


def documented_geoms():
    """2-D, groups 1: strides, paddings, dilations, odd and even sizes, 1x1 and 3x3 (not
    every one documented in every dtype: `documented`)."""
    out = []
    for (n, c, h, w_), (k, kh, kw), stride, pad, dil in (
            ((2, 8, 9, 9), (16, 3, 3), 1, 1, 1),
            ((2, 16, 8, 12), (8, 1, 1), 1, 0, 1),
            ((1, 8, 11, 7), (8, 3, 3), 2, 1, 1),
            ((2, 4, 10, 10), (8, 3, 3), 1, 2, 2),
            ((4, 32, 6, 6), (32, 3, 3), 1, 1, 1)):
        for channels_last in (False, True):
            x, wt = (n, c, h, w_), (k, c, kh, kw)
            if channels_last:
                x, wt = (n, h, w_, c), (k, kh, kw, c)
            out.append(ConvGeometry.create(x, wt, stride, pad, dil, 1,
                                           "NHWC" if channels_last else "NCHW"))
    return out


GEOMS = documented_geoms()


@pytest.fixture
def spied(monkeypatch):
    """The algorithms of the fused and the plain forward calls that ran (a call cuDNN
    refused raised, and is not counted)."""
    lib = cudnn()
    calls = {"fused": [], "plain": []}
    for name, key in (("convolutionBiasActivationForward", "fused"),
                      ("convolutionForward", "plain")):
        real = getattr(lib, name)

        def spy(*args, _real=real, _key=key):
            out = _real(*args)
            calls[_key].append(args[7])
            return out

        monkeypatch.setattr(lib, name, spy)
    return calls


def documented(geom, dtype, activation):
    return conv_fusion_documented(geom.layout, geom.groups, geom.dilation, geom.in_channels,
                                  geom.out_channels, dtype, activation)


CONFIGS = list(itertools.product(GEOMS, ["relu", "identity"], ["float32", "float16"]))
DOCUMENTED = [(g, a, d) for g, a, d in CONFIGS if documented(g, d, a)]
UNDOCUMENTED = [(g, a, d) for g, a, d in CONFIGS if not documented(g, d, a)]
FALLBACKS = (FusedFallbackWarning, WorkspaceFallbackWarning, BiasGradFallbackWarning)


def _cid(config):
    geom, activation, dtype = config
    return f"{geom.describe().replace(' ', '_')}-{activation}-{dtype}"


def _run(monkeypatch, rng, geom, activation, dtype, with_bias, with_res):
    """One conv_bias_act on NaN-poisoned outputs, checked against the float64 reference;
    the categories of the fallback warnings it gave (other warnings pass on)."""
    x, w = Data(rng, geom.input_shape, dtype), Data(rng, geom.weight_shape, dtype)
    b = Data(rng, geom.bias_shape, dtype) if with_bias else None
    res = Data(rng, geom.output_shape, dtype) if with_res else None
    y_ref, _ = ops.conv_bias_act(x.ref, w.ref, b and b.ref, geom, activation,
                                 res and res.ref, 0.5)
    with warnings.catch_warnings(record=True) as seen, poison_outputs(monkeypatch):
        warnings.simplefilter("always")
        y, _ = ops.conv_bias_act(x.dev, w.dev, b and b.dev, geom, activation,
                                 res and res.dev, 0.5)
    for rec in seen:
        if not issubclass(rec.category, FALLBACKS):
            warnings.warn_explicit(rec.message, rec.category, rec.filename, rec.lineno)
    assert_close(y, y_ref, dtype, "y")
    return [rec.category for rec in seen if issubclass(rec.category, FALLBACKS)]


def test_the_grid_has_both_kinds():
    assert DOCUMENTED and UNDOCUMENTED
    assert all(g.dilation == (1, 1) for g, _, _ in DOCUMENTED)
    assert any(g.in_channels == 4 and g.channels_last and d == "float16"
               for g, _, d in UNDOCUMENTED)


@pytest.mark.parametrize(("geom", "activation", "dtype"), DOCUMENTED,
                         ids=[_cid(c) for c in DOCUMENTED])
@pytest.mark.parametrize(("with_bias", "with_res"), [(True, False), (False, True), (True, True)])
def test_documented_configurations_run_fused(monkeypatch, rng, spied, geom, activation, dtype,
                                             with_bias, with_res):
    seen = _run(monkeypatch, rng, geom, activation, dtype, with_bias, with_res)
    assert seen == []  # no fallback of any kind
    assert spied["fused"] and spied["plain"] == []
    plan = get_plan(geom, dtype, activation, with_res)
    assert plan.fused_refusal is None
    assert plan.forward_path == ForwardPath("fused", "heuristics")
    if activation == "identity":  # Note [IDENTITY needs IMPLICIT_PRECOMP_GEMM]
        assert spied["fused"] == [cudnn().CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM]


@pytest.mark.parametrize(("geom", "activation", "dtype"), UNDOCUMENTED,
                         ids=[_cid(c) for c in UNDOCUMENTED])
@pytest.mark.parametrize(("with_bias", "with_res"), [(True, False), (True, True)])
def test_undocumented_configurations_are_fused_or_fall_back(monkeypatch, rng, spied, geom,
                                                           activation, dtype, with_bias,
                                                           with_res):
    """Outside the documentation cuDNN may refuse the fused call: then exactly one
    FusedFallbackWarning and the unfused path (convolutionForward), else the fused call;
    the numbers are right either way."""
    seen = _run(monkeypatch, rng, geom, activation, dtype, with_bias, with_res)
    plan = get_plan(geom, dtype, activation, with_res)
    if seen:
        assert seen == [FusedFallbackWarning]
        assert spied["fused"] == [] and spied["plain"]
        assert plan.forward_path.path == "unfused"
    else:
        assert spied["fused"] and spied["plain"] == []
        assert plan.forward_path == ForwardPath("fused", "heuristics")


@pytest.mark.parametrize("geom", GEOMS[:2], ids=lambda g: g.layout)
@pytest.mark.parametrize(("activation", "dtype"), [("identity", "float32"),
                                                   ("identity", "float16"),
                                                   ("tanh", "float32")])
def test_nothing_to_fuse_runs_one_convolution_forward(monkeypatch, rng, spied, geom, activation,
                                                      dtype):
    """Note [nothing to fuse] in ops/cudnn/conv.py: no bias, no residual, no activation
    cuDNN applies: one convolutionForward with the plan's own choice, never the fused call
    (whose IDENTITY algorithm is forced), the right numbers on poisoned outputs."""
    x, w = Data(rng, geom.input_shape, dtype), Data(rng, geom.weight_shape, dtype)
    y_ref, _ = ops.conv_bias_act(x.ref, w.ref, None, geom, activation)
    with warnings.catch_warnings(), poison_outputs(monkeypatch):
        warnings.simplefilter("error", FusedFallbackWarning)
        y, _ = ops.conv_bias_act(x.dev, w.dev, None, geom, activation)
    assert_close(y, y_ref, dtype, "y")
    assert (host(y) < 0).any()  # no ReLU slipped in
    assert spied["fused"] == [] and len(spied["plain"]) == 1
    assert get_plan(geom, dtype, activation).forward_path is None


@pytest.mark.parametrize("geom", GEOMS[:4], ids=lambda g: g.layout)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_benchmark_times_both_identity_paths_and_keeps_the_faster(monkeypatch, rng, spied, geom,
                                                                  dtype):
    """Note [forced algorithm versus speed]: both paths run, are timed, and give the same
    numbers; later calls take the recorded one."""
    x, w = Data(rng, geom.input_shape, dtype), Data(rng, geom.weight_shape, dtype)
    b = Data(rng, geom.bias_shape, dtype)
    y_ref, _ = ops.conv_bias_act(x.ref, w.ref, b.ref, geom, "tanh")
    with config.flags(benchmark=True), warnings.catch_warnings():
        warnings.simplefilter("error", FusedFallbackWarning)
        with poison_outputs(monkeypatch):
            y, _ = ops.conv_bias_act(x.dev, w.dev, b.dev, geom, "tanh")
        # benchmark mode's search may pick an FFT or Winograd algorithm for the unfused
        # path: the transform algorithms' float32 tolerance (tests/gpu/_binding_gpu_helpers)
        rtol = 1e-4 if dtype == "float32" else None
        assert_close(y, y_ref, dtype, "y (timed call)", rtol)
        plan = get_plan(geom, dtype, "tanh")
        path = plan.forward_path
        assert path.reason == "timed" and path.fused_ms > 0 and path.unfused_ms > 0
        assert path.path == ("fused" if path.fused_ms <= path.unfused_ms else "unfused")
        spied["fused"].clear()
        with poison_outputs(monkeypatch):
            y2, _ = ops.conv_bias_act(x.dev, w.dev, b.dev, geom, "tanh")
    assert_close(y2, y_ref, dtype, "y (after the choice)", rtol)
    assert bool(spied["fused"]) == (path.path == "fused")
