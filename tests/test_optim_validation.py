"""convfuse.optim's argument validation: bad hyperparameters and parameter lists are refused
with PyTorch's messages, and a refused construction leaves the parameters alone."""

from __future__ import annotations

import numpy as np
import pytest

import convfuse as cf
from convfuse import Parameter
from convfuse.optim import SGD, Adam, AdamW
from tests._optim_helpers import grad_sequence, make_params, run


# -- validation ------------------------------------------------------------------------------
def _p():
    return [Parameter(np.zeros(3, np.float32))]


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: SGD(_p(), lr=-1), ValueError, "Invalid learning rate: -1"),
        (lambda: SGD(_p(), lr=float("nan")), ValueError, "Invalid learning rate: nan"),
        (lambda: SGD(_p(), lr=0.1, momentum=-0.5), ValueError, "Invalid momentum value: -0.5"),
        (lambda: SGD(_p(), lr=0.1, weight_decay=-1e-4), ValueError,
         "Invalid weight_decay value: -0.0001"),
        (lambda: SGD(_p(), lr=0.1, nesterov=True), ValueError,
         "Nesterov momentum requires a momentum and zero dampening"),
        (lambda: SGD(_p(), lr=0.1, momentum=0.9, nesterov="yes"), TypeError, "nesterov must be"),
        (lambda: SGD(_p(), lr=None), TypeError, "lr must be a real number"),
        (lambda: Adam(_p(), lr=-0.1), ValueError, "Invalid learning rate: -0.1"),
        (lambda: Adam(_p(), eps=-1e-8), ValueError, "Invalid epsilon value: -1e-08"),
        (lambda: Adam(_p(), betas=(1.0, 0.999)), ValueError,
         "Invalid beta parameter at index 0: 1.0"),
        (lambda: Adam(_p(), betas=(0.9, -0.1)), ValueError,
         "Invalid beta parameter at index 1: -0.1"),
        (lambda: Adam(_p(), betas=(0.9,)), ValueError, "betas must be a pair"),
        (lambda: Adam(_p(), betas=(0.9, "x")), TypeError, r"betas\[1\] must be a real number"),
        (lambda: AdamW(_p(), weight_decay=-0.01), ValueError, "Invalid weight_decay value: -0.01"),
        (lambda: SGD([], lr=0.1), ValueError, "optimizer got an empty parameter list"),
        (lambda: SGD(iter([]), lr=0.1), ValueError, "empty parameter list"),
        (lambda: SGD(Parameter(np.zeros(2)), lr=0.1), TypeError, "single Parameter"),
        (lambda: SGD(3, lr=0.1), TypeError, "iterable of Parameter, got int"),
        (lambda: SGD([np.zeros(2)], lr=0.1), TypeError, r"params\[0\] is a ndarray"),
        (lambda: SGD([Parameter(np.zeros(2, np.int32))], lr=0.1), ValueError,
         r"params\[0\]: unsupported dtype int32"),
    ],
)
def test_validation_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_duplicate_parameters_are_refused():
    p, q = Parameter(np.zeros(2)), Parameter(np.zeros(2))
    with pytest.raises(ValueError, match=r"params\[2\] is the same Parameter as params\[0\]"):
        SGD([p, q, p], lr=0.1)


@pytest.mark.parametrize("second", [lambda w: w, lambda w: w[1:3], lambda w: w.reshape(2, 2)])
def test_parameters_sharing_memory_are_refused(second):
    """Two Parameters over one array (or overlapping views) would be copied into separate
    flat slots and silently untied by the first step: refused, and nothing is moved."""
    w = np.ones(4)
    a, b = Parameter(w), Parameter(second(w))
    with pytest.raises(ValueError, match=r"params\[2\] shares memory with params\[0\]"):
        SGD([a, Parameter(np.zeros(2)), b], lr=0.1)
    assert a.data is w and np.shares_memory(b.data, w)
    SGD([a, Parameter(np.zeros(4))], lr=0.1)  # separate memory: taken


def test_grad_that_does_not_match_data_is_refused():
    p = Parameter(np.zeros((2, 3), np.float32))
    p.grad = np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match=r"params\[0\] has grad float32\(3, 2\) but data"):
        SGD([p], lr=0.1)
    p.grad = np.zeros((2, 3), np.float64)
    with pytest.raises(ValueError, match="float64"):
        SGD([p], lr=0.1)


def test_failed_construction_leaves_parameters_alone():
    p = Parameter(np.ones(3, np.float32))
    data = p.data
    with pytest.raises(ValueError):
        SGD([p], lr=-1.0)
    with pytest.raises(ValueError, match="same Parameter"):
        SGD([p, p], lr=1.0)
    assert p.data is data


def test_none_grad_becomes_zeros():
    p = Parameter(np.ones(3))
    p.grad = None
    SGD([p], lr=0.1)
    assert p.grad is not None and p.grad.shape == (3,) and not p.grad.any()


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_signature_is_torch_optims(name):
    """Calls written for torch.optim mean the same: every argument's name, kind (positional
    or keyword-only), order and default are torch's, lr defaulting to 1e-3 as in torch."""
    import inspect

    torch = pytest.importorskip("torch")
    ours = list(inspect.signature(getattr(cf.optim, name)).parameters.values())
    theirs = list(inspect.signature(getattr(torch.optim, name)).parameters.values())
    assert [(p.name, p.kind) for p in ours] == [(p.name, p.kind) for p in theirs]
    assert [p.default for p in ours[1:]] == [p.default for p in theirs[1:]]


def test_sgd_takes_torch_optim_sgds_arguments_in_its_order():
    """Positional (params, lr, momentum, dampening, weight_decay, nesterov) as in torch; a
    nonzero dampening, which the fused update does not implement, is refused rather than
    dropped."""
    opt = SGD(_p(), 0.1, 0.9, 0.0, 1e-4, True)
    assert opt.lr == 0.1 and opt.defaults == {"momentum": 0.9, "weight_decay": 1e-4,
                                              "nesterov": True}
    with pytest.raises(ValueError, match=r"^SGD: dampening=0\.5 is not supported"):
        SGD(_p(), 0.1, 0.9, 0.5)
    with pytest.raises(TypeError, match=r"^SGD: dampening must be a real number, got str"):
        SGD(_p(), dampening="0")


_FLAGS = {
    "SGD": ("maximize", "foreach", "differentiable", "fused"),
    "Adam": ("amsgrad", "foreach", "maximize", "capturable", "differentiable", "fused"),
    "AdamW": ("amsgrad", "foreach", "maximize", "capturable", "differentiable", "fused"),
}


@pytest.mark.parametrize("name", sorted(_FLAGS))
def test_torch_flags_at_values_convfuse_computes_are_accepted_and_change_nothing(name, rng):
    """torch.optim's flags that choose an implementation (foreach, fused, capturable) take
    any value torch takes; those that change the update (amsgrad, maximize,
    differentiable) their default False. The steps are those of the plain optimizer."""
    cls = getattr(cf.optim, name)
    shapes = [(3, 2), (4,)]
    grads = grad_sequence(rng, shapes, 3)
    plain = make_params(rng, np.float64, shapes)
    flagged = [Parameter(p.data.copy()) for p in plain]
    opt = cls(plain, lr=0.01)
    settings = {"foreach": True, "fused": False, "capturable": True, "amsgrad": False,
                "maximize": np.False_, "differentiable": False}
    other = cls(flagged, lr=0.01, **{k: settings[k] for k in _FLAGS[name]})
    assert other.defaults == opt.defaults
    run(opt, plain, grads)
    run(other, flagged, grads)
    for p, q in zip(plain, flagged):
        np.testing.assert_array_equal(p.data, q.data)
    for none_ok in ("foreach", "fused"):
        cls(_p(), **{none_ok: None})


@pytest.mark.parametrize("name", sorted(_FLAGS))
def test_torch_flags_convfuse_does_not_implement_are_refused_naming_them(name):
    """Refused before anything changes, with a typed error naming the optimizer and the
    argument (not Python's bare 'unexpected keyword argument')."""
    cls = getattr(cf.optim, name)
    p = _p()
    before = p[0].data
    for flag in ("amsgrad", "maximize", "differentiable"):
        if flag not in _FLAGS[name]:
            continue
        with pytest.raises(ValueError, match=rf"^{name}: {flag}=True is not supported: "
                                             rf"convfuse's fused update is torch\.optim's "
                                             rf"with {flag}=False"):
            cls(p, **{flag: True})
        with pytest.raises(TypeError, match=rf"^{name}: {flag} must be a bool, got str"):
            cls(p, **{flag: "no"})
    for flag in ("foreach", "fused"):
        with pytest.raises(TypeError, match=rf"^{name}: {flag} must be None or a bool, got int"):
            cls(p, **{flag: 1})
    assert p[0].data is before  # never re-homed
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'nope'"):
        cls(p, nope=1)


def test_adam_takes_decoupled_weight_decay_as_torch_adam(rng):
    """torch.optim.Adam(decoupled_weight_decay=True) is AdamW: so is convfuse's."""
    shapes = [(3, 2), (4,)]
    grads = grad_sequence(rng, shapes, 4)
    a = make_params(rng, np.float64, shapes)
    b = [Parameter(p.data.copy()) for p in a]
    opt_a = Adam(a, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)
    opt_b = AdamW(b, lr=0.01, weight_decay=0.1)
    assert opt_a.defaults == opt_b.defaults
    run(opt_a, a, grads)
    run(opt_b, b, grads)
    for p, q in zip(a, b):
        np.testing.assert_array_equal(p.data, q.data)
    with pytest.raises(TypeError, match=r"^Adam: decoupled_weight_decay must be a bool"):
        Adam(_p(), decoupled_weight_decay=1)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_parameter_groups_and_closures_are_refused_naming_why(name):
    """torch.optim's parameter groups (dicts in params) and step(closure): typed errors
    naming the optimizer and what to do instead."""
    cls = getattr(cf.optim, name)
    p = _p()
    with pytest.raises(TypeError, match=rf"^{name}: params\[1\] is a dict: parameter groups "
                                        r"\(torch\.optim's .*are not supported; .*build one "
                                        r"optimizer per group"):
        cls([p[0], {"params": _p(), "lr": 0.1}])
    opt = cls(p, lr=0.1)
    p[0].grad[...] = 1.0
    with pytest.raises(TypeError, match=rf"^{name}\.step: closure is not supported"):
        opt.step(lambda: 0.0)
    np.testing.assert_array_equal(p[0].data, 0.0)  # no step was taken
    assert not hasattr(opt, "param_groups") and not hasattr(opt, "add_param_group")


def test_interleaved_views_of_one_array_do_not_share_and_are_taken():
    """Their address ranges meet but no element is shared: NumPy's exact answer decides."""
    base = np.zeros((4, 4))
    left, right = Parameter(base[:, :2]), Parameter(base[:, 2:])
    opt = SGD([left, right], lr=0.5)
    left.grad[...], right.grad[...] = 1.0, 2.0
    opt.step()
    np.testing.assert_array_equal(left.data, np.full((4, 2), -0.5))
    np.testing.assert_array_equal(right.data, np.full((4, 2), -1.0))
    w = np.ones(4)
    with pytest.raises(ValueError, match=r"params\[1\] shares memory with params\[0\]"):
        SGD([Parameter(w[::-1]), Parameter(w[1:2])], lr=0.1)  # a reversed view


@pytest.mark.parametrize("value", [True, 1, "yes"])
def test_zero_grad_refuses_set_to_none_naming_why(value):
    """PyTorch's zero_grad(set_to_none=True): refused with the reason (a convfuse gradient
    is always an array), the gradients unchanged; set_to_none=False zeroes them."""
    conv = cf.Conv2d(1, 2, 1, device="cpu", seed=0)
    opt = cf.optim.SGD(conv.parameters(), lr=0.1)
    conv.weight.grad[...] = 1.0
    for owner, call in (("SGD", opt.zero_grad), ("Conv2d", conv.zero_grad)):
        with pytest.raises(ValueError, match=rf"^{owner}.zero_grad: set_to_none={value!r} is "
                                             r"not supported: a convfuse gradient is always"):
            call(set_to_none=value)
        assert conv.weight.grad.all()
    opt.zero_grad(set_to_none=False)
    assert not conv.weight.grad.any()
    for falsy in (np.False_, None, 0):  # PyTorch zeroes on any false value
        conv.weight.grad[...] = 1.0
        conv.zero_grad(set_to_none=falsy)
        assert not conv.weight.grad.any()
