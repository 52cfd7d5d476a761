"""torch.compile(backend=convfuse) where fusing would change what a program computes or
make a valid one fail: an activation given out=, writes the chain's inputs see only by
an aten schema, a `_foreach_` list or not at all, a weight an earlier fused chain
computes, an activation's output written in place later; and convert() on a convolution
whose padding was reassigned. Each compared with torch.nn in float64."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import convfuse.torch as ct  # noqa: E402
from tests._backend_helpers import assert_matches_torch, compile_recorded  # noqa: E402


def _forward_only(model, x):
    """(compiled output, torch's, records): float64, no autograd (out= allows none)."""
    model = model.double().requires_grad_(False)
    ref = copy.deepcopy(model)
    compiled, records, _ = compile_recorded(model)
    x = x.double()
    return compiled(x), ref(x), records


class _Conv(nn.Module):
    def __init__(self, forward):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.f = forward

    def forward(self, x):
        return self.f(self, x)


def _sigmoid_out(m, x):
    buf = torch.zeros_like(x)
    torch.sigmoid(m.conv(x), out=buf)
    return buf


def _tanh_out(m, x):
    buf = torch.zeros_like(x)
    torch.tanh(m.conv(x), out=buf)
    return buf * 2


def _sigmoid_out_after_add(m, x):
    buf = torch.zeros_like(x)
    torch.sigmoid(m.conv(x) + x, out=buf)
    return buf


@pytest.mark.parametrize("forward", [_sigmoid_out, _tanh_out, _sigmoid_out_after_add])
def test_activation_with_out_is_left_to_torch(forward):
    y, ref, records = _forward_only(_Conv(forward), torch.randn(2, 4, 6, 6))
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    assert records[0].reason == "an activation with out="


@torch._dynamo.allow_in_graph
def _scale_(t):  # kept a call in the graph: what it writes cannot be read off it
    t.mul_(2.0)


_WRITES = {
    "aten.mul_": lambda h: torch.ops.aten.mul_(h, 2.0),
    "aten.mul_.Scalar": lambda h: torch.ops.aten.mul_.Scalar(h, 2.0),
    "aten.copy_": lambda h: torch.ops.aten.copy_(h, h * 2),
    "_foreach_add_": lambda h: torch._foreach_add_([h], 1.0),
    "_foreach_mul_ list": lambda h: torch._foreach_mul_([h * 1, h], 2.0),
    "allow_in_graph": _scale_,
}


@pytest.mark.parametrize("write", _WRITES.values(), ids=list(_WRITES))
def test_write_into_the_conv_input_stops_the_chain(write):
    """The fused op reads the convolution's input at the activation: a write in between,
    by any spelling, keeps the activation torch's."""

    def forward(m, x):
        h = x * 1.0
        y = m.conv(h)
        write(h)
        return F.relu(y)

    y, ref, records = _forward_only(_Conv(forward), torch.randn(2, 4, 6, 6))
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    assert [r.pattern for r in records] == ["conv2d"]


class _DynamicFilter(nn.Module):
    """Kernels predicted by a convolution (fused) and used as another's weight."""

    def __init__(self):
        super().__init__()
        self.gen = nn.Conv1d(3, 3, 1)

    def forward(self, x, z):
        return F.conv1d(x, torch.tanh(self.gen(z)), padding=1).relu()


def test_weight_computed_by_a_fused_chain():
    torch.manual_seed(0)
    x, z = torch.randn(2, 3, 9), torch.randn(5, 3, 2)
    records, _ = assert_matches_torch(_DynamicFilter(), x, z)
    assert [(r.pattern, r.fused) for r in records] == [("conv1d+tanh", True),
                                                       ("conv1d+relu", True)]
    assert len(ct.explain(_DynamicFilter(), x, z).fused) == 2


_SAVE_INPUT = {"leaky_relu": F.leaky_relu, "relu6": F.relu6,
               "hardtanh(0, 6)": lambda t: F.hardtanh(t, 0.0, 6.0)}


class _WrittenAfter(nn.Module):
    """act(conv(x)) or act(bn(conv(x))), its output then written in place: torch's
    leaky_relu and hardtanh saved their input, so torch's backward runs."""

    def __init__(self, act, bn, write):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4) if bn else nn.Identity()
        self.act, self.write = act, write

    def forward(self, x, skip):
        y = self.act(self.bn(self.conv(x)))
        if self.write == "add":
            y += skip
        else:
            y.view(-1).add_(skip.view(-1))  # through a view
        return y * 1


@pytest.mark.parametrize("write", ["add", "view"])
@pytest.mark.parametrize("bn", [False, True], ids=["conv", "batch_norm"])
@pytest.mark.parametrize("act", _SAVE_INPUT.values(), ids=list(_SAVE_INPUT))
def test_activation_output_written_in_place_later(act, bn, write):
    torch.manual_seed(0)
    model = _WrittenAfter(act, bn, write)
    records, _ = assert_matches_torch(model, torch.randn(2, 4, 6, 6), torch.randn(2, 4, 6, 6))
    last = records[-1]
    assert last.pattern == ("batch_norm" if bn else "conv2d") and "in place" in last.reason


def test_activation_output_returned_then_written_in_place():
    """The caller (or the graph after a graph break) may write a returned tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.LeakyReLU()).double()
    ref = copy.deepcopy(model)
    compiled, records, _ = compile_recorded(model)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    for m, t in ((compiled, x), (ref, xr)):
        y = m(t)
        y += 1
        y.square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-12, atol=1e-12)
    assert records[0].pattern == "conv2d" and "output of the graph" in records[0].reason


def test_in_place_spelling_still_fuses():
    """torch's leaky_relu_ saves its output as the fused op does: nothing to refuse."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.LeakyReLU(inplace=True))
    records, _ = assert_matches_torch(model, torch.randn(2, 4, 6, 6))
    assert [r.pattern for r in records] == ["conv2d+leaky_relu"]


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_convert_keeps_the_padding_torch_pads_by(mode):
    """torch.nn pads a padding_mode other than 'zeros' by the padding it was built with,
    whatever `padding` is reassigned to."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3, padding=1, padding_mode=mode).double()
    conv.padding = (2, 2)
    x = torch.randn(1, 3, 6, 6, dtype=torch.float64)
    ref = conv(x)
    new = ct.convert(copy.deepcopy(conv))
    assert isinstance(new, ct.Conv2d)
    torch.testing.assert_close(new(x), ref, rtol=1e-12, atol=1e-12)


def _transposed_branch(m, x):
    y = m.conv(x)
    s = x.mean(1).mT  # a getattr node (a view): it writes nothing
    return F.relu(y) + s.sum()


def _sorted_branch(m, x):
    y = m.conv(x)
    s = x.flatten(2).sort(-1).values  # an out-of-place sort (not TorchScript's list sort_)
    return F.relu(y) + s.sum()


@pytest.mark.parametrize("forward", [_transposed_branch, _sorted_branch])
def test_reads_in_between_do_not_stop_a_chain(forward):
    """Being careful about writes must not refuse what writes nothing: a `.mT` (Dynamo's
    getattr) and a sort (whose name also matches a list overload that sorts in place)."""
    torch.manual_seed(0)
    records, _ = assert_matches_torch(_Conv(forward), torch.randn(2, 4, 6, 6))
    assert [r.pattern for r in records if r.fused] == ["conv2d+relu"]
