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
