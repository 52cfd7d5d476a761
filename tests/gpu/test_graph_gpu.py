"""Whole training steps captured as CUDA graphs: same result as eager steps, no syncs."""

from __future__ import annotations

import numpy as np
import pytest

import convfuse as cf
from convfuse.errors import CaptureError

pytestmark = pytest.mark.gpu


def build(seed=0):
    model = cf.Sequential(
        cf.Conv2d(1, 8, 3, padding=1, activation="relu", device="cuda", seed=seed),
        cf.MaxPool2d(2),
        cf.Flatten(),
        cf.Linear(8 * 4 * 4, 10, device="cuda", seed=seed + 1),
    )
    loss_fn = cf.CrossEntropyLoss()
    opt = cf.optim.Adam(model.parameters(), lr=1e-2)
    mean = cf.metrics.Mean()

    def step(x, y):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        opt.step()
        mean.add(loss)
        return loss

    return model, step, mean


def batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.random((16, 1, 8, 8), dtype=np.float32),
             rng.integers(0, 10, 16).astype(np.int32)) for _ in range(n)]


def test_replay_equals_eager_steps():
    import cupy as cp

    data = batches(6)
    eager_model, eager_step, eager_mean = build()
    for x, y in data:
        eager_step(cp.asarray(x), cp.asarray(y))
    graph_model, graph_step, graph_mean = build()
    captured = cf.graph.capture(graph_step, cp.asarray(data[0][0]), cp.asarray(data[0][1]))
    for x, y in data[1:]:
        captured(cp.asarray(x), cp.asarray(y))
    captured.synchronize()
    for pe, pg in zip(eager_model.parameters(), graph_model.parameters()):
        np.testing.assert_allclose(pg.data.get(), pe.data.get(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(graph_mean.compute(), eager_mean.compute(), rtol=1e-5)


def test_step_with_a_host_sync_cannot_be_captured():
    import cupy as cp

    _, step, _ = build()

    def syncing_step(x, y):
        loss = step(x, y)
        float(loss)  # a device-to-host read: forbidden inside a graph
        return loss

    x, y = batches(1)[0]
    with pytest.raises(CaptureError, match="could not be captured"):
        cf.graph.capture(syncing_step, cp.asarray(x), cp.asarray(y))


def test_inputs_must_keep_their_shape():
    import cupy as cp

    _, step, _ = build()
    x, y = batches(1)[0]
    captured = cf.graph.capture(step, cp.asarray(x), cp.asarray(y))
    with pytest.raises(ValueError, match="captured with"):
        captured(cp.asarray(x[:8]), cp.asarray(y[:8]))
