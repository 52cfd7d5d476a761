"""The layers' per-signature call cache (convfuse/nn/_conv_base.py Note [layer call cache]):
a signature is checked once, later calls skip the checks and give the checked path's exact
result; anything the checks look at that changes (shapes, dtypes, contiguity, arrays' kind,
hyperparameters, activation, residual scale, config flags) is checked again, so bad input
gets the same typed error as on a fresh layer, before any engine call; backward's state
safety is unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import convfuse as cf
from convfuse import functional_transpose
from convfuse.errors import ArrayTooLargeError, SavedTensorModifiedError
from convfuse.nn import conv as nn_conv
from convfuse.nn import conv_transpose as nn_transpose
from convfuse.ops.reference import conv as rc


@pytest.fixture
def checked(monkeypatch):
    """Counts calls of the checked forward ops (the conv's and the transposed conv's)."""
    calls = []
    for cls in (nn_conv._ConvNd, nn_transpose._ConvTransposeNd):
        real = cls._forward_op

        def spy(*args, _real=real, **kwargs):
            calls.append(args[0].shape)
            return _real(*args, **kwargs)

        monkeypatch.setattr(cls, "_forward_op", spy)
    return calls


def _x(shape=(2, 3, 5, 5), dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _same_error(fresh_call, cached_call):
    with pytest.raises(Exception) as want:
        fresh_call()
    with pytest.raises(Exception) as got:
        cached_call()
    assert type(got.value) is type(want.value)
    assert str(got.value) == str(want.value)


def test_a_signature_is_checked_once_and_gives_the_checked_result(checked):
    layer = cf.Conv2d(3, 4, 3, padding=1, activation="relu", seed=0)
    x = _x()
    first = layer(x)
    assert len(checked) == 1
    again = layer(x.copy())
    assert len(checked) == 1  # the cache answered
    np.testing.assert_array_equal(first, again)
    layer(_x((1, 3, 5, 5)))  # a new shape: checked
    layer(_x((1, 3, 5, 5), seed=1))
    assert len(checked) == 2


def test_bad_input_after_a_cached_call_gets_the_fresh_layers_error(checked):
    layer = cf.Conv2d(3, 4, 3, padding=1, seed=0)
    fresh = cf.Conv2d(3, 4, 3, padding=1, seed=0)
    layer(_x())
    for bad in (_x(dtype=np.float64), _x((2, 4, 5, 5)), _x((2, 3, 5)), [[1.0]], None,
                _x()[..., None]):
        _same_error(lambda b=bad: fresh(b), lambda b=bad: layer(b))
    _same_error(lambda: fresh(_x(), residual=_x((2, 4, 4, 4))),
                lambda: layer(_x(), residual=_x((2, 4, 4, 4))))


def test_a_non_contiguous_input_hits_the_cache_and_is_copied(checked):
    layer = cf.Conv2d(3, 4, 3, padding=1, seed=0)
    x = _x((2, 5, 5, 3)).transpose(0, 3, 1, 2)  # NCHW view, not contiguous
    keep = x.copy()
    want = layer(np.ascontiguousarray(x))
    got1, got2 = layer(x), layer(x)
    assert len(checked) == 2  # contiguity is part of the signature
    np.testing.assert_array_equal(got1, want)
    np.testing.assert_array_equal(got2, want)
    np.testing.assert_array_equal(x, keep)  # the caller's array untouched


@pytest.mark.parametrize(("name", "value"), [("stride", 2), ("padding", 0), ("dilation", 2),
                                             ("padding_mode", "reflect"),
                                             ("activation", "gelu"),
                                             ("residual_scale", 0.5)])
def test_assigned_hyperparameters_take_effect_after_a_cached_call(name, value):
    kwargs = dict(padding=1, seed=0, activation="relu")
    layer = cf.Conv2d(3, 4, 3, **kwargs)
    x, r = _x((2, 3, 8, 8)), None
    if name == "residual_scale":
        r = _x((2, 4, 8, 8), seed=2)
    layer(x, r)
    layer(x, r)
    setattr(layer, name, value)
    fresh = cf.Conv2d(3, 4, 3, **kwargs)
    setattr(fresh, name, value)
    np.testing.assert_array_equal(layer(x, r), fresh(x, r))


def test_an_invalid_assignment_after_a_cached_call_changes_nothing():
    layer = cf.Conv2d(3, 4, 3, padding="same", seed=0)
    x = _x()
    want = layer(x)
    with pytest.raises(ValueError):
        layer.stride = 2  # 'same' padding needs stride 1
    np.testing.assert_array_equal(layer(x), want)


def test_config_changes_are_seen_by_a_cached_signature():
    layer = cf.Conv2d(3, 4, 3, padding=1, seed=0)
    x = _x()
    layer(x)
    with cf.config.flags(max_array_bytes=64), pytest.raises(ArrayTooLargeError):
        layer(x)
    layer(x)  # and back


@pytest.mark.parametrize("make, shape", [
    (lambda: cf.MaxPool2d(2), (2, 3, 32, 32)),
    (lambda: cf.AvgPool2d(2), (2, 3, 32, 32)),
    (lambda: cf.Linear(4, 4, seed=0), (1000, 4)),
    (lambda: cf.ConvTranspose2d(3, 2, 2, stride=2, seed=0), (1, 3, 32, 32)),
])
def test_a_lowered_memory_cap_refuses_a_shape_the_layer_already_ran(make, shape):
    """Note [geometry memos]: a remembered geometry holds only under the flags it was
    checked with; the warmed layer refuses what a fresh one refuses, with its message."""
    layer, x = make(), _x(shape)
    want = layer(x)
    with cf.config.flags(max_array_bytes=4096):
        _same_error(lambda: make()(x), lambda: layer(x))
    np.testing.assert_array_equal(layer(x), want)  # and back


@pytest.mark.parametrize("cls", [cf.Conv2d, cf.ConvTranspose2d])
def test_a_swapped_weight_of_another_kernel_runs_as_on_a_fresh_layer(cls):
    """Note [geometry memos]: the geometry is the weight's, so a layer that ran a 3x3
    weight and is given a 5x5 one computes what a fresh layer given it computes."""
    layer, fresh = (cls(2, 2, 3, padding=1, seed=0, dtype="float64") for _ in range(2))
    x = _x((1, 2, 6, 6), np.float64)
    layer(x)
    w5 = np.random.default_rng(1).standard_normal((2, 2, 5, 5))
    for target in (layer, fresh):
        target.weight.data = w5.copy()
    y = layer(x)
    np.testing.assert_array_equal(y, fresh(x))
    conv = functional_transpose.conv_transpose_bias_act if cls is cf.ConvTranspose2d \
        else cf.functional.conv_bias_act
    np.testing.assert_allclose(y, conv(x, w5, layer.bias.data, padding=1), rtol=1e-13)
    assert y.shape == ((1, 2, 8, 8) if cls is cf.ConvTranspose2d else (1, 2, 4, 4))


def test_the_geometry_memos_are_bounded():
    """Note [geometry memos]: a layer fed ever new shapes starts its memo over."""
    from convfuse.nn._memo import MAX_GEOMETRIES

    layers = [cf.Conv1d(1, 1, 1, seed=0), cf.ConvTranspose1d(1, 1, 1, seed=0)]
    for n in range(1, 2 * MAX_GEOMETRIES):
        for layer in layers:
            layer(_x((1, 1, n)))
    pool, linear = cf.MaxPool2d(1), cf.Linear(2, 2, seed=0)
    for n in range(1, 2 * MAX_GEOMETRIES):
        pool(_x((1, 1, 1, n)))
        linear(_x((n, 2)))
    for layer in (*layers, pool, linear):
        assert 0 < len(layer.__dict__["_geoms"]) <= MAX_GEOMETRIES


def test_replaced_weights_are_checked_again(checked):
    layer = cf.Conv2d(3, 4, 3, padding=1, seed=0)
    x = _x()
    want = layer(x)
    w = layer.weight.data
    # a non-contiguous weight with the same values: copied by the checked path, same result
    layer.weight.data = np.asfortranarray(w)
    np.testing.assert_array_equal(layer(x), want)
    assert len(checked) == 2
    fresh = cf.Conv2d(3, 4, 3, padding=1, seed=0)
    layer.weight.data = w.astype(np.float64)
    fresh.weight.data = w.astype(np.float64)
    _same_error(lambda: fresh(x), lambda: layer(x))
    layer.weight.data = w
    layer.bias = None
    fresh.weight.data, fresh.bias = w, None
    np.testing.assert_array_equal(layer(x), fresh(x))


def test_backward_after_cached_forwards_keeps_its_safety_rules():
    layer = cf.Conv2d(3, 4, 3, padding=1, activation="relu", seed=0)
    x = _x()
    layer(x)
    y = layer(x)  # cached
    assert not y.flags.writeable  # the saved output is read-only on the CPU
    with pytest.raises(ValueError):
        y[...] = 0
    dy = _x(y.shape, seed=3)
    layer.zero_grad()
    layer.weight.data = layer.weight.data + 0  # a new version: backward must refuse
    with pytest.raises(SavedTensorModifiedError):
        layer.backward(dy)
    layer(x)
    with pytest.raises(ValueError):
        layer.backward(dy[:1])  # wrong dy: refused, nothing written, context kept
    assert not layer.weight.grad.any()
    dx = layer.backward(dy)
    fresh = cf.Conv2d(3, 4, 3, padding=1, activation="relu", seed=0)
    fresh.weight.data = layer.weight.data.copy()
    fresh(x)
    fresh.zero_grad()
    np.testing.assert_array_equal(dx, fresh.backward(dy))
    np.testing.assert_array_equal(layer.weight.grad, fresh.weight.grad)


def test_conv_transpose_caches_per_output_size(checked):
    layer = cf.ConvTranspose2d(3, 2, 3, stride=2, padding=1, seed=0)
    x = _x((1, 3, 4, 4))
    a = layer(x)
    b = layer(x, output_size=(8, 8))
    assert a.shape == (1, 2, 7, 7) and b.shape == (1, 2, 8, 8)
    layer(x)
    layer(x, output_size=(8, 8))
    assert len(checked) == 2
    np.testing.assert_array_equal(layer(x), a)
    np.testing.assert_array_equal(layer(x, output_size=[8, 8]), b)  # a list is the tuple
    assert len(checked) == 2
    fresh = cf.ConvTranspose2d(3, 2, 3, stride=2, padding=1, seed=0)
    _same_error(lambda: fresh(x, output_size=(9, 9)), lambda: layer(x, output_size=(9, 9)))


def test_the_cache_is_bounded():
    layer = cf.Conv1d(1, 1, 1, seed=0)
    for n in range(1, 80):
        layer(_x((1, 1, n)))
    assert len(layer.__dict__["_calls"]) <= 64


def test_tiny_layers_gather_their_columns(monkeypatch):
    """A 1x1x4x4 conv takes the one-gather path (reference/conv.py Note [choosing the
    method]), which the cache's speed relies on."""
    used = []
    real = rc._gather_index

    def spy(geom):
        used.append(geom)
        return real(geom)

    monkeypatch.setattr(rc, "_gather_index", spy)
    layer = cf.Conv2d(1, 1, 3, padding=1, seed=0)
    layer(_x((1, 1, 4, 4)))
    assert used


def test_linear_caches_its_checked_signature_and_rechecks_replaced_weights():
    layer = cf.Linear(5, 3, activation="relu", seed=0)
    fresh = cf.Linear(5, 3, activation="relu", seed=0)
    x = _x((4, 5))
    want = fresh(x)
    layer(x)
    np.testing.assert_array_equal(layer(x), want)  # cached
    layer.activation = "tanh"
    fresh.activation = "tanh"
    np.testing.assert_array_equal(layer(x), fresh(x))
    w = layer.weight.data
    layer.weight.data = w.astype(np.float64)
    fresh.weight.data = w.astype(np.float64)
    _same_error(lambda: fresh(x), lambda: layer(x))
    layer.weight.data = np.asfortranarray(w)  # not contiguous: the checked path copies it
    np.testing.assert_array_equal(layer(x), fresh.__class__(5, 3, activation="tanh",
                                                            seed=0)(x))


def test_moving_a_layer_drops_what_it_checked_for_the_old_device():
    """Note [layer call cache]: the signatures and geometries a layer checked hold checks
    made for its device (the memory cap, the CPU engine's buffers): `.to()` drops them."""
    layer = cf.Conv2d(3, 4, 3, padding=1, seed=0)
    layer(np.zeros((1, 3, 5, 5), np.float32))
    assert layer.__dict__["_calls"] and layer.__dict__["_geoms"]
    layer._move_own("cpu")
    assert layer.__dict__["_calls"] == {} and layer.__dict__["_geoms"] == {}
    assert "_geoms_flags" not in layer.__dict__
    y = layer(np.ones((1, 3, 5, 5), np.float32))  # checked again, and runs
    assert y.shape == (1, 4, 5, 5)


def test_a_float_output_size_is_refused_after_the_int_one_was_cached():
    """10.0 == 10 and hashes alike: the call caches must not let a float output_size hit
    the int one's entry and skip the check that refuses it (native and bridge layers)."""
    layer = cf.ConvTranspose2d(4, 3, 3, stride=2, padding=1, dtype="float64", device="cpu")
    x = np.zeros((2, 4, 5, 5))
    for _ in range(2):
        with pytest.raises(TypeError, match=r"^ConvTranspose2d: output_size must be a "
                                            r"sequence of ints"):
            layer(x, output_size=(10.0, 10.0))
        assert layer(x, output_size=(10, 10)).shape == (2, 3, 10, 10)
    assert layer(x, output_size=(np.int64(10), 10)).shape == (2, 3, 10, 10)
    with pytest.raises(TypeError, match=r"^ConvTranspose2d.output_shape: input_shape must be a "
                                        r"sequence of ints"):
        layer.output_shape((2, 4, 5.0, 5))
    with pytest.raises(ValueError, match=r"input_shape must not be negative"):
        layer.output_shape((2, 4, -1, 5))
    torch = pytest.importorskip("torch")
    ct = pytest.importorskip("convfuse.torch")
    m = ct.ConvTranspose2d(4, 3, 3, stride=2, padding=1)
    t = torch.zeros(2, 4, 5, 5)
    for _ in range(2):
        with pytest.raises(TypeError, match="output_size"):
            m(t, output_size=(10.0, 10.0))
        assert m(t, output_size=(10, 10)).shape == (2, 3, 10, 10)
