"""Note [channels-last sums]: the reference engine's per-channel float32 sums in a
channels-last layout (batch norm's statistics, the bias gradients) are as accurate as in
channels-first, against float64 oracles. NumPy reduces outer axes row by row; these were
2-3 orders of magnitude less accurate, and this engine is what the GPU tests compare to."""

from __future__ import annotations

import numpy as np
import pytest

import convfuse as cf
from convfuse import ops
from convfuse.geometry import ConvGeometry

RNG = np.random.default_rng(0)
# 131,072 values per channel, offset from zero so that a running float32 total drifts
X = (RNG.standard_normal((32, 64, 64, 2)) + 5.0).astype(np.float32)
TOL = 2e-6


def _rel(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_batchnorm_statistics_and_output():
    bn = cf.BatchNorm2d(2, layout="NHWC", device="cpu")
    y = bn(X)
    x64 = X.astype(np.float64)
    mean, var = x64.mean((0, 1, 2)), x64.var((0, 1, 2))
    assert _rel(y, (x64 - mean) / np.sqrt(var + 1e-5)) < TOL
    assert _rel(bn.running_mean, 0.1 * mean) < TOL
    dx = bn.backward(X)  # dy = x: the weight and bias gradients are large sums too
    assert np.isfinite(dx).all()
    assert _rel(bn.bias.grad, x64.sum((0, 1, 2))) < TOL


@pytest.mark.parametrize("activation", ["identity", "relu"])
def test_bias_gradients(activation):
    geom = ConvGeometry.create((32, 66, 66, 2), (2, 3, 3, 2), 1, 0, 1, 1, "NHWC")
    assert geom.output_shape == X.shape
    want = X.astype(np.float64).sum((0, 1, 2))
    assert _rel(ops.conv_backward_bias(X, geom), want) < TOL
    y = np.maximum(X, 0) if activation == "relu" else None
    _, db = ops.activation_backward_bias(X, y, activation, geom)
    assert _rel(db, want) < TOL


@pytest.mark.parametrize("shape", [(1048576, 2, 1), (65536, 2, 2)])
def test_batchnorm1d_with_a_short_length(shape):
    """(N, C, L) with a short L: NumPy runs one total per channel through all N rows too."""
    x = (np.random.default_rng(1).standard_normal(shape) + 5.0).astype(np.float32)
    bn = cf.BatchNorm1d(2, device="cpu")
    bn(x)
    want = 0.1 * x.astype(np.float64).mean((0, 2))
    assert _rel(bn.running_mean, want) < TOL


def test_the_blocked_sum_is_a_float64_sum_and_small_sums_are_numpys():
    from convfuse.ops.reference._accumulate import channel_sum

    a = (RNG.standard_normal((300, 7, 5, 3)) + 5.0).astype(np.float32)
    for axes in [(0, 1, 2), (1, 2), (0,), (0, 3), (0, 2, 3)]:
        got = channel_sum(a, axes)
        assert got.dtype == np.float32
        assert _rel(got, a.astype(np.float64).sum(axes)) < 1e-6
    small = a[:2, :3]
    np.testing.assert_array_equal(channel_sum(small, (0, 1, 2)), small.sum((0, 1, 2)))
