"""Bad input to the batch-normalization ops: a typed error naming the op and the argument,
raised before any engine runs (the engines are patched to fail if reached), and nothing
written (running statistics and gradient outputs keep their values)."""

from __future__ import annotations

import numpy as np
import pytest

import convfuse.ops as ops
from convfuse.errors import DeviceMismatchError
from convfuse.ops.reference import batchnorm as ref
from convfuse.plan.batchnorm import BatchNormGeometry


@pytest.fixture
def no_engine(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("engine reached")

    for name in ("batchnorm_forward_training", "batchnorm_forward_inference",
                 "batchnorm_backward"):
        monkeypatch.setattr(ref, name, boom)


def arrays(dtype=np.float32, shape=(4, 3, 2, 2)):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(dtype)
    pd = np.float64 if dtype == np.float64 else np.float32
    c = shape[1]
    return x, np.ones(c, pd), np.zeros(c, pd), np.zeros(c, pd), np.ones(c, pd)


TRAIN = ops.batchnorm_forward_training


@pytest.mark.parametrize(("mutate", "exc", "match"), [
    (lambda a: a.update(x=[1.0, 2.0]), TypeError, "x must be a NumPy or CuPy array"),
    (lambda a: a.update(x=np.zeros((4,), np.float32)), ValueError, "2-d to 5-d"),
    (lambda a: a.update(x=np.zeros((2, 3, 1, 1, 1, 1), np.float32)), ValueError, "2-d to 5-d"),
    (lambda a: a.update(x=np.zeros((1, 3, 1, 1), np.float32)), ValueError,
     "more than 1 value per channel"),
    (lambda a: a.update(layout="NDHWC"), ValueError, "layout must be"),
    (lambda a: a.update(eps=-1.0), ValueError, "eps must be >= 0"),
    (lambda a: a.update(eps=float("nan")), ValueError, "eps must be finite"),
    (lambda a: a.update(eps="1e-5"), TypeError, "eps must be a real number"),
    (lambda a: a.update(exponential_average_factor=1.5), ValueError, r"\[0, 1\]"),
    (lambda a: a.update(running_var=None), ValueError, "running_mean and running_var together"),
    (lambda a: a.update(weight=np.ones(4, np.float32)), ValueError, r"weight has shape \(4,\)"),
    (lambda a: a.update(weight=np.ones(3, np.float64)), ValueError,
     "weight has dtype float64 but float32 is expected"),
    (lambda a: a.update(bias=np.ones(3, np.int32)), ValueError, "bias has unsupported dtype"),
    (lambda a: a.update(residual=np.ones((4, 3, 2, 1), np.float32)), ValueError,
     "residual has shape"),
    (lambda a: a.update(residual=np.ones((4, 3, 2, 2), np.float16)), ValueError,
     "residual has dtype float16"),
    (lambda a: a.update(activation="softmax"), ValueError, "unknown activation"),
    (lambda a: a.update(x=np.zeros((4, 2, 2, 3), np.float32).transpose(0, 3, 1, 2)), ValueError,
     "x is not C-contiguous"),
])
def test_forward_training_rejects(no_engine, mutate, exc, match):
    x, w, b, rm, rv = arrays()
    kw = dict(x=x, weight=w, bias=b, running_mean=rm, running_var=rv)
    mutate(kw)
    before = (rm.copy(), rv.copy())
    with pytest.raises(exc, match=match) as info:
        TRAIN(**kw)
    assert "batchnorm_forward_training" in str(info.value)
    np.testing.assert_array_equal(rm, before[0])
    np.testing.assert_array_equal(rv, before[1])


def test_running_stats_may_not_alias_inputs(no_engine):
    x, w, b, rm, rv = arrays()
    with pytest.raises(ValueError, match="running_mean overlaps input 'weight'"):
        TRAIN(x, w, b, w, rv)
    flat = np.zeros(3 * 4 * 2 * 2 + 3, np.float32)
    with pytest.raises(ValueError, match="running_var overlaps input 'x'"):
        TRAIN(flat[:48].reshape(4, 3, 2, 2), w, b, rm, flat[45:48])


def test_read_only_running_stats_are_refused(no_engine):
    x, w, b, rm, rv = arrays()
    rm.flags.writeable = False
    with pytest.raises(ValueError, match="running_mean is read-only"):
        TRAIN(x, w, b, rm, rv)


def test_inference_needs_running_statistics(no_engine):
    x, w, b, rm, _ = arrays()
    with pytest.raises(ValueError, match="batchnorm_forward_inference: running_mean and "
                                         "running_var are required"):
        ops.batchnorm_forward_inference(x, w, b, rm, None)


def test_mixing_numpy_and_cupy_is_a_device_mismatch(no_engine):
    cp = pytest.importorskip("cupy")
    x, _w, b, rm, rv = arrays()
    fake = cp.ndarray((3,), np.float32, memptr=cp.cuda.MemoryPointer(
        cp.cuda.memory.UnownedMemory(1 << 40, 12, None, device_id=0), 0))
    with pytest.raises(DeviceMismatchError, match="batchnorm_forward_training"):
        TRAIN(x, fake, b, rm, rv)


def test_backward_rejects_and_writes_nothing(no_engine):
    x, w, b, _rm, _rv = arrays()
    saved = ops.BatchNormSaved(np.zeros(3, np.float32), np.ones(3, np.float32), None, True)
    gw, gb = np.full(3, 7.0, np.float32), np.full(3, 8.0, np.float32)
    bad = [
        (dict(dy=np.ones((4, 3, 2, 1), np.float32)), ValueError, "dy has shape"),
        (dict(saved=(1, 2)), TypeError, "saved must be the BatchNormSaved"),
        (dict(activation="relu"), ValueError, "needs the forward's saved tensor"),
        (dict(bias_grad=None), ValueError, "weight_grad and bias_grad together"),
        (dict(weight_grad=x[0, 0, 0, :].copy()[:2]), ValueError, "weight_grad has shape"),
        (dict(param_beta=float("inf")), ValueError, "param_beta must be finite"),
        (dict(bias_grad=gw), ValueError, "bias_grad overlaps"),
    ]
    for change, exc, match in bad:
        kw = dict(dy=np.ones_like(x), x=x, weight=w, bias=b, saved=saved, weight_grad=gw,
                  bias_grad=gb, param_beta=1.0)
        kw.update(change)
        if "bias_grad" in change and change["bias_grad"] is gw:
            kw["weight_grad"] = gw
        with pytest.raises(exc, match=match) as info:
            ops.batchnorm_backward(**kw)
        assert "batchnorm_backward" in str(info.value)
        assert (gw == 7.0).all() and (gb == 8.0).all()


def test_geometry_answers():
    g = BatchNormGeometry.create((2, 5, 6, 3), "NHWC")
    assert (g.channels, g.channel_axis, g.reduce_axes, g.count) == (3, 3, (0, 1, 2), 60)
    assert g.shape_cf == (2, 3, 5, 6) and g.lifted_cf == (2, 3, 5, 6)
    assert BatchNormGeometry.create((7, 4), "NHWC").lifted_cf == (7, 4, 1, 1)
    assert BatchNormGeometry.create((7, 4), "NHWC").channel_axis == 1
    assert BatchNormGeometry.create((2, 9, 4), "NHWC").lifted_cf == (2, 4, 1, 9)
    assert BatchNormGeometry.create((2, 4, 9)).lifted_cf == (2, 4, 1, 9)
    assert BatchNormGeometry.create((0, 3)).count == 0  # an empty batch (the ops return it)
    with pytest.raises(ValueError, match="every dimension but the batch must be positive"):
        BatchNormGeometry.create((2, 0))


def test_inference_stats_must_be_a_bool(no_engine):
    x, w, b, rm, rv = arrays()
    with pytest.raises(TypeError, match="batchnorm_forward_inference: stats must be a bool"):
        ops.batchnorm_forward_inference(x, w, b, rm, rv, stats=1)


@pytest.mark.parametrize("act", ["identity", "relu", "silu"])
def test_inference_without_statistics_gives_the_same_y_and_cannot_be_differentiated(act):
    """Note [inference without statistics]: stats=False gives y bit for bit, and a saved
    with no statistics is refused by the backward before any engine runs."""
    x, w, b, rm, rv = arrays()
    rv = rv * 1.5 + 0.25
    y, saved = ops.batchnorm_forward_inference(x, w, b, rm, rv, activation=act)
    y2, bare = ops.batchnorm_forward_inference(x, w, b, rm, rv, activation=act, stats=False)
    np.testing.assert_array_equal(y, y2)
    assert saved.mean is not None and bare.mean is None and bare.invstd is None
    if saved.saved is not None:
        np.testing.assert_array_equal(saved.saved, bare.saved)
    dw, db = np.full(3, 7.0, np.float32), np.full(3, 7.0, np.float32)
    with pytest.raises(ValueError, match="batchnorm_backward: saved holds no statistics"):
        ops.batchnorm_backward(np.ones_like(x), x, w, b, bare, activation=act,
                               weight_grad=dw, bias_grad=db)
    assert (dw == 7.0).all() and (db == 7.0).all()  # nothing written


def test_backward_refuses_a_bias_without_a_weight():
    """weight None is affine=False, whose gradients are none: a bias given with it had its
    gradient dropped silently (torch.nn.functional.batch_norm gives it one). The forward
    takes it (a shift without a scale), as the layers use it."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 2, 2))
    b = np.array([1.0, 2.0, 3.0])
    y, saved = ops.batchnorm_forward_training(x, None, b, None, None)
    with pytest.raises(ValueError, match=r"^batchnorm_backward: bias given without a weight"):
        ops.batchnorm_backward(np.ones_like(y), x, None, b, saved)
    _, _, db, _ = ops.batchnorm_backward(np.ones_like(y), x, np.ones(3), b, saved)
    np.testing.assert_allclose(db, [16.0, 16.0, 16.0])
