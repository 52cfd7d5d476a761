"""convfuse.torch.convert on the model zoos' own layer classes: subclasses of torch.nn's convs
and batch norms that keep torch.nn's forward (torchvision's Conv3DSimple), timm's
BatchNormAct2d, Conv2dSame, StdConv2d, ScaledStdConv2d and their Same variants. Each is
checked against the unconverted module in float64 (outputs, input and parameter gradients,
and parameters and running statistics after an SGD step, train and eval); what stays is
warned about with its reason; and torchvision, timm and MONAI models built without weights
leave at most 1% of their convolutions and batch norms to torch.nn."""

from __future__ import annotations

import collections
import copy
import functools
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import convfuse.torch as ct  # noqa: E402
from convfuse.torch import zoo_layers  # noqa: E402
from tests._zoo import import_monai, import_timm, import_torchvision  # noqa: E402

_TORCH_KINDS = (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm)
_CONVFUSE_KINDS = (ct.Conv1d, ct.Conv2d, ct.Conv3d, ct.ConvTranspose1d, ct.ConvTranspose2d,
                   ct.ConvTranspose3d, ct.BatchNorm1d, ct.BatchNorm2d, ct.BatchNorm3d)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: torch's thread pool only adds contention on a shared machine (float64
    depthwise convolutions took seconds instead of milliseconds with two threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _step(ref: nn.Module, model: nn.Module, x: torch.Tensor, tol: float = 1e-10,
          forward=None) -> None:
    """One forward/backward/SGD step on both (the same RNG state before each forward, for
    dropout; `forward` runs `model`, itself by default): equal outputs, input and parameter
    gradients, and afterwards equal parameters and buffers (running statistics)."""
    xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(7)
    y_ref = ref(xr)
    torch.manual_seed(7)
    y = (forward or model)(xm)
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    dy = torch.randn_like(y)
    y_ref.backward(dy)
    y.backward(dy)
    torch.testing.assert_close(xm.grad, xr.grad, rtol=tol, atol=tol)
    named = dict(ref.named_parameters())
    mine = dict(model.named_parameters())
    assert list(mine) == list(named)
    for name, p in mine.items():
        torch.testing.assert_close(p.grad, named[name].grad, rtol=tol, atol=tol, msg=name)
    for m in (ref, model):
        if named:
            torch.optim.SGD(m.parameters(), lr=1e-2).step()
            m.zero_grad()
    state = model.state_dict()
    assert list(state) == list(ref.state_dict())
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=tol, atol=tol, msg=name)


def _agree(ref: nn.Module, shapes: list[tuple[int, ...]], tol: float = 1e-10,
           modes: tuple[bool, ...] = (True, True, False)) -> nn.Module:
    """convert() of a deep copy of `ref` (float64), then _step in each mode and shape."""
    ref = ref.double()
    model = ct.convert(copy.deepcopy(ref))
    for train in modes:
        ref.train(train)
        model.train(train)
        for shape in shapes:
            _step(ref, model, torch.randn(shape, dtype=torch.float64), tol)
    return model


def _convert_warned(model: nn.Module) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ct.convert(model)
    return [str(w.message) for w in caught]


# --- subclasses of torch.nn's layers --------------------------------------------------------

class _KeepsForward(nn.Conv2d):
    """Only __init__ differs (torchvision's Conv3DSimple is this kind)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(cin, cout, 3, padding=1, bias=False)


class _OwnForward(nn.Conv2d):
    def forward(self, x):
        return super().forward(x) * 2


class _OwnConvForward(nn.Conv2d):
    def _conv_forward(self, x, weight, bias):
        return super()._conv_forward(x, weight.flip(-1), bias)


class _ExtraParameter(nn.Conv2d):
    def __init__(self) -> None:
        super().__init__(2, 2, 1)
        self.scale = nn.Parameter(torch.ones(1))


class _KeepsBatchNorm(nn.BatchNorm2d):
    pass


class _OwnBatchNorm(nn.BatchNorm2d):
    def forward(self, x):
        return super().forward(x).clamp(min=0)


class _KeepsTranspose(nn.ConvTranspose2d):
    pass


class _Symmetric(nn.Module):
    def forward(self, w):
        return (w + w.flip(-1)) / 2


def test_subclasses_keeping_torch_forward_convert_with_the_same_numbers():
    torch.manual_seed(0)
    ref = nn.Sequential(_KeepsForward(2, 4), _KeepsBatchNorm(4), nn.ReLU(),
                        _KeepsTranspose(4, 3, 3, stride=2), nn.SiLU())
    model = _agree(ref, [(2, 2, 5, 5)])
    assert [type(m) for m in model] == [ct.Conv2d, ct.BatchNorm2d, nn.Identity,
                                        ct.ConvTranspose2d, nn.Identity]
    assert model[1].activation == "relu" and model[3].activation == "silu"
    assert model[0].weight is not None and model[0].bias is None
    conv = _KeepsForward(2, 3)
    fused = ct.fused_conv(conv, "relu")
    assert isinstance(fused, ct.Conv2d) and fused.weight is conv.weight


def test_a_subclass_convfuse_would_change_stays_with_a_warning_naming_it_and_why():
    conv = nn.Conv2d(2, 2, 1)
    conv.register_forward_hook(lambda m, i, o: None)
    parametrized = nn.Conv2d(2, 2, 3)
    torch.nn.utils.parametrize.register_parametrization(parametrized, "weight", _Symmetric())
    seq = nn.Sequential(_OwnForward(2, 2, 1), _OwnConvForward(2, 2, 1), _ExtraParameter(),
                        _OwnBatchNorm(2), conv, parametrized, nn.LazyBatchNorm2d(),
                        nn.Conv2d(2, 2, 1))
    texts = _convert_warned(seq)
    assert [type(m) for m in seq][:7] == [_OwnForward, _OwnConvForward, _ExtraParameter,
                                          _OwnBatchNorm, nn.Conv2d, type(parametrized),
                                          nn.LazyBatchNorm2d]
    assert isinstance(seq[7], ct.Conv2d)
    reasons = [
        "_OwnForward has its own forward (_OwnForward.forward), which convfuse's Conv2d "
        "would not run",
        "_OwnConvForward has its own _conv_forward (_OwnConvForward._conv_forward)",
        "_ExtraParameter holds ['scale'] beyond",
        "_OwnBatchNorm has its own forward (_OwnBatchNorm.forward), which convfuse's "
        "BatchNorm2d would not run",
        "Conv2d has forward hooks, which convfuse's layer would not run",
        "ParametrizedConv2d's weight is parametrized (torch.nn.utils.parametrize)",
        "no fused layer for LazyBatchNorm2d, a lazy module",
    ]
    assert len(texts) == len(reasons)  # one per layer left, none for the one converted
    for text, reason in zip(texts, reasons):
        assert text.startswith("convfuse.torch.convert: kept ") and reason in text, text
    with pytest.warns(UserWarning, match="_OwnForward has its own forward"):
        assert ct.fused_conv(_OwnForward(2, 2, 1)) is None
    assert ct.fused_conv(nn.BatchNorm2d(2)) is None  # another family: no conv, no warning


def test_torchvision_conv3d_subclasses_convert():
    tv = import_torchvision()
    from torchvision.models.video.resnet import Conv3DNoTemporal, Conv3DSimple

    torch.manual_seed(1)
    ref = nn.Sequential(Conv3DSimple(2, 3, None, 1, 1), nn.ReLU(),
                        Conv3DNoTemporal(3, 2, None, 2, 1))
    model = _agree(ref, [(1, 2, 3, 4, 4)], modes=(True, False))
    assert [type(m) for m in model] == [ct.Conv3d, nn.Identity, ct.Conv3d]
    r3d = tv.models.video.r3d_18()
    assert _convert_warned(r3d) == []
    assert sum(isinstance(m, ct.Conv3d) for m in r3d.modules()) == 20
    assert not any(isinstance(m, _TORCH_KINDS) for m in r3d.modules())


# --- timm's layers ---------------------------------------------------------------------------

def _timm_layers():
    """timm.layers, which holds BatchNormAct2d, Conv2dSame, (Scaled)StdConv2d(Same)."""
    return import_timm().layers


@pytest.mark.parametrize("kwargs, activation, kept", [
    ({}, "relu", ()),
    ({"act_layer": nn.SiLU, "momentum": None}, "silu", ()),
    ({"apply_act": False, "affine": False}, "identity", ()),
    ({"act_layer": nn.Hardswish}, "identity", ("act",)),  # convfuse has no hardswish
    ({"drop_layer": functools.partial(nn.Dropout, 0.25)}, "identity", ("drop", "act")),
    ({"act_layer": nn.GELU, "track_running_stats": False}, "gelu", ()),
])
def test_timm_batchnorm_act(kwargs, activation, kept):
    BatchNormAct2d = _timm_layers().BatchNormAct2d
    torch.manual_seed(2)
    ref = BatchNormAct2d(3, **kwargs)
    if ref.affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-0.5, 0.5)
    fused = _agree(ref, [(4, 3, 3, 5)])
    assert type(fused) is zoo_layers.BatchNormAct2d and fused.activation == activation
    for name in ("drop", "act"):
        module, theirs = getattr(fused, name), getattr(ref, name)
        assert type(module) is (type(theirs) if name in kept else nn.Identity)
        assert name not in kept or type(theirs) is not nn.Identity
    assert fused.running_mean is None or fused.num_batches_tracked.item() == 2


def test_timm_batchnorm_acts_act_with_a_hook_is_kept_and_its_hook_runs():
    BatchNormAct2d = _timm_layers().BatchNormAct2d
    torch.manual_seed(2)
    ref = BatchNormAct2d(3)
    calls = []
    ref.act.register_forward_hook(lambda *args: calls.append(1))
    fused = _agree(ref, [(4, 3, 3, 5)])  # one call each, the reference's hook included
    assert fused.activation == "identity" and type(fused.act) is nn.ReLU  # a deep copy
    before = len(calls)
    fused(torch.randn(4, 3, 3, 5, dtype=torch.float64))
    assert len(calls) == before + 1  # folded into an Identity, it ran no more


def test_timm_batchnorm_act_shares_its_tensors_and_folds_nothing_after_it():
    BatchNormAct2d = _timm_layers().BatchNormAct2d

    class OwnForward(BatchNormAct2d):
        def forward(self, x):
            return super().forward(x) + 1

    bn = BatchNormAct2d(3)
    seq = nn.Sequential(bn, nn.ReLU(), OwnForward(3))
    texts = _convert_warned(seq)
    assert seq[0].weight is bn.weight and seq[0].running_var is bn.running_var
    assert seq[0].num_batches_tracked is bn.num_batches_tracked
    assert seq[0].activation == "relu" and type(seq[1]) is nn.ReLU  # its own act only
    assert type(seq[2]) is OwnForward and len(texts) == 1
    assert "OwnForward has its own forward (test_timm_batchnorm_act_shares_its_tensors_and_" \
           "folds_nothing_after_it.<locals>.OwnForward.forward), which convfuse's " \
           "BatchNormAct2d would not run" in texts[0]
    with pytest.raises(ValueError, match="BatchNormAct2d takes no further activation"):
        ct.fused_batchnorm(BatchNormAct2d(3), "relu")


@pytest.mark.parametrize("build, shapes", [
    (lambda L: L.Conv2dSame(3, 4, 3, stride=2), [(2, 3, 7, 8), (1, 3, 8, 5)]),
    (lambda L: L.Conv2dSame(3, 4, 4, dilation=2, bias=False), [(2, 3, 6, 7)]),
    (lambda L: L.StdConv2d(3, 4, 3), [(2, 3, 6, 6)]),
    (lambda L: L.StdConv2dSame(4, 6, 3, stride=2, groups=2, bias=True), [(2, 4, 7, 6)]),
    (lambda L: L.ScaledStdConv2d(3, 4, 3, stride=2, gamma=1.5), [(2, 3, 7, 6)]),
    (lambda L: L.ScaledStdConv2dSame(3, 4, 5, stride=2), [(2, 3, 9, 8), (1, 3, 6, 6)]),
    (lambda L: L.ScaledStdConv2dSame(3, 4, 3), [(2, 3, 5, 5)]),  # a static 'SAME'
], ids=["Conv2dSame", "Conv2dSame-even", "StdConv2d", "StdConv2dSame", "ScaledStdConv2d",
        "ScaledStdConv2dSame", "ScaledStdConv2dSame-static"])
def test_timm_convolutions(build, shapes):
    layers = _timm_layers()
    torch.manual_seed(3)
    ref = build(layers)
    if hasattr(ref, "gain"):
        with torch.no_grad():
            ref.gain.uniform_(0.5, 2.0)  # not its initial ones: the gradient must reach it
    fused = _agree(ref, shapes)
    expected = zoo_layers.Conv2dSame if type(ref) is layers.Conv2dSame else zoo_layers.StdConv2d
    assert type(fused) is expected
    assert (getattr(fused, "gain", None) is None) == (not hasattr(ref, "gain"))
    assert getattr(fused, "same_pad", False) == getattr(ref, "same_pad", False)
    assert _convert_warned(nn.Sequential(build(layers))) == []


def test_timm_layers_keep_channels_last():
    layers = _timm_layers()
    torch.manual_seed(5)
    cl = torch.channels_last
    for ref in (layers.ScaledStdConv2d(4, 6, 3), layers.StdConv2dSame(4, 6, 3, stride=2),
                layers.Conv2dSame(4, 6, 3, stride=2), layers.BatchNormAct2d(4)):
        ref = ref.double().to(memory_format=cl)
        model = ct.convert(copy.deepcopy(ref))
        x = torch.randn(2, 4, 7, 6, dtype=torch.float64).to(memory_format=cl)
        xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref, y = ref(xr), model(xm)
        torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
        y_ref.square().sum().backward()
        y.square().sum().backward()
        torch.testing.assert_close(xm.grad, xr.grad, rtol=1e-10, atol=1e-10)
        assert y.is_contiguous(memory_format=cl) and xm.grad.is_contiguous(memory_format=cl)


def test_timm_convolution_folds_the_activation_after_it():
    layers = _timm_layers()
    torch.manual_seed(4)
    ref = nn.Sequential(layers.ScaledStdConv2d(3, 4, 3), nn.ReLU(),
                        layers.Conv2dSame(4, 2, 3, stride=2), nn.Tanh())
    model = _agree(ref, [(2, 3, 7, 7)])
    assert [(type(m), getattr(m, "activation", None)) for m in model] == [
        (zoo_layers.StdConv2d, "relu"), (nn.Identity, None),
        (zoo_layers.Conv2dSame, "tanh"), (nn.Identity, None)]


def test_timm_layers_compile_whole():
    layers = _timm_layers()
    torch.manual_seed(6)
    ref = nn.Sequential(layers.ScaledStdConv2dSame(3, 4, 3, stride=2), layers.BatchNormAct2d(4),
                        layers.Conv2dSame(4, 4, 3, stride=2),
                        layers.BatchNormAct2d(4, act_layer=nn.Hardswish)).double()
    model = ct.convert(copy.deepcopy(ref))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    _step(ref, model, x, forward=compiled)
    assert int(model[1].num_batches_tracked) == 1


def test_timm_stays_unimported():
    code = ("import sys, torch; import convfuse.torch as ct; "
            "m = ct.convert(torch.nn.Sequential(torch.nn.Conv2d(1, 1, 1))); "
            "assert isinstance(m[0], ct.Conv2d); "
            "assert not [n for n in sys.modules if n.split('.')[0] in ('timm', 'torchvision')]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- whole timm models -----------------------------------------------------------------------

def _tiny_resnetv2():
    import_timm()
    from timm.layers import BatchNormAct2d, StdConv2d
    from timm.models.resnetv2 import ResNetV2
    return ResNetV2([1, 1], channels=(16, 32), num_classes=3, stem_chs=8,
                    norm_layer=BatchNormAct2d, conv_layer=StdConv2d)


@pytest.mark.parametrize("name, kwargs, size, expect", [
    ("test_efficientnet", {}, 48, zoo_layers.BatchNormAct2d),
    ("test_efficientnet", {"pad_type": "same"}, 40, zoo_layers.Conv2dSame),
    ("test_nfnet", {}, 24, zoo_layers.StdConv2d),
    ("resnetv2", {}, 24, zoo_layers.StdConv2d),
])
def test_small_timm_models_agree(name, kwargs, size, expect):
    timm = import_timm()
    torch.manual_seed(5)
    if name == "resnetv2":
        ref = _tiny_resnetv2()
    else:
        ref = timm.create_model(name, num_classes=3, **kwargs)
    model = _agree(ref, [(2, 3, size, size)], tol=1e-8, modes=(True, False))
    assert any(type(m) is expect for m in model.modules())
    assert not any(isinstance(m, _TORCH_KINDS) for m in model.modules())


# --- coverage over the zoos ------------------------------------------------------------------

def _zoo_models():
    tv, timm, monai = import_torchvision(), import_timm(), import_monai()
    nets = monai.networks.nets
    m = tv.models
    return {
        "torchvision resnet18": m.resnet18,
        "torchvision mobilenet_v3_small": m.mobilenet_v3_small,
        "torchvision efficientnet_b0": m.efficientnet_b0,
        "torchvision r3d_18": m.video.r3d_18,
        "torchvision deeplabv3_mobilenet_v3_large": functools.partial(
            m.segmentation.deeplabv3_mobilenet_v3_large, weights=None, weights_backbone=None),
        **{f"timm {n}": functools.partial(timm.create_model, n) for n in (
            "resnet18", "efficientnet_b0", "mobilenetv3_small_100", "nf_resnet26",
            "tf_mobilenetv3_small_minimal_100", "test_byobnet")},
        "timm resnetv2 (StdConv2d)": _tiny_resnetv2,
        "MONAI UNet": functools.partial(nets.UNet, 2, 1, 2, (8, 16, 32), (2, 2),
                                        num_res_units=1, norm="batch"),
        "MONAI BasicUNet": functools.partial(nets.BasicUNet, 2, 1, 2),
        "MONAI DenseNet121": functools.partial(nets.DenseNet121, 2, 1, 2),
        "MONAI SegResNet": functools.partial(nets.SegResNet, 2, 8, 1, 2, norm="batch"),
    }


def test_zoo_models_leave_at_most_one_percent_to_torch():
    rows, before, left = [], collections.Counter(), collections.Counter()
    for name, build in _zoo_models().items():
        model = build()
        mine = collections.Counter(type(m).__name__ for m in model.modules()
                                   if isinstance(m, _TORCH_KINDS))
        keys = list(model.state_dict())
        texts = _convert_warned(model)
        assert list(model.state_dict()) == keys, name
        stay = collections.Counter(type(m).__name__ for m in model.modules()
                                   if isinstance(m, _TORCH_KINDS))
        fused = sum(isinstance(m, _CONVFUSE_KINDS) for m in model.modules())
        assert fused + sum(stay.values()) == sum(mine.values()), name
        assert len(texts) == sum(stay.values()), (name, texts)  # a reason for each
        before.update(mine)
        left.update(stay)
        rows.append((name, sum(mine.values()), fused, dict(stay)))
    total, kept = sum(before.values()), sum(left.values())
    print(f"\n{'model':45s} {'convs+BNs':>9s} {'convfuse':>8s}  left to torch.nn")
    for name, n, fused, stay in rows:
        print(f"{name:45s} {n:9d} {fused:8d}  {stay or ''}")
    print(f"{'all':45s} {total:9d} {total - kept:8d}  {dict(left) or ''} "
          f"({kept / total:.2%})")
    print("by class:", dict(before))
    for cls in ("BatchNormAct2d", "ScaledStdConv2d", "StdConv2d", "Conv2dSame",
                "Conv3DSimple"):
        assert before[cls] > 0, cls  # the set holds each zoo class this test is about
    assert kept <= 0.01 * total, dict(left)
