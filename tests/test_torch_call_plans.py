"""convfuse.torch's per-signature call plans (convfuse/torch/_call_plan.py Note [call
plans]): one FusedCall per eager call signature of a Conv or ConvTranspose layer, whose
later calls give what a fresh layer gives, whatever changed in between, and whose CPU
runner steps aside for any replaced function (a spy sees every call)."""

from __future__ import annotations

import copy

import pytest
import torch

import convfuse.torch as cft
from convfuse import ops
from convfuse.ops import validated
from convfuse.ops.reference import conv as ref_conv
from convfuse.torch import _call_plan
from convfuse.torch import conv as torch_conv


def _pair(kind: str, **kwargs):
    torch.manual_seed(0)
    if kind == "conv":
        theirs = torch.nn.Conv2d(2, 3, 3, padding=1, **kwargs).double()
    else:
        theirs = torch.nn.ConvTranspose2d(2, 3, 3, padding=1, **kwargs).double()
    return cft.convert(copy.deepcopy(theirs)), theirs


def _plans():
    return [v for v in torch_conv.CALLS.values() if isinstance(v, _call_plan.FusedCall)]


@pytest.mark.parametrize("kind", ["conv", "transpose"])
@pytest.mark.parametrize(("name", "value"), [("stride", (2, 2)), ("padding", (0, 0)),
                                             ("dilation", (2, 2)), ("activation", "relu")])
def test_hyperparameters_assigned_after_cached_calls_take_effect(kind, name, value):
    ours, theirs = _pair(kind)
    x = torch.randn(2, 2, 7, 7, dtype=torch.float64)
    ours(x)
    ours(x)
    setattr(ours, name, value)
    fresh = copy.deepcopy(ours)  # a layer that never ran, with the same attributes
    torch_conv.CALLS.clear()
    want = fresh(x)
    torch_conv.CALLS.clear()
    ours(x)
    setattr(ours, name, value)
    torch.testing.assert_close(ours(x), want, rtol=0, atol=0)
    if name != "activation":
        setattr(theirs, name, value)
        torch.testing.assert_close(ours(x), theirs(x))


def test_one_plan_per_signature_and_strides_are_part_of_it():
    torch_conv.CALLS.clear()
    ours, theirs = _pair("conv")
    x = torch.randn(2, 2, 6, 6, dtype=torch.float64)
    for _ in range(3):
        ours(x)
    assert len(_plans()) == 1
    xcl = x.to(memory_format=torch.channels_last)
    y = ours(xcl)
    assert len(_plans()) == 2
    assert y.is_contiguous(memory_format=torch.channels_last) == theirs(xcl).is_contiguous(
        memory_format=torch.channels_last)
    torch.testing.assert_close(y, theirs(x))
    ours(x[:, :, :, :5])  # another shape
    assert len(_plans()) == 3


def test_a_weight_whose_dtype_changes_under_the_layer_gets_a_new_plan():
    torch.manual_seed(1)
    theirs = torch.nn.Conv2d(2, 3, 3, padding=1)
    ours = cft.convert(copy.deepcopy(theirs))
    x = torch.randn(1, 2, 5, 5)
    ours(x)
    ours(x)
    ours.double()  # swaps .data in place: the same Parameter objects, float64 now
    theirs.double()
    got = ours(x.double())
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, theirs(x.double()))


def test_bad_input_after_cached_calls_gets_the_fresh_layers_error():
    ours, _ = _pair("conv")
    fresh = copy.deepcopy(ours)
    x = torch.randn(2, 2, 6, 6, dtype=torch.float64)
    ours(x)
    ours(x)
    for bad in (x.float(), torch.randn(2, 5, 6, 6, dtype=torch.float64),
                torch.randn(1, 2, 2, 6, 6, dtype=torch.float64)):
        with pytest.raises(Exception) as want:
            fresh(bad)
        with pytest.raises(Exception) as got:
            ours(bad)
        assert type(got.value) is type(want.value) and str(got.value) == str(want.value)


@pytest.mark.parametrize("where", ["ops", "validated", "engine"])
def test_the_cpu_runner_steps_aside_for_a_replaced_function(monkeypatch, where):
    torch.manual_seed(2)
    theirs = torch.nn.Conv2d(1, 2, 3, padding=1)
    ours = cft.convert(copy.deepcopy(theirs))
    x = torch.randn(1, 1, 4, 4)
    with torch.no_grad():
        want = ours(x)
        assert torch.equal(ours(x), want)  # the runner's result, bit for bit
        assert any(p.runner for p in _plans())  # armed: this is the tiny float32 case
        module = {"ops": ops, "validated": validated, "engine": ref_conv}[where]
        real = module.conv_bias_act
        calls = []
        monkeypatch.setattr(module, "conv_bias_act",
                            lambda *a, **k: calls.append(1) or real(*a, **k))
        assert torch.equal(ours(x), want)
        assert calls == [1]
        torch.testing.assert_close(want, theirs(x))


def test_the_cpu_runner_keeps_nothing_the_engine_let_go():
    """The runner holds its TinyConv weakly: once the engine's LRU drops it, the plan's
    next call takes the validated path (same numbers) and arms a runner again, so a
    per-signature cache of thousands of plans keeps no TinyConv the engine would not."""
    torch.manual_seed(3)
    ours = cft.convert(torch.nn.Conv2d(1, 2, 3, padding=1))
    x = torch.randn(1, 1, 5, 4)
    with torch.no_grad():
        want = ours(x)
        ours(x)
        plan, = (p for p in _plans() if p.prep.geom.input_shape == (1, 1, 5, 4))
        runner = plan.runner
        assert runner and runner(x.numpy(), ours.weight.detach().numpy(),
                                 ours.bias.detach().numpy()) is not None
        ref_conv._tiny.cache_clear()
        assert runner(x.numpy(), ours.weight.detach().numpy(),
                      ours.bias.detach().numpy()) is None  # nothing kept alive
        assert torch.equal(ours(x), want)  # the validated path, then armed again
        assert plan.runner and plan.runner is not runner
        assert torch.equal(ours(x), want)


@pytest.mark.parametrize("kind", ["conv", "transpose"])
@pytest.mark.parametrize("activation", ["identity", "relu", "silu"])
def test_plan_gradients_match_torch_nn_in_float64(kind, activation):
    ours, theirs = _pair(kind)
    ours.activation = activation
    act = {"identity": lambda t: t, "relu": torch.relu, "silu": torch.nn.functional.silu}[
        activation]
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    for _ in range(2):  # the second call runs the cached plan
        ya = ours(x)
        yb = act(theirs(x))
        dy = torch.randn_like(yb)
        ga = torch.autograd.grad(ya, [x, *ours.parameters()], dy)
        gb = torch.autograd.grad(yb, [x, *theirs.parameters()], dy)
        torch.testing.assert_close(ya, yb)
        for a, b in zip(ga, gb, strict=True):
            torch.testing.assert_close(a, b)
    assert type(ya.grad_fn).__name__ in ("ConvBiasActBackward", "ConvTransposeBiasActBackward")


def test_plan_double_backward_through_the_recorded_path():
    ours, _ = _pair("conv")
    ours.activation = "silu"
    x = torch.randn(1, 2, 4, 4, dtype=torch.float64, requires_grad=True)
    ours(x)
    torch.autograd.gradgradcheck(lambda t: ours(t), (x,))
