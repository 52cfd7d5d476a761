"""Residual: act(body(x) + shortcut(x)) with the add and activation fused into the body's
last layer; against PyTorch and finite differences."""

from __future__ import annotations

import numpy as np
import pytest

import convfuse as cf
from convfuse import functional
from tests.gradcheck import assert_grad_close

torch = pytest.importorskip("torch")
tnn = torch.nn

F64 = {"dtype": "float64", "device": "cpu"}


def conv(cin, cout, k=3, stride=1, bias=False, seed=0, **kw):
    return cf.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=bias, seed=seed,
                     **F64, **kw)


def bn(c, act=None, **kw):
    return cf.BatchNorm2d(c, activation=act, **F64, **kw)


def randomize_bn(layer, rng):
    layer.weight.data[...] = rng.uniform(0.5, 1.5, layer.num_features)
    layer.bias.data[...] = rng.standard_normal(layer.num_features) * 0.1
    layer.running_mean[...] = rng.standard_normal(layer.num_features) * 0.1
    layer.running_var[...] = rng.uniform(0.5, 2.0, layer.num_features)


def down_block(rng):
    """A ResNet-style block that halves the resolution: 2 -> 3 channels."""
    block = cf.Residual(
        cf.Sequential(conv(2, 3, stride=2, seed=1), bn(3, "relu"), conv(3, 3, seed=2), bn(3)),
        shortcut=cf.Sequential(conv(2, 3, k=1, stride=2, seed=3), bn(3)),
    )
    for m in block.modules():
        if isinstance(m, cf.BatchNorm2d):
            randomize_bn(m, rng)
    return block


class TorchBlock(tnn.Module):
    def __init__(self):
        super().__init__()
        self.body = tnn.Sequential(tnn.Conv2d(2, 3, 3, 2, 1, bias=False), tnn.BatchNorm2d(3),
                                   tnn.ReLU(), tnn.Conv2d(3, 3, 3, 1, 1, bias=False),
                                   tnn.BatchNorm2d(3))
        self.shortcut = tnn.Sequential(tnn.Conv2d(2, 3, 1, 2, 0, bias=False), tnn.BatchNorm2d(3))

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


def torch_twin(block):
    """The same block in PyTorch; our body has no ReLU module, so map keys by position."""
    ref = TorchBlock().double()
    ours = block.state_dict()
    theirs = ref.state_dict()
    rename = {"body.2.": "body.3.", "body.3.": "body.4."}
    mapped = {}
    for k, v in ours.items():
        for a, b in rename.items():
            if k.startswith(a):
                k = b + k[len(a):]
                break
        mapped[k] = torch.tensor(v)
    assert set(mapped) == set(theirs)
    ref.load_state_dict(mapped)
    return ref


def test_state_dict_keys_are_body_and_shortcut():
    block = down_block(np.random.default_rng(0))
    keys = list(block.state_dict())
    assert keys[:2] == ["body.0.weight", "body.1.weight"]
    assert "body.3.running_var" in keys and "shortcut.1.num_batches_tracked" in keys
    assert all(k.startswith(("body.", "shortcut.")) for k in keys)
    assert "shortcut" not in dict(cf.Residual(conv(2, 2)).named_children())


@pytest.mark.parametrize("training", [True, False])
def test_matches_torch_forward_backward(rng, training):
    block = down_block(rng)
    ref = torch_twin(block)
    block.train(training)
    ref.train(training)
    x = rng.standard_normal((2, 2, 6, 6))
    y = block(x)
    tx = torch.tensor(x, requires_grad=True)
    ty = ref(tx)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-12)
    dy = rng.standard_normal(y.shape)
    dx = block.backward(dy)
    ty.backward(torch.tensor(dy))
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    grads = {n: p.grad for n, p in block.named_parameters()}
    np.testing.assert_allclose(grads["body.0.weight"], ref.body[0].weight.grad.numpy(),
                               rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grads["body.3.weight"], ref.body[4].weight.grad.numpy(),
                               rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grads["shortcut.0.weight"],
                               ref.shortcut[0].weight.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grads["shortcut.1.bias"], ref.shortcut[1].bias.grad.numpy(),
                               rtol=1e-10, atol=1e-12)
    if training:
        np.testing.assert_allclose(block.body[3].running_mean,
                                   ref.body[4].running_mean.numpy(), rtol=1e-12)


@pytest.mark.parametrize("act", ["relu", None, "tanh"])
def test_identity_shortcut_with_conv_tail_finite_differences(rng, act):
    block = cf.Residual(cf.Sequential(conv(2, 2, seed=4), conv(2, 2, bias=True, seed=5)),
                        activation=act)
    assert block.body[1].activation == cf.activations.normalize(act)
    x = rng.standard_normal((2, 2, 4, 4))
    w = rng.standard_normal((2, 2, 4, 4))
    y = block(x)
    c0, c1 = block.body[0], block.body[1]
    z = functional.conv_bias_act(functional.conv_bias_act(x, c0.weight.data, padding=1),
                                 c1.weight.data, c1.bias.data, padding=1)
    expect = {"relu": np.maximum(z + x, 0), None: z + x, "tanh": np.tanh(z + x)}[act]
    np.testing.assert_allclose(y, expect, rtol=1e-12, atol=1e-12)
    dx = block.backward(w)

    def loss():
        return float((block(x) * w).sum())

    assert_grad_close(dx, loss, x, rtol=1e-6, atol=1e-8)
    dw = c0.weight.grad.copy()
    assert_grad_close(dw, loss, c0.weight.data, rtol=1e-6, atol=1e-8)


def test_batchnorm_block_finite_differences_in_training(rng):
    block = down_block(rng)
    x = rng.standard_normal((3, 2, 4, 4))
    w = rng.standard_normal(block(x).shape)
    dx = block.backward(w)

    def loss():
        return float((block(x) * w).sum())

    assert_grad_close(dx, loss, x, rtol=1e-5, atol=1e-7)
    g = block.shortcut[1].weight.grad.copy()
    assert_grad_close(g, loss, block.shortcut[1].weight.data, rtol=1e-5, atol=1e-7)


def test_inside_a_sequential(rng):
    net = cf.Sequential(conv(1, 2, seed=6), down_block(rng),
                        cf.Residual(cf.Sequential(conv(3, 3, seed=7), bn(3))),
                        cf.AdaptiveAvgPool2d(1), cf.Flatten(), cf.Linear(3, 2, **F64, seed=8))
    keys = list(net.state_dict())
    assert "1.body.0.weight" in keys and "2.body.1.running_mean" in keys
    x = rng.standard_normal((2, 1, 6, 6))
    w = rng.standard_normal((2, 2))
    net(x)
    dx = net.backward(w)
    assert_grad_close(dx, lambda: float((net(x) * w).sum()), x, rtol=1e-5, atol=1e-7)


def _count_dx(monkeypatch):
    calls = []
    real = functional.ops.conv_backward_data

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(functional.ops, "conv_backward_data", spy)
    return calls


def test_needs_input_grad_false_skips_dx_in_both_branches(rng, monkeypatch):
    block = down_block(rng)
    x = rng.standard_normal((2, 2, 6, 6))
    dy = rng.standard_normal(block(x).shape)
    calls = _count_dx(monkeypatch)
    block.backward(dy)
    assert len(calls) == 3  # conv2 -> bn1, conv1 -> x, shortcut conv -> x
    block.needs_input_grad = False
    assert not block.body[0].needs_input_grad and not block.shortcut[0].needs_input_grad
    block.zero_grad()
    block(x)
    calls.clear()
    assert block.backward(dy) is None
    assert len(calls) == 1  # only conv2's dx, which bn1 needs
    assert np.abs(block.shortcut[0].weight.grad).sum() > 0  # parameters still get grads
    ident = cf.Residual(cf.Sequential(conv(2, 2), bn(2)))
    ident.needs_input_grad = False
    ident(x)
    assert ident.backward(np.ones((2, 2, 6, 6))) is None


def test_rejected_dy_changes_nothing_and_keeps_the_forward(rng):
    block = down_block(rng)
    x = rng.standard_normal((2, 2, 6, 6))
    y = block(x)
    before = {n: p.grad.copy() for n, p in block.named_parameters()}
    with pytest.raises(ValueError, match=r"Residual: dy has shape \(2, 3, 3\)"):
        block.backward(np.ones((2, 3, 3)))
    with pytest.raises(ValueError, match="dtype float32"):
        block.backward(np.ones(y.shape, np.float32))
    with pytest.raises(TypeError, match="Residual: dy must be a NumPy or CuPy array"):
        block.backward(y.tolist())
    for n, p in block.named_parameters():
        np.testing.assert_array_equal(p.grad, before[n])
    assert block.backward(np.ones_like(y)).shape == x.shape
    with pytest.raises(cf.BackwardBeforeForwardError):
        block.backward(np.ones_like(y))


def test_a_layer_that_cannot_run_its_backward_stops_the_block_before_any_write(rng):
    """check_contexts: every layer's own pre-write check (`_check_backward`, e.g. a saved
    context outdated by a parameter update) runs before the block's first gradient write."""
    class Stale(cf.Conv2d):
        def _check_backward(self):
            raise RuntimeError("Stale: parameter changed since the forward")

    block = cf.Residual(cf.Sequential(Stale(2, 2, 3, padding=1, **F64), bn(2)),
                        shortcut=cf.Sequential(conv(2, 2, k=1), bn(2)))
    y = block(rng.standard_normal((2, 2, 4, 4)))
    before = {n: p.grad.copy() for n, p in block.named_parameters()}
    with pytest.raises(RuntimeError, match="Stale: parameter changed"):
        block.backward(np.ones_like(y))
    for n, p in block.named_parameters():
        np.testing.assert_array_equal(p.grad, before[n], err_msg=n)


def test_constructor_errors():
    with pytest.raises(TypeError, match=r"Residual: the body must end with a Conv or BatchNorm"
                                        r" layer .* ends with ReLU"):
        cf.Residual(cf.Sequential(conv(2, 2), cf.ReLU()))
    with pytest.raises(TypeError, match="ends with MaxPool2d"):
        cf.Residual(cf.MaxPool2d(2))
    with pytest.raises(ValueError, match="empty Sequential"):
        cf.Residual(cf.Sequential())
    with pytest.raises(ValueError, match="already applies activation 'relu' before the add"):
        cf.Residual(cf.Sequential(conv(2, 2), bn(2, "relu")))
    with pytest.raises(TypeError, match="Residual: body must be a convfuse layer"):
        cf.Residual(lambda x: x)
    with pytest.raises(TypeError, match="shortcut must be a convfuse layer or None"):
        cf.Residual(conv(2, 2), shortcut="identity")
    with pytest.raises(ValueError, match=r"Residual: activation: .*swoosh"):
        cf.Residual(conv(2, 2), activation="swoosh")
    c = conv(2, 2)
    c.residual_scale = 0.5
    with pytest.raises(ValueError, match=r"residual_scale 0\.5"):
        cf.Residual(c)
    elsewhere = conv(2, 2, k=1)
    elsewhere.device = "cuda"  # as if moved
    with pytest.raises(cf.DeviceMismatchError, match="body and shortcut are on different"):
        cf.Residual(conv(2, 2), shortcut=elsewhere)
    nested = cf.Residual(cf.Sequential(conv(2, 2), cf.Sequential(conv(2, 2), bn(2))))
    assert nested.body[1][1].activation == "relu"


def test_call_errors(rng):
    block = cf.Residual(conv(2, 2)).to("cpu")
    with pytest.raises(TypeError, match="Residual: input must be a NumPy or CuPy array"):
        block([1.0])
    assert "activation='relu'" in repr(block)
    block.device = "cuda"  # as if moved: a NumPy input is then on the wrong device
    with pytest.raises(cf.DeviceMismatchError, match="Residual is on 'cuda' but its input is"):
        block(np.ones((1, 2, 3, 3)))


@pytest.mark.parametrize("act", ["identity", "tanh"])
def test_assigned_activation_is_the_one_the_block_computes(rng, act):
    """Assigning a block's activation after construction takes effect at its next call
    (on the body's last layer, where the add and activation run), as a Conv's does."""
    block = cf.Residual(cf.Sequential(conv(2, 2, bias=True), bn(2)))
    x = rng.standard_normal((2, 2, 4, 4))
    block.activation = act
    assert block.activation == act and block.body[1].activation == act
    assert repr(block).splitlines()[1].strip() == f"activation={act!r}"
    block.body[1].activation = "identity"
    pre = block.body[1](block.body[0](x), residual=x)  # the block's sum before any activation
    block.activation = act
    want = pre if act == "identity" else np.tanh(pre)
    np.testing.assert_allclose(block(x), want, rtol=1e-13, atol=1e-13)
    before = block.activation
    for bad, err in (("swoosh", ValueError), (3, TypeError)):
        with pytest.raises(err, match="Residual: activation: "):
            block.activation = bad
        assert block.activation == before
