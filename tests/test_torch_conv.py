"""convfuse.torch.Conv1d/2d/3d on the CPU: gradients (gradcheck, float64), equivalence with
torch.nn + the activation, layouts, dtypes, which convfuse ops ran, and input errors."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import convfuse.ops.reference.activation as ref_act  # noqa: E402
import convfuse.ops.reference.conv as ref_conv  # noqa: E402
import convfuse.torch as ct  # noqa: E402
from convfuse.activations import ACTIVATIONS  # noqa: E402

TORCH_ACT = {
    "identity": lambda z: z, "relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "elu": F.elu, "relu6": F.relu6, "leaky_relu": lambda z: F.leaky_relu(z, 0.01),
    "silu": F.silu, "gelu": F.gelu,
}
LAYERS = {1: (ct.Conv1d, torch.nn.Conv1d), 2: (ct.Conv2d, torch.nn.Conv2d),
          3: (ct.Conv3d, torch.nn.Conv3d)}
MEMORY_FORMAT = {2: torch.channels_last, 3: torch.channels_last_3d}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _pair(rank, cin, cout, k, act, dtype=torch.float64, bias=True, **kw):
    """A convfuse layer and the equal torch.nn layer (same parameters)."""
    ours = LAYERS[rank][0](cin, cout, k, bias=bias, activation=act, dtype=dtype, **kw)
    theirs = LAYERS[rank][1](cin, cout, k, bias=bias, dtype=dtype, **kw)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _input(rank, n, c, size, dtype=torch.float64, channels_last=False):
    x = torch.randn(n, c, *([size] * rank), dtype=dtype)
    if channels_last:
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)  # channels-last strides, any rank
    return x.requires_grad_()


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_gradcheck_every_activation(act, residual):
    layer, _ = _pair(2, 2, 3, 3, act, padding=1)
    x = _input(2, 1, 2, 4)
    args = (x, torch.randn(1, 3, 4, 4, dtype=torch.float64, requires_grad=True)) \
        if residual else (x,)
    assert torch.autograd.gradcheck(lambda *a: layer(*a), args)
    # the parameters too: gradcheck through a functional call with them as inputs
    w = layer.weight.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_()

    def f(w, b, *a):
        return torch.func.functional_call(layer, {"weight": w, "bias": b}, a)

    assert torch.autograd.gradcheck(f, (w, b, *args))


GEOMETRIES = [
    # rank, cin, cout, k, stride, padding, dilation, groups, channels_last, activation
    (1, 4, 6, 3, 2, 1, 1, 2, False, "tanh"),
    (1, 3, 2, 2, 1, 0, 2, 1, True, "gelu"),
    (2, 4, 4, 3, 2, 1, 1, 4, False, "silu"),
    (2, 4, 6, (3, 2), (1, 2), (1, 0), (2, 1), 2, True, "relu"),
    (2, 3, 4, 3, 1, 2, 2, 1, True, "elu"),
    (3, 2, 4, 2, 1, 1, 1, 2, False, "sigmoid"),
    (3, 2, 3, 2, (1, 2, 1), (0, 1, 1), 1, 1, True, "leaky_relu"),
]


@pytest.mark.parametrize("geo", GEOMETRIES, ids=lambda g: f"{g[0]}d-g{g[7]}-cl{int(g[8])}")
def test_gradcheck_and_equivalence_geometry_grid(geo):
    rank, cin, cout, k, stride, padding, dilation, groups, cl, act = geo
    kw = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    ours, theirs = _pair(rank, cin, cout, k, act, **kw)
    x = _input(rank, 2, cin, 5, channels_last=cl)
    y = ours(x)
    res = torch.randn_like(y).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, r: ours(a, r), (x, res))
    # equal to torch.nn + activation, outputs and every gradient
    y = ours(x, res)
    y_ref = TORCH_ACT[act](theirs(x) + res)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, res, ours.weight, ours.bias], dy)
    want = torch.autograd.grad(y_ref, [x, res, theirs.weight, theirs.bias], dy)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    # torch.nn's memory format: channels-last in, channels-last out for 2-d (and float32
    # 3-d); contiguous for 1-d and float64 3-d, as torch.nn returns (so y.view works)
    ref = theirs(x)
    assert y._base is None and y.stride() == ref.stride()
    if cl and rank == 2:
        assert y.is_contiguous(memory_format=torch.channels_last)
    if rank != 2:
        assert y.is_contiguous()


@pytest.mark.parametrize("act", ["relu", "silu", "identity"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_float32_equivalence_with_torch_nn(act, channels_last):
    ours, theirs = _pair(2, 8, 16, 3, act, dtype=torch.float32, padding=1, stride=2)
    x = _input(2, 4, 8, 9, torch.float32, channels_last)
    y, y_ref = ours(x), TORCH_ACT[act](theirs(x))
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, ours.weight, ours.bias], dy)
    want = torch.autograd.grad(y_ref, [x, theirs.weight, theirs.bias], dy)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_bfloat16_and_float16_on_the_cpu():
    for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float16, 3e-3)):
        ours, _ = _pair(2, 4, 8, 3, "relu", dtype=dtype, padding=1)
        x = torch.randn(2, 4, 6, 6).to(dtype).requires_grad_()
        y = ours(x)
        assert y.dtype == dtype
        w, b = ours.weight.detach().double(), ours.bias.detach().double()
        x64 = x.detach().double().requires_grad_()
        y_ref = F.relu(F.conv2d(x64, w, b, padding=1))
        torch.testing.assert_close(y.double(), y_ref, rtol=tol, atol=tol)
        y.sum().backward()
        y_ref.sum().backward()
        assert x.grad.dtype == dtype and ours.weight.grad.dtype == dtype
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol, atol=10 * tol)


def test_no_bias_and_state_dict_and_init_match_torch_nn():
    torch.manual_seed(3)
    ours = ct.Conv2d(3, 5, (3, 1), stride=2, groups=1, activation="relu")
    torch.manual_seed(3)
    theirs = torch.nn.Conv2d(3, 5, (3, 1), stride=2)
    assert set(ours.state_dict()) == set(theirs.state_dict()) == {"weight", "bias"}
    for k, v in ours.state_dict().items():
        assert torch.equal(v, theirs.state_dict()[k])  # same initialisation, draw for draw
    nb = ct.Conv2d(3, 5, 3, bias=False)
    assert nb.bias is None and list(nb.state_dict()) == ["weight"]
    nb.load_state_dict(torch.nn.Conv2d(3, 5, 3, bias=False).state_dict())
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    nb64 = ct.Conv2d(3, 5, 3, bias=False, activation="tanh", dtype=torch.float64)
    assert torch.autograd.gradcheck(nb64, (x,))


def test_only_the_gradients_autograd_asks_for(monkeypatch):
    calls = {"data": 0, "filter": 0, "bias": 0, "act_bias": 0}

    def spy(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(ref_conv, "conv_backward_data", spy("data", ref_conv.conv_backward_data))
    monkeypatch.setattr(ref_conv, "conv_backward_filter",
                        spy("filter", ref_conv.conv_backward_filter))
    monkeypatch.setattr(ref_conv, "conv_backward_bias", spy("bias", ref_conv.conv_backward_bias))
    monkeypatch.setattr(ref_act, "activation_backward_bias",
                        spy("act_bias", ref_act.activation_backward_bias))
    first = ct.Conv2d(2, 4, 3, padding=1, activation="relu")
    second = ct.Conv2d(4, 4, 3, padding=1)
    x = torch.randn(2, 2, 5, 5)  # no requires_grad: the first layer computes no dx
    second(first(x)).sum().backward()
    assert calls == {"data": 1, "filter": 2, "bias": 1, "act_bias": 1}
    # frozen weights: dx and the bias gradient only
    for k in calls:
        calls[k] = 0
    second.weight.requires_grad_(False)
    first.requires_grad_(False)
    xg = x.clone().requires_grad_()
    second(first(xg)).sum().backward()
    assert calls == {"data": 2, "filter": 0, "bias": 1, "act_bias": 0}
    assert xg.grad is not None and second.bias.grad is not None


def test_channels_last_is_zero_copy(monkeypatch):
    seen = {}
    real = ref_conv.conv_bias_act

    def spy(x, w, b, geom, *rest):
        seen["x_ptr"], seen["layout"] = x.ctypes.data, geom.layout
        y, z = real(x, w, b, geom, *rest)
        seen["y_ptr"] = y.ctypes.data
        return y, z

    monkeypatch.setattr(ref_conv, "conv_bias_act", spy)
    layer = ct.Conv2d(4, 8, 3, padding=1, activation="relu").to(memory_format=torch.channels_last)
    x = torch.randn(2, 4, 6, 6).to(memory_format=torch.channels_last)
    y = layer(x)
    assert seen["layout"] == "NHWC"
    assert seen["x_ptr"] == x.data_ptr()          # the input's memory, no copy
    assert seen["y_ptr"] == y.data_ptr()          # the engine's output is the tensor's memory
    assert y.is_contiguous(memory_format=torch.channels_last)
    y2 = layer(x.contiguous())  # a channels_last weight makes torch.nn's output channels_last
    assert seen["layout"] == "NHWC" and y2.is_contiguous(memory_format=torch.channels_last)
    y3 = layer.to(memory_format=torch.contiguous_format)(x.contiguous())
    assert seen["layout"] == "NCHW" and y3.is_contiguous()
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(y, y3)


def test_errors_name_the_layer_and_argument():
    with pytest.raises(ValueError, match="Conv2d: padding_mode must be one of"):
        ct.Conv2d(2, 2, 3, padding_mode="mirror")
    with pytest.raises(ValueError, match="Conv2d: padding='same' is not supported for strided"):
        ct.Conv2d(2, 2, 3, stride=2, padding="same")
    with pytest.raises(ValueError, match="Conv2d: invalid padding string 'full'"):
        ct.Conv2d(2, 2, 3, padding="full")
    with pytest.raises(ValueError, match=r"Conv2d: .*divisible by groups"):
        ct.Conv2d(3, 4, 3, groups=2)
    with pytest.raises(ValueError, match="Conv2d: unknown activation"):
        ct.Conv2d(2, 2, 3, activation="softplus")
    with pytest.raises(TypeError, match=r"Conv1d: dtype torch\.int32"):
        ct.Conv1d(2, 2, 3, dtype=torch.int32)
    layer = ct.Conv2d(2, 3, 3)
    with pytest.raises(ValueError, match="Conv2d: input has 5 channels"):
        layer(torch.randn(1, 5, 4, 4))
    with pytest.raises(ValueError, match=r"Conv2d: expected a 3-d \(unbatched\) or 4-d"):
        layer(torch.randn(2, 4))
    with pytest.raises(TypeError, match=r"Conv2d: input dtype torch\.float64"):
        layer(torch.randn(1, 2, 4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="Conv2d: residual has shape"):
        layer(torch.randn(1, 2, 4, 4), torch.randn(1, 3, 4, 4))
    with pytest.raises(ValueError, match="kernel larger than the padded input"):
        layer(torch.randn(1, 2, 2, 2))


def test_same_padding_and_repr():
    ours, theirs = _pair(2, 2, 3, 3, "relu", padding="same", dilation=2)
    x = _input(2, 1, 2, 7)
    torch.testing.assert_close(ours(x), F.relu(theirs(x)))
    assert "activation='relu'" in repr(ours) and "dilation=(2, 2)" in repr(ours)


def test_numpy_side_sees_bfloat16_through_an_int16_view():
    from convfuse.torch._arrays import to_array, to_tensor

    t = torch.randn(3, 4).to(torch.bfloat16)
    a = to_array(t)
    assert a.dtype.name == "bfloat16" and a.ctypes.data == t.data_ptr()
    np.testing.assert_array_equal(a.astype(np.float32), t.float().numpy())
    back = to_tensor(a)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == t.data_ptr()


@pytest.mark.parametrize("case", ["cl-input", "cl-weight", "1d-transposed", "3d-cl-float64"])
def test_opcheck_fake_layouts_match_the_real_ops(case):
    """torch.library.opcheck of both conv ops: schema, the fake implementations' shapes
    and strides (torch.nn's memory format) against the real ones, and AOT dispatch."""
    rank = {"1d-transposed": 1, "3d-cl-float64": 3}.get(case, 2)
    x = torch.randn(2, 3, *[5] * rank, dtype=torch.float64)
    w = torch.randn(4, 3, *[3] * rank, dtype=torch.float64)
    if case == "cl-weight":
        w = w.to(memory_format=torch.channels_last)
    else:
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    b = torch.randn(4, dtype=torch.float64)
    hyper = ([1] * rank, [1] * rank, [1] * rank, 1)
    y, z = torch.ops.convfuse.conv_bias_act(x, w, b, None, *hyper, "silu")
    ref = F.conv2d if rank == 2 else F.conv1d if rank == 1 else F.conv3d
    assert y.stride() == ref(x, w, b, 1, 1).stride() and y._base is None
    torch.library.opcheck(torch.ops.convfuse.conv_bias_act, (x, w, b, None, *hyper, "silu"))
    torch.library.opcheck(torch.ops.convfuse.conv_bias_act_backward,
                          (torch.randn_like(y), x, w, z, *hyper, "silu", True, True, True,
                           True))
