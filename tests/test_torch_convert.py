"""convfuse.torch.convert on torch.nn models: what is replaced (convolutions, batch norms, the
activation after them inside nn.Sequential), that Parameters and buffers are shared, and
that a torchvision-style ResNet-18 gives the same outputs, gradients and running statistics
afterwards, in training and evaluation."""

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


class ResNet(nn.Module):
    """torchvision's ResNet (the same attribute names, so the same state-dict keys);
    layers=(2, 2, 2, 2) is ResNet-18. `width` scales the 64-channel stem down for CPU runs."""

    def __init__(self, layers=(2, 2, 2, 2), width: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = width
        for i, n in enumerate(layers):
            cout = width * 2 ** i
            blocks = [BasicBlock(cin, cout, 1 if i == 0 else 2)]
            blocks += [BasicBlock(cout, cout) for _ in range(n - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
            cin = cout
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _same_step(ref: nn.Module, model: nn.Module, x: torch.Tensor, tol: float = 1e-9) -> None:
    """One forward/backward/SGD step on both: equal outputs, input and parameter gradients,
    and afterwards equal parameters and buffers (running statistics)."""
    xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = ref(xr), model(xm)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    dy = torch.randn_like(y)
    y_ref.backward(dy)
    y.backward(dy)
    torch.testing.assert_close(xm.grad, xr.grad, rtol=tol, atol=tol)
    named = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, named[name].grad, rtol=tol, atol=tol, msg=name)
    for m in (ref, model):
        torch.optim.SGD(m.parameters(), lr=1e-3).step()
        m.zero_grad()
    mine = model.state_dict()
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(mine[name], t, rtol=tol, atol=tol, msg=name)


def test_resnet18_same_outputs_gradients_and_running_statistics():
    torch.manual_seed(0)
    ref = ResNet(width=8).double()
    model = ct.convert(copy.deepcopy(ref))
    assert list(model.state_dict()) == list(ref.state_dict())
    assert [type(m) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.BatchNorm2d))] \
        == []  # every torch conv and batch norm was replaced
    assert sum(isinstance(m, ct.Conv2d) for m in model.modules()) == 20
    assert sum(isinstance(m, ct.BatchNorm2d) for m in model.modules()) == 20
    # outside nn.Sequential nothing is fused: BasicBlock applies its ReLU twice
    block = model.layer2[0]
    assert block.bn1.activation == "identity" and isinstance(block.relu, nn.ReLU)
    assert block.bn1.running_mean is not ref.layer2[0].bn1.running_mean  # a deep copy
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    for train in (True, True, False):
        ref.train(train)
        model.train(train)
        _same_step(ref, model, x)
    assert int(model.bn1.num_batches_tracked) == 2
    assert not torch.allclose(model.bn1.running_mean, torch.zeros(8, dtype=torch.float64))


def _vgg_like() -> nn.Sequential:
    """Conv -> BatchNorm -> ReLU runs inside nn.Sequential, plus a pre-activation BN."""
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(inplace=True),
        nn.Conv2d(6, 8, 3, stride=2), nn.BatchNorm2d(8, momentum=None), nn.SiLU(),
        nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1),
        nn.Flatten(), nn.BatchNorm1d(4 * 3 * 3, affine=False), nn.Linear(4 * 3 * 3, 3),
    )


def test_conv_batchnorm_activation_fuses_inside_sequential(monkeypatch):
    torch.manual_seed(1)
    ref = _vgg_like().double()
    model = ct.convert(copy.deepcopy(ref))
    assert list(model.state_dict()) == list(ref.state_dict())
    kinds = [(type(m).__name__, getattr(m, "activation", None)) for m in model]
    assert kinds == [
        ("Conv2d", "identity"), ("BatchNorm2d", "relu"), ("Identity", None),
        ("Conv2d", "identity"), ("BatchNorm2d", "silu"), ("Identity", None),
        ("BatchNorm2d", "relu"), ("Identity", None), ("Conv2d", "identity"),
        ("Flatten", None), ("BatchNorm1d", "identity"), ("Linear", None)]
    assert isinstance(model[1], ct.BatchNorm2d) and model[4].momentum is None
    x = torch.randn(5, 3, 8, 8, dtype=torch.float64)
    for train in (True, True, False):
        ref.train(train)
        model.train(train)
        _same_step(ref, model, x)
    # the same Parameter and buffer objects as before the conversion
    bn = nn.BatchNorm2d(3)
    fused = ct.convert(bn)
    assert isinstance(fused, ct.BatchNorm2d)
    assert fused.weight is bn.weight and fused.running_var is bn.running_var
    assert fused.num_batches_tracked is bn.num_batches_tracked


def test_converted_batchnorm_runs_convfuse(monkeypatch):
    import convfuse.ops.reference.batchnorm as ref_bn

    calls = []
    real = ref_bn.batchnorm_forward_training
    monkeypatch.setattr(ref_bn, "batchnorm_forward_training",
                        lambda *a: calls.append(a[8]) or real(*a))
    model = ct.convert(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(),
                                     nn.Conv2d(2, 2, 3), nn.BatchNorm2d(2)))
    model(torch.randn(2, 1, 6, 6))
    assert calls == ["relu", "identity"]


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


def test_convert_warns_once_per_layer_it_leaves_to_torch():
    seq = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), nn.ReLU(),
                        nn.Conv2d(2, 2, 4, padding="same"), nn.Conv2d(2, 2, 3),
                        nn.ConvTranspose2d(2, 2, 3), nn.LazyConv2d(2, 3),
                        nn.Conv2d(2, 2, 3, dtype=torch.complex64), nn.SyncBatchNorm(2),
                        nn.Sequential(nn.ConvTranspose1d(2, 2, 3)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ct.convert(seq)
    # reflect padding and an even-kernel 'same' are convfuse's now (torch.nn's explicit pad)
    assert isinstance(seq[0], ct.Conv2d) and seq[0].activation == "relu"
    assert seq[0].padding_mode == "reflect" and isinstance(seq[1], nn.Identity)
    assert isinstance(seq[2], ct.Conv2d) and seq[2].padding == "same"
    assert isinstance(seq[3], ct.Conv2d)
    texts = [str(w.message) for w in caught]
    left = {5: "LazyConv2d", 6: "Conv2d", 7: "SyncBatchNorm"}
    # ConvTranspose*d: warned about for as long as convfuse leaves them to torch.nn
    if type(seq[4]) is nn.ConvTranspose2d:
        left[4] = "ConvTranspose2d"
    if type(seq[8][0]) is nn.ConvTranspose1d:
        left[8] = "ConvTranspose1d"
    for index, kind in left.items():
        module = seq[index][0] if index == 8 else seq[index]
        assert type(module).__name__ == kind  # kept as PyTorch's
        mine = [t for t in texts if f"kept {kind}" in t or repr(module) in t]
        assert len(mine) == 1, (kind, texts)  # once per layer, naming it and why
    assert len(texts) == len(left)
    assert any("complex" in t for t in texts)
    assert any("no fused layer for LazyConv2d" in t for t in texts)
    assert any("SyncBatchNorm: convfuse has no cross-rank" in t for t in texts)


def test_converted_model_runs_convfuse(monkeypatch):
    calls = []
    real = ref_conv.conv_bias_act
    monkeypatch.setattr(ref_conv, "conv_bias_act",
                        lambda *a: calls.append(a[4]) or real(*a))
    model = ct.convert(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Conv2d(2, 2, 3)))
    model(torch.randn(1, 1, 6, 6))
    assert calls == ["relu", "identity"]


def test_convert_leaves_batchnorm_subclasses_and_keeps_flags():
    seq = nn.Sequential(nn.Conv2d(2, 4, 3), nn.SyncBatchNorm(4), nn.ReLU(),
                        nn.BatchNorm2d(4, affine=False, track_running_stats=False), nn.Tanh())
    seq.eval()
    with pytest.warns(UserWarning, match="kept SyncBatchNorm .* no cross-rank"):
        ct.convert(seq)
    assert type(seq[1]) is nn.SyncBatchNorm and type(seq[2]) is nn.ReLU  # not fused past it
    bn = seq[3]
    assert isinstance(bn, ct.BatchNorm2d) and bn.activation == "tanh" and not bn.training
    assert bn.weight is None and bn.running_mean is None and isinstance(seq[4], nn.Identity)


class _SkipSequential(nn.Sequential):
    """A Sequential whose forward adds a skip around its children: folding the ReLU into the
    conv would apply it before the skip instead of after."""

    def forward(self, x):
        return self[1](self[0](x) + x)


def test_a_sequential_with_its_own_forward_folds_nothing():
    torch.manual_seed(0)
    model = _SkipSequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()).double()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    ct.convert(model)
    assert isinstance(model[0], ct.Conv2d) and model[0].activation == "identity"
    assert type(model[1]) is nn.ReLU
    torch.testing.assert_close(model(x), ref(x), rtol=1e-12, atol=1e-12)
    plain = type("PlainSubclass", (nn.Sequential,), {})(nn.Conv2d(4, 4, 3), nn.ReLU())
    ct.convert(plain)  # nn.Sequential's own forward: folded
    assert plain[0].activation == "relu" and type(plain[1]) is nn.Identity


def test_hooks_on_a_conv_or_batchnorm_keep_it_with_a_warning():
    """A backward or state-dict hook would be lost with the module: it stays, warned."""
    seen = []
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Conv2d(3, 3, 1))
    model[0].register_full_backward_hook(lambda m, gi, go: seen.append("conv"))
    model[1].register_full_backward_pre_hook(lambda m, go: seen.append("bn"))
    model[2].register_state_dict_pre_hook(lambda m, prefix, keep_vars: seen.append("sd"))
    with pytest.warns(UserWarning) as got:
        ct.convert(model)
    texts = [str(w.message) for w in got]
    assert len(texts) == 3
    assert "Conv2d has backward hooks, which convfuse's layer would not run" in texts[0]
    assert "BatchNorm2d has backward-pre hooks" in texts[1]
    assert "Conv2d has state-dict-pre hooks" in texts[2]
    assert [type(m) for m in model] == [nn.Conv2d, nn.BatchNorm2d, nn.Conv2d]
    model(torch.randn(2, 2, 5, 5)).sum().backward()
    model.state_dict()
    assert sorted(seen) == ["bn", "conv", "sd"]


def test_a_hooked_activation_is_not_folded():
    torch.manual_seed(0)
    seen = []
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Conv2d(3, 3, 1), nn.ReLU()).double()
    model[1].register_forward_hook(lambda m, args, out: seen.append(out.detach().clone()))
    ref = copy.deepcopy(model)
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left unconverted: no warning
        ct.convert(model)
    assert isinstance(model[0], ct.Conv2d) and model[0].activation == "identity"
    assert type(model[1]) is nn.ReLU  # still runs its hook
    assert model[2].activation == "relu" and type(model[3]) is nn.Identity
    torch.testing.assert_close(model(x), ref(x), rtol=1e-12, atol=1e-12)
    assert len(seen) == 2  # one call each, before and after the conversion
    torch.testing.assert_close(seen[1], seen[0], rtol=1e-12, atol=1e-12)


def test_attributes_a_user_set_come_along():
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3))
    model[0].is_stem, model[1].frozen = True, "yes"
    ct.convert(model)
    assert isinstance(model[0], ct.Conv2d) and model[0].is_stem is True
    assert isinstance(model[1], ct.BatchNorm2d) and model[1].frozen == "yes"
    assert model[0].activation == "identity"  # the layer's own attributes are its own


@pytest.mark.parametrize("needs_input_grad", [True, False])
def test_flop_counter_counts_what_it_counts_for_torch_nn(needs_input_grad):
    """FlopCounterMode gives a converted model torch.nn's count (torch's own formulas, on
    the custom ops), forward and backward, convolutions of every kind."""
    from torch.utils.flop_counter import FlopCounterMode

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                          nn.ConvTranspose2d(8, 4, 3, stride=2, groups=4),
                          nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1, bias=False))
    converted = ct.convert(copy.deepcopy(model))
    x = torch.randn(2, 3, 8, 8, requires_grad=needs_input_grad)
    totals = []
    for m in (model, converted):
        with FlopCounterMode(display=False) as counter:
            m(x).sum().backward()
        totals.append(counter.get_total_flops())
    assert totals[0] > 0 and totals[1] == totals[0]
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        converted(x)
    with FlopCounterMode(display=False) as reference, torch.no_grad():
        model(x)
    assert counter.get_total_flops() == reference.get_total_flops()


def test_a_forward_set_on_an_instance_keeps_the_module():
    """Offloading hooks and LoRA-style patches set `module.forward` on the instance: such a
    conv, batch norm or activation computes something else, so it stays (the activation
    unfolded), and the model computes what it did."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Conv2d(3, 3, 1), nn.ReLU(),
                          nn.BatchNorm2d(3)).double()
    conv, act, bn = model[0], model[3], model[4]
    conv.forward = lambda x, c=conv: nn.Conv2d.forward(c, x) * 0.5
    act.forward = lambda x: torch.relu(x) + 1.0
    bn.forward = lambda x, b=bn: nn.BatchNorm2d.forward(b, x) - 2.0
    ref = copy.deepcopy(model)
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    with pytest.warns(UserWarning) as got:
        ct.convert(model)
    texts = [str(w.message) for w in got]
    assert len(texts) == 2 and all("has its own forward set on the instance" in t
                                   for t in texts)
    assert model[0] is conv and model[4] is bn
    assert isinstance(model[2], ct.Conv2d) and model[2].activation == "identity"
    assert model[3] is act
    torch.testing.assert_close(model(x), ref(x), rtol=1e-12, atol=1e-12)


class _NormEvalBackbone(nn.Module):
    """mmdetection's pattern: train() puts every batch norm back in eval mode, found by
    isinstance(m, nn.BatchNorm2d)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU())

    def forward(self, x):
        return self.body(x)

    def train(self, mode=True):
        super().train(mode)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
        return self


class _AlwaysEvalBN(nn.BatchNorm2d):
    def train(self, mode=True):
        return super().train(False)


def test_train_overrides_keep_the_batch_norms_they_may_switch():
    torch.manual_seed(0)
    model = _NormEvalBackbone().double()
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="_NormEvalBackbone overrides train()"):
        ct.convert(model)
    assert isinstance(model.body[0], ct.Conv2d)  # convolutions convert all the same
    assert type(model.body[1]) is nn.BatchNorm2d
    model.train()
    ref.train()
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    torch.testing.assert_close(model(x), ref(x), rtol=1e-12, atol=1e-12)
    assert int(model.body[1].num_batches_tracked) == 0  # still frozen
    bn = _AlwaysEvalBN(3)
    with pytest.warns(UserWarning, match="_AlwaysEvalBN has its own train"):
        assert ct.fused_batchnorm(bn) is None


class _CachingTrain(_NormEvalBackbone):
    """A train() that only keeps a cache (timm's attention biases) and calls super()'s
    nn.Module.train: nothing to do with batch norms."""

    def train(self, mode=True):
        self.cache = {}
        return nn.Module.train(self, mode)


def test_a_train_override_that_leaves_batch_norms_alone_converts_them():
    model = _CachingTrain()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ct.convert(model)
    assert isinstance(model.body[1], ct.BatchNorm2d) and model.body[1].activation == "relu"


def test_a_conversion_that_raises_part_way_changes_nothing():
    """Warnings as errors (pytest -W error): the first warning raises after the conv and
    its activation were folded; the model is as it was."""
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.SyncBatchNorm(3))
    children = list(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="SyncBatchNorm"):
            ct.convert(model)
    assert list(model) == children and type(model[0]) is nn.Conv2d


def test_a_relu6_with_other_bounds_is_not_folded():
    # nn.ReLU6 is a Hardtanh whose forward reads min_val and max_val at every call
    ref = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU6()).double()
    ref[1].max_val = 3.0
    model = ct.convert(copy.deepcopy(ref))
    assert ct.activation_of(ref[1]) is None and type(model[1]) is nn.ReLU6
    x = torch.randn(2, 2, 6, 6, dtype=torch.float64) * 10
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=1e-12)
    assert ref(x).max() == 3.0


def test_a_module_used_in_two_places_stays_one_module():
    bn = nn.BatchNorm2d(3)
    ref = nn.Sequential(nn.Conv2d(3, 3, 1), bn, nn.ReLU(), nn.Conv2d(3, 3, 1), bn)
    model = ct.convert(copy.deepcopy(ref))
    assert model[1] is model[4] and type(model[1]).__module__.startswith("convfuse")
    assert type(model[2]) is nn.ReLU  # no activation folded into a shared module
    ref, model = ref.double(), model.double()  # one module: its buffers move once
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    torch.testing.assert_close(model(x), ref(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean, rtol=1e-12,
                               atol=1e-14)


def test_a_container_used_twice_still_folds_its_activations():
    # its children are registered once (in it), though two paths reach them
    block = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU())
    ref = nn.Sequential(block, block).double()
    model = ct.convert(copy.deepcopy(ref))
    assert model[0] is model[1] and model[0][1].activation == "relu"
    assert type(model[0][2]) is nn.Identity
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    torch.testing.assert_close(model(x), ref(x), rtol=1e-12, atol=1e-12)


def test_a_residual_blocks_batch_norm_used_elsewhere_stays_one_module():
    class Tapped(nn.Module):  # the block's bn2 also registered outside it
        def __init__(self):
            super().__init__()
            self.block = BasicBlock(3, 3)
            self.tap = self.block.bn2

        def forward(self, x):
            return self.block(x) + self.tap(x)

    ref = Tapped().double()
    model = ct.convert(copy.deepcopy(ref))
    assert model.tap is model.block.bn2 and type(model.tap).__module__.startswith("convfuse")
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    torch.testing.assert_close(model(x), ref(x), rtol=1e-12, atol=1e-12)


def test_the_fused_functions_refuse_bad_arguments_naming_them():
    conv, bn = nn.Conv2d(2, 2, 3), nn.BatchNorm2d(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused as arguments, not kept with a warning
        with pytest.raises(ValueError, match=r"^fused_conv: unknown activation 'foo'"):
            ct.fused_conv(conv, "foo")
        with pytest.raises(ValueError, match=r"^fused_batchnorm: unknown activation 'rleu'"):
            ct.fused_batchnorm(bn, "rleu")
        with pytest.raises(TypeError, match=r"^fused_conv_transpose: activation must be"):
            ct.fused_conv_transpose(nn.ConvTranspose2d(2, 2, 3), 5)
        with pytest.raises(TypeError, match=r"^fused_conv expects a torch.nn.Module, got str"):
            ct.fused_conv("conv")
        with pytest.raises(TypeError, match=r"^activation_of expects a torch.nn.Module"):
            ct.activation_of("relu")
