"""convfuse.optim's argument validation: bad hyperparameters and parameter lists are refused
with PyTorch's messages, and a refused construction leaves the parameters alone."""

from __future__ import annotations

import numpy as np
import pytest

import convfuse as cf
from convfuse import Parameter
from convfuse.optim import SGD, Adam, AdamW


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


def test_sgd_takes_torch_optim_sgds_arguments_in_its_order():
    """Positional calls written for torch.optim.SGD mean the same: (params, lr, momentum,
    dampening, weight_decay, nesterov), lr defaulting to 1e-3 as in torch; a nonzero
    dampening, which the fused update does not implement, is refused rather than dropped."""
    import inspect

    torch = pytest.importorskip("torch")
    ours = list(inspect.signature(SGD).parameters.values())
    theirs = [p for p in inspect.signature(torch.optim.SGD).parameters.values()
              if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in ours] == [p.name for p in theirs]
    assert [p.default for p in ours[1:]] == [p.default for p in theirs[1:]]
    opt = SGD(_p(), 0.1, 0.9, 0.0, 1e-4, True)
    assert opt.lr == 0.1 and opt.defaults == {"momentum": 0.9, "weight_decay": 1e-4,
                                              "nesterov": True}
    with pytest.raises(ValueError, match=r"^SGD: dampening=0\.5 is not supported"):
        SGD(_p(), 0.1, 0.9, 0.5)
    with pytest.raises(TypeError, match=r"^SGD: dampening must be a real number, got str"):
        SGD(_p(), dampening="0")


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
