"""Identity, ReLU/Activation and Dropout layers against direct formulas and PyTorch."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import convfuse as cf


def test_identity_passes_values_and_gradients(rng):
    layer = cf.Identity(54, unused="argument")
    x = rng.standard_normal((3, 4))
    assert layer(x) is x
    dy = rng.standard_normal((3, 4))
    assert layer.backward(dy) is dy
    layer(x)
    with pytest.raises(ValueError, match="Identity: dy has shape"):
        layer.backward(dy[:2])
    assert layer.backward(dy) is dy  # the rejected dy kept the context


@pytest.mark.parametrize("act", ["relu", "gelu", "tanh", "silu"])
def test_activation_layer_matches_pytorch(rng, act):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((2, 3, 4, 5))
    dy = rng.standard_normal(x.shape)
    layer = cf.ReLU() if act == "relu" else cf.Activation(act)
    y = layer(x)
    tx = torch.from_numpy(x).requires_grad_()
    ty = getattr(torch.nn.functional, act)(tx)
    ty.backward(torch.from_numpy(dy))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(layer.backward(dy), tx.grad.numpy(), rtol=1e-12, atol=1e-14)
    assert np.array_equal(x, tx.detach().numpy())  # input untouched


def test_dropout_train_eval_and_mask_reuse(rng):
    drop = cf.Dropout(0.25, seed=3)
    x = rng.standard_normal((400, 50)) + 5.0
    y = drop(x)
    kept = y != 0
    assert 0.70 < kept.mean() < 0.80
    np.testing.assert_allclose(y[kept], x[kept] / 0.75, rtol=1e-15)
    dy = rng.standard_normal(x.shape)
    dx = drop.backward(dy)
    np.testing.assert_allclose(dx, np.where(kept, dy / 0.75, 0.0), rtol=1e-15, atol=0)
    drop.eval()
    assert drop(x) is x
    assert drop.backward(dy) is dy
    drop.train()
    assert np.all(cf.Dropout(1.0)(x) == 0)
    with pytest.raises(ValueError, match=r"Dropout: p must be in \[0, 1\]"):
        cf.Dropout(1.5)
    with pytest.raises(TypeError, match="Dropout: p must be a number"):
        cf.Dropout("half")


@pytest.mark.parametrize("dtype", [np.int64, np.int8, np.bool_])
@pytest.mark.parametrize("training", [True, False])
def test_dropout_refuses_integer_and_bool_input(dtype, training):
    # torch refuses them in training; an integer scale 1/(1-p) truncated (kept 10s stayed 10
    # at p=0.3, and a p>=0.5 scale of 2 or more was an integer too)
    drop = cf.Dropout(0.3, seed=0).train(training)
    x = np.full((4, 5), 10, dtype=dtype)
    before = x.copy()
    with pytest.raises(ValueError, match=f"^Dropout: input has unsupported dtype "
                                         f"{np.dtype(dtype)}"):
        drop(x)
    np.testing.assert_array_equal(x, before)


def test_dropout_on_the_device_draws_from_its_own_seeded_generator(monkeypatch):
    """The GPU branch, with NumPy standing in for CuPy: the mask comes from the layer's own
    Generator (made once per device, seeded from `seed`), never from the module-level
    `random` functions (on CuPy, cuRAND's host API, which a stream capture refuses)."""
    from types import SimpleNamespace

    from convfuse.nn import simple

    made = []
    device = {"id": 0}

    def default_rng(seed):
        made.append(seed)
        return np.random.default_rng(seed)

    fake_cp = SimpleNamespace(
        float32=np.float32, zeros=np.zeros,
        random=SimpleNamespace(default_rng=default_rng),  # no module-level random()
        get_default_memory_pool=lambda: SimpleNamespace(malloc=None),
        cuda=SimpleNamespace(runtime=SimpleNamespace(getDevice=lambda: device["id"]),
                             using_allocator=lambda malloc: contextlib.nullcontext()))
    monkeypatch.setattr(simple, "array_module", lambda a: fake_cp)
    x = np.ones((64, 32))
    masks = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        drop = cf.Dropout(0.5, seed=seed)
        masks[name] = [drop(x) != 0 for _ in range(2)]
    assert len(made) == 3  # one generator per layer and device, reused by its later calls
    assert np.array_equal(masks["a"][0], masks["b"][0])  # the same seed, the same masks
    assert np.array_equal(masks["a"][1], masks["b"][1])
    assert not np.array_equal(masks["a"][0], masks["a"][1])  # the state advances
    assert not np.array_equal(masks["a"][0], masks["c"][0])
    device["id"] = 1
    drop = cf.Dropout(0.5, seed=7)
    drop(x)
    drop(x)
    assert len(made) == 4
    y = drop(x)
    np.testing.assert_allclose(y[y != 0], 2.0)


def test_small_layers_follow_their_input_and_refuse_non_arrays():
    for layer in (cf.Identity(), cf.ReLU(), cf.Dropout()):
        with pytest.raises(TypeError, match="must be a NumPy or CuPy array, got list"):
            layer([1.0, 2.0])
    assert cf.ReLU()(np.float32([-1, 2])).tolist() == [0, 2]


def test_dropout_refuses_to_seed_its_gpu_generator_inside_a_capture(monkeypatch):
    """Made inside a capture, the generator's seeding would be recorded (every replay the
    same mask) and its state would live in the capture's pool: refused, as Mean's buffer
    is; the warm-up (outside any capture) makes it."""
    cupy = pytest.importorskip("cupy")
    from convfuse.errors import CaptureError
    from convfuse.plan import capture

    made = []
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(cupy.random, "default_rng", lambda seed: made.append(seed) or seed)
    monkeypatch.setattr(capture, "stream_is_capturing", lambda ptr=None: True)
    drop = cf.Dropout(0.5, seed=0)
    with pytest.raises(CaptureError, match="Dropout's first training call"):
        drop._device_rng(cupy)
    assert made == []
    monkeypatch.setattr(capture, "stream_is_capturing", lambda ptr=None: False)
    monkeypatch.setattr(cupy, "get_default_memory_pool",
                        lambda: type("Pool", (), {"malloc": staticmethod(lambda n: None)})())
    monkeypatch.setattr(cupy.cuda, "using_allocator", lambda malloc: contextlib.nullcontext())
    seed = drop._device_rng(cupy)
    assert made == [seed] and drop._device_rng(cupy) == seed  # made once, then kept
