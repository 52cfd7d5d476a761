"""benchmarks/bench checks, cases and the bias-gradient recommendation, on small synthetic
inputs: the relative-error check, the layer and bias cases (CPU scaling, geometries), and the
recommendation's reading of the numbers."""

from __future__ import annotations

import math

import pytest

from tests._benchmarks_helpers import biasgrad, cases, checks

# -- checks and cases ---------------------------------------------------------------------

def test_compare_relative_to_the_reference_scale():
    import numpy as np

    want = np.array([[2.0, -4.0], [1.0, 0.0]])
    ok = checks.compare("y", want + 2e-5, want, 1e-5)
    assert ok["ok"] and ok["rel_err"] == pytest.approx(5e-6)
    bad = checks.compare("y", want + 1e-3, want, 1e-5)
    assert not bad["ok"] and "rel err" in checks.failures([bad])
    nan = want.copy()
    nan[0, 0] = np.nan
    assert not checks.compare("y", nan, want, 1.0)["ok"]
    assert "shapes differ" in checks.failures([checks.compare("y", want[0], want, 1.0)])


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_the_adjoint_check_takes_true_gradients_and_refuses_wrong_ones(layout):
    """backward's check of dx and dw at any layer size: the true gradients (the reference
    engine's, float64) pass; zero, doubled, another dz's and partly missing gradients (a
    batch part, a group, a kernel tap never written) fail."""
    import numpy as np

    from convfuse import ops
    from convfuse.geometry import ConvGeometry

    rng = np.random.default_rng(0)
    nchw = layout == "NCHW"
    g = ConvGeometry.create((4, 8, 6, 6) if nchw else (4, 6, 6, 8),
                           (6, 4, 3, 3) if nchw else (6, 3, 3, 4),
                           stride=2, padding=1, groups=2, layout=layout)
    x, w = rng.standard_normal(g.input_shape), rng.standard_normal(g.weight_shape)
    dz, other = rng.standard_normal(g.output_shape), rng.standard_normal(g.output_shape)
    dx, dw = ops.conv_backward_data(dz, w, g), ops.conv_backward_filter(x, dz, g)

    def check(grad, shape, image):
        probes = [(v, image(v)) for v in (rng.uniform(-1, 1, shape) for _ in range(4))]
        return checks.adjoint("g", grad, dz, probes, 1e-3)

    def dx_check(grad):
        return check(grad, g.input_shape, lambda v: ops.conv_forward(v, w, g))

    def dw_check(grad):
        return check(grad, g.weight_shape, lambda v: ops.conv_forward(x, v, g))

    assert dx_check(dx)["ok"] and dw_check(dw)["ok"]
    assert dx_check(dx)["rel_err"] < 1e-12 and dw_check(dw)["rel_err"] < 1e-12
    group_c = (slice(None), slice(4, None)) if nchw else (..., slice(2, None))
    tap = (slice(None), slice(None), 0) if nchw else (slice(None), 0)

    def without(a, where):
        a = a.copy()
        a[where] = 0
        return a

    wrong = [(np.zeros_like(dx), np.zeros_like(dw)), (2 * dx, 2 * dw),
             (ops.conv_backward_data(other, w, g), ops.conv_backward_filter(x, other, g)),
             (without(dx, slice(2, None)), without(dw, slice(3, None))),
             (without(dx, group_c), without(dw, tap))]
    for wrong_dx, wrong_dw in wrong:
        assert not dx_check(wrong_dx)["ok"] and not dw_check(wrong_dw)["ok"]


def test_cpu_scaling_keeps_depthwise_and_records_the_original():
    dw = next(c for c in cases.LAYERS if c.name == "mbv2.dw3x3")
    small = dw.scaled(8, 14, 32)
    assert (small.batch, small.cin, small.cout, small.groups, small.size) == (8, 32, 32, 32, 14)
    assert small.scaled_from == dw.describe()
    assert small.geometry("NHWC").output_shape == (8, 14, 14, 32)
    tiny = cases.LayerCase("t", "", 2, 1, 4, 5, 3, padding=1)
    assert tiny.scaled(8, 14, 32) == tiny and tiny.scaled(8, 14, 32).scaled_from is None


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_bias_case_geometry_outputs_dy(layout):
    for case in cases.BIAS_CASES:
        g = case.geometry(layout)
        assert g.output_shape == case.shape(layout)
        assert g.out_channels == case.k


def test_every_gpu_layer_case_is_a_valid_geometry():
    for case in cases.LAYERS:
        for layout in cases.LAYOUTS:
            g = case.geometry(layout)
            assert math.prod(g.output_shape) > 0
    assert len(cases.layer_cases(quick=True, cpu=False)) == len(cases.QUICK_LAYERS)


# -- the bias-gradient recommendation -----------------------------------------------------

def _bias_rec(act, cudnn, generic, fused):
    medians = {"cudnn": cudnn, "generic": generic, "fused": fused}
    return {"section": "biasgrad", "status": "ok", "activation": act,
            "winner": min(medians, key=medians.get),
            "ratios": {"fused/cudnn": fused / cudnn, "generic/cudnn": generic / cudnn}}


def test_recommendation_follows_the_numbers_on_gpu():
    fast_fused = [_bias_rec("relu", 2.0, 1.5, 0.5), _bias_rec("relu", 1.0, 0.9, 0.25),
                  _bias_rec("identity", 1.0, 0.5, 4.0)]
    rec = biasgrad.recommendation(fast_fused, on_gpu=True)
    # only relu counts (geometric mean of 0.25 and 0.25); identity is not the switch's
    assert rec["recommendation"] == "fused" and "CHANGE" in rec["text"]
    assert rec["geomean_fused_over_cudnn"] == pytest.approx({"relu": 0.25, "identity": 4.0})
    assert "always use cuDNN's bias call" in rec["text"]  # the sum beat cuDNN on identity
    slow_fused = [_bias_rec("relu", 1.0, 3.0, 1.2), _bias_rec("relu", 1.0, 3.0, 0.9),
                  _bias_rec("identity", 1.0, 3.0, 0.1)]
    rec = biasgrad.recommendation(slow_fused, on_gpu=True)
    assert rec["recommendation"] == "cudnn" and "matches" in rec["text"]
    assert rec["wins"] == {"cudnn": 1, "generic": 0, "fused": 1}
    generic_wins = [_bias_rec("relu", 1.0, 0.1, 0.5)]
    rec = biasgrad.recommendation(generic_wins, on_gpu=True)
    assert rec["wins"]["generic"] == 1 and "never uses one" in rec["text"]
    assert biasgrad.recommendation(fast_fused, on_gpu=False)["recommendation"] is None
    assert biasgrad.recommendation([], on_gpu=True)["recommendation"] is None
    identity_only = [_bias_rec("identity", 1.0, 1.0, 0.1)]
    assert biasgrad.recommendation(identity_only, on_gpu=True)["recommendation"] is None


def test_biasgrad_paths_are_timed_with_their_flag_already_in_force(monkeypatch):
    """Each timed call of a bias-gradient path finds config bias_grad set to its path's
    flag by the sample around it, so no flag switch (microseconds of host time) is timed;
    warm-up calls outside a sample still run under their flag."""
    from contextlib import contextmanager

    from convfuse import config
    from tests._benchmarks_helpers import timing

    switches = []
    real = config.flags

    @contextmanager
    def counted(**kw):
        switches.append(kw)
        with real(**kw):
            yield

    monkeypatch.setattr(config, "flags", counted)
    seen = []
    timer = biasgrad._FlagTimer(timing.CpuTimer(), "fused")
    fn = biasgrad._under(lambda i: seen.append((i, config.get().bias_grad, len(switches))),
                         "fused")
    fn(7)  # a warm-up call: switches itself
    assert seen == [(7, "fused", 1)] and config.get().bias_grad == "cudnn"
    seen.clear()
    assert len(timer.sample(fn, 3, 1, 4)) == 4
    # one switch for the whole sample, made before its first timed call
    assert seen == [(1, "fused", 2), (2, "fused", 2), (0, "fused", 2), (1, "fused", 2)]
    assert config.get().bias_grad == "cudnn" and timer.kind == timing.CpuTimer.kind
