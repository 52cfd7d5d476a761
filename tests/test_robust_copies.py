"""Issue #11, class 1: copies and pickles of a model with its optimizer (or an optimizer
alone) keep training, and a checkpoint restored from state_dicts continues bitwise."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import convfuse as cf

OPTIMIZERS = [
    (cf.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    (cf.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    (cf.optim.Adam, {"lr": 1e-2}),
    (cf.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
]
IDS = ["sgd-momentum", "sgd-nesterov", "adam", "adamw"]


def _model(seed=0):
    return cf.Sequential(
        cf.Conv2d(1, 3, 3, padding=1, activation="relu", device="cpu", seed=seed),
        cf.MaxPool2d(2), cf.Flatten(), cf.Linear(12, 4, device="cpu", seed=seed + 1),
    )


def _batch(i):
    rng = np.random.default_rng(100 + i)
    return rng.standard_normal((5, 1, 4, 4)).astype(np.float32), rng.integers(0, 4, 5)


def _train(model, opt, steps, start=0):
    loss_fn = cf.CrossEntropyLoss()
    losses = []
    for i in range(start, start + steps):
        x, labels = _batch(i)
        opt.zero_grad()
        losses.append(float(loss_fn(model(x), labels)))
        model.backward(loss_fn.backward())
        opt.step()
    return losses


def _same(a, b):
    for (ka, p), (kb, q) in zip(a.named_parameters(), b.named_parameters()):
        assert ka == kb
        np.testing.assert_array_equal(p.data, q.data, err_msg=ka)


def _copies():
    return {
        "deepcopy": lambda pair: copy.deepcopy(pair),
        "pickle": lambda pair: pickle.loads(pickle.dumps(pair)),
        "pickle-reversed": lambda pair: pickle.loads(pickle.dumps(pair[::-1]))[::-1],
    }


@pytest.mark.parametrize("how", list(_copies()))
@pytest.mark.parametrize("opt_cls,kw", OPTIMIZERS, ids=IDS)
def test_a_copied_pair_trains_exactly_as_the_original(how, opt_cls, kw):
    model = _model()
    opt = opt_cls(model.parameters(), **kw)
    _train(model, opt, 2)
    model2, opt2 = _copies()[how]((model, opt))
    before = [p.data.copy() for p in model2.parameters()]
    assert _train(model2, opt2, 3, start=2) == _train(model, opt, 3, start=2)
    _same(model, model2)
    assert any(not np.array_equal(b, p.data) for b, p in zip(before, model2.parameters()))


@pytest.mark.parametrize("opt_cls,kw", OPTIMIZERS, ids=IDS)
def test_stepping_a_copy_leaves_the_original_alone(opt_cls, kw):
    model = _model()
    opt = opt_cls(model.parameters(), **kw)
    _train(model, opt, 1)
    snapshot = [p.data.copy() for p in model.parameters()]
    model2, opt2 = copy.deepcopy((model, opt))
    _train(model2, opt2, 2, start=1)
    for s, p in zip(snapshot, model.parameters()):
        np.testing.assert_array_equal(s, p.data)


@pytest.mark.parametrize("opt_cls,kw", OPTIMIZERS, ids=IDS)
def test_an_optimizer_copied_alone_updates_its_own_copies(opt_cls, kw):
    model = _model()
    opt = opt_cls(model.parameters(), **kw)
    _train(model, opt, 1)
    opt2 = pickle.loads(pickle.dumps(opt))
    params = [s.param for g in opt2._groups for s in sorted(g.slots, key=lambda s: s.index)]
    for p, q in zip(params, model.parameters()):
        assert p is not q
        np.testing.assert_array_equal(p.data, q.data)
        p.grad[...] = 1.0
    before = [p.data.copy() for p in params]
    opt2.step()
    assert all(not np.array_equal(b, p.data) for b, p in zip(before, params))
    assert opt2.state_dict()["state"][0]["step"] == 2


@pytest.mark.parametrize("opt_cls,kw", OPTIMIZERS, ids=IDS)
def test_checkpoint_from_state_dicts_continues_bitwise(opt_cls, kw):
    model = _model()
    opt = opt_cls(model.parameters(), **kw)
    _train(model, opt, 3)
    ckpt = pickle.dumps({"model": model.state_dict(), "opt": opt.state_dict()})
    fresh = _model(seed=7)  # different initial weights: everything must come from the file
    fresh_opt = opt_cls(fresh.parameters(), **{**kw, "lr": 0.5})
    loaded = pickle.loads(ckpt)
    fresh.load_state_dict(loaded["model"])
    fresh_opt.load_state_dict(loaded["opt"])
    assert _train(fresh, fresh_opt, 4, start=3) == _train(model, opt, 4, start=3)
    _same(model, fresh)


def test_a_shallow_copy_makes_the_original_refuse_to_step_rather_than_do_nothing():
    model = _model()
    opt = cf.optim.SGD(model.parameters(), lr=0.1)
    twin = copy.copy(opt)
    for p in model.parameters():
        p.grad[...] = 1.0
    before = [p.data.copy() for p in model.parameters()]
    twin.step()
    assert all(not np.array_equal(b, p.data) for b, p in zip(before, model.parameters()))
    with pytest.raises(RuntimeError, match="replaced after this optimizer re-homed it"):
        opt.step()


def test_zero_grad_refuses_as_step_does_once_a_parameters_arrays_were_replaced():
    """Moving the model (or assigning .grad) after building the optimizer leaves its flat
    buffers behind: zero_grad says so too, instead of zeroing what no layer reads."""
    model = _model()
    opt = cf.optim.SGD(model.parameters(), lr=0.1)
    p = next(iter(model.parameters()))
    p.grad = np.zeros_like(p.grad)
    with pytest.raises(RuntimeError, match=r"had its \.grad replaced .*\.to\(\)/\.cuda\(\)"):
        opt.zero_grad()
