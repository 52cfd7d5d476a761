"""convfuse.torch as a drop-in for torch.nn (issue 19): what real scripts do with torch.nn's
layers works the same on convfuse's, checked against torch.nn itself in float64.

In-place ops on outputs (ReLU(inplace=True), `out += identity`) in torch.nn's memory
formats, torch.nn's positional argument order, empty batches, eps checks, unbatched inputs,
the padding modes and even-kernel 'same', num_batches_tracked never read on the host, and
convert() of torchvision-style models (BasicBlock ResNet in channels_last, a VGG-like
Conv-BN-ReLU(inplace) stack, padded and 'same' convolutions) in train, eval and no_grad.
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = nn.functional

import convfuse.ops.reference.conv as ref_conv  # noqa: E402
import convfuse.torch as ct  # noqa: E402

D = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}
CONVS = {1: (ct.Conv1d, nn.Conv1d), 2: (ct.Conv2d, nn.Conv2d), 3: (ct.Conv3d, nn.Conv3d)}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _twins(ours_cls, theirs_cls, *args, **kw):
    ours = ours_cls(*args, dtype=D, **kw)
    theirs = theirs_cls(*args, dtype=D, **kw)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _compare(ours, theirs, x, *, post=lambda y: y, grad=True):
    """Same input to both, `post` applied to each output; outputs, memory formats,
    gradients and buffers equal."""
    xo, xt = x.detach().clone(), x.detach().clone()
    if grad:
        xo.requires_grad_()
        xt.requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own padding='same' copy warning
        yo, yt = post(ours(xo)), post(theirs(xt))
    assert yo.shape == yt.shape and yo.stride() == yt.stride()
    torch.testing.assert_close(yo, yt, **TOL)
    for (name, b), bt in zip(ours.named_buffers(), theirs.buffers()):
        torch.testing.assert_close(b, bt, **TOL, msg=name)
    if grad:
        dy = torch.randn_like(yt)
        (yo * dy).sum().backward()
        (yt * dy).sum().backward()
        torch.testing.assert_close(xo.grad, xt.grad, **TOL)
        for (name, p), pt in zip(ours.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(p.grad, pt.grad, **TOL, msg=name)
    return yo


# --- defect 1: ordinary outputs in torch.nn's memory format --------------------------------

@pytest.mark.parametrize("rank,fmt", [(2, torch.channels_last), (3, torch.channels_last_3d),
                                      (1, None)])
def test_in_place_ops_on_outputs_in_torch_nn_memory_formats(rank, fmt):
    conv, conv_t = _twins(*CONVS[rank], 4, 4, 3, padding=1)
    bn_cls = {1: (ct.BatchNorm1d, nn.BatchNorm1d), 2: (ct.BatchNorm2d, nn.BatchNorm2d),
              3: (ct.BatchNorm3d, nn.BatchNorm3d)}[rank]
    bn, bn_t = _twins(*bn_cls, 4)
    x = torch.randn(2, 4, *[5] * rank, dtype=D)
    # channels_last (or, for 1-d, a transposed (N, L, C) tensor)
    x = x.to(memory_format=fmt) if fmt else x.movedim(1, -1).contiguous().movedim(-1, 1)
    y = _compare(conv, conv_t, x, post=lambda y: y.relu_())
    assert y._base is None
    if rank == 2:
        assert y.is_contiguous(memory_format=torch.channels_last)
    else:  # torch.nn: contiguous for 1-d, and for float64 channels_last_3d
        assert y.is_contiguous() and y.view(2, -1).shape == (2, 4 * 5 ** rank)
    _compare(bn, bn_t, x, post=lambda y: y.add_(x))


def test_weight_in_channels_last_makes_the_output_channels_last_as_torch_nn():
    conv, conv_t = _twins(ct.Conv2d, nn.Conv2d, 3, 4, 3)
    conv.to(memory_format=torch.channels_last)
    conv_t.to(memory_format=torch.channels_last)
    y = _compare(conv, conv_t, torch.randn(2, 3, 6, 6, dtype=D))
    assert y.is_contiguous(memory_format=torch.channels_last)


# --- defect 2: torch.nn's argument order ---------------------------------------------------

def test_positional_arguments_in_torch_nn_order_and_keyword_only_additions():
    conv = ct.Conv2d(2, 4, 3, 1, 1, 1, 1, False, "reflect", "cpu", D)
    assert conv.padding_mode == "reflect" and conv.bias is None and conv.weight.dtype == D
    with pytest.raises(TypeError):
        ct.Conv2d(2, 4, 3, 1, 1, 1, 1, False, "zeros", "cpu", D, "relu")
    with pytest.raises(ValueError, match="Conv2d: padding_mode must be one of"):
        ct.Conv2d(2, 4, 3, 1, 1, 1, 1, True, "relu")  # the old order now names the right one
    bn = ct.BatchNorm2d(3, 1e-3, 0.2, True, True, "cpu", D, activation="relu")
    assert bn.running_mean.dtype == D and bn.activation == "relu" and bn.eps == 1e-3
    with pytest.raises(TypeError):
        ct.BatchNorm2d(3, 1e-3, 0.2, True, True, "cpu", D, "relu")


# --- defect 3: empty batches ---------------------------------------------------------------

@pytest.mark.parametrize("rank", [1, 2, 3])
def test_empty_batch_convolution_as_torch_nn(rank):
    conv, conv_t = _twins(*CONVS[rank], 3, 4, 3, padding=1, padding_mode="reflect")
    y = _compare(conv, conv_t, torch.randn(0, 3, *[5] * rank, dtype=D))
    assert y.shape == (0, 4, *[5] * rank)
    assert torch.equal(conv.weight.grad, torch.zeros_like(conv.weight))
    assert torch.equal(conv.bias.grad, torch.zeros_like(conv.bias))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_empty_batch_batchnorm_as_torch_nn(momentum):
    bn, bn_t = _twins(ct.BatchNorm2d, nn.BatchNorm2d, 3, momentum=momentum)
    for _ in range(2):
        _compare(bn, bn_t, torch.randn(0, 3, 4, 4, dtype=D))
    assert int(bn.num_batches_tracked) == int(bn_t.num_batches_tracked) == 2
    assert torch.equal(bn.running_var, torch.ones(3, dtype=D))  # untouched, as torch.nn
    _compare(bn, bn_t, torch.randn(4, 3, 2, 2, dtype=D))  # then a real batch, same count
    bn.eval()
    bn_t.eval()
    _compare(bn, bn_t, torch.randn(0, 3, 4, 4, dtype=D))


# --- defect 4: eps -------------------------------------------------------------------------

@pytest.mark.parametrize("eps", [0.0, -1e-3])
def test_eps_checked_as_torch_nn(eps):
    ours, theirs = ct.BatchNorm2d(3, eps=eps), nn.BatchNorm2d(3, eps=eps)  # both construct
    x = torch.randn(2, 3, 2, 2)
    with pytest.raises(ValueError, match="BatchNorm2d: eps must be positive"):
        ours(x)
    with pytest.raises(ValueError):
        theirs(x)
    ours.eval()
    theirs.eval()
    try:
        y_ref = theirs(x)
    except ValueError:
        with pytest.raises(ValueError, match="BatchNorm2d: eps must be"):
            ours(x)
    else:
        torch.testing.assert_close(ours(x), y_ref)
    assert int(ours.num_batches_tracked) == 0  # a refused call leaves no state behind


# --- defect 6: unbatched inputs ------------------------------------------------------------

@pytest.mark.parametrize("rank", [1, 2, 3])
def test_unbatched_inputs_as_torch_nn(rank):
    conv, conv_t = _twins(*CONVS[rank], 3, 4, 3, padding="same")
    y = _compare(conv, conv_t, torch.randn(3, *[5] * rank, dtype=D), post=lambda y: y.relu_())
    assert y.shape == (4, *[5] * rank)
    fused = CONVS[rank][0](3, 4, 3, padding="same", dtype=D, activation="relu")
    fused.load_state_dict(conv.state_dict())
    x = torch.randn(3, *[6] * rank, dtype=D)
    res = torch.randn(4, *[6] * rank, dtype=D)
    torch.testing.assert_close(fused(x, residual=res), F.relu(conv_t(x) + res), **TOL)
    with pytest.raises(ValueError, match="residual has shape"):
        fused(x, residual=res.unsqueeze(0))


def test_batchnorm_has_no_unbatched_form_as_torch_nn():
    for ours, theirs, shape in ((ct.BatchNorm2d(3), nn.BatchNorm2d(3), (3, 4, 4)),
                                (ct.BatchNorm3d(3), nn.BatchNorm3d(3), (3, 2, 2, 2))):
        with pytest.raises(ValueError):
            theirs(torch.randn(shape))
        with pytest.raises(ValueError, match=f"{type(ours).__name__}: expected a"):
            ours(torch.randn(shape))


# --- defects 7 and 8: padding modes and even-kernel 'same' --------------------------------

@pytest.mark.parametrize("mode", ["zeros", "reflect", "replicate", "circular"])
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_padding_modes_and_same_padding_forward_and_backward(mode, rank):
    calls = []
    real = ref_conv.conv_bias_act

    def spy(*a):
        calls.append(a[3].padding)
        return real(*a)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ref_conv, "conv_bias_act", spy)
        for kw in ({"padding": 2, "stride": 2}, {"padding": (1, 2, 0)[:rank]},
                   {"padding": "same", "kernel_size": 4, "dilation": 1},
                   {"padding": "same", "kernel_size": 2, "dilation": 3}):
            kw = {"kernel_size": 3, **kw}
            k = kw.pop("kernel_size")
            conv, conv_t = _twins(*CONVS[rank], 2, 3, k, padding_mode=mode, **kw)
            _compare(conv, conv_t, torch.randn(2, 2, *[6] * rank, dtype=D))
            assert repr(conv).count(f"padding_mode={mode}") == (mode != "zeros")
    assert len(calls) == 4  # convfuse ran each convolution


def test_padding_errors_name_the_layer_and_argument_like_torch():
    with pytest.raises(ValueError, match="Conv1d: padding='same' is not supported for strided"):
        ct.Conv1d(2, 2, 3, stride=2, padding="same")
    conv = ct.Conv2d(2, 2, 3, padding=3, padding_mode="reflect")
    x = torch.randn(1, 2, 3, 3)
    with pytest.raises(RuntimeError):
        nn.Conv2d(2, 2, 3, padding=3, padding_mode="reflect")(x)
    for kind in (ValueError, RuntimeError):  # typed: ValueError, and RuntimeError as torch's
        with pytest.raises(kind, match=r"Conv2d: padding=\(3, 3\) with padding_mode='reflect'"):
            conv(x)
    with pytest.raises(ValueError, match=r"Conv2d: .*padding_mode='circular' would wrap"):
        ct.Conv2d(2, 2, 3, padding=3, padding_mode="circular")(torch.randn(1, 2, 2, 2))
    assert ct.Conv2d(2, 2, 3, padding=3, padding_mode="replicate")(x).shape == (1, 2, 7, 7)


# --- issue 18, 7.3: num_batches_tracked stays on the device --------------------------------

@pytest.mark.parametrize("momentum", [0.1, None])
def test_no_host_read_of_num_batches_tracked(monkeypatch, momentum):
    """Every way of reading a tensor's value on the host is made to fail during training
    steps: the count is added to and used on its device only (Note [the cumulative
    average on the device]); the statistics still equal torch.nn's."""
    bn, bn_t = _twins(ct.BatchNorm2d, nn.BatchNorm2d, 3, momentum=momentum)
    xs = [torch.randn(4, 3, 2, 2, dtype=D) for _ in range(3)]
    for x in xs:
        bn_t(x)

    def no_host_read(*_args, **_kw):
        raise AssertionError("a tensor was read on the host")

    with monkeypatch.context() as mp:
        for name in ("item", "tolist", "__int__", "__float__", "__index__", "__bool__"):
            mp.setattr(torch.Tensor, name, no_host_read)
        for x in xs:
            bn(x.clone().requires_grad_()).sum().backward()
    for (name, b), bt in zip(bn.named_buffers(), bn_t.buffers()):
        torch.testing.assert_close(b, bt, rtol=1e-14, atol=1e-14, msg=name)


# --- convert() of torchvision-style models -------------------------------------------------

class BasicBlock(nn.Module):
    """torchvision's BasicBlock, written as torchvision writes it: ReLU(inplace=True) and
    `out += identity`."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


def _resnet():
    return nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8),
                         nn.ReLU(inplace=True), BasicBlock(8, 8), BasicBlock(8, 16, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 3))


def _vgg():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8),
                         nn.ReLU(inplace=True), nn.Conv2d(8, 8, 3, padding=1),
                         nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 3))


def _padded():
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, padding_mode="reflect"),
                         nn.ReLU(inplace=True),
                         nn.Conv2d(6, 6, 3, padding=2, padding_mode="replicate", bias=False),
                         nn.BatchNorm2d(6), nn.ReLU(inplace=True),
                         nn.Conv2d(6, 4, 4, padding="same", padding_mode="circular"),
                         nn.Conv2d(4, 4, 2, padding="same", dilation=3), nn.Flatten(),
                         nn.Linear(4 * 12 * 12, 3))


class _Same1d3d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(2, 4, 4, padding="same")
        self.c3 = nn.Conv3d(2, 4, (2, 3, 4), padding="same", padding_mode="reflect")
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):  # x: (N, 2, 4, 4, 4)
        a = self.bn(self.c1(x.flatten(2)))
        b = self.c3(x).flatten(2)
        return torch.relu_(a + b)


MODELS = {"resnet": (_resnet, (4, 3, 8, 8)), "vgg": (_vgg, (2, 3, 8, 8)),
          "padded": (_padded, (2, 3, 10, 10)), "same1d3d": (_Same1d3d, (3, 2, 4, 4, 4))}


def _check_converted(ref, model, x, *, grad=True, run=None, tol=1e-10):
    """`run` (default: the model itself, e.g. a compiled form of it) against `ref`."""
    xr, xm = x.clone().requires_grad_(grad), x.clone().requires_grad_(grad)
    y_ref, y = ref(xr), (model if run is None else run)(xm)
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    if grad:
        dy = torch.randn_like(y)
        y_ref.backward(dy)
        y.backward(dy)
        torch.testing.assert_close(xm.grad, xr.grad, rtol=10 * tol, atol=tol)
        named = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, named[name].grad, rtol=10 * tol, atol=tol,
                                       msg=name)
    mine = model.state_dict()
    for name, t in ref.state_dict().items():  # parameters and running statistics
        torch.testing.assert_close(mine[name], t, rtol=tol / 100, atol=tol / 100, msg=name)
    for m in (ref, model):
        m.zero_grad()


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("name", list(MODELS))
def test_convert_torchvision_style_models_train_eval_no_grad(name, channels_last):
    build, shape = MODELS[name]
    ref = build().double()
    if channels_last and len(shape) == 4:
        ref = ref.to(memory_format=torch.channels_last)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left to torch.nn here
        ct.convert(model)
    kinds = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    assert not [m for m in model.modules() if type(m) in kinds]
    calls = []
    real = ref_conv.conv_bias_act
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ref_conv, "conv_bias_act", lambda *a: calls.append(1) or real(*a))
        for mode in ("train", "train", "eval", "no_grad-train", "no_grad-eval"):
            x = torch.randn(shape, dtype=D)
            if channels_last:
                x = x.to(memory_format=torch.channels_last) if x.dim() == 4 \
                    else x.movedim(1, -1).contiguous().movedim(-1, 1)
            for m in (ref, model):
                m.train(mode.endswith("train"))
            if mode.startswith("no_grad"):
                with torch.no_grad():
                    _check_converted(ref, model, x, grad=False)
            else:
                _check_converted(ref, model, x)
    assert calls  # convfuse ran


@pytest.mark.slow  # inductor compiles C++ (tens of seconds here); still in the default run
def test_compile_fullgraph_of_converted_models_with_padding_and_in_place_ops():
    """In float32: in float64, torch 2.11's inductor generated C++ for this model (its own
    pad kernels around the opaque convfuse ops) that g++ refused (a vectorised blend of
    doubles); float32 compiles on torch 2.11 and 2.13."""
    torch.manual_seed(0)
    ref = _padded()
    block = BasicBlock(3, 3).to(memory_format=torch.channels_last)
    model, model_block = ct.convert(copy.deepcopy(ref)), ct.convert(copy.deepcopy(block))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    compiled_block = torch.compile(model_block, fullgraph=True)
    for _ in range(2):
        x = torch.randn(2, 3, 10, 10)
        _check_converted(ref, model, x, run=compiled, tol=1e-4)
        _check_converted(block, model_block, x.to(memory_format=torch.channels_last),
                         run=compiled_block, tol=1e-4)
