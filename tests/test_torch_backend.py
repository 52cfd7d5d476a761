"""torch.compile(model, backend=convfuse.torch.backend(...)) on the CPU: every spelling of a
convolution, batch norm, residual add and activation the Dynamo graph can hold becomes
convfuse's fused op (or is left, with the reason), and the compiled model matches torch.nn
in float64: outputs, input and parameter gradients, running statistics and SGD steps."""

from __future__ import annotations

from typing import ClassVar

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import convfuse.torch as ct  # noqa: E402
from convfuse.torch.dynamo import Record, backend  # noqa: E402
from tests._backend_helpers import (  # noqa: E402
    assert_matches_torch,
    compile_recorded,
    convfuse_ops,
    torch_ops_left,
)


def _patterns(records):
    return [(r.pattern, r.fused) for r in records]


class Activations(nn.Module):
    """One convolution per spelling of an activation (module, function, method, in place)."""

    FORMS: ClassVar = [
        ("relu", nn.ReLU()), ("relu", nn.ReLU(inplace=True)), ("relu", torch.relu),
        ("relu", torch.relu_), ("relu", lambda t: t.relu()), ("relu", lambda t: t.relu_()),
        ("relu", lambda t: F.relu(t, inplace=True)),
        ("relu6", nn.ReLU6(inplace=True)), ("relu6", F.relu6), ("relu6", nn.Hardtanh(0.0, 6.0)),
        ("silu", nn.SiLU()), ("silu", lambda t: F.silu(t, inplace=True)),
        ("gelu", nn.GELU()), ("gelu", lambda t: F.gelu(t, approximate="none")),
        ("sigmoid", torch.sigmoid), ("sigmoid", lambda t: t.sigmoid_()), ("sigmoid", nn.Sigmoid()),
        ("tanh", nn.Tanh()), ("tanh", lambda t: t.tanh_()),
        ("leaky_relu", nn.LeakyReLU()), ("leaky_relu", lambda t: F.leaky_relu(t, 0.01, True)),
        ("elu", nn.ELU()), ("elu", lambda t: F.elu(t, inplace=True)),
        # not convfuse's: the convolution is fused alone, the activation left to torch
        (None, nn.GELU(approximate="tanh")), (None, nn.LeakyReLU(0.2)), (None, nn.ELU(0.5)),
        (None, nn.Hardtanh(-1.0, 1.0)), (None, nn.Hardswish()),
    ]

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(2, 2, 3, padding=1) for _ in self.FORMS)

    def forward(self, x):
        return torch.cat([f(c(x)) for c, (_, f) in zip(self.convs, self.FORMS)], 1)


def test_activation_forms_fuse_with_their_parameters_checked():
    records, graphs = assert_matches_torch(Activations(), torch.randn(2, 2, 5, 5))
    expected = [("conv2d+" + name if name else "conv2d", True) for name, _ in Activations.FORMS]
    assert _patterns(records) == expected
    refused = [r.reason for r in records[-5:]]
    assert "approximate='tanh'" in refused[0] and "negative_slope=0.2" in refused[1]
    assert "alpha=0.5" in refused[2] and "min_val=-1.0" in refused[3]
    assert refused[4] == "hardswish is no activation" or "no activation" in refused[4]
    assert torch_ops_left(graphs) == []


class Residuals(nn.Module):
    """conv -> + residual -> relu, the add in every spelling and either order."""

    ADDS: ClassVar = [lambda y, r: y + r, lambda y, r: r + y, torch.add,
                      lambda y, r: torch.add(r, y), lambda y, r: y.add(r),
                      lambda y, r: y.add_(r), lambda y, r: r.add(y)]

    def __init__(self):
        super().__init__()
        n = len(self.ADDS) + 3
        self.convs = nn.ModuleList(nn.Conv2d(2, 2, 3, padding=1) for _ in range(n))

    def forward(self, x):
        r = x * 2
        outs = [torch.relu(add(c(x), r)) for c, add in zip(self.convs, self.ADDS)]
        y = self.convs[-3](x)
        y += r  # torchvision's spelling
        outs.append(F.relu(y, inplace=True))
        s = r.clone()
        s += self.convs[-2](x)  # writes into the residual: not fused (r's own value changes)
        outs.append(s.relu())
        outs.append(torch.add(self.convs[-1](x), r, alpha=2).relu())  # alpha: not fused
        return torch.cat(outs, 1)


def test_residual_add_forms():
    records, _ = assert_matches_torch(Residuals(), torch.randn(2, 2, 5, 5))
    n = len(Residuals.ADDS) + 1
    assert _patterns(records) == [("conv2d+add+relu", True)] * n + [("conv2d", True)] * 2
    assert records[-2].reason == "adds into the residual in place"
    assert records[-1].reason == "an add with alpha or out="


class Convolutions(nn.Module):
    """Every convolution kind convfuse has, as modules and functions, with padding modes,
    'same', groups, dilation and stride."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(2, 4, 3, padding=2, dilation=2)
        self.c3 = nn.Conv3d(2, 2, 2, padding="same")
        self.reflect = nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect", groups=2)
        self.circular = nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular", bias=False)
        self.same = nn.Conv2d(2, 2, 4, padding="same", dilation=1)
        self.w = nn.Parameter(torch.randn(3, 2, 3, 3) * 0.3)
        self.t1 = nn.ConvTranspose1d(4, 2, 3, stride=2, output_padding=1)
        self.t2 = nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.t3 = nn.ConvTranspose3d(2, 2, 2, stride=2, bias=False)

    def forward(self, x):
        a = torch.tanh(self.t1(F.silu(self.c1(x.flatten(2)))))
        b = self.c3(x.unsqueeze(2).expand(-1, -1, 2, -1, -1)).relu()
        c = self.reflect(x) + self.circular(x).repeat(1, 2, 1, 1)
        d = F.conv2d(x, self.w, None, 2, 1).sigmoid() + 0  # stride 2, no bias
        e = F.gelu(torch.conv2d(self.same(x), self.w[:2], padding="valid"))
        f = F.relu(self.t2(x)) + self.t3(x.unsqueeze(2)).sum(2)
        return a.sum() + b.sum() + c.sum() + d.sum() + e.sum() + f.mean()


def test_convolution_kinds_and_padding():
    records, graphs = assert_matches_torch(Convolutions(), torch.randn(2, 2, 4, 4))
    fused = sorted(r.pattern for r in records if r.fused)
    assert fused == sorted(["conv1d+silu", "conv_transpose1d+tanh", "conv3d+relu",
                            "conv2d+add", "conv2d", "conv2d+sigmoid", "conv2d", "conv2d+gelu",
                            "conv_transpose2d+relu", "conv_transpose3d"])
    assert not [r for r in records if not r.fused]
    assert torch_ops_left(graphs) == []


class Norms(nn.Module):
    """Batch norms in every state: momentum, affine=False, no running statistics, 1-d/3-d,
    conv -> BN -> +residual -> act, and BN -> act (pre-activation)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(3, momentum=0.3)
        self.plain = nn.BatchNorm2d(3, affine=False)
        self.free = nn.BatchNorm2d(3, track_running_stats=False)
        self.bn1 = nn.BatchNorm1d(3)
        self.bn3 = nn.BatchNorm3d(3)

    def forward(self, x):
        y = F.relu6(self.bn(self.conv(x)) + x[:, :1])  # the residual broadcast: not fused
        z = F.silu(self.plain(self.conv(x)) + y)
        w = torch.sigmoid(self.free(z))
        v = F.elu(self.bn1(w.mean((2, 3))))
        u = self.bn3(w.unsqueeze(2).expand(-1, -1, 2, -1, -1))
        return w.sum((2, 3)) + v + u.sum((2, 3, 4))


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_in_training_and_eval(training):
    model = Norms().train(training)
    records, graphs = assert_matches_torch(model, torch.randn(2, 2, 4, 4), steps=2)
    assert sorted(_patterns(records)) == sorted([
        ("conv2d", True), ("batch_norm", True), ("conv2d", True),
        ("batch_norm+add+silu", True), ("batch_norm+sigmoid", True), ("batch_norm+elu", True),
        ("batch_norm", True)])
    assert torch_ops_left(graphs) == []
    bn = next(r for r in records if r.pattern == "batch_norm")
    assert "differs in shape" in bn.reason
    if training:
        assert int(model.bn.num_batches_tracked) == 2  # torch's own increment, kept


def test_momentum_none_is_left_to_torch_and_still_matches():
    """torch.nn computes momentum=None's factor on the host, `1 / float(num_batches_tracked)`:
    Dynamo breaks the graph there and torch runs that batch norm (with
    capture_scalar_outputs Dynamo itself fails on it, torch 2.13)."""
    model = nn.Sequential(nn.Conv2d(2, 2, 3), nn.BatchNorm2d(2, momentum=None), nn.ReLU())
    assert_matches_torch(model, torch.randn(2, 2, 5, 5), steps=3, fullgraph=False)
    assert int(model[1].num_batches_tracked) == 3


def test_dynamic_shapes_say_how_to_keep_batch_norm_floats_constant():
    """Under dynamic=True Dynamo passes a module's momentum and eps as graph inputs: the
    batch norm is left to torch with a reason naming the setting that keeps them constant,
    and with that setting it is fused (the numbers match torch.nn either way)."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU()).double()

    x = torch.randn(2, 2, 6, 6, dtype=torch.float64)
    for specialize, fused in ((False, False), (True, True)):
        m, ref = model(), model()
        records: list[Record] = []
        torch._dynamo.reset()
        with torch._dynamo.config.patch(specialize_float=specialize):
            y = torch.compile(m, backend=backend(records=records), dynamic=True)(x)
        torch.testing.assert_close(y, ref(x), rtol=1e-12, atol=1e-12)
        bn = [r for r in records if "batch_norm" in r.pattern]
        left = [r for r in bn if not r.fused]
        if fused:
            assert bn and not left, records
        else:  # (Dynamo may also compile a second, specialised graph)
            assert left and all("specialize_float" in r.reason for r in left), records


class Shared(nn.Module):
    """ResNet's single ReLU applied twice, an intermediate needed elsewhere, a BN output
    read twice, and a tensor written between a chain's first and last node."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Conv2d(2, 2, 3, padding=1) for _ in range(3))
        self.bn = nn.BatchNorm2d(2)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.relu(self.a(x))
        y = self.relu(self.b(y) + x)
        keep = self.c(y)  # also returned: the conv is fused alone, the relu left
        z = self.bn(keep)
        return torch.relu(keep) + z + z.tanh()


def test_shared_activation_and_intermediates_with_other_users():
    records, graphs = assert_matches_torch(Shared(), torch.randn(2, 2, 4, 4))
    assert _patterns(records) == [("conv2d+relu", True), ("conv2d+add+relu", True),
                                  ("conv2d", True), ("batch_norm", True)]
    assert records[2].reason.endswith("has 2 users")
    assert records[3].reason.endswith("has 2 users")
    assert torch_ops_left(graphs) == []


def test_channels_last():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 4, 1), nn.SiLU()).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 5, 5).to(memory_format=torch.channels_last)
    records, _ = assert_matches_torch(model, x)
    assert _patterns(records) == [("conv2d", True), ("batch_norm+relu", True),
                                  ("conv2d+silu", True)]


class IdentityFirst(nn.Module):
    """`x + bn(conv(x))`: torch's add takes the first operand's layout, the fused op the
    conv's; with channels_last weights and a contiguous x the two differ."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x):
        # a view: only torch's (contiguous) layout allows it; the conv's failed the compile
        return F.relu(x + self.bn(self.conv(x))).view(x.shape[0], -1)


def test_a_residual_add_of_another_layout_is_left_to_torch():
    model = IdentityFirst().to(memory_format=torch.channels_last)
    records, _ = assert_matches_torch(model, torch.randn(2, 3, 5, 5))
    assert _patterns(records) == [("conv2d", True), ("batch_norm", True)]
    assert "changes the memory layout" in records[1].reason


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.bn = nn.BatchNorm2d(2)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.bn(self.conv(x))  # bfloat16
            y = torch.relu(y + x)  # float32 residual: the add promotes, not fused
            return torch.relu(self.conv(y))


def test_autocast_fuses_the_casting_convolution_not_a_promoting_add():
    torch.manual_seed(0)
    model = Mixed()
    x = torch.randn(2, 2, 4, 4)
    compiled, records, graphs = compile_recorded(model)
    y = compiled(x)
    assert _patterns(records) == [("conv2d", True), ("batch_norm", True),
                                  ("conv2d+relu", True)]
    assert "changes dtype" in records[1].reason
    expected = model(x)
    assert y.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected.float(), rtol=0.05, atol=0.05)
    assert convfuse_ops(graphs) == 3


def test_parameters_are_the_graphs_own():
    """The fused ops read the module's own Parameters and buffers (the graph's placeholders),
    never copies: gradients land on them and the running statistics move in place."""
    model = nn.Sequential(nn.Conv2d(2, 2, 3), nn.BatchNorm2d(2), nn.ReLU())
    mean = model[1].running_mean
    compiled, records, graphs = compile_recorded(model)
    compiled(torch.randn(2, 2, 4, 4)).sum().backward()
    assert all(r.fused for r in records) and convfuse_ops(graphs) == 2
    assert model[0].weight.grad is not None and model[1].weight.grad is not None
    assert model[1].running_mean is mean and mean.abs().sum() > 0
    fused = [n for n in graphs[0].graph.nodes if n.op == "call_function"
             and ("convfuse" in str(n.target) or n.target.__name__ == "batchnorm_act")]
    assert all(a.op == "placeholder" for n in fused for a in n.args[1:3])


class GradSwitch(nn.Module):
    """A grad-mode switch inside the forward: a compile leaves what it separates."""

    def __init__(self):
        super().__init__()
        self.c, self.c2 = nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 3, 1)

    def forward(self, x):
        y = self.c(x)
        with torch.no_grad():
            z = self.c2(x)
        return F.relu(y + z)


def test_explain_reports_what_a_compile_in_the_callers_grad_mode_does():
    model, x = GradSwitch(), torch.randn(2, 3, 5, 5)
    report = ct.explain(model, x)
    compiled, records, _ = compile_recorded(model, "eager")
    compiled(x)  # grad mode on, as the caller's
    assert [(r.pattern, r.fused, r.reason) for r in report] == \
        [(r.pattern, r.fused, r.reason) for r in records]
    assert all("switches grad mode" in r.reason for r in records)  # explain ran under
    # no_grad before, where Dynamo saw no switch and reported conv2d+add+relu fused


def test_explain_table_and_records_and_state_restored():
    model = Shared()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = ct.explain(model, torch.randn(2, 2, 4, 4))
    assert [r.pattern for r in report.fused] == ["conv2d+relu", "conv2d+add+relu", "conv2d",
                                                 "batch_norm"]
    assert report.left == []
    table = str(report)
    assert "conv2d+add+relu" in table and "has 2 users" in table
    assert table.splitlines()[-1] == "4 chains fused (1 with a residual add), 0 left to the " \
        "inner backend"
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # explain's run undone


def test_backend_refuses_a_bad_inner():
    with pytest.raises(TypeError, match="inner must be"):
        ct.backend(inner=3)
    with pytest.raises(ValueError, match=r"inner=.nope. is not a torch\.compile backend"):
        ct.backend(inner="nope")  # at construction, not at the first compile
    with pytest.raises(ValueError, match="another backend than 'convfuse'"):
        ct.backend(inner="convfuse")
    for name in ("inductor", "aot_eager", "eager"):
        assert callable(ct.backend(inner=name))
    with pytest.raises(TypeError, match=r"^convfuse\.torch\.backend: records must be a list or "
                                        "None, got int"):
        ct.backend(records=5)  # at construction, not inside the first compile


def test_explain_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match=r"explain: model must be a torch\.nn\.Module, got str"):
        ct.explain("resnet18", torch.randn(1, 3, 8, 8))


class Refusals(nn.Module):
    """What convfuse cannot take stays torch's: an unbatched input, a functional batch norm
    with a bias but no weight."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3)
        self.bias = nn.Parameter(torch.randn(2))
        self.register_buffer("mean", torch.zeros(2))
        self.register_buffer("var", torch.ones(2))

    def forward(self, x):
        a = self.conv(x[0]).relu()  # (C, H, W)
        b = F.batch_norm(x, self.mean, self.var, None, self.bias, True).relu()
        return a.sum() + b.sum()


def test_refused_heads_stay_with_torch_and_say_why():
    records, graphs = assert_matches_torch(Refusals(), torch.randn(2, 2, 4, 4))
    assert [(r.pattern, r.fused, r.reason) for r in records] == [
        ("conv2d", False, "an unbatched input"),
        ("batch_norm", False, "a bias without a weight")]
    assert len(torch_ops_left(graphs)) == 2


class Plain(nn.Module):
    def __init__(self, inner_autocast: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.bn = nn.BatchNorm2d(2)
        self.inner = inner_autocast

    def forward(self, x):
        if self.inner:  # no dtype: the device's autocast dtype
            with torch.autocast("cpu"):
                return torch.relu(self.bn(self.conv(x)))
        return torch.relu(self.bn(self.conv(x)))


@pytest.mark.parametrize("where", ["outside", "inside_without_dtype"])
def test_autocast_around_the_compiled_model_or_without_a_dtype_fuses_the_convolution(where):
    """The usual AMP loop enters autocast outside the compiled function (no region in the
    graph: the ambient state, which dynamo guards on), and `torch.autocast("cpu")` names no
    dtype: either way the casting convolution is convfuse's, as inside a region."""
    torch.manual_seed(0)
    model = Plain(inner_autocast=where != "outside")
    x = torch.randn(2, 2, 4, 4)
    compiled, records, graphs = compile_recorded(model)
    torch._dynamo.reset()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "outside"):
            y = compiled(x)
            expected = model(x)
    finally:
        torch._dynamo.reset()
    assert _patterns(records) == [("conv2d", True), ("batch_norm+relu", True)]
    assert y.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected.float(), rtol=0.05, atol=0.05)
    assert convfuse_ops(graphs) == 2


class _FrozenBranch(nn.Module):
    """A frozen feature branch (under no_grad) added to a trainable one: fine-tuning."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        with torch.no_grad():
            f = self.frozen(x)
        return F.relu(f + self.head(x))


def test_a_chain_never_spans_a_grad_mode_switch():
    """The fused op runs where the chain ends: a conv computed under no_grad must not be
    fused into an add and activation after it, or the frozen branch gets gradients."""
    import copy

    torch.manual_seed(0)
    model = _FrozenBranch().double()
    ref = copy.deepcopy(model)
    compiled, records, _ = compile_recorded(model)
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y, yr = compiled(x), ref(xr)
    torch.testing.assert_close(y, yr, rtol=1e-12, atol=1e-12)
    y.sum().backward()
    yr.sum().backward()
    assert model.frozen.weight.grad is None and model.frozen.bias.grad is None
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model.head.weight.grad, ref.head.weight.grad, rtol=1e-12,
                               atol=1e-12)
    # the frozen conv fused alone (stopped at the switch), the head with the add and relu
    assert [(r.pattern, r.reason.endswith("switches grad mode in between"))
            for r in records] == [("conv2d", True), ("conv2d+add+relu", False)], records


class _GlobalContext(nn.Module):
    """GCNet / squeeze-excitation style: a conv on the pooled (N, C, 1, 1) context added to
    the full map, which broadcasts the conv's output."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(4, 4, 1)
        self.bn = nn.BatchNorm2d(4)
        self.t = nn.ConvTranspose2d(4, 4, 1)

    def forward(self, x):
        ctx = x.mean((2, 3), keepdim=True)
        return x + self.c(ctx) + F.relu(self.bn(self.c(ctx)) + x) + self.t(ctx)


def test_a_residual_add_that_broadcasts_the_chains_output_is_left_to_torch():
    records, _ = assert_matches_torch(_GlobalContext(), torch.randn(2, 4, 5, 5))
    assert any("changes the shape (2, 4, 1, 1) to (2, 4, 5, 5)" in r.reason
               for r in records), records


class _WritesBetween(nn.Module):
    """Writes into the conv's input between the conv and its activation, by spellings an
    in-place method name does not show."""

    def __init__(self, how):
        super().__init__()
        self.c = nn.Conv2d(3, 3, 3, padding=1)
        self.how = how

    def forward(self, x):
        if self.how == "view":
            x = x * 1
            y = self.c(x[:, :, 1:])
            x.relu_()  # the base of the conv's input
        elif self.how == "mT":
            x = x * 1
            y = self.c(x.mT)  # a view by an op no list of view names has
            x.relu_()
        else:
            y = self.c(x)
            if self.how == "setitem":
                x[:, 0] = 0.0
            else:
                torch.mul(x, 2.0, out=x)
        return F.relu(y)


@pytest.mark.parametrize("how", ["setitem", "out", "view", "mT"])
def test_a_write_into_the_heads_input_in_between_stops_the_chain(how):
    import copy

    torch.manual_seed(0)
    model = _WritesBetween(how)
    ref = copy.deepcopy(model)
    compiled, records, _ = compile_recorded(model)
    x = torch.randn(2, 3, 5, 5)
    with torch.no_grad():  # eager is right here (with autograd it refuses the write)
        y, yr = compiled(x.clone()), ref(x.clone())
    torch.testing.assert_close(y, yr, rtol=1e-6, atol=1e-6)
    assert [r.pattern for r in records if r.fused] == ["conv2d"], records


class _ResidualWrittenBeforeTheActivation(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.c, self.how = nn.Conv2d(3, 3, 3, padding=1), how

    def forward(self, x, r):
        y = self.c(x) + r  # the add reads r here
        if self.how == "view":
            r.view(-1).mul_(3.0)
        else:
            r.mul_(2.0)  # then r is written: the activation must not see the new r
        return torch.relu(y)


@pytest.mark.parametrize("how", ["direct", "view"])
def test_a_write_into_the_residual_before_the_activation_stops_the_chain(how):
    """The fused op reads the residual at the activation: a write into it after the add
    (directly or through a view) keeps the activation out of the chain (it was fused, and
    the activation saw the new residual)."""
    import copy

    torch.manual_seed(0)
    model = _ResidualWrittenBeforeTheActivation(how).double()
    ref = copy.deepcopy(model)
    compiled, records, _ = compile_recorded(model)
    x, r = torch.randn(2, 3, 5, 5, dtype=torch.float64), torch.randn(2, 3, 5, 5,
                                                                    dtype=torch.float64)
    with torch.no_grad():
        y, yr = compiled(x.clone(), r.clone()), ref(x.clone(), r.clone())
    torch.testing.assert_close(y, yr, rtol=1e-12, atol=1e-12)
    assert [r.pattern for r in records if r.fused] == ["conv2d+add"], records


class _StatisticsReadBeforeTheActivation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x):
        view = self.bn.running_mean[:2]
        y = self.bn(x)
        snap = view.clone()  # the statistics as the batch norm left them
        return torch.relu(y), snap


def test_a_read_of_the_statistics_through_a_view_stops_the_chain():
    """The fused batch norm updates the running statistics at the chain's last node: a
    read of them through a view before that keeps the activation out (it read the old
    statistics)."""
    import copy

    torch.manual_seed(0)
    model = _StatisticsReadBeforeTheActivation().double().train()
    ref = copy.deepcopy(model)
    compiled, records, _ = compile_recorded(model)
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        (y, snap), (yr, snapr) = compiled(x.clone()), ref(x.clone())
    torch.testing.assert_close((y, snap), (yr, snapr), rtol=1e-12, atol=1e-12)
    assert not any(r.fused and "relu" in r.pattern for r in records), records
