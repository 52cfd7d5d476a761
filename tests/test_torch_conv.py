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


def _both(make, change, x, **tol):
    """make(module) built the same in torch.nn and convfuse.torch (the same parameters),
    changed alike, called on x: the outputs and input gradients agree."""
    torch.manual_seed(0)
    theirs = make(torch.nn)
    ours = make(ct)
    ours.load_state_dict(theirs.state_dict())
    change(theirs)
    change(ours)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = theirs(xa), ours(xb)
    torch.testing.assert_close(yb, ya, **tol)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    torch.testing.assert_close(xb.grad, xa.grad, **tol)
    return ours


def _set(**values):
    def change(m):
        for k, v in values.items():
            setattr(m, k, v)
    return change


@pytest.mark.parametrize("make, values", [
    (lambda M: M.Conv2d(4, 6, 3, dtype=torch.float64), dict(stride=2)),
    (lambda M: M.Conv2d(4, 6, 3, dtype=torch.float64), dict(dilation=2, padding=2)),
    (lambda M: M.Conv1d(4, 6, 3, dtype=torch.float64), dict(stride=[2])),
    (lambda M: M.ConvTranspose2d(4, 6, 3, dtype=torch.float64), dict(stride=2)),
    (lambda M: M.ConvTranspose2d(4, 6, 3, dtype=torch.float64),
     dict(stride=(2, 2), output_padding=1)),
    (lambda M: M.ConvTranspose2d(4, 6, 3, dtype=torch.float64), dict(dilation=2)),
])
def test_hyperparameters_assigned_as_ints_after_construction(make, values):
    """torch.nn takes `conv.stride = 2` (an int where the constructor made a tuple): so does
    convfuse, at the next call, with torch.nn's result."""
    x = torch.randn(2, 4, 9) if "Conv1d" in repr(make(torch.nn)) else torch.randn(2, 4, 9, 9)
    _both(make, _set(**values), x.double(), rtol=1e-12, atol=1e-12)


def test_an_invalid_assigned_stride_is_refused_naming_the_layer():
    conv = ct.Conv2d(4, 6, 3)
    conv.stride = 0
    with pytest.raises(ValueError,
                       match=r"^Conv2d: stride and dilation must be >= 1 and < 2\*\*31, got 0"):
        conv(torch.randn(1, 4, 5, 5))
    conv.stride = (1, 2, 3)
    with pytest.raises(ValueError, match=r"^Conv2d: stride must be an int or 2 ints"):
        conv(torch.randn(1, 4, 5, 5))


@pytest.mark.parametrize("padding, kernel, size", [("same", 5, 9), (1, 5, 9), (0, 1, 2)])
def test_a_swapped_weight_sets_the_kernel_as_in_torch_nn(padding, kernel, size):
    """torch.nn's convolution reads the kernel off the weight, not `kernel_size`: a weight
    of another kernel size assigned after construction (model surgery) computes with it,
    its 'same' padding and its output shape included."""
    weight = torch.randn(6, 4, kernel, kernel, dtype=torch.float64)

    def swap(m):
        m.weight = torch.nn.Parameter(weight.clone())

    ours = _both(lambda M: M.Conv2d(4, 6, 3, padding=padding, dtype=torch.float64), swap,
                 torch.randn(2, 4, size, size, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    out = ours.output_shape((2, 4, size, size))
    r = torch.randn(out, dtype=torch.float64)  # a residual of that shape is taken
    torch.testing.assert_close(ours(torch.zeros(2, 4, size, size, dtype=torch.float64),
                                    residual=r), r + ours.bias.view(1, -1, 1, 1))


def test_dtype_and_device_refusals_are_torch_nns_runtime_errors_too():
    """Code written for torch.nn catches RuntimeError; convfuse's own classes still say
    TypeError / DeviceMismatchError."""
    from convfuse.errors import DeviceMismatchError

    cases = [
        (torch.nn.Conv2d(4, 6, 3), ct.Conv2d(4, 6, 3), torch.randn(1, 4, 5, 5).double()),
        (torch.nn.Conv2d(4, 6, 3), ct.Conv2d(4, 6, 3), torch.ones(1, 4, 5, 5, dtype=torch.int64)),
        (torch.nn.ConvTranspose2d(4, 6, 3), ct.ConvTranspose2d(4, 6, 3),
         torch.randn(1, 4, 5, 5).double()),
        (torch.nn.BatchNorm2d(4), ct.BatchNorm2d(4), torch.randn(2, 4, 5, 5).double()),
        (torch.nn.ConvTranspose2d(4, 6, 3, output_padding=1), ct.ConvTranspose2d(
            4, 6, 3, output_padding=1), torch.randn(1, 4, 5, 5)),
    ]
    for theirs, ours, x in cases:
        with pytest.raises(RuntimeError):
            theirs(x)
        with pytest.raises(RuntimeError, match=f"^{type(ours).__name__}: "):
            ours(x)
    with pytest.raises(TypeError):
        ct.Conv2d(4, 6, 3)(torch.randn(1, 4, 5, 5).double())
    on_meta = torch.randn(1, 4, 5, 5, device="meta")
    for layer in (ct.Conv2d(4, 6, 3), ct.BatchNorm2d(4)):
        with pytest.raises(DeviceMismatchError, match="input is on meta"):
            layer(on_meta)
        with pytest.raises(RuntimeError):
            layer(on_meta)
    conv = ct.Conv2d(4, 6, 3)
    with pytest.raises(ct.InputTypeError, match=r"residual is torch\.float64 on cpu"):
        conv(torch.randn(1, 4, 5, 5), residual=torch.randn(1, 6, 3, 3).double())


def test_numpy_integers_for_counts_as_torch_nn():
    """A count read off an array's shape is a NumPy integer: torch.nn takes it, so does
    convfuse (stored as int); a bool is still refused."""
    conv = ct.Conv2d(np.int64(4), np.int32(6), 3, groups=np.int64(2))
    ref = torch.nn.Conv2d(np.int64(4), np.int32(6), 3, groups=np.int64(2))
    assert (conv.in_channels, conv.out_channels, conv.groups) == (4, 6, 2)
    assert type(conv.in_channels) is int and conv.weight.shape == ref.weight.shape
    bn = ct.BatchNorm2d(np.int64(3), eps=np.float32(1e-3), momentum=np.float64(0.2))
    assert bn.num_features == 3 and bn.running_mean.shape == (3,)
    with pytest.raises(ValueError, match=r"^Conv2d: in_channels must be a positive int"):
        ct.Conv2d(True, 6, 3)
    with pytest.raises(TypeError, match=r"^BatchNorm2d: momentum must be a number or None"):
        ct.BatchNorm2d(3, momentum="0.1")


@pytest.mark.parametrize("make", [
    lambda M: M.Conv2d(2, 2, 3, padding=(1, 2)), lambda M: M.Conv3d(2, 2, 3, padding=1),
    lambda M: M.Conv1d(2, 2, 4, padding="same"), lambda M: M.Conv2d(2, 2, 3, padding="valid"),
    lambda M: M.ConvTranspose2d(2, 2, 3, padding=(1, 2)), lambda M: M.ConvTranspose1d(2, 2, 3),
])
def test_reversed_padding_attribute_is_torch_nns(make):
    """Code that pads by hand reads _reversed_padding_repeated_twice: the same value and
    type as torch.nn's."""
    ours, theirs = make(ct), make(torch.nn)
    assert ours._reversed_padding_repeated_twice == theirs._reversed_padding_repeated_twice
    assert type(ours._reversed_padding_repeated_twice) is \
        type(theirs._reversed_padding_repeated_twice)


def test_a_model_on_the_meta_device_infers_shapes_as_torch_nn():
    """A model built on torch.device("meta") (shape inference, deferred initialisation)
    runs the custom ops' fake kernels: meta outputs and gradients of torch.nn's shapes."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8),
                                    torch.nn.ReLU(), torch.nn.ConvTranspose2d(8, 4, 3, 2))
        ref = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8),
                                  torch.nn.ReLU(), torch.nn.ConvTranspose2d(8, 4, 3, 2))
    ct.convert(model)
    assert isinstance(model[0], ct.Conv2d) and isinstance(model[3], ct.ConvTranspose2d)
    x = torch.randn(2, 3, 8, 8, device="meta", requires_grad=True)
    y = model(x)
    assert y.device.type == "meta" and y.shape == ref(x).shape == (2, 4, 13, 13)
    y.sum().backward()
    assert x.grad.device.type == "meta" and x.grad.shape == x.shape
    assert model[0].weight.grad.shape == model[0].weight.shape
    model.eval()
    assert model(x).shape == (2, 4, 13, 13)


def _with_dtypes(layer, **dtypes):
    for name, dtype in dtypes.items():
        param = getattr(layer, name)
        if isinstance(param, torch.nn.Parameter):
            setattr(layer, name, torch.nn.Parameter(param.detach().to(dtype)))
        else:
            setattr(layer, name, param.to(dtype))
    return layer


@pytest.mark.parametrize("make", [
    lambda: (torch.nn.Conv2d(4, 6, 3), ct.Conv2d(4, 6, 3), torch.randn(1, 4, 5, 5),
             {"bias": torch.float64}),
    lambda: (torch.nn.ConvTranspose2d(4, 6, 3), ct.ConvTranspose2d(4, 6, 3),
             torch.randn(1, 4, 5, 5), {"bias": torch.float16}),
    # batch norm: the input's dtype throughout, or float32 throughout beside half data
    lambda: (torch.nn.BatchNorm2d(4), ct.BatchNorm2d(4), torch.randn(2, 4, 3, 3).half(),
             {"running_mean": torch.float16, "running_var": torch.float16}),
    lambda: (torch.nn.BatchNorm2d(4), ct.BatchNorm2d(4), torch.randn(2, 4, 3, 3).half(),
             {"weight": torch.float16, "bias": torch.float16}),
    lambda: (torch.nn.BatchNorm2d(4), ct.BatchNorm2d(4), torch.randn(2, 4, 3, 3).bfloat16(),
             {"bias": torch.bfloat16}),
])
def test_a_parameter_of_another_dtype_is_refused_as_torch_nn_refuses_it(make):
    """A bias (or batch-norm statistic) in another dtype than the layer's others: torch.nn's
    RuntimeError, as convfuse's InputTypeError naming the layer and the tensor, before
    anything runs (it was an untyped engine error, or silently accepted)."""
    from convfuse.torch import InputTypeError

    theirs, ours, x, dtypes = make()
    _with_dtypes(theirs, **dtypes)
    _with_dtypes(ours, **dtypes)
    if not isinstance(theirs, torch.nn.ConvTranspose2d):  # torch's CPU one casts (PYTORCH.md)
        with pytest.raises(RuntimeError):
            theirs(x)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with pytest.raises(InputTypeError, match=f"^{type(ours).__name__}: .*(bias|running|weight)"):
        ours(x)
    for k, v in ours.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


@pytest.mark.parametrize("make", [
    lambda: (torch.nn.Conv2d(3, 4, 3), ct.Conv2d(3, 4, 3), (2, 3, 8, 8)),
    lambda: (torch.nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"),
             ct.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (2, 3, 8, 8)),
    lambda: (torch.nn.ConvTranspose2d(3, 4, 3, stride=2),
             ct.ConvTranspose2d(3, 4, 3, stride=2), (2, 3, 5, 5)),
])
def test_a_spectral_norm_parametrization_runs_once_per_call(make):
    """torch.nn.utils.parametrizations.spectral_norm on a convfuse layer: one power
    iteration per call, as on torch.nn's (the layer reads its weight in several places,
    each read ran one: u and v drifted from torch.nn's)."""
    from torch.nn.utils.parametrizations import spectral_norm

    theirs, ours, shape = make()
    theirs, ours = theirs.double(), ours.double()
    ours.load_state_dict(theirs.state_dict())
    torch.manual_seed(0)
    theirs = spectral_norm(theirs)
    torch.manual_seed(0)
    # torch.nn picks dim=1 for its own transposed convolutions by isinstance (PYTORCH.md)
    ours = spectral_norm(ours, dim=1 if isinstance(theirs, torch.nn.ConvTranspose2d) else 0)
    for _ in range(3):
        x = torch.randn(shape, dtype=torch.float64)
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-12, atol=1e-12)
    sn_ours, sn_theirs = ours.parametrizations.weight[0], theirs.parametrizations.weight[0]
    torch.testing.assert_close(sn_ours._u, sn_theirs._u, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sn_ours._v, sn_theirs._v, rtol=1e-12, atol=1e-12)


def test_a_parametrized_batch_norm_weight_is_computed_once_per_call():
    from torch.nn.utils import parametrize

    class Counting(torch.nn.Module):
        calls = 0

        def forward(self, w):
            Counting.calls += 1
            return w * 1.0

    ours = ct.BatchNorm2d(3)
    parametrize.register_parametrization(ours, "weight", Counting())
    Counting.calls = 0  # registering ran it once
    for i, shape in enumerate([(2, 3, 4, 4), (2, 3, 4, 4), (4, 3, 2, 2)]):
        ours(torch.randn(shape))
        assert Counting.calls == i + 1
    ours.eval()
    ours(torch.randn(2, 3, 4, 4))
    assert Counting.calls == 4
