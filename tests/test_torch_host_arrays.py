"""A layer's kept NumPy views of its own tensors (Note [a layer's host arrays] in
convfuse/torch/_host_arrays.py) and its parameters read from nn.Module's dicts (Note
[reading a layer's state] in _module_state.py): whatever happens to the tensors between
calls (an optimizer step, `.data` or `set_` giving new memory, a reassigned Parameter,
functional_call, load_state_dict, a cast, a copy), every call computes what torch.nn
computes with the tensors the layer has at that call."""

from __future__ import annotations

import copy
import pickle
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import convfuse.torch as ct  # noqa: E402
from convfuse.torch._host_arrays import HostArrays  # noqa: E402

F64 = torch.float64


def _pair(kind):
    """(torch.nn layer, its convfuse.torch conversion), float64, sharing nothing."""
    torch.manual_seed(0)
    if kind == "conv":
        theirs = nn.Conv2d(2, 3, 3, padding=1)
    elif kind == "transpose":
        theirs = nn.ConvTranspose2d(2, 3, 3, padding=1)
    else:
        theirs = nn.BatchNorm2d(2)
    theirs = theirs.to(F64)
    return theirs, ct.convert(copy.deepcopy(theirs))


def _input(kind, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 5, 4, dtype=F64, generator=g)


def _agree(theirs, ours, kind, seed=1, grad=True):
    """One call of each on the same input: outputs, input and parameter gradients and (a
    batch norm's) running statistics agree."""
    x = _input(kind, seed)
    xa, xb = x.clone().requires_grad_(grad), x.clone().requires_grad_(grad)
    for m in (theirs, ours):
        m.zero_grad(set_to_none=True)
    ya, yb = theirs(xa), ours(xb)
    torch.testing.assert_close(yb, ya, rtol=1e-12, atol=1e-12)
    if grad:
        dy = torch.randn(ya.shape, dtype=F64, generator=torch.Generator().manual_seed(seed + 7))
        ya.backward(dy)
        yb.backward(dy)
        torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-11, atol=1e-11)
        for (name, pa), pb in zip(theirs.named_parameters(), ours.parameters()):
            torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-11, atol=1e-11, msg=name)
    for (name, ba), bb in zip(theirs.named_buffers(), ours.buffers()):
        torch.testing.assert_close(bb, ba, rtol=1e-12, atol=1e-12, msg=name)


def _both(theirs, ours, fn):
    """fn(m) on both layers, under no_grad (a change to their tensors)."""
    with torch.no_grad():
        fn(theirs)
        fn(ours)


KINDS = ["conv", "transpose", "batchnorm"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_every_change_to_the_tensors_between_calls_is_seen(kind, grad):
    theirs, ours = _pair(kind)
    theirs.train()
    ours.train()
    step = 0

    def check():
        nonlocal step
        step += 1
        if grad:
            _agree(theirs, ours, kind, seed=step)
        else:
            with torch.no_grad():
                _agree(theirs, ours, kind, seed=step, grad=False)

    check()
    check()  # the kept views
    _both(theirs, ours, lambda m: m.weight.mul_(1.5))  # in place (an optimizer step)
    check()
    new_w = torch.randn(theirs.weight.shape, dtype=F64)
    _both(theirs, ours, lambda m: setattr(m.weight, "data", new_w.clone()))  # other memory
    check()
    new_b = torch.randn(theirs.bias.shape, dtype=F64)
    _both(theirs, ours, lambda m: m.bias.set_(new_b.clone()))
    check()
    new_w2 = torch.randn(theirs.weight.shape, dtype=F64)
    theirs.weight = nn.Parameter(new_w2.clone())  # a new Parameter object
    ours.weight = nn.Parameter(new_w2.clone())
    check()
    state = {k: torch.randn_like(v) if v.is_floating_point() else v
             for k, v in theirs.state_dict().items()}
    if kind == "batchnorm":
        state["running_var"] = state["running_var"].abs() + 0.5
    theirs.load_state_dict(state)
    ours.load_state_dict(state)
    check()
    if kind == "batchnorm":  # the statistics it writes in place, moved to other memory
        _both(theirs, ours, lambda m: setattr(m.running_mean, "data", torch.zeros(2, dtype=F64)))
        _both(theirs, ours, lambda m: setattr(m.running_var, "data", torch.ones(2, dtype=F64)))
        check()
        check()


@pytest.mark.parametrize("kind", KINDS)
def test_layers_sharing_a_plan_keep_their_own_views(kind):
    a_theirs, a_ours = _pair(kind)
    b_theirs, b_ours = _pair(kind)
    _both(b_theirs, b_ours, lambda m: m.weight.mul_(-2.0))
    for seed in range(3):  # alternating: one plan, two layers' views
        _agree(a_theirs, a_ours, kind, seed)
        _agree(b_theirs, b_ours, kind, seed)


@pytest.mark.parametrize("kind", KINDS)
def test_functional_call_uses_its_tensors_and_then_the_layers_own(kind):
    theirs, ours = _pair(kind)
    _agree(theirs, ours, kind)
    swapped = {"weight": torch.randn(theirs.weight.shape, dtype=F64)}
    x = _input(kind)
    with torch.no_grad():
        want = torch.func.functional_call(theirs, swapped, (x,))
        got = torch.func.functional_call(ours, swapped, (x,))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    _agree(theirs, ours, kind, seed=2)


@pytest.mark.parametrize("kind", KINDS)
def test_a_cast_drops_the_views_and_the_cast_layer_agrees(kind):
    theirs, ours = _pair(kind)
    _agree(theirs, ours, kind)
    assert ours.__dict__["_host_arrays"].entry is not None
    ours.float()
    assert "_host_arrays" not in ours.__dict__  # no view holds the float64 memory
    theirs.float()
    x = _input(kind).float()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_a_copied_or_pickled_layer_starts_without_views(kind):
    theirs, ours = _pair(kind)
    _agree(theirs, ours, kind)
    held = ours.__dict__["_host_arrays"]
    for other in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        assert other.__dict__["_host_arrays"] is not held
        assert other.__dict__["_host_arrays"].entry is None
        x = _input(kind, 3)
        with torch.no_grad():  # all three count the batch (a batch norm)
            torch.testing.assert_close(other(x), ours(x), rtol=0, atol=0)
            theirs(x)
    _agree(theirs, ours, kind, seed=4)


def test_views_are_kept_only_for_the_same_plan_objects_and_addresses():
    held = HostArrays()
    plan, other_plan = object(), object()
    w, b = torch.randn(3, dtype=F64, requires_grad=True), torch.randn(3, dtype=F64)
    first = held.views(plan, (w, None, b))
    assert first[1] is None
    assert np.shares_memory(first[0], w.detach().numpy())
    assert first[0].ctypes.data == w.data_ptr() and first[2].ctypes.data == b.data_ptr()
    assert held.views(plan, (w, None, b)) is first
    assert held.views(other_plan, (w, None, b)) is not first
    again = held.views(plan, (w, None, b))
    assert again is not first and held.views(plan, (w, None, b)) is again
    w.data = torch.zeros(3, dtype=F64)
    moved = held.views(plan, (w, None, b))
    assert moved is not again and moved[0].ctypes.data == w.data_ptr()
    assert held.views(plan, (w.detach(), None, b)) is not moved  # another object
    with pytest.raises(RuntimeError):  # what .numpy() says of a non-CPU tensor
        held.views(plan, (torch.empty(3, device="meta"), None, b))
    copied = copy.copy(held)
    assert copied.entry is None and pickle.loads(pickle.dumps(held)).entry is None


class _Scale(nn.Module):
    def forward(self, w):
        return w * 3.0


@pytest.mark.parametrize("kind", ["conv", "transpose"])
def test_a_parametrized_weight_is_the_one_used(kind):
    from torch.nn.utils import parametrize

    theirs, ours = _pair(kind)
    _agree(theirs, ours, kind)  # the plain class first: its views are kept
    for m in (theirs, ours):
        parametrize.register_parametrization(m, "weight", _Scale())
    assert type(ours).__name__.startswith("Parametrized")
    _agree(theirs, ours, kind, seed=2)
    _agree(theirs, ours, kind, seed=3)


def test_a_class_with_its_own_getattr_is_read_through_it():
    class Doubled(ct.Conv2d):
        def __getattr__(self, name):
            value = super().__getattr__(name)
            return value * 2 if name == "weight" else value

    torch.manual_seed(0)
    ours = Doubled(2, 3, 3, padding=1, dtype=F64)
    x = _input("conv")
    with torch.no_grad():
        want = nn.functional.conv2d(x, ours._parameters["weight"] * 2, ours.bias, padding=1)
        torch.testing.assert_close(ours(x), want, rtol=1e-12, atol=1e-12)


def test_old_weight_norm_hooks_move_the_weight_out_of_the_dict():
    theirs, ours = _pair("conv")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm
        for m in (theirs, ours):
            nn.utils.weight_norm(m)
    assert "weight" not in ours._parameters
    _agree(theirs, ours, "conv")
    _both(theirs, ours, lambda m: m.weight_g.mul_(0.5))
    _agree(theirs, ours, "conv", seed=2)


def test_a_tensor_computed_by_autograd_is_not_kept():
    held = HostArrays()
    plan = object()
    w = torch.randn(3, dtype=F64, requires_grad=True)
    kept = held.views(plan, (w, None))
    assert held.entry is not None
    computed = w * 2  # a standardised weight: new at every call, with a graph
    arrays = held.views(plan, (computed, None))
    assert held.entry is None
    np.testing.assert_array_equal(arrays[0], 2 * kept[0])
