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
    # deterministic algorithms on both sides: an atomics-summing gradient algorithm could
    # differ by an ulp between the two models, which Adam's normalisation can carry to a
    # whole lr step for a gradient near zero
    with cf.config.flags(deterministic=True):
        eager_model, eager_step, eager_mean = build()
        for x, y in data:
            eager_step(cp.asarray(x), cp.asarray(y))
        graph_model, graph_step, graph_mean = build()
        captured = cf.graph.capture(graph_step, cp.asarray(data[0][0]),
                                    cp.asarray(data[0][1]))
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


def test_convfuses_own_capture_refusal_comes_through_as_it_is():
    """A step that plans a new convolution only in its captured call: the plan's own
    CaptureError (what was needed, and the warm-up advice) is what the caller sees, not
    wrapped in a second one."""
    import cupy as cp

    layer = cf.Conv2d(3, 4, 3, device="cuda")
    calls = []

    def step(x):
        calls.append(1)
        return layer(x if len(calls) == 1 else cp.ascontiguousarray(x[:, :, :6, :6]))

    x = cp.asarray(np.random.default_rng(0).standard_normal((2, 3, 8, 8)), np.float32)
    with pytest.raises(CaptureError) as info:
        cf.graph.capture(step, x, warmup=1)
    text = str(info.value)
    assert "algorithm for" in text and "run the step eagerly first" in text
    assert "could not be captured" not in text


def test_inputs_must_keep_their_shape():
    import cupy as cp

    _, step, _ = build()
    x, y = batches(1)[0]
    captured = cf.graph.capture(step, cp.asarray(x), cp.asarray(y))
    with pytest.raises(ValueError, match="captured with"):
        captured(cp.asarray(x[:8]), cp.asarray(y[:8]))


def build_in(layout, dtype, seed=0):
    """A step with two conv layers (relu, then silu with a residual), pooling and Linear,
    in `layout` and `dtype`."""
    conv = dict(padding=1, layout=layout, dtype=dtype, device="cuda")
    c1 = cf.Conv2d(3, 8, 3, activation="relu", seed=seed, **conv)
    c2 = cf.Conv2d(8, 8, 3, activation="silu", seed=seed + 1, **conv)
    pool, flat = cf.MaxPool2d(2, layout=layout), cf.Flatten()
    head = cf.Linear(8 * 4 * 4, 10, dtype=dtype, device="cuda", seed=seed + 2)
    layers = [c1, c2, head]
    loss_fn = cf.CrossEntropyLoss()
    params = [p for layer in layers for p in layer.parameters()]
    opt = cf.optim.SGD(params, lr=1e-2, momentum=0.9)
    mean = cf.metrics.Mean()

    def step(x, y):
        opt.zero_grad()
        h1 = c1(x)
        h2 = c2(h1, residual=h1)
        logits = head(flat(pool(h2)))
        loss = loss_fn(logits, y)
        g = flat.backward(head.backward(loss_fn.backward()))
        dh2 = pool.backward(g)
        dh1, dres = c2.backward(dh2)
        c1.backward(dh1 + dres)
        opt.step()
        mean.add(loss)
        return loss

    return params, step, mean


@pytest.mark.parametrize(("layout", "dtype"), [("NHWC", "float32"), ("NCHW", "float16"),
                                               ("NHWC", "float16"), ("NCHW", "bfloat16"),
                                               ("NHWC", "bfloat16")])
def test_replay_equals_eager_in_every_layout_and_dtype(layout, dtype):
    """Issue #13: capture covers channels-last and the 16-bit dtypes, not only NCHW float32."""
    import cupy as cp

    from convfuse.dtypes import SUPPORTED

    if dtype == "bfloat16" and int(cp.cuda.Device().compute_capability) < 80:
        pytest.skip("bfloat16 needs sm_80")
    rng = np.random.default_rng(3)
    shape = (16, 8, 8, 3) if layout == "NHWC" else (16, 3, 8, 8)
    data = [(rng.standard_normal(shape).astype(SUPPORTED[dtype]),
             rng.integers(0, 10, 16).astype(np.int32)) for _ in range(5)]
    eager_params, eager_step, eager_mean = build_in(layout, dtype)
    for x, y in data:
        eager_step(cp.asarray(x), cp.asarray(y))
    graph_params, graph_step, graph_mean = build_in(layout, dtype)
    captured = cf.graph.capture(graph_step, cp.asarray(data[0][0]), cp.asarray(data[0][1]))
    for x, y in data[1:]:
        captured(cp.asarray(x), cp.asarray(y))
    captured.synchronize()
    rtol = 1e-5 if dtype == "float32" else 2e-2
    for pe, pg in zip(eager_params, graph_params):
        ge, gg = (cp.asnumpy(p.data).astype(np.float32) for p in (pe, pg))
        assert np.isfinite(gg).all()
        np.testing.assert_allclose(gg, ge, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(graph_mean.compute(), eager_mean.compute(), rtol=rtol)


def test_a_step_with_dropout_is_captured_and_draws_a_new_mask_each_replay():
    """Dropout's mask comes from the layer's own device Generator (CuPy kernels), which a
    capture records; CuPy's module-level random functions (cuRAND's host API) would be
    refused there. Each replay advances the generator's state: a new mask."""
    import cupy as cp

    drop = cf.Dropout(0.5, seed=0)
    out = {}

    def step(x):
        out["y"] = drop(x)
        return out["y"]

    x = cp.ones((256, 64), dtype=cp.float32)
    captured = cf.graph.capture(step, x)
    masks = []
    for _ in range(3):
        captured(x)
        captured.synchronize()
        y = out["y"]
        masks.append(cp.asnumpy(y != 0))
        assert 0.4 < masks[-1].mean() < 0.6
        np.testing.assert_allclose(cp.asnumpy(y)[masks[-1]], 2.0)
    assert not np.array_equal(masks[0], masks[1]) and not np.array_equal(masks[1], masks[2])
