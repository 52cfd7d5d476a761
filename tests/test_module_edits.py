"""torch.nn.Module's editing API on native layers, against torch.nn as the oracle:
Sequential's del/insert/extend/pop (torch renumbers the children), train() reaching a
child's own override, and edits that must leave the model as it was when refused."""

from __future__ import annotations

import numpy as np
import pytest

import convfuse as cf
from convfuse.errors import ArrayTooLargeError, StateDictError

torch = pytest.importorskip("torch")


def _names(seq):
    return [(name, type(m).__name__.replace("Identity", "I").replace("ReLU", "R")
             .replace("Tanh", "T").replace("Sigmoid", "S")) for name, m in seq.named_children()]


def _pair():
    return (cf.Sequential(cf.ReLU(), cf.Identity(), cf.ReLU()),
            torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Identity(), torch.nn.ReLU()))


@pytest.mark.parametrize("edit", [
    lambda seq, m: seq.__delitem__(0),
    lambda seq, m: seq.__delitem__(-1),
    lambda seq, m: seq.__delitem__(slice(0, 2)),
    lambda seq, m: seq.insert(0, m.Identity()),
    lambda seq, m: seq.insert(-1, m.Identity()),
    lambda seq, m: seq.insert(3, m.Identity()),
    lambda seq, m: seq.extend([m.Identity(), m.ReLU()]),
    lambda seq, m: seq.pop(1),
    lambda seq, m: seq.__setitem__(np.int64(1), m.ReLU()),
], ids=["del0", "del-1", "delslice", "insert0", "insert-1", "insert3", "extend", "pop", "setnp"])
def test_sequential_edits_name_and_order_as_torch(edit):
    ours, theirs = _pair()
    edit(ours, cf)
    edit(theirs, torch.nn)
    assert _names(ours) == _names(theirs)
    x = np.linspace(-1, 1, 6).reshape(2, 3)
    np.testing.assert_array_equal(ours(x), theirs(torch.tensor(x)).numpy())


def test_sequential_edit_refusals_change_nothing():
    seq = cf.Sequential(cf.ReLU(), cf.ReLU())
    with pytest.raises(IndexError, match=r"Sequential.insert: index 3 is out of range"):
        seq.insert(3, cf.ReLU())
    with pytest.raises(TypeError, match=r"Sequential.extend: int is not a convfuse layer"):
        seq.extend([cf.ReLU(), 3])
    with pytest.raises(IndexError, match="index 2 is out of range for 2 layers"):
        del seq[2]
    with pytest.raises(TypeError, match="index must be an int or a slice, got str"):
        del seq["0"]
    assert _names(seq) == [("0", "R"), ("1", "R")]


@pytest.mark.parametrize("edit", [lambda s: s.__delitem__(1), lambda s: s.pop(1),
                                  lambda s: s.insert(1, cf.Identity()),
                                  lambda s: s.__setitem__(1, cf.Identity()),
                                  lambda s: s.append(cf.Identity()),
                                  lambda s: s.extend([cf.Identity()]),
                                  lambda s: s.add_module("extra", cf.Identity()),
                                  lambda s: setattr(s, "extra", cf.Identity()),
                                  lambda s: setattr(s, "1", None),
                                  lambda s: setattr(s, "1", cf.Parameter(np.zeros(1)))],
                         ids=["del", "pop", "insert", "setitem", "append", "extend",
                              "add_module", "setattr", "setattr-None", "setattr-Parameter"])
def test_an_edit_between_forward_and_backward_drops_the_context(edit):
    """The backward would run the edited list's layers, not the forward's (a silently
    wrong dx): refused, as a backward without a forward is."""
    rng = np.random.default_rng(5)
    seq = cf.Sequential(cf.Linear(3, 3, dtype="float64", seed=0), cf.ReLU(),
                        cf.Linear(3, 2, dtype="float64", seed=1))
    seq(rng.standard_normal((4, 3)))
    edit(seq)
    with pytest.raises(cf.BackwardBeforeForwardError):
        seq.backward(np.ones((4, 2)))


def test_a_folded_numbered_sequential_is_renumbered_and_appends_safely():
    """A gap ("0", "3") made a later append reuse "3" and replace that layer; a child named
    as add_module allows ("_stem") folds too."""
    m = cf.Sequential(cf.Conv2d(3, 4, 3, seed=0), cf.BatchNorm2d(4), cf.ReLU(),
                      cf.Conv2d(4, 5, 3, seed=1)).eval()
    folded = cf.nn.fold_batchnorm(m)
    folded.append(cf.Flatten())
    folded.append(cf.Identity())
    assert [type(c).__name__ for _, c in folded.named_children()] == \
        ["Conv2d", "Conv2d", "Flatten", "Identity"]
    stem = cf.Sequential()
    stem.add_module("_stem", cf.Conv2d(3, 4, 3, dtype="float64", seed=0))
    stem.add_module("bn", cf.BatchNorm2d(4, dtype="float64"))
    stem.eval()
    x = np.random.default_rng(6).standard_normal((1, 3, 5, 5))
    folded = cf.nn.fold_batchnorm(stem)
    assert [n for n, _ in folded.named_children()] == ["_stem"]
    np.testing.assert_allclose(folded(x), stem(x), rtol=1e-12, atol=1e-14)


def test_a_removed_first_layer_hands_needs_input_grad_on():
    """needs_input_grad flows to the first layer: after deleting it (or inserting before
    it) the new first layer takes the Sequential's flag, the others pass gradients on."""
    a, b, c = cf.ReLU(), cf.ReLU(), cf.ReLU()
    seq = cf.Sequential(a, b)
    seq.needs_input_grad = False
    del seq[0]
    assert b.needs_input_grad is False and seq.needs_input_grad is False
    seq.insert(0, c)
    assert (c.needs_input_grad, b.needs_input_grad) == (False, True)
    seq.append(a)
    assert a.needs_input_grad is True


def test_reading_a_slice_changes_nothing():
    a, b = cf.ReLU(), cf.ReLU()
    seq = cf.Sequential(a, b)
    seq.needs_input_grad = False
    part = seq[::-1]
    assert [m is n for m, n in zip(part, (b, a))] == [True, True]
    assert (a.needs_input_grad, b.needs_input_grad, seq.needs_input_grad) == (False, True, False)


class _FrozenBN(cf.nn.Module):
    """The torch idiom: a block that keeps its BatchNorm in eval whatever its parent's mode."""

    def __init__(self, bn):
        self.bn = bn

    def train(self, mode=True):
        super().train(mode)
        self.bn.eval()
        return self

    def forward(self, x):
        return self.bn(x)

    def backward(self, dy):
        return self.bn.backward(dy)


class _TorchFrozenBN(torch.nn.Module):
    def __init__(self, bn):
        super().__init__()
        self.bn = bn

    def train(self, mode=True):
        super().train(mode)
        self.bn.eval()
        return self

    def forward(self, x):
        return self.bn(x)


def test_train_calls_each_childs_own_train_as_torch():
    rng = np.random.default_rng(0)
    ours = cf.Sequential(_FrozenBN(cf.BatchNorm2d(2, dtype="float64", device="cpu")))
    theirs = torch.nn.Sequential(_TorchFrozenBN(torch.nn.BatchNorm2d(2).double()))
    stats = {"running_mean": rng.standard_normal(2), "running_var": rng.uniform(0.5, 2, 2)}
    ours.load_state_dict({f"0.bn.{k}": v for k, v in stats.items()}, strict=False)
    theirs.load_state_dict({f"0.bn.{k}": torch.tensor(v) for k, v in stats.items()},
                           strict=False)
    assert ours.train() is ours
    theirs.train()
    assert [m.training for m in ours.modules()] == [m.training for m in theirs.modules()] == \
        [True, True, False]
    x = rng.standard_normal((3, 2, 2, 2))
    np.testing.assert_allclose(ours(x), theirs(torch.tensor(x)).detach().numpy(), rtol=1e-12)
    np.testing.assert_array_equal(ours[0].bn.running_mean, stats["running_mean"])


def test_fold_batchnorm_keeps_a_named_sequentials_names():
    """A forward that reaches a child by name, and a checkpoint's keys, survive folding:
    an unfused layer keeps its name, a fused Conv -> BatchNorm takes the conv's."""

    class Net(cf.nn.Module):
        def __init__(self):
            self.features = cf.Sequential({"conv": cf.Conv2d(2, 3, 3, dtype="float64", seed=0),
                                           "bn": cf.BatchNorm2d(3, dtype="float64"),
                                           "act": cf.ReLU()})
            self.head = cf.Sequential({"flat": cf.Flatten(),
                                       "fc": cf.Linear(12, 2, dtype="float64", seed=1)})

        def forward(self, x):
            return self.head.fc(self.head.flat(self.features(x)))

    net = Net().eval()
    net.features.bn.running_mean[...] = [0.1, -0.2, 0.3]
    x = np.random.default_rng(1).standard_normal((2, 2, 4, 4))
    folded = cf.nn.fold_batchnorm(net)
    assert list(folded.state_dict()) == ["features.conv.weight", "features.conv.bias",
                                         "head.fc.weight", "head.fc.bias"]
    np.testing.assert_allclose(folded(x), net(x), rtol=1e-12, atol=1e-14)


def test_a_parameter_of_a_fortran_ordered_array_has_a_contiguous_grad():
    """A weight ported as a transpose (F order) must still train: its gradient buffer,
    which backward accumulates into, is C-contiguous (and zero_grad's new one too)."""
    rng = np.random.default_rng(2)
    lin = cf.Linear(3, 4, dtype="float64", device="cpu")
    w = rng.standard_normal((3, 4)).T
    lin.weight = cf.Parameter(w)
    assert lin.weight.grad.flags.c_contiguous
    x, dy = rng.standard_normal((5, 3)), rng.standard_normal((5, 4))
    lin(x)
    lin.backward(dy)
    np.testing.assert_allclose(lin.weight.grad, dy.T @ x, rtol=1e-12)
    lin.weight.grad = None
    lin.weight.zero_grad()
    assert lin.weight.grad.flags.c_contiguous


def test_load_state_dict_into_a_read_only_buffer_loads_nothing():
    class Holder(cf.nn.Module):
        def __init__(self):
            self.register_buffer("table", np.broadcast_to(np.arange(3.0), (2, 3)))

    seq = cf.Sequential(cf.Linear(2, 2, dtype="float64", seed=0), Holder())
    before = {k: np.array(v) for k, v in seq.state_dict().items()}
    with pytest.raises(StateDictError, match=r"1.table: the model's array is read-only"):
        seq.load_state_dict({k: v + 1 for k, v in before.items()})
    for k, v in seq.state_dict().items():
        np.testing.assert_array_equal(v, before[k])


def test_adaptive_pool_output_is_held_to_max_array_bytes():
    """README: a pooling layer's output over the limit is refused before it is allocated;
    an adaptive pool's can be far larger than its input."""
    pool = cf.AdaptiveAvgPool2d(1000)
    with cf.config.flags(max_array_bytes=10**6), \
            pytest.raises(ArrayTooLargeError, match=r"^AdaptiveAvgPool2d: output"):
        pool(np.ones((1, 1, 3, 3), np.float32))


@pytest.mark.parametrize("lead", [(), (4,), (2, 3), (2, 0, 3)])
def test_linear_takes_any_leading_dims_as_torch(lead):
    rng = np.random.default_rng(3)
    ours = cf.Linear(5, 4, activation="relu", dtype="float64", device="cpu", seed=0)
    theirs = torch.nn.Linear(5, 4).double()
    with torch.no_grad():
        theirs.weight.copy_(torch.tensor(ours.weight.data))
        theirs.bias.copy_(torch.tensor(ours.bias.data))
    x = rng.standard_normal((*lead, 5))
    dy = rng.standard_normal((*lead, 4))
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.relu(theirs(xt))
    yt.backward(torch.tensor(dy))
    y = ours(x)
    assert y.shape == (*lead, 4)
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match=r"^Linear: dy has shape \(1, 4\)"):
        ours.backward(np.zeros((1, 4)))  # the forward's shape, not its row count
    dx = ours.backward(dy)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(ours.weight.grad, theirs.weight.grad.numpy(), rtol=1e-12,
                               atol=1e-14)
    with pytest.raises(ValueError, match=r"^Linear: expects input of shape \(\*, 5\), got "
                                         r"\(2, 4\)"):
        ours(np.zeros((2, 4)))


class _Tower(cf.nn.Module):
    """A model that keeps its blocks in a ModuleList, as torch models do."""

    def __init__(self, list_type):
        self.blocks = list_type(cf.Linear(3, 3, dtype="float64", seed=i) for i in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def backward(self, dy):
        for block in reversed(list(self.blocks)):
            dy = block.backward(dy)
        return dy


class _TorchTower(torch.nn.Module):
    def __init__(self, ours):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(3, 3).double() for _ in range(3))
        self.load_state_dict({k: torch.tensor(v) for k, v in ours.state_dict().items()})

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_module_list_registers_its_layers_as_torch():
    """A plain list hides its layers from parameters() and state_dict(); a ModuleList
    holds them with torch's keys, and the model trains as torch's."""
    ours = _Tower(cf.ModuleList)
    theirs = _TorchTower(ours)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert len(ours.parameters()) == 6
    x = np.random.default_rng(4).standard_normal((2, 3))
    xt = torch.tensor(x, requires_grad=True)
    yt = theirs(xt)
    yt.backward(torch.ones_like(yt))
    np.testing.assert_allclose(ours(x), yt.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(ours.backward(np.ones((2, 3))), xt.grad.numpy(), rtol=1e-12)
    ours.eval()
    assert not any(m.training for m in ours.modules())
    assert ours.get_submodule("blocks.1") is ours.blocks[1]


def test_module_list_edits_as_torch():
    ours = cf.ModuleList([cf.ReLU(), cf.Identity()])
    theirs = torch.nn.ModuleList([torch.nn.ReLU(), torch.nn.Identity()])
    for m, lib in ((ours, cf), (theirs, torch.nn)):
        m.append(lib.ReLU())
        m.insert(0, lib.Identity())
        m.extend([lib.ReLU()])
        m += [lib.Identity()]
        del m[1]
        m[0] = lib.ReLU()
        m.pop(-1)
    assert _names(ours) == _names(theirs)
    assert _names(ours[1:]) == _names(theirs[1:])
    assert _names(ours + cf.ModuleList([cf.Identity()])) == \
        _names(theirs + torch.nn.ModuleList([torch.nn.Identity()]))
    with pytest.raises(TypeError, match=r"^ModuleList.append: int is not a convfuse layer"):
        ours.append(3)
    with pytest.raises(TypeError, match=r"^ModuleList.extend: layers must be an iterable"):
        cf.ModuleList(5)
    with pytest.raises(IndexError, match=r"^ModuleList: index 9 is out of range for"):
        ours[9]
    with pytest.raises(NotImplementedError):
        ours(np.zeros(2))


def test_register_parameter_and_get_submodule_as_torch():
    m = cf.Sequential(cf.Linear(2, 2, seed=0))
    p = cf.Parameter(np.ones(3))
    m[0].register_parameter("scale", p)
    assert m[0].scale is p and "0.scale" in m.state_dict()
    m[0].register_parameter("shift", None)
    assert "0.shift" not in m.state_dict()
    with pytest.raises(KeyError, match=r"parameter name 'a.b' can't be empty or contain"):
        m[0].register_parameter("a.b", p)
    with pytest.raises(TypeError, match=r"'w' is a ndarray, not a convfuse Parameter"):
        m[0].register_parameter("w", np.ones(2))
    with pytest.raises(KeyError, match=r"attribute 'forward' already exists"):
        m[0].register_parameter("forward", p)
    assert m.get_submodule("") is m and m.get_submodule("0") is m[0]
    with pytest.raises(AttributeError, match=r"Linear has no child module 'x' \(in '0.x'\)"):
        m.get_submodule("0.x")
