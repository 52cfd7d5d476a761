"""convfuse.torch.convert on torch.nn models: what is replaced, that Parameters are shared,
and that a ResNet-like model gives the same outputs and gradients afterwards."""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import convfuse.ops.reference.conv as ref_conv  # noqa: E402
import convfuse.torch as ct  # noqa: E402


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock (torchvision is not installed here)."""

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
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)  # the same ReLU twice: never fused with conv1


def resnet_like(width: int = 8, classes: int = 5) -> nn.Module:
    """ResNet-18's shape in miniature: a stem, four stages of two BasicBlocks, a head. The
    stem's conv is followed directly by a ReLU, which convert fuses."""
    w = width
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, w, 3, padding=1), nn.ReLU()),
        nn.Sequential(BasicBlock(w, w), BasicBlock(w, w)),
        nn.Sequential(BasicBlock(w, 2 * w, 2), BasicBlock(2 * w, 2 * w)),
        nn.Sequential(BasicBlock(2 * w, 4 * w, 2), BasicBlock(4 * w, 4 * w)),
        nn.Sequential(BasicBlock(4 * w, 8 * w, 2), BasicBlock(8 * w, 8 * w)),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8 * w, classes),
    )


def test_resnet_like_same_outputs_and_gradients():
    torch.manual_seed(0)
    ref = resnet_like().double()
    model = ct.convert(copy.deepcopy(ref))
    assert set(model.state_dict()) == set(ref.state_dict())
    stem = model[0]
    assert isinstance(stem[0], ct.Conv2d) and stem[0].activation == "relu"
    assert isinstance(stem[1], nn.Identity)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert convs == []  # every torch conv was replaced
    assert sum(isinstance(m, ct.Conv2d) for m in model.modules()) == 20
    block = model[2][0]
    assert isinstance(block.conv1, ct.Conv2d) and block.conv1.activation == "identity"
    assert isinstance(block.relu, nn.ReLU) and isinstance(block.bn1, nn.BatchNorm2d)
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    for train in (True, False):
        ref.train(train)
        model.train(train)
        xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref, y = ref(xr), model(xm)
        torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
        dy = torch.randn_like(y)
        y_ref.backward(dy)
        y.backward(dy)
        torch.testing.assert_close(xm.grad, xr.grad, rtol=1e-9, atol=1e-9)
        named = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, named[name].grad, rtol=1e-9, atol=1e-9,
                                       msg=name)
        ref.zero_grad()
        model.zero_grad()


def test_convert_shares_parameters_and_keeps_training_flag():
    seq = nn.Sequential(nn.Conv1d(2, 4, 3), nn.SiLU(), nn.Conv3d(4, 4, 1), nn.GELU("tanh"))
    seq.eval()
    w0, b0 = seq[0].weight, seq[0].bias
    opt = torch.optim.SGD(seq.parameters(), lr=0.1)
    out = ct.convert(seq)
    assert out is seq
    assert isinstance(seq[0], ct.Conv1d) and seq[0].activation == "silu"
    assert seq[0].weight is w0 and seq[0].bias is b0 and not seq[0].training
    assert isinstance(seq[1], nn.Identity)
    # GELU's tanh approximation is not convfuse's gelu: the conv converts alone
    assert isinstance(seq[2], ct.Conv3d) and seq[2].activation == "identity"
    assert isinstance(seq[3], nn.GELU)
    assert opt.param_groups[0]["params"][0] is w0  # an existing optimizer still sees them


def test_convert_activation_table_and_bare_conv():
    acts = {nn.ReLU(): "relu", nn.ReLU6(): "relu6", nn.Sigmoid(): "sigmoid", nn.Tanh(): "tanh",
            nn.SiLU(): "silu", nn.GELU(): "gelu", nn.ELU(): "elu", nn.LeakyReLU(): "leaky_relu",
            nn.ELU(alpha=0.5): None, nn.LeakyReLU(0.2): None, nn.Softplus(): None}
    for module, name in acts.items():
        assert ct.activation_of(module) == name
    conv = nn.Conv2d(2, 3, 3)
    fused = ct.convert(conv)
    assert isinstance(fused, ct.Conv2d) and fused.weight is conv.weight
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        ct.convert("model")


def test_convert_keeps_what_convfuse_cannot_run(monkeypatch):
    seq = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), nn.ReLU(),
                        nn.Conv2d(2, 2, 4, padding="same"), nn.Conv2d(2, 2, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ct.convert(seq)
    assert type(seq[0]) is nn.Conv2d and type(seq[1]) is nn.ReLU
    assert type(seq[2]) is nn.Conv2d
    assert isinstance(seq[3], ct.Conv2d)
    text = " ".join(str(w.message) for w in caught)
    assert "padding_mode='reflect'" in text and "asymmetric" in text


def test_converted_model_runs_convfuse(monkeypatch):
    calls = []
    real = ref_conv.conv_bias_act
    monkeypatch.setattr(ref_conv, "conv_bias_act",
                        lambda *a: calls.append(a[4]) or real(*a))
    model = ct.convert(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Conv2d(2, 2, 3)))
    model(torch.randn(1, 1, 6, 6))
    assert calls == ["relu", "identity"]
