"""convfuse.no_grad(): native forwards keep no context for a backward (inference memory),
with the same outputs, a backward refused saying why, and torch's grad-mode API."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import convfuse as cf
from convfuse.models import resnet18
from convfuse.ops.reference import conv as rc


def _model():
    return resnet18(num_classes=5, dtype="float64", device="cpu", seed=0)


def test_outputs_match_and_nothing_is_kept(rng):
    model = _model()
    x = rng.standard_normal((2, 3, 32, 32))
    for training in (True, False):
        model.train(training)
        want = model(x)  # (in training, a batch's statistics: the next call sees the same)
        for m in model.modules():
            m._ctx = None
        state = {k: v.copy() for k, v in model.state_dict().items()}
        with cf.no_grad():
            got = model(x)
        np.testing.assert_array_equal(got, want)
        if training:  # the running statistics moved once more, as with grad
            model.load_state_dict(state)
        assert all(m._ctx is None for m in model.modules())
        assert rc.kept_bytes() == 0  # no im2col columns or padded inputs held


def test_a_backward_after_a_no_grad_forward_says_why(rng):
    model = _model().eval()
    x = rng.standard_normal((1, 3, 32, 32))
    with cf.no_grad():
        y = model(x)
    with pytest.raises(cf.BackwardBeforeForwardError, match=r"ran under convfuse\.no_grad"):
        model.backward(np.ones_like(y))
    conv = cf.Conv2d(3, 2, 3, dtype="float64", device="cpu", seed=1)
    with cf.no_grad():
        conv(x)
    with pytest.raises(cf.BackwardBeforeForwardError, match=r"Conv2d\.backward\(\): the last"):
        conv.backward(np.ones((1, 2, 30, 30)))
    # a forward outside keeps its context again: the gradient is the usual one
    y = conv(x)
    dx = conv.backward(np.ones_like(y))
    fresh = cf.Conv2d(3, 2, 3, dtype="float64", device="cpu", seed=1)
    fresh(x)
    np.testing.assert_array_equal(dx, fresh.backward(np.ones_like(y)))
    np.testing.assert_array_equal(conv.weight.grad, fresh.weight.grad)


def test_the_modes_nest_and_follow_torchs_api():
    assert cf.is_grad_enabled()
    with cf.no_grad():
        assert not cf.is_grad_enabled()
        with cf.enable_grad():
            assert cf.is_grad_enabled()
        assert not cf.is_grad_enabled()
    assert cf.is_grad_enabled()

    @cf.no_grad()
    def infer() -> bool:
        return cf.is_grad_enabled()

    assert infer() is False and cf.is_grad_enabled()
    with cf.set_grad_enabled(False):
        assert not cf.is_grad_enabled()
    assert cf.is_grad_enabled()
    cf.set_grad_enabled(False)  # called alone: it stays, as torch's
    try:
        assert not cf.is_grad_enabled()
    finally:
        cf.set_grad_enabled(True)
    with pytest.raises(TypeError, match="set_grad_enabled: mode must be a bool"):
        cf.set_grad_enabled(0)
    assert cf.is_grad_enabled()


def test_the_mode_is_per_thread():
    seen = []
    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait(10)
        seen.append(cf.is_grad_enabled())
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with cf.no_grad():
        inside.set()
        done.wait(10)
    t.join(10)
    assert seen == [True]


def test_one_block_entered_again_restores_each_entry():
    """A recursive decorated function enters one no_grad object again (torch makes one per
    call): the modes are kept per thread, not on the object."""
    @cf.no_grad()
    def depth(n: int) -> int:
        return 0 if n == 0 else 1 + depth(n - 1)

    assert depth(3) == 3 and cf.is_grad_enabled()
    block = cf.no_grad()
    with block:
        with cf.enable_grad():
            with block:
                assert not cf.is_grad_enabled()
            assert cf.is_grad_enabled()
        assert not cf.is_grad_enabled()
    assert cf.is_grad_enabled()

    @cf.no_grad  # without parentheses, as torch takes it
    def bare() -> bool:
        return cf.is_grad_enabled()

    @cf.set_grad_enabled(False)  # a decorator: nothing changes until a call
    def off() -> bool:
        return cf.is_grad_enabled()

    assert cf.is_grad_enabled()
    assert bare() is False and off() is False and cf.is_grad_enabled()


def test_a_backward_refused_under_no_grad_keeps_the_forward(rng):
    """A rejected dy keeps the forward's context, whatever the grad mode of the backward."""
    pool = cf.AdaptiveAvgPool2d(2)
    x = rng.standard_normal((1, 2, 5, 5))
    y = pool(x)
    with cf.no_grad():
        with pytest.raises(ValueError, match="dy has shape"):
            pool.backward(np.ones((1, 2, 3, 3)))
        dx = pool.backward(np.ones_like(y))
    assert dx.shape == x.shape
