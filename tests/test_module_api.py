"""The PyTorch-shaped Module API: registration, traversal, state_dict, modes, devices."""

from __future__ import annotations

import numpy as np
import pytest

import convfuse as cf
from convfuse.nn import Layer


def _torch():
    return pytest.importorskip("torch")


def make_net(layout: str = "NCHW") -> cf.Sequential:
    return cf.Sequential(
        cf.Conv2d(2, 4, 3, padding=1, activation="relu", layout=layout, dtype="float64",
                  device="cpu", seed=1),
        cf.MaxPool2d(2, layout=layout),
        cf.Conv2d(4, 6, 3, padding=1, layout=layout, dtype="float64", device="cpu", seed=2),
        cf.Flatten(),
        cf.Linear(6 * 2 * 2, 3, dtype="float64", device="cpu", seed=3),
    )


class Block(Layer):
    """A hand-written block, registered by attribute assignment as in PyTorch."""

    def __init__(self) -> None:
        self.conv1 = cf.Conv2d(2, 2, 3, padding=1, activation="relu", dtype="float64",
                               device="cpu", seed=4)
        self.conv2 = cf.Conv2d(2, 2, 3, padding=1, dtype="float64", device="cpu", seed=5)
        self.register_buffer("scale", np.ones(2))
        self.register_buffer("scratch", np.zeros(3), persistent=False)
        self.device = "cpu"


def test_named_parameters_follow_definition_order_and_pytorch_keys():
    net = make_net()
    names = [n for n, _ in net.named_parameters()]
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert list(net.state_dict()) == names
    block = Block()
    assert [n for n, _ in block.named_parameters()] == [
        "conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"]
    assert [n for n, _ in block.named_buffers()] == ["scale", "scratch"]
    assert list(block.state_dict()) == [
        "scale", "conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"]
    assert [n for n, _ in block.named_children()] == ["conv1", "conv2"]
    assert [n for n, _ in block.named_modules()] == ["", "conv1", "conv2"]
    assert len(list(net.modules())) == 6


def test_a_shared_layer_counts_once_but_saves_under_each_name():
    """parameters() lists a shared layer's once; state_dict() has its entries under each
    name it is reachable by, as torch.nn's does (a checkpoint of such a torch model loads
    strictly)."""
    torch = pytest.importorskip("torch")
    conv = cf.Conv2d(1, 1, 1, device="cpu")
    net = cf.Sequential(conv, conv)
    assert len(net.parameters()) == 2
    tconv = torch.nn.Conv2d(1, 1, 1)
    expected = list(torch.nn.Sequential(tconv, tconv).state_dict())
    assert expected == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert list(net.state_dict()) == expected
    sd = {k: v.detach().numpy() for k, v in torch.nn.Sequential(tconv, tconv).state_dict().items()}
    assert net.load_state_dict(sd) == ([], [])
    np.testing.assert_array_equal(conv.weight.data, tconv.weight.detach().numpy())
    # a checkpoint naming the shared layer once (convfuse's own, before) loads strictly,
    # by either of its names
    for prefix in ("0.", "1."):
        once = {k: v + 1 for k, v in sd.items() if k.startswith(prefix)}
        assert net.load_state_dict(once) == ([], [])
        np.testing.assert_array_equal(conv.bias.data, once[prefix + "bias"])
    with pytest.raises(cf.StateDictError, match=r"missing key\(s\) in state_dict: "
                                                r"'0\.bias', '1\.bias'"):
        net.load_state_dict({k: v for k, v in sd.items() if not k.endswith("bias")})


def test_assigning_a_non_parameter_to_a_parameter_name_is_refused():
    conv = cf.Conv2d(1, 1, 1, device="cpu")
    with pytest.raises(TypeError, match="cannot assign ndarray as parameter 'weight'"):
        conv.weight = np.zeros((1, 1, 1, 1), np.float32)
    conv.bias = None  # None is allowed, as in PyTorch
    assert [n for n, _ in conv.named_parameters()] == ["weight"]
    with pytest.raises(TypeError, match="buffer 'scale' must be a NumPy or CuPy array"):
        Block().scale = [1.0, 2.0]


def test_state_dict_is_a_copy_in_pytorch_layout():
    net = make_net()
    sd = net.state_dict()
    sd["0.weight"][...] = 0
    assert np.abs(net[0].weight.data).sum() > 0
    nhwc = cf.Conv2d(3, 5, (2, 3), layout="NHWC", dtype="float64", device="cpu", seed=7)
    assert nhwc.weight.shape == (5, 2, 3, 3)
    assert nhwc.state_dict()["weight"].shape == (5, 3, 2, 3)
    np.testing.assert_array_equal(nhwc.state_dict()["weight"],
                                  np.moveaxis(nhwc.weight.data, -1, 1))


def test_state_dict_round_trip_gives_identical_outputs(rng):
    a, b = make_net(), make_net()
    for p in b.parameters():
        p.data[...] = rng.standard_normal(p.shape)
    x = rng.standard_normal((2, 2, 4, 4))
    assert not np.allclose(a(x), b(x))
    result = b.load_state_dict(a.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    np.testing.assert_array_equal(a(x), b(x))


def test_nhwc_model_loads_nchw_checkpoint(rng):
    src, dst = make_net("NCHW"), make_net("NHWC")
    dst.load_state_dict(src.state_dict())
    x = rng.standard_normal((2, 2, 4, 4))
    y_nchw = src(x)
    y_nhwc = dst(np.ascontiguousarray(x.transpose(0, 2, 3, 1)))
    # Flatten sees different orders, so compare at the last conv instead.
    a = src[2](src[1](src[0](x)))
    b = dst[2](dst[1](dst[0](np.ascontiguousarray(x.transpose(0, 2, 3, 1)))))
    np.testing.assert_allclose(b, a.transpose(0, 2, 3, 1), rtol=1e-12, atol=1e-12)
    assert y_nchw.shape == y_nhwc.shape
    np.testing.assert_array_equal(dst.state_dict()["2.weight"], src.state_dict()["2.weight"])


def test_load_errors_name_every_key_and_load_nothing(rng):
    net = make_net()
    before = {k: v.copy() for k, v in net.state_dict().items()}
    sd = {k: rng.standard_normal(v.shape) for k, v in before.items()}
    sd["2.weight"] = np.zeros((1, 2, 3))
    sd["4.bias"] = np.zeros(3, dtype=np.complex128)
    del sd["0.bias"]
    sd["9.weight"] = np.zeros(1)
    with pytest.raises(cf.StateDictError) as info:
        net.load_state_dict(sd)
    msg = str(info.value)
    for needle in ("size mismatch for 2.weight", "(1, 2, 3)", "(6, 4, 3, 3)",
                   "dtype mismatch for 4.bias", "'0.bias'", "'9.weight'"):
        assert needle in msg
    assert isinstance(info.value, RuntimeError)
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(v, before[k])


def test_non_strict_load_reports_keys_and_loads_the_rest(rng):
    net = make_net()
    sd = net.state_dict()
    new_w = rng.standard_normal(sd["0.weight"].shape)
    sd = {"0.weight": new_w, "extra": np.zeros(1)}
    result = net.load_state_dict(sd, strict=False)
    assert result.unexpected_keys == ["extra"]
    assert "0.bias" in result.missing_keys and "0.weight" not in result.missing_keys
    np.testing.assert_array_equal(net[0].weight.data, new_w)


def test_load_refuses_non_mappings_and_non_arrays():
    net = make_net()
    with pytest.raises(TypeError, match="expects a mapping"):
        net.load_state_dict([1, 2])
    sd = net.state_dict()
    sd["0.bias"] = "zeros"
    with pytest.raises(cf.StateDictError, match=r"state_dict\['0.bias'\] is a str"):
        net.load_state_dict(sd)


def test_load_writes_in_place_so_the_optimizer_keeps_training(rng):
    net = make_net()
    opt = cf.optim.SGD(net.parameters(), lr=0.1)
    target = {k: rng.standard_normal(v.shape) for k, v in net.state_dict().items()}
    net.load_state_dict(target)
    x = rng.standard_normal((2, 2, 4, 4))
    net.backward(np.ones_like(net(x)))
    before = net[4].weight.data.copy()
    opt.step()
    np.testing.assert_allclose(net[4].weight.data, before - 0.1 * net[4].weight.grad)


def test_train_eval_and_devices():
    net = make_net()
    assert net.training and all(m.training for m in net.modules())
    assert net.eval() is net and not any(m.training for m in net.modules())
    net.train()
    assert all(m.training for m in net.modules())
    with pytest.raises(TypeError, match="mode must be a bool"):
        net.train("yes")
    assert net.cpu() is net and net[0].weight.device == "cpu"
    if not cf.gpu_available():
        with pytest.raises(cf.DeviceUnavailableError):
            net.cuda()


def test_sequential_passes_residual_to_its_last_layer(rng):
    from tests.gradcheck import assert_grad_close

    body = cf.Sequential(
        cf.Conv2d(2, 3, 3, padding=1, activation="relu", dtype="float64", device="cpu", seed=1),
        cf.Conv2d(3, 2, 3, padding=1, activation="relu", dtype="float64", device="cpu", seed=2),
    )
    x = rng.standard_normal((2, 2, 5, 5))
    r = rng.standard_normal((2, 2, 5, 5))
    y = body(x, residual=r)
    ref = body[1](body[0](x), residual=r)
    np.testing.assert_array_equal(y, ref)
    w = rng.standard_normal(y.shape)
    body(x, residual=r)
    dx, dres = body.backward(w)

    def loss():
        return float(np.sum(body(x, residual=r) * w))

    assert_grad_close(dx, loss, x, rtol=1e-6, atol=1e-8)
    assert_grad_close(dres, loss, r, rtol=1e-6, atol=1e-8)
    with pytest.raises(TypeError, match="takes no residual"):
        cf.Sequential(cf.Conv2d(2, 2, 1, device="cpu"), cf.Flatten())(
            np.zeros((1, 2, 2, 2), np.float32), residual=np.zeros((1, 8), np.float32))


def test_needs_input_grad_skips_the_first_dx_only(rng):
    net, ref = make_net(), make_net()
    net.needs_input_grad = False
    assert net[0].needs_input_grad is False and net[2].needs_input_grad is True
    x = rng.standard_normal((2, 2, 4, 4))
    dy = rng.standard_normal((2, 3))
    net(x)
    ref(x)
    assert net.backward(dy) is None
    assert ref.backward(dy) is not None
    for p, q in zip(net.parameters(), ref.parameters()):
        np.testing.assert_array_equal(p.grad, q.grad)


def test_pytorch_state_dict_loads_and_matches_pytorch_outputs(rng):
    torch = _torch()
    tnet = torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(4, 6, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(24, 3),
    ).double()
    net = cf.Sequential(
        cf.Conv2d(2, 4, 3, padding=1, activation="relu", dtype="float64", device="cpu"),
        cf.Identity(),
        cf.MaxPool2d(2),
        cf.Conv2d(4, 6, 3, padding=1, dtype="float64", device="cpu"),
        cf.Flatten(),
        cf.Linear(24, 3, dtype="float64", device="cpu"),
    ) if hasattr(cf, "Identity") else None
    if net is None:
        pytest.skip("Identity layer not available")
    net.load_state_dict({k: v.numpy() for k, v in tnet.state_dict().items()})
    x = rng.standard_normal((2, 2, 4, 4))
    np.testing.assert_allclose(net(x), tnet(torch.from_numpy(x)).detach().numpy(),
                               rtol=1e-12, atol=1e-12)
    # torch tensors load directly too (through __array__).
    net.load_state_dict(tnet.state_dict())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bfloat16_torch_tensors_load(dtype):
    """NumPy has no bfloat16, so a CPU torch.bfloat16 tensor crosses neither __array__ nor
    DLPack: its bytes are read as bfloat16 (exactly), into a bfloat16 layer or converted
    into a float32 one; a transposed view too."""
    torch = _torch()
    torch.manual_seed(0)
    ref = torch.nn.Conv2d(3, 4, 3).to(torch.bfloat16)
    layer = cf.Conv2d(3, 4, 3, dtype=dtype, device="cpu", seed=1)
    state = ref.state_dict()
    layer.load_state_dict(state)
    for name in ("weight", "bias"):
        got = np.asarray(getattr(layer, name).data, np.float32)
        np.testing.assert_array_equal(got, state[name].float().numpy())
    lin = cf.Linear(3, 4, dtype=dtype, device="cpu", seed=1)
    w = torch.randn(3, 4).to(torch.bfloat16)
    lin.load_state_dict({"weight": w.t(), "bias": torch.zeros(4, dtype=torch.bfloat16)})
    np.testing.assert_array_equal(np.asarray(lin.weight.data, np.float32), w.t().float().numpy())


def test_a_hand_written_block_without_its_own_context_works_inside_sequential(rng):
    class Head(Layer):
        def __init__(self) -> None:
            self.conv = cf.Conv2d(2, 3, 3, padding=1, dtype="float64", device="cpu", seed=1)
            self.device = "cpu"

        def __call__(self, x):
            return self.conv(x)

        def backward(self, dy):
            return self.conv.backward(dy)

    net = cf.Sequential(Head(), cf.Flatten())
    x = rng.standard_normal((2, 2, 4, 4))
    with pytest.raises(cf.BackwardBeforeForwardError, match=r"Sequential\.backward"):
        net.backward(np.ones((2, 48)))
    with pytest.raises(cf.BackwardBeforeForwardError, match=r"Conv2d\.backward"):
        net[0]._check_backward()  # no forward yet: the block's child says so
    y = net(x)
    dx = net.backward(np.ones_like(y))
    ref = cf.Conv2d(2, 3, 3, padding=1, dtype="float64", device="cpu", seed=1)
    ref(x)
    np.testing.assert_array_equal(dx, ref.backward(np.ones((2, 3, 4, 4))))


def test_replacing_a_child_or_parameter_keeps_its_place():
    """torch.nn's dicts keep a replaced entry where it was: a Sequential's children order is
    its forward's, so moving a replaced layer to the end would run the layers in another
    order."""
    x = np.random.default_rng(0).standard_normal((1, 3, 4, 4)).astype(np.float32)
    seq = cf.Sequential(cf.Conv2d(3, 3, 1, device="cpu", seed=0), cf.ReLU())
    new = cf.Conv2d(3, 3, 1, device="cpu", seed=1)
    seq.add_module("0", new)
    assert [n for n, _ in seq.named_children()] == ["0", "1"]
    np.testing.assert_array_equal(seq(x), np.maximum(new(x), 0))
    other = cf.Conv2d(3, 3, 1, device="cpu", seed=2)
    setattr(seq, "0", other)
    seq[-1] = cf.Identity()
    assert [type(m) for m in seq] == [cf.Conv2d, cf.Identity] and seq[0] is other
    np.testing.assert_array_equal(seq(x), other(x))
    conv = seq[0]
    conv.weight = cf.Parameter(np.zeros((3, 3, 1, 1), np.float32))
    assert list(conv.state_dict()) == ["weight", "bias"]
    conv.register_buffer("stat", np.zeros(2))
    conv.register_buffer("stat", np.ones(2))
    assert list(conv.state_dict()) == ["weight", "bias", "stat"]


def test_sequential_setitem_refusals():
    seq = cf.Sequential(cf.ReLU(), cf.ReLU())
    with pytest.raises(IndexError, match="Sequential: index 2 is out of range for 2 layers"):
        seq[2] = cf.ReLU()
    with pytest.raises(TypeError, match=r"Sequential.__setitem__: int is not a convfuse layer"):
        seq[0] = 3
    with pytest.raises(TypeError, match="Sequential: index must be an int, got str"):
        seq["0"] = cf.ReLU()
    assert [type(m) for m in seq] == [cf.ReLU, cf.ReLU]


def test_sequential_setitem_at_the_front_keeps_needs_input_grad():
    x = np.random.default_rng(0).standard_normal((1, 1, 3, 3)).astype(np.float32)
    seq = cf.Sequential(cf.Conv2d(1, 1, 1, device="cpu"), cf.ReLU())
    seq.needs_input_grad = False  # fed by data: no dx
    seq[-2] = cf.Conv2d(1, 1, 1, device="cpu", seed=3)
    assert seq[0].needs_input_grad is False
    later = cf.ReLU()
    later.needs_input_grad = False
    seq[1] = later  # not the first: its input gradient is the first layer's dy
    assert later.needs_input_grad is True
    seq(x)
    assert seq.backward(np.ones((1, 1, 3, 3), np.float32)) is None


@pytest.mark.parametrize("name, error", [
    ("a.b", KeyError), ("", KeyError), ("weight", KeyError), ("forward", KeyError),
    ("training", KeyError), (2, TypeError),
])
def test_add_module_refuses_names_torch_nn_refuses_and_changes_nothing(name, error):
    # "a.b" beside a child a holding b would give two layers one state_dict key; "weight"
    # would drop the parameter; an int was registered before the TypeError
    torch = pytest.importorskip("torch")
    layer = cf.Linear(2, 2, device="cpu")
    before = (list(layer.state_dict()), [n for n, _ in layer.named_children()])
    with pytest.raises(error):
        layer.add_module(name, cf.ReLU())
    with pytest.raises((KeyError, TypeError)):  # torch.nn's verdict on the same name
        torch.nn.Linear(2, 2).add_module(name, torch.nn.ReLU())
    assert (list(layer.state_dict()), [n for n, _ in layer.named_children()]) == before
    assert layer.weight is not None and len(list(layer.parameters())) == 2


@pytest.mark.parametrize("name", ["weight", "forward", "training"])
def test_register_buffer_does_not_take_over_another_attribute(name):
    torch = pytest.importorskip("torch")
    layer = cf.Conv2d(1, 1, 1, device="cpu")
    with pytest.raises(KeyError, match=f"attribute '{name}' already exists"):
        layer.register_buffer(name, np.zeros(1, np.float32))
    with pytest.raises(KeyError):
        torch.nn.Conv2d(1, 1, 1).register_buffer(name, torch.zeros(1))
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
    layer.register_buffer("extra", np.zeros(1, np.float32))
    layer.register_buffer("extra", np.ones(1, np.float32))  # its own name: replaced
    assert [n for n, _ in layer.named_buffers()] == ["extra"]


def test_to_the_device_a_model_is_on_keeps_its_pending_backward(rng):
    # torch.nn: model.cpu() between forward and backward changes nothing on a CPU model
    torch = pytest.importorskip("torch")
    # parameter-free layers (following their input, device None) around the conv too
    model = cf.Sequential(cf.ReLU(), cf.Conv2d(1, 2, 3, dtype="float64", device="cpu", seed=0),
                          cf.MaxPool2d(1))
    ref = torch.nn.Conv2d(1, 2, 3).double()
    ref.weight.data = torch.tensor(model[1].weight.data)
    ref.bias.data = torch.tensor(model[1].bias.data)
    x = rng.standard_normal((1, 1, 5, 5))
    y = model(x)
    model.cpu()
    model.to("cpu")
    model.backward(np.ones_like(y))
    ref(torch.tensor(x).relu()).sum().backward()
    np.testing.assert_allclose(model[1].weight.grad, ref.weight.grad.numpy(), rtol=1e-12)
