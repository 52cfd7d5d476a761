"""Linear, MaxPool2d, AvgPool2d, Flatten and Sequential on the CPU engine."""

from __future__ import annotations

import math

import numpy as np
import pytest

import convfuse as cf
from convfuse.errors import BackwardBeforeForwardError, DeviceMismatchError
from tests.gradcheck import assert_grad_close


def test_linear_forward_is_matmul_plus_bias_then_activation(rng):
    layer = cf.Linear(7, 5, activation="tanh", dtype="float64", device="cpu", seed=1)
    x = rng.standard_normal((4, 7))
    expect = np.tanh(x @ layer.weight.data.T + layer.bias.data)
    np.testing.assert_allclose(layer(x), expect, rtol=1e-12)
    bound = 1 / math.sqrt(7)
    assert np.abs(layer.weight.data).max() <= bound and layer.weight.shape == (5, 7)


@pytest.mark.parametrize("act,bias", [("identity", True), ("relu", False), ("gelu", True)])
def test_linear_gradients(act, bias, rng):
    layer = cf.Linear(6, 3, bias=bias, activation=act, dtype="float64", device="cpu", seed=2)
    x = rng.standard_normal((5, 6))
    r = rng.standard_normal((5, 3))
    layer(x)
    dx = layer.backward(r)

    def loss():
        return float(np.sum(layer(x) * r))

    assert_grad_close(dx, loss, x)
    assert_grad_close(layer.weight.grad, loss, layer.weight.data)
    if bias:
        assert_grad_close(layer.bias.grad, loss, layer.bias.data)
    else:
        assert layer.bias is None and len(layer.parameters()) == 1


def test_linear_in_torch_nn_positional_order_is_told_where_device_goes():
    with pytest.raises(ValueError, match=r"^Linear: activation 'cpu' is a device; pass "
                                         r"device='cpu' by keyword"):
        cf.Linear(5, 4, True, "cpu")  # torch.nn's 4th positional argument is device


def test_linear_rejects_bad_input(rng):
    layer = cf.Linear(6, 3, device="cpu")
    with pytest.raises(ValueError, match=r"expects input of shape \(\*, 6\)"):
        layer(np.zeros((2, 5), dtype=np.float32))
    with pytest.raises(ValueError, match="dtype"):
        layer(np.zeros((2, 6), dtype=np.float64))
    layer(np.zeros((2, 6), dtype=np.float32))
    with pytest.raises(ValueError, match="dy has shape"):
        layer.backward(np.zeros((3, 3), dtype=np.float32))


def blocks(x, k):
    n, c, h, w = x.shape
    return x[:, :, : h // k * k, : w // k * k].reshape(n, c, h // k, k, w // k, k)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_maxpool_and_avgpool_forward(layout, rng):
    x = rng.standard_normal((2, 3, 6, 7))
    xin = np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if layout == "NHWC" else x
    back = (lambda a: a.transpose(0, 3, 1, 2)) if layout == "NHWC" else (lambda a: a)
    np.testing.assert_allclose(back(cf.MaxPool2d(2, layout=layout)(xin)),
                               blocks(x, 2).max(axis=(3, 5)))
    np.testing.assert_allclose(back(cf.AvgPool2d(2, layout=layout)(xin)),
                               blocks(x, 2).mean(axis=(3, 5)), rtol=1e-12)


@pytest.mark.parametrize("cls,kw", [(cf.MaxPool2d, dict(kernel_size=3, stride=2, padding=1)),
                                    (cf.AvgPool2d, dict(kernel_size=(2, 3), stride=1, padding=1))])
def test_pool_gradients(cls, kw, rng):
    pool = cls(**kw)
    x = rng.standard_normal((2, 2, 6, 5))
    y = pool(x)
    r = rng.standard_normal(y.shape)
    dx = pool.backward(r)
    assert_grad_close(dx, lambda: float(np.sum(pool(x) * r)), x, max_entries=60)
    pool.backward(r)  # consumes the last forward of the gradient check
    with pytest.raises(BackwardBeforeForwardError):
        pool.backward(r)


def test_pool_rejects_bad_hyperparameters():
    with pytest.raises(ValueError):
        cf.MaxPool2d(2, padding=2)  # padding must be at most half the kernel (PyTorch's rule)
    with pytest.raises(ValueError):
        cf.AvgPool2d(0)
    with pytest.raises(ValueError, match="4-d input"):
        cf.MaxPool2d(2)(np.zeros((2, 3, 4)))


@pytest.mark.parametrize("name, args, kwargs", [
    ("MaxPool2d", (3, 2, 1, 1, False, False), {}),  # torch.nn's positional order
    ("MaxPool2d", (3,), {"dilation": (1, 1), "return_indices": False, "ceil_mode": False}),
    ("AvgPool2d", (3, 2, 1, False, True, None), {}),
    ("AvgPool2d", (3,), {"stride": 2, "padding": 1, "count_include_pad": True}),
])
def test_pools_take_torch_nn_arguments_at_the_values_they_compute(rng, name, args, kwargs):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((2, 3, 7, 6))
    pool = getattr(cf, name)(*args, **kwargs)
    ref = getattr(torch.nn, name)(*args, **kwargs)
    np.testing.assert_allclose(pool(x), ref(torch.from_numpy(x)).numpy(), rtol=1e-14)
    def pair(v):  # dilation: an int or a pair, as given to torch.nn
        return (v, v) if isinstance(v, int) and not isinstance(v, bool) else v

    for attr in pool._fixed:  # torch.nn's attributes, at their values
        assert pair(getattr(pool, attr)) == pair(getattr(ref, attr))


@pytest.mark.parametrize("name, kwargs", [
    ("MaxPool2d", {"dilation": 2}), ("MaxPool2d", {"return_indices": True}),
    ("MaxPool2d", {"ceil_mode": True}), ("AvgPool2d", {"ceil_mode": True}),
    ("AvgPool2d", {"count_include_pad": False}), ("AvgPool2d", {"divisor_override": 4}),
])
def test_pools_refuse_torch_nn_arguments_they_do_not_compute(name, kwargs):
    (arg, value), = kwargs.items()
    with pytest.raises(ValueError, match=rf"^{name}: {arg}={value!r} is not supported"):
        getattr(cf, name)(2, **kwargs)
    pool = getattr(cf, name)(2)
    with pytest.raises(ValueError, match=rf"^{name}: {arg}={value!r} is not supported"):
        setattr(pool, arg, value)  # not silently ignored
    with pytest.raises(TypeError):  # layout is keyword-only: torch.nn's 4th is another
        getattr(cf, name)(2, 2, 0, "NHWC", False, True, None, "NHWC")


def make_net(seed=0, dtype="float64"):
    return cf.Sequential(
        cf.Conv2d(1, 4, 3, padding=1, activation="relu", dtype=dtype, device="cpu", seed=seed),
        cf.MaxPool2d(2),
        cf.Conv2d(4, 6, 3, padding=1, activation="silu", dtype=dtype, device="cpu", seed=seed + 1),
        cf.AvgPool2d(2),
        cf.Flatten(),
        cf.Linear(6 * 2 * 2, 3, dtype=dtype, device="cpu", seed=seed + 2),
    )


def test_sequential_end_to_end_gradients(rng):
    net = make_net()
    x = rng.standard_normal((3, 1, 8, 8))
    r = rng.standard_normal((3, 3))
    net(x)
    dx = net.backward(r)

    def loss():
        return float(np.sum(net(x) * r))

    assert_grad_close(dx, loss, x, rtol=1e-5, atol=1e-7)
    for p in net.parameters():
        assert_grad_close(p.grad, loss, p.data, rtol=1e-5, atol=1e-7, max_entries=10)
    assert len(net.parameters()) == 6 and len(net) == 6
    net.zero_grad()
    assert all(not p.grad.any() for p in net.parameters())


def test_flatten_round_trip_and_sequential_checks(rng):
    flat = cf.Flatten()
    x = rng.standard_normal((2, 3, 4))
    y = flat(x)
    assert y.shape == (2, 12) and np.shares_memory(y, x)
    np.testing.assert_array_equal(flat.backward(y), x)
    with pytest.raises(TypeError, match="is not a layer"):
        cf.Sequential(cf.Flatten(), "relu")


@pytest.mark.parametrize("dims", [(), (0,), (1, 2), (-3, -2), (2, -1), (0, -1)])
def test_flatten_takes_torch_nn_dims(rng, dims):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((2, 3, 4, 5))
    flat, ref = cf.Flatten(*dims), torch.nn.Flatten(*dims)
    y = flat(x)
    assert y.shape == tuple(ref(torch.from_numpy(x)).shape) and np.shares_memory(y, x)
    np.testing.assert_array_equal(y, ref(torch.from_numpy(x)).numpy())
    np.testing.assert_array_equal(flat.backward(y), x)
    assert repr(flat) == repr(ref)


@pytest.mark.parametrize("dims", [(), (1, 2), (0,)])
def test_flatten_of_a_channels_last_input_takes_torchs_order(rng, dims):
    """Flatten(layout="NHWC") flattens (N, H, W, C) in PyTorch's (N, C, H, W) order, as
    torch.nn.Flatten flattens a channels_last tensor; its gradient comes back channels-last
    and C-contiguous."""
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((2, 3, 4, 5))  # NCHW
    nhwc = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    flat, ref = cf.Flatten(*dims, layout="NHWC"), torch.nn.Flatten(*dims)
    want = ref(torch.from_numpy(x).to(memory_format=torch.channels_last)).numpy()
    y = flat(nhwc)
    np.testing.assert_array_equal(y, want)
    dy = rng.standard_normal(y.shape)
    dx = flat.backward(dy)
    np.testing.assert_array_equal(dx, dy.reshape(x.shape).transpose(0, 2, 3, 1))
    assert dx.flags.c_contiguous
    assert repr(flat).endswith("layout='NHWC')")
    with pytest.raises(ValueError, match="Flatten: unknown layout 'CHWN'"):
        cf.Flatten(layout="CHWN")
    with pytest.raises(TypeError, match=r"Flatten: layout must be a str .* got int 4"):
        cf.Flatten(layout=4)


def test_a_checkpoint_moves_between_layouts_through_flatten(rng):
    """The same model in NCHW and NHWC, one state dict: the same logits (the Linear after
    Flatten sees PyTorch's feature order in both)."""
    def net(layout):
        return cf.Sequential(
            cf.Conv2d(1, 4, 3, padding=1, activation="relu", layout=layout, dtype="float64",
                      seed=0),
            cf.MaxPool2d(2, layout=layout), cf.Flatten(layout=layout),
            cf.Linear(4 * 3 * 3, 5, dtype="float64", seed=1))

    a, b = net("NCHW"), net("NHWC")
    b.load_state_dict(a.state_dict())
    x = rng.standard_normal((2, 1, 6, 6))
    ya, yb = a(x), b(np.ascontiguousarray(x.transpose(0, 2, 3, 1)))
    np.testing.assert_allclose(yb, ya, rtol=1e-13, atol=1e-13)
    a.backward(np.ones_like(ya))
    b.backward(np.ones_like(yb))
    np.testing.assert_allclose(b[0].weight.grad, a[0].weight.grad.transpose(0, 2, 3, 1),
                               rtol=1e-13, atol=1e-13)


def test_flatten_refuses_dims_the_input_lacks():
    x = np.zeros((2, 3))
    with pytest.raises(IndexError, match=r"Flatten: start_dim 2 is out of range .*\(2, 3\)"):
        cf.Flatten(2)(x)
    with pytest.raises(IndexError, match="Flatten: start_dim 1 is out of range"):
        cf.Flatten()(np.zeros(3))  # torch.nn's IndexError too
    with pytest.raises(ValueError, match="start_dim 1 comes after end_dim 0"):
        cf.Flatten(1, 0)(x)
    with pytest.raises(TypeError, match="Flatten: end_dim must be an int, got float"):
        cf.Flatten(1, -1.0)


def test_a_flatten_pickled_before_its_arguments_existed_still_runs(rng):
    import pickle

    flat = cf.Flatten()
    for name in ("start_dim", "end_dim"):
        del flat.__dict__[name]  # as an older convfuse pickled it
    flat = pickle.loads(pickle.dumps(flat))
    x = rng.standard_normal((2, 3, 4))
    assert flat(x).shape == (2, 12) and repr(flat) == "Flatten(start_dim=1, end_dim=-1)"


def test_sequential_takes_named_layers_and_slices_keep_their_names(rng):
    torch = pytest.importorskip("torch")
    layers = {"conv": cf.Conv2d(1, 2, 3, dtype="float64", seed=0), "flat": cf.Flatten(),
              "fc": cf.Linear(2, 3, dtype="float64", seed=1)}
    model = cf.Sequential(layers)
    assert [name for name, _ in model.named_children()] == ["conv", "flat", "fc"]
    assert list(model.state_dict()) == ["conv.weight", "conv.bias", "fc.weight", "fc.bias"]
    x = rng.standard_normal((2, 1, 3, 3))
    np.testing.assert_array_equal(model(x), layers["fc"](layers["flat"](layers["conv"](x))))
    part = model[1:]
    assert list(part.state_dict()) == ["fc.weight", "fc.bias"]
    ref = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(),
                              torch.nn.Linear(2, 3))
    assert list(cf.Sequential(*model)[1:].state_dict()) == list(ref[1:].state_dict())
    with pytest.raises(ValueError, match=r"Sequential: 'a\.b' cannot name a layer"):
        cf.Sequential({"a.b": cf.Flatten()})
    for taken in ("forward", "training", "device", "_ctx_value", "_calls"):
        with pytest.raises(ValueError, match=f"'{taken}' cannot name a layer"):
            cf.Sequential({taken: cf.Flatten()})
    with pytest.raises(TypeError, match="layer names must be str, got int"):
        cf.Sequential({0: cf.Flatten()})
    if not cf.gpu_available():
        with pytest.raises(cf.DeviceUnavailableError):
            make_net().to("cuda")


def test_layer_refuses_input_from_another_device(monkeypatch):
    layer = cf.Conv2d(1, 1, 1, device="cpu")
    layer.device = "cuda"  # as if the layer had moved; the input stays on the CPU
    with pytest.raises(DeviceMismatchError, match="is on 'cuda' but its input is on 'cpu'"):
        layer(np.zeros((1, 1, 2, 2), dtype=np.float32))


def test_needs_input_grad_of_a_sequential_is_its_first_layers(rng):
    """A slice, or a Sequential built around a layer that computes no input gradient, says
    so (its backward returns None); the flag set on an empty one reaches its first layer."""
    model = cf.Sequential(cf.Conv2d(1, 2, 3, seed=0), cf.ReLU(), cf.Conv2d(2, 2, 1, seed=1))
    model.needs_input_grad = False
    head = model[0:2]
    assert head.needs_input_grad is False and model[1:].needs_input_grad is True
    assert cf.Sequential(model[0]).needs_input_grad is False
    y = head(rng.standard_normal((1, 1, 4, 4)).astype(np.float32))
    assert head.backward(np.ones_like(y)) is None
    empty = cf.Sequential()
    empty.needs_input_grad = False
    empty.append(cf.ReLU())
    assert empty.needs_input_grad is False and empty[0].needs_input_grad is False


def test_a_layer_added_after_the_first_passes_its_input_gradient_on(rng):
    """A layer whose own default is needs_input_grad=False (a ResNet's) placed after another
    in a Sequential computes its input gradient: the layers before it need it."""
    torch = pytest.importorskip("torch")
    first = cf.Conv2d(1, 2, 1, dtype="float64", device="cpu", seed=0)
    second = cf.Conv2d(2, 2, 3, padding=1, dtype="float64", device="cpu", seed=1)
    second.needs_input_grad = False
    model = cf.Sequential(first, second)
    assert second.needs_input_grad is True
    x = rng.standard_normal((2, 1, 4, 4))
    dy = rng.standard_normal((2, 2, 4, 4))
    model(x)
    model.backward(dy)
    xt = torch.tensor(x)
    w1, b1 = (torch.tensor(a).requires_grad_() for a in (first.weight.data, first.bias.data))
    w2, b2 = (torch.tensor(a) for a in (second.weight.data, second.bias.data))
    torch.nn.functional.conv2d(torch.nn.functional.conv2d(xt, w1, b1), w2, b2,
                               padding=1).backward(torch.tensor(dy))
    np.testing.assert_allclose(first.weight.grad, w1.grad.numpy(), rtol=1e-12)
    appended = cf.Sequential(cf.ReLU())
    late = cf.Conv2d(2, 2, 1, device="cpu")
    late.needs_input_grad = False
    appended.append(late)
    assert late.needs_input_grad is True


def test_a_later_layer_set_to_compute_no_input_gradient_is_refused_before_any_write(rng):
    model = cf.Sequential(cf.Conv2d(1, 2, 1, device="cpu", seed=0),
                          cf.Conv2d(2, 2, 1, device="cpu", seed=1))
    y = model(rng.standard_normal((1, 1, 3, 3)).astype(np.float32))
    model[1].needs_input_grad = False  # after construction
    with pytest.raises(ValueError, match=r"^Sequential: layer 1 \(Conv2d\) has "
                                         r"needs_input_grad=False"):
        model.backward(np.ones_like(y))
    assert all(not p.grad.any() for p in model.parameters())  # nothing written
    model[1].needs_input_grad = True
    model.backward(np.ones_like(y))  # the forward's context was kept
    assert model[0].weight.grad.any()


def test_a_residual_whose_branch_computes_no_input_gradient_is_refused_before_any_write(rng):
    body = cf.Sequential(cf.Conv2d(2, 2, 3, padding=1, device="cpu", seed=0))
    block = cf.Residual(body)
    body[0].needs_input_grad = False  # the block's own flag still says True
    y = block(rng.standard_normal((1, 2, 3, 3)).astype(np.float32))
    with pytest.raises(ValueError, match=r"^Residual: the body's first layer"):
        block.backward(np.ones_like(y))
    assert all(not p.grad.any() for p in block.parameters())


def test_a_blocks_later_body_layer_set_to_compute_no_input_gradient_is_refused(rng):
    """A ResNet BasicBlock's body is a list of layers, not a Sequential: the block checks
    them itself, before any gradient is written."""
    from convfuse.models.resnet import BasicBlock

    block = BasicBlock(4, 4, device="cpu", seed=0)
    y = block(rng.standard_normal((2, 4, 3, 3)).astype(np.float32))
    block.conv2.needs_input_grad = False
    with pytest.raises(ValueError, match=r"^BasicBlock: a body layer after the first "
                                         r"\(Conv2d\) has needs_input_grad=False"):
        block.backward(np.ones_like(y))
    assert all(not p.grad.any() for p in block.parameters())
