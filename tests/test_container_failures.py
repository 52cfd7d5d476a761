"""Containers (Sequential, Residual, ResNet, a user's Module) and failed calls: a forward
that raises part-way leaves every layer's context as the last good forward left it (Note [a
failed forward keeps the contexts] in convfuse/nn/module.py), so the backward that follows
gives exactly the gradients it would have without the failed call; a backward that raises
on a check keeps the contexts for a corrected retry. The oracle is the same model run
without the failure, in float64."""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest

import convfuse as cf
from convfuse.models import resnet18

RNG = np.random.default_rng(0)


def _arr(*shape):
    return RNG.standard_normal(shape)


def _grads(model):
    return [p.grad.copy() for p in model.parameters()]


def _chain():
    return cf.Sequential(
        cf.Conv2d(2, 3, 3, padding=1, activation="relu", dtype="float64", device="cpu",
                  seed=0),
        cf.Conv2d(3, 3, 3, padding=1, dtype="float64", device="cpu", seed=1))


def test_a_sequential_whose_last_layer_fails_keeps_the_good_contexts():
    x1, x2, r, dy = _arr(2, 2, 5, 5), _arr(2, 2, 5, 5), _arr(2, 3, 5, 5), _arr(2, 3, 5, 5)
    clean, failed = _chain(), _chain()
    clean(x1, residual=r)
    dclean = clean.backward(dy)
    failed(x1, residual=r)
    with pytest.raises(ValueError, match="residual"):
        failed(x2, residual=np.zeros((2, 3, 4, 4)))  # the first layer runs, the last refuses
    dfailed = failed.backward(dy)
    for a, b in zip(dfailed, dclean):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_grads(failed), _grads(clean)):
        np.testing.assert_array_equal(a, b)


def test_a_residual_for_a_last_layer_that_takes_none_is_refused_before_any_layer_runs():
    model = cf.Sequential(cf.Conv2d(2, 3, 3, dtype="float64", device="cpu", seed=0), cf.ReLU())
    with pytest.raises(TypeError, match="ReLU takes no residual"):
        model(_arr(1, 2, 5, 5), residual=_arr(1, 3, 3, 3))
    assert model[0]._ctx is None  # nothing ran


def _block():
    body = cf.Sequential(
        cf.Conv2d(3, 3, 3, padding=1, activation="relu", dtype="float64", device="cpu",
                  seed=2),
        cf.Conv2d(3, 3, 3, padding=1, dtype="float64", device="cpu", seed=3))
    return cf.Residual(body, cf.Conv2d(3, 3, 1, dtype="float64", device="cpu", seed=4))


def test_a_residual_block_whose_body_fails_keeps_the_good_contexts(monkeypatch):
    x1, dy = _arr(2, 3, 5, 5), _arr(2, 3, 5, 5)
    clean, failed = _block(), _block()
    clean(x1)
    dclean = clean.backward(dy)
    failed(x1)
    real, tail = cf.Conv2d.__call__, failed.body[1]

    def engine_failure(self, *args, **kwargs):  # as a cuDNN error in the body's last conv
        if self is tail:
            raise RuntimeError("engine failure")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cf.Conv2d, "__call__", engine_failure)
    with pytest.raises(RuntimeError, match="engine failure"):
        failed(_arr(2, 3, 5, 5))  # the shortcut and the body's first conv ran
    monkeypatch.undo()
    np.testing.assert_array_equal(failed.backward(dy), dclean)
    for a, b in zip(_grads(failed), _grads(clean)):
        np.testing.assert_array_equal(a, b)


def test_a_users_module_gets_the_same_rule():
    class TwoConvs(cf.Module):
        def __init__(self):
            self.a = cf.Conv2d(2, 3, 3, padding=1, dtype="float64", device="cpu", seed=5)
            self.b = cf.Conv2d(3, 3, 3, padding=1, dtype="float64", device="cpu", seed=6)

        def forward(self, x, fail=False):
            h = self.a(x)
            if fail:
                raise RuntimeError("late failure")
            return self.b(h)

        def backward(self, dy):
            return self.a.backward(self.b.backward(dy))

    x1, dy = _arr(1, 2, 4, 4), _arr(1, 3, 4, 4)
    clean, failed = TwoConvs(), TwoConvs()
    clean(x1)
    dclean = clean.backward(dy)
    failed(x1)
    with pytest.raises(RuntimeError, match="late failure"):
        failed(_arr(1, 2, 4, 4), fail=True)
    np.testing.assert_array_equal(failed.backward(dy), dclean)
    for a, b in zip(_grads(failed), _grads(clean)):  # a's weight gradient reads its x
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("make", [_block, lambda: resnet18(num_classes=3, in_channels=2,
                                                           dtype="float64", device="cpu")])
def test_a_backward_refused_on_a_gradient_buffer_keeps_the_contexts(make):
    """A parameter's .grad set to None inside the model: the backward refuses it before
    writing anything, and after zero_grad() the retry gives the clean run's gradients."""
    model = make()
    shape = (2, 3, 5, 5) if isinstance(model, cf.Residual) else (2, 2, 16, 16)
    x = _arr(*shape)
    clean = copy.deepcopy(model)
    y = clean(x)
    dy = _arr(*y.shape)
    dclean = clean.backward(dy)
    model(x)
    inner = model.parameters()[0]
    inner.grad = None
    with pytest.raises(TypeError):
        model.backward(dy)
    model.zero_grad()
    dretry = model.backward(dy)
    if dclean is None:
        assert dretry is None
    else:
        np.testing.assert_array_equal(dretry, dclean)
    for a, b in zip(_grads(model), _grads(clean)):
        np.testing.assert_array_equal(a, b)


def test_a_sequential_checks_inside_a_residual_before_writing():
    """Sequential(Residual, Flatten, Linear) with a gradient buffer gone inside the block:
    the backward refuses before the Linear accumulates anything."""
    model = cf.Sequential(_block(), cf.Flatten(),
                          cf.Linear(75, 2, dtype="float64", device="cpu", seed=7))
    x = _arr(2, 3, 5, 5)
    model(x)
    model[0].body[0].weight.grad = None
    with pytest.raises(TypeError):
        model.backward(_arr(2, 2))
    assert not np.any(model[2].weight.grad)


def test_an_inner_container_that_fails_and_is_caught_keeps_its_contexts():
    """A forward with a fallback: its child Sequential raises part-way, the forward catches
    it and goes on. The child's layers keep the last good forward's contexts; and a model
    another forward calls (not a child) gets the same rule."""

    class WithFallback(cf.Module):
        def __init__(self, other):
            self.fast = _chain()
            self.other = other  # a child here; `outside` below is not one

        def forward(self, x, residual=None, outside=None):
            try:
                y = self.fast(x, residual=residual)
            except ValueError:
                y = None
            if outside is not None:
                with contextlib.suppress(ValueError):
                    outside(x, residual=residual)
            return y

    x1, x2, r, dy = _arr(2, 2, 5, 5), _arr(2, 2, 5, 5), _arr(2, 3, 5, 5), _arr(2, 3, 5, 5)
    model, outside = WithFallback(cf.Identity()), _chain()
    clean_fast, clean_outside = _chain(), _chain()
    model(x1, residual=r, outside=outside)
    assert model(x2, residual=np.zeros((2, 3, 4, 4)), outside=outside) is None
    clean_fast(x1, residual=r)
    clean_outside(x1, residual=r)
    for failed, clean in ((model.fast, clean_fast), (outside, clean_outside)):
        for a, b in zip(failed.backward(dy), clean.backward(dy)):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(_grads(failed), _grads(clean)):
            np.testing.assert_array_equal(a, b)


def test_a_container_called_twice_whose_second_call_fails_keeps_the_first():
    """Called again in the same forward, a container that fails restores what its first
    call left (not the state before the outer call)."""

    class Twice(cf.Module):
        def __init__(self):
            self.s = _chain()

        def forward(self, x, bad=None):
            y = self.s(x, residual=np.zeros((2, 3, 5, 5)))
            if bad is not None:
                with contextlib.suppress(ValueError):  # its first conv runs on 2x
                    self.s(2 * x, residual=bad)
            return y

    x1, x2, dy = _arr(2, 2, 5, 5), _arr(2, 2, 5, 5), _arr(2, 3, 5, 5)
    model, clean = Twice(), _chain()
    model(x1)
    model(x2, bad=np.zeros((2, 3, 4, 4)))
    clean(x1, residual=np.zeros((2, 3, 5, 5)))
    clean(x2, residual=np.zeros((2, 3, 5, 5)))
    for a, b in zip(model.s.backward(dy), clean.backward(dy)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_grads(model.s), _grads(clean)):
        np.testing.assert_array_equal(a, b)
