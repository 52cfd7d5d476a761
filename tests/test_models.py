"""convfuse.models.resnet18/34 against a torchvision-identical PyTorch ResNet (torchvision
itself is not installed): keys, shapes, outputs, gradients and running statistics after
loading its state_dict; finite differences on a tiny ResNet; typed errors."""

from __future__ import annotations

import numpy as np
import pytest

import convfuse as cf
from convfuse.models import BasicBlock, ResNet, resnet18, resnet34
from tests.gradcheck import assert_grad_close

torch = pytest.importorskip("torch")
tnn = torch.nn


# --- torchvision's ResNet (torchvision/models/resnet.py), BasicBlock only -----------------
class TVBasicBlock(tnn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = tnn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = tnn.BatchNorm2d(planes)
        self.relu = tnn.ReLU(inplace=True)
        self.conv2 = tnn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = tnn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class TVResNet(tnn.Module):
    def __init__(self, layers, num_classes=1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = tnn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = tnn.BatchNorm2d(64)
        self.relu = tnn.ReLU(inplace=True)
        self.maxpool = tnn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], 2)
        self.layer3 = self._make_layer(256, layers[2], 2)
        self.layer4 = self._make_layer(512, layers[3], 2)
        self.avgpool = tnn.AdaptiveAvgPool2d((1, 1))
        self.fc = tnn.Linear(512, num_classes)

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = tnn.Sequential(tnn.Conv2d(self.inplanes, planes, 1, stride, bias=False),
                                        tnn.BatchNorm2d(planes))
        layers = [TVBasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [TVBasicBlock(planes, planes) for _ in range(1, blocks)]
        return tnn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def tv_model(layers, num_classes, seed=0):
    """A float64 torchvision-style ResNet with random BN affine parameters and running
    statistics (so that loading them is actually tested)."""
    torch.manual_seed(seed)
    model = TVResNet(layers, num_classes).double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, tnn.BatchNorm2d):
                n = m.num_features
                m.weight.copy_(torch.rand(n, generator=g, dtype=torch.float64) + 0.5)
                m.bias.copy_(torch.randn(n, generator=g, dtype=torch.float64) * 0.1)
                m.running_mean.copy_(torch.randn(n, generator=g, dtype=torch.float64) * 0.1)
                m.running_var.copy_(torch.rand(n, generator=g, dtype=torch.float64) + 0.5)
                m.num_batches_tracked.fill_(3)
    return model


def to_numpy(sd):
    return {k: v.numpy() for k, v in sd.items()}


@pytest.mark.parametrize("ctor,layers", [(resnet18, (2, 2, 2, 2)), (resnet34, (3, 4, 6, 3))])
def test_state_dict_keys_and_shapes_equal_torchvision(ctor, layers):
    ours = ctor(num_classes=7, dtype="float64", device="cpu", seed=0).state_dict()
    theirs = TVResNet(layers, 7).double().state_dict()
    assert list(ours) == list(theirs)
    for k, v in theirs.items():
        assert ours[k].shape == tuple(v.shape), k
        assert ours[k].dtype == (np.int64 if k.endswith("num_batches_tracked") else np.float64)
    assert len(ours) == {18: 122, 34: 218}[18 if layers[0] == 2 else 34]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_resnet18_matches_torchvision_after_loading_its_weights(rng, layout):
    ref = tv_model((2, 2, 2, 2), 5)
    model = resnet18(num_classes=5, layout=layout, dtype="float64", device="cpu")
    model.load_state_dict(to_numpy(ref.state_dict()))
    model.needs_input_grad = True
    x = rng.standard_normal((2, 3, 32, 32))
    xin = np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if layout == "NHWC" else x
    # Training mode: batch statistics, running-statistics update, every gradient.
    tx = torch.tensor(x, requires_grad=True)
    ty = ref(tx)
    y = model(xin)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-10, atol=1e-11)
    dlogits = rng.standard_normal(y.shape)
    ty.backward(torch.tensor(dlogits))
    dx = model.backward(dlogits)
    if layout == "NHWC":
        dx = dx.transpose(0, 3, 1, 2)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-8, atol=1e-9)
    grads = dict(model.named_parameters())
    modules = dict(model.named_modules())
    for name, p in ref.named_parameters():
        prefix, _, attr = name.rpartition(".")
        got = modules[prefix]._param_to_state(attr, grads[name].grad)  # PyTorch's layout
        want = p.grad.numpy()
        # Sums of hundreds of products: compare to the gradient's own scale.
        np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10 * np.abs(want).max(),
                                   err_msg=name)
    sd, tsd = model.state_dict(), ref.state_dict()
    for k in sd:
        np.testing.assert_allclose(sd[k], tsd[k].numpy(), rtol=1e-10, atol=1e-12, err_msg=k)
    # Evaluation mode: running statistics.
    model.eval()
    ref.eval()
    np.testing.assert_allclose(model(xin), ref(torch.tensor(x)).detach().numpy(), rtol=1e-10,
                               atol=1e-11)


def test_resnet34_eval_matches_torchvision(rng):
    ref = tv_model((3, 4, 6, 3), 4, seed=3).eval()
    model = resnet34(num_classes=4, dtype="float64", device="cpu").eval()
    model.load_state_dict(to_numpy(ref.state_dict()))
    x = rng.standard_normal((1, 3, 32, 32))
    np.testing.assert_allclose(model(x), ref(torch.tensor(x)).detach().numpy(), rtol=1e-10,
                               atol=1e-11)


def tiny(layout="NCHW", **kw):
    return ResNet((1, 1), (2, 3), num_classes=3, in_channels=1, stem="small", layout=layout,
                  dtype="float64", device="cpu", seed=0, **kw)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_tiny_resnet_finite_differences(rng, layout):
    model = tiny(layout)
    model.needs_input_grad = True
    shape = (3, 1, 6, 6) if layout == "NCHW" else (3, 6, 6, 1)
    x = rng.standard_normal(shape)
    w = rng.standard_normal((3, 3))
    model(x)
    dx = model.backward(w)

    def loss():
        return float((model(x) * w).sum())

    assert_grad_close(dx, loss, x, rtol=1e-5, atol=1e-7)
    for name in ["conv1.weight", "layer1.0.conv2.weight", "layer2.0.downsample.0.weight",
                 "layer2.0.bn2.bias", "fc.weight"]:
        p = dict(model.named_parameters())[name]
        assert_grad_close(p.grad.copy(), loss, p.data, rtol=1e-5, atol=1e-7, max_entries=10)


def test_imagenet_stem_finite_differences(rng):
    model = ResNet((1,), (2,), num_classes=2, in_channels=2, dtype="float64", device="cpu",
                   seed=1)
    assert isinstance(model.maxpool, cf.MaxPool2d)
    x = rng.standard_normal((2, 2, 12, 12))
    w = rng.standard_normal((2, 2))
    model(x)
    assert model.backward(w) is None  # the stem computes no input gradient by default
    p = model.conv1.weight
    assert_grad_close(p.grad.copy(), lambda: float((model(x) * w).sum()), p.data, rtol=1e-5,
                      atol=1e-7, max_entries=15)


def test_structure_init_and_defaults():
    model = resnet18(device="cpu", seed=0)
    assert model.dtype == np.float32 and model.num_classes == 1000
    assert model.fc.weight.shape == (1000, 512)
    assert not model.needs_input_grad and not model.conv1.needs_input_grad
    assert model.conv1.bias is None and model.conv1.stride == (2, 2)
    assert model.bn1.activation == "relu" and model.layer1[0].bn2.activation == "relu"
    assert model.layer1[0].downsample is None
    assert isinstance(model.layer2[0], BasicBlock) and model.layer2[0].stride == 2
    # torchvision's init: kaiming normal with fan_out for convs.
    w = model.layer4[1].conv2.weight.data
    assert abs(w.std() - np.sqrt(2 / (512 * 9))) < 0.02 * np.sqrt(2 / (512 * 9))
    again = resnet18(device="cpu", seed=0).state_dict()
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, again[k])
    assert len(model.parameters()) == 62
    assert "stem='imagenet'" in repr(model)


def test_backward_rejects_bad_dlogits_and_keeps_the_forward(rng):
    model = tiny()
    with pytest.raises(cf.BackwardBeforeForwardError):
        model.backward(np.ones((2, 3)))
    y = model(rng.standard_normal((2, 1, 6, 6)))
    before = {n: p.grad.copy() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"ResNet: dlogits has shape \(2, 4\)"):
        model.backward(np.ones((2, 4)))
    with pytest.raises(ValueError, match="dtype float32"):
        model.backward(np.ones(y.shape, np.float32))
    with pytest.raises(TypeError, match=r"ResNet:? dlogits must be a NumPy or CuPy array"):
        model.backward(y.tolist())
    for n, p in model.named_parameters():
        np.testing.assert_array_equal(p.grad, before[n])
    assert model.backward(np.ones_like(y)) is None


@pytest.mark.parametrize("kwargs,err,match", [
    ({"block_counts": (1, 1), "widths": (2,)}, ValueError, "same length"),
    ({"block_counts": (), "widths": ()}, ValueError, "non-empty"),
    ({"block_counts": (1, 0), "widths": (2, 3)}, ValueError, "block_counts entries must be"),
    ({"block_counts": 3}, TypeError, "sequences of ints"),
    ({"stem": "cifar"}, ValueError, "stem must be one of"),
    ({"layout": "NCDHW"}, ValueError, "layout must be 'NCHW' or 'NHWC'"),
    ({"num_classes": 0}, ValueError, "num_classes must be a positive int"),
    ({"dtype": "int8"}, ValueError, "unsupported dtype"),
])
def test_constructor_errors(kwargs, err, match):
    args = {"block_counts": (1,), "widths": (2,), "device": "cpu", **kwargs}
    with pytest.raises(err, match=match):
        ResNet(**args)


def test_numpy_ints_are_taken_as_ints():
    """As block_counts takes them, and torchvision's resnet18(num_classes=np.int64(10))."""
    model = ResNet(np.array([1]), (np.int64(2),), num_classes=np.int64(3),
                   in_channels=np.int32(2), stem="small", device="cpu")
    assert type(model.num_classes) is int and model.num_classes == 3
    assert model.fc.weight.data.shape == (3, 2) and model.conv1.weight.data.shape[1] == 2


def test_call_errors(rng):
    model = tiny()
    with pytest.raises(ValueError, match=r"ResNet expects a 4-d input \(NCHW\)"):
        model(np.ones((1, 6, 6)))
    with pytest.raises(ValueError, match="dtype"):
        model(np.ones((1, 1, 6, 6), np.float32))
