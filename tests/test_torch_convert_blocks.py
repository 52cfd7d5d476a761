"""convert() of torchvision's and timm's residual blocks (Note [residual blocks] in
convfuse/torch/_convert_blocks.py): BasicBlock and Bottleneck become blocks whose batch norms
take the ReLU and the last one the identity, and MobileNet's inverted residual blocks (Note
[inverted residual blocks]) blocks whose last batch norm adds the input, with the same
numbers as torch.nn in float64 (outputs, gradients, running statistics, optimizer steps;
train and eval), the same state-dict keys and Parameter objects, one ReLU node left in
ResNet-18's graph instead of 17 and no add node in MobileNet's; anything that could make a
block compute something else keeps the block as it is."""

from __future__ import annotations

import copy
import io
import warnings

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import convfuse.torch as ct  # noqa: E402
from convfuse.torch import _convert_blocks  # noqa: E402
from tests._zoo import import_timm, import_torchvision  # noqa: E402

F64 = torch.float64


def _models(name, **kwargs):
    """(torchvision, torch.nn model, its conversion); `name` "timm:..." is timm's model."""
    tv = import_torchvision()
    torch.manual_seed(0)
    if name.startswith("timm:"):
        theirs = import_timm().create_model(name[5:], pretrained=False, **kwargs)
    else:
        theirs = getattr(tv.models, name)(**kwargs)
    theirs = theirs.to(F64)
    return tv, theirs, ct.convert(copy.deepcopy(theirs))


def _nodes(y, name):
    """How many autograd nodes of `y`'s graph have `name` in their type's name."""
    seen, todo, count = set(), [y.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += name in type(node).__name__
        todo += [n for n, _ in node.next_functions]
    return count


def _close(got, want, what):
    scale = max(want.abs().max().item(), 1.0)
    assert (got - want).abs().max().item() <= 1e-9 * scale, what


CASES = {  # model -> (its blocks' fused class, the activation the batch norms take)
    "resnet18": ("FusedBasicBlock", "relu"), "resnet50": ("FusedBottleneck", "relu"),
    "timm:resnet18": ("FusedTimmBasicBlock", "relu"),
    "timm:resnet50d": ("FusedTimmBottleneck", "relu"),  # average-pool downsample
    "timm:resnet26t": ("FusedTimmBottleneck", "relu"),  # deep stem
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_converted_resnet_trains_as_torch_nn_does(name):
    _, theirs, ours = _models(name)
    fused, act = CASES[name]
    blocks = [m for m in ours.modules() if type(m).__name__.startswith("Fused")]
    assert blocks and all(type(m).__name__ == fused for m in blocks)
    assert len(blocks) == sum(type(m).__name__ in ("BasicBlock", "Bottleneck")
                              for m in theirs.modules())
    for m in blocks:
        assert all(getattr(m, bn).activation == act for _, bn in m._fused_pairs)
    assert list(ours.state_dict()) == list(theirs.state_dict())

    def first_step(ya, yb):
        if name in ("resnet18", "timm:resnet18"):
            assert _nodes(ya, "ReluBackward") == 17 and _nodes(yb, "ReluBackward") == 1
            assert _nodes(yb, "AddBackward") == 0

    _train_alike(theirs, ours, first_step)


def _train_alike(theirs, ours, first_step, lr=0.1):
    """Two SGD steps and an evaluation of both models on the same data, compared in
    float64; `first_step(y_theirs, y_ours)` looks at the first step's graphs."""
    opt_a = torch.optim.SGD(theirs.parameters(), lr=lr, momentum=0.9)
    opt_b = torch.optim.SGD(ours.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(2, 3, 64, 64, dtype=F64, generator=g)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = theirs(xa), ours(xb)
        _close(yb, ya, f"output, step {step}")
        if step == 0:
            first_step(ya, yb)
        dy = torch.randn(ya.shape, dtype=F64, generator=g)
        ya.backward(dy)
        yb.backward(dy)
        _close(xb.grad, xa.grad, "input gradient")
        for (n, pa), pb in zip(theirs.named_parameters(), ours.parameters()):
            _close(pb.grad, pa.grad, n)
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    for (n, ba), bb in zip(theirs.named_buffers(), ours.buffers()):
        _close(bb.to(F64), ba.to(F64), n)
    theirs.eval()
    ours.eval()
    x = torch.randn(2, 3, 32, 32, dtype=F64, generator=g)
    with torch.no_grad():
        _close(ours(x), theirs(x), "eval output")


def test_a_converted_block_keeps_its_parameters_and_copies_and_pickles():
    tv, theirs, _ = _models("resnet18")
    model = copy.deepcopy(theirs)
    params = list(model.parameters())
    ct.convert(model)
    assert all(p is q for p, q in zip(params, model.parameters()))
    model.load_state_dict(theirs.state_dict())
    x = torch.randn(1, 3, 32, 32, dtype=F64)
    with torch.no_grad():
        want = model.eval()(x)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert type(loaded.layer1[0]).__name__ == "FusedBasicBlock"
        for other in (copy.deepcopy(model), loaded):
            torch.testing.assert_close(other.eval()(x), want, rtol=0, atol=0)
        assert isinstance(model.layer2[0], tv.models.resnet.BasicBlock)


def _block(tv, planes=4, downsample=True):
    torch.manual_seed(0)
    ds = nn.Sequential(nn.Conv2d(planes, planes, 1, bias=False), nn.BatchNorm2d(planes)) \
        if downsample else None
    return tv.models.resnet.BasicBlock(planes, planes, downsample=ds).to(F64)


def _agree(theirs, ours, channels=4):
    x = torch.randn(2, channels, 6, 6, dtype=F64, generator=torch.Generator().manual_seed(3))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = theirs(xa), ours(xb)
    torch.testing.assert_close(yb, ya, rtol=1e-12, atol=1e-12)
    ya.sum().backward()
    yb.sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("change", ["subclass", "subclass_forward", "instance_forward",
                                    "hook", "relu_hook", "silu", "bn_hook"])
def test_a_block_that_may_compute_something_else_is_kept(change):
    tv = import_torchvision()
    theirs = _block(tv)
    fired = []
    if change.startswith("subclass"):
        body = {} if change == "subclass" else {
            "forward": lambda self, x: tv.models.resnet.BasicBlock.forward(self, x) * 2}
        theirs.__class__ = type("Mine", (tv.models.resnet.BasicBlock,), body)
    elif change == "instance_forward":
        theirs.forward = lambda x: tv.models.resnet.BasicBlock.forward(theirs, x) - 1
    elif change == "hook":
        theirs.register_forward_hook(lambda m, i, o: fired.append(1))
    elif change == "relu_hook":
        theirs.relu.register_forward_hook(lambda m, i, o: fired.append(1))
    elif change == "silu":
        theirs.relu = nn.SiLU()
    else:
        theirs.bn2.register_forward_hook(lambda m, i, o: fired.append(1))
    ours = copy.deepcopy(theirs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ct.convert(ours)
    assert type(ours) is type(theirs)
    assert isinstance(ours.conv1, ct.Conv2d)
    assert isinstance(ours.bn2, ct.BatchNorm2d) != (change == "bn_hook")
    assert ours.bn1.activation == "identity"
    assert len(caught) == (change == "bn_hook")  # the batch norm kept says why, once
    fired.clear()
    _agree(theirs, ours)
    assert len(fired) == 2 * (change in ("hook", "bn_hook")) + 4 * (change == "relu_hook")


def test_global_module_hooks_keep_every_activation_called():
    """A hook registered for every module's call (torch.nn.modules.module.
    register_module_forward_hook) must see the ReLUs: with one in place, convert() warns
    once, fuses no block and folds no activation; each hook sees what torch.nn's did."""
    tv = import_torchvision()
    block = _block(tv)
    seq = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.BatchNorm2d(2), nn.ReLU()).double()
    seen = []

    def hook(module, args, out):
        seen.append(type(module).__name__)
        return out * 2 if isinstance(module, nn.ReLU) else None  # changes the result

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        for theirs in (block, seq):
            ours = copy.deepcopy(theirs)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ct.convert(ours)
            assert [str(w.message) for w in caught if "every module" in str(w.message)] \
                and len(caught) == 1, [str(w.message) for w in caught]
            assert type(ours) is type(theirs) and isinstance(ours[1] if theirs is seq
                                                             else ours.bn2, ct.BatchNorm2d)
            x = torch.randn(2, 4 if theirs is block else 2, 5, 5, dtype=torch.float64)
            seen.clear()
            want = theirs(x)
            relus = seen.count("ReLU")
            seen.clear()
            torch.testing.assert_close(ours(x), want, rtol=1e-12, atol=1e-12)
            assert relus and seen.count("ReLU") == relus
    finally:
        handle.remove()
    # without it, both fuse again
    assert type(ct.convert(copy.deepcopy(block))).__name__ == "FusedBasicBlock"
    assert isinstance(ct.convert(copy.deepcopy(seq))[2], nn.Identity)


@pytest.mark.parametrize("downsample", [True, False])
def test_a_lone_block_converts_with_and_without_downsample(downsample):
    tv = import_torchvision()
    theirs = _block(tv, downsample=downsample)
    ours = ct.convert(copy.deepcopy(theirs))
    assert type(ours).__name__ == "FusedBasicBlock"
    assert ours.bn2.activation == "relu"
    _agree(theirs, ours)


def test_an_identity_in_another_dtype_is_cast_as_the_in_place_add_keeps_it():
    tv = import_torchvision()
    theirs = _block(tv, downsample=False).float()
    ours = ct.convert(copy.deepcopy(theirs))
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = theirs(x), ours(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)


def test_timm_blocks_take_their_own_activation():
    _, theirs, ours = _models("timm:resnet18", act_layer="silu")
    block = ours.layer1[0]
    assert type(block).__name__ == "FusedTimmBasicBlock"
    assert block.bn1.activation == block.bn2.activation == "silu"
    x = torch.randn(2, 3, 64, 64, dtype=F64)
    with torch.no_grad():
        _close(ours(x), theirs(x), "output")


@pytest.mark.parametrize("change", ["se", "drop_path", "version"])
def test_timm_blocks_with_optional_parts_or_another_release_are_kept(change, monkeypatch):
    timm = import_timm()
    if change == "version":
        monkeypatch.setattr(timm, "__version__", "1.1.0")
    kwargs = {"drop_path_rate": 0.1} if change == "drop_path" else {}
    _, theirs, ours = _models("timm:seresnet18" if change == "se" else "timm:resnet18",
                               **kwargs)
    block = ours.layer4[1]  # drop_path's rate grows with depth: 0 in the first block
    assert change != "drop_path" or block.drop_path is not None
    assert type(block) is timm.models.resnet.BasicBlock
    assert isinstance(block.conv1, ct.Conv2d) and isinstance(block.bn2, ct.BatchNorm2d)
    assert block.bn2.activation == "identity"
    theirs.eval()
    ours.eval()  # drop_path draws random numbers in training
    x = torch.randn(2, 3, 64, 64, dtype=F64)
    with torch.no_grad():
        _close(ours(x), theirs(x), "output")


def test_converting_twice_changes_nothing_and_compiles_in_one_graph():
    _, theirs, ours = _models("resnet18", num_classes=10)
    before = [type(m) for m in ours.modules()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ct.convert(ours) is ours
    assert not caught and [type(m) for m in ours.modules()] == before
    x = torch.randn(2, 3, 64, 64, dtype=F64)
    want = theirs(x)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
        got = compiled(x)  # the fused blocks' forward traces without a graph break
        got.sum().backward()
    finally:
        torch._dynamo.reset()
    _close(got, want, "compiled output")


# ---- Note [inverted residual blocks] ----------------------------------------------------

MOBILENETS = {  # model -> its blocks' fused classes
    "mobilenet_v2": {"FusedInvertedResidual"},
    "mobilenet_v3_small": {"FusedInvertedResidualV3"},
    "mobilenet_v3_large": {"FusedInvertedResidualV3"},
    "timm:efficientnet_b0": {"FusedTimmInvertedResidual"},
    "timm:mobilenetv3_large_100": {"FusedTimmInvertedResidual",
                                   "FusedTimmDepthwiseSeparableConv"},
    "timm:efficientnet_es": {"FusedTimmInvertedResidual", "FusedTimmEdgeResidual"},
}


def _skips(model):
    """The blocks that add their input: torchvision's `use_res_connect`, timm's `has_skip`."""
    return [m for m in model.modules() if getattr(m, "use_res_connect", None) is True
            or getattr(m, "has_skip", None) is True]


@pytest.mark.parametrize("name", sorted(MOBILENETS))
def test_a_converted_mobilenet_trains_as_torch_nn_does(name):
    _, theirs, ours = _models(name, **({} if name.startswith("timm:") else {"dropout": 0.0}))
    fused = [m for m in ours.modules() if type(m).__name__.startswith("Fused")]
    skips = _skips(theirs)
    assert skips and len(fused) == len(skips)
    assert {type(m).__name__ for m in fused} == MOBILENETS[name]
    for m in fused:
        bn = _convert_blocks.inverted_batchnorm(m, type(m).__name__)
        assert isinstance(bn, ct.BatchNorm2d) and bn.activation == "identity"
    assert list(ours.state_dict()) == list(theirs.state_dict())

    def first_step(ya, yb):
        assert _nodes(ya, "AddBackward") == len(skips) and _nodes(yb, "AddBackward") == 0

    # MobileNetV2's gradients reach hundreds here: at lr 0.1 (0.01) its second step is so
    # ill-conditioned that torch.nn and an unfused conversion already differ by 1e-7 (1e-9)
    _train_alike(theirs, ours, first_step, lr=0.001)


C = 8  # a lone inverted block's input channels (V3 rounds channels to multiples of 8)


def _inverted(tv, version, residual=True):
    """A lone inverted residual block of MobileNetV2 or V3 (float64), with a skip unless
    `residual` is False."""
    torch.manual_seed(0)
    out = C if residual else 2 * C
    if version == 2:
        block = tv.models.mobilenetv2.InvertedResidual(C, out, 1, 6)
    else:
        cnf = tv.models.mobilenetv3.InvertedResidualConfig(C, 3, 3 * C, out, True, "RE", 1, 1,
                                                           1.0)
        block = tv.models.mobilenetv3.InvertedResidual(cnf, nn.BatchNorm2d)
    return block.to(F64)


@pytest.mark.parametrize("version", [2, 3])
def test_a_lone_inverted_block_converts_copies_and_pickles(version):
    tv = import_torchvision()
    theirs = _inverted(tv, version)
    ours = ct.convert(copy.deepcopy(theirs))
    assert type(ours).__name__ == ("FusedInvertedResidual" if version == 2
                                   else "FusedInvertedResidualV3")
    _agree(theirs, ours, C)
    buf = io.BytesIO()
    torch.save(ours, buf)
    buf.seek(0)
    for other in (copy.deepcopy(ours), torch.load(buf, weights_only=False)):
        assert type(other) is type(ours)
        _agree(theirs, other, C)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ct.convert(ours) is ours and not caught  # converting again changes nothing
    assert type(ours).__name__.startswith("FusedInverted")


@pytest.mark.parametrize("change", ["no_skip", "subclass", "hook", "branch_hook",
                                    "inner_hook", "bn_hook", "skip_off_later"])
@pytest.mark.parametrize("version", [2, 3])
def test_an_inverted_block_that_may_compute_something_else_is_kept(version, change):
    tv = import_torchvision()
    theirs = _inverted(tv, version, residual=change != "no_skip")
    branch = theirs.conv if version == 2 else theirs.block
    fired = []

    def hook(*_):
        fired.append(1)

    if change == "subclass":
        theirs.__class__ = type("Mine", (type(theirs),), {})
    elif change == "hook":
        theirs.register_forward_hook(hook)
    elif change == "branch_hook":
        branch.register_forward_hook(hook)
    elif change == "inner_hook":  # V3's last child is walked through, V2's first is called
        branch[-1 if version == 3 else 0].register_forward_hook(hook)
    elif change == "bn_hook":
        (branch[-1][-1] if version == 3 else branch[-1]).register_forward_hook(hook)
    ours = copy.deepcopy(theirs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ct.convert(ours)
    if change == "skip_off_later":  # taken, then told to skip the add: the branch alone
        assert type(ours).__name__.startswith("FusedInverted")
        theirs.use_res_connect = ours.use_res_connect = False
    elif version == 2 and change == "inner_hook":  # called as before: its hook fires
        assert type(ours).__name__ == "FusedInvertedResidual"
    else:
        assert type(ours) is type(theirs)
    assert len(caught) == (change == "bn_hook")  # the batch norm kept says why, once
    fired.clear()
    _agree(theirs, ours, C)
    assert len(fired) == 2 * (change not in ("no_skip", "subclass", "skip_off_later"))


@pytest.mark.parametrize("version", [2, 3])
def test_an_inverted_blocks_add_rounds_as_torchs_when_autocast_leaves_the_input(version):
    """V2's `x + branch(x)` promotes to the input's float32; V3's `+=` keeps the branch's
    bfloat16."""
    tv = import_torchvision()
    theirs = _inverted(tv, version).float()
    ours = ct.convert(copy.deepcopy(theirs))
    assert type(ours).__name__.startswith("FusedInverted")
    x = torch.randn(2, C, 6, 6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = theirs(x), ours(x)
    assert got.dtype == want.dtype == (torch.float32 if version == 2 else torch.bfloat16)
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)


def _timm_block(kind, **kwargs):
    """A lone block of timm's EfficientNet family (float64), with a skip."""
    blocks = import_timm().models._efficientnet_blocks
    torch.manual_seed(0)
    if kind == "InvertedResidual":
        block = blocks.InvertedResidual(C, C, exp_ratio=3.0, **kwargs)
    elif kind == "DepthwiseSeparableConv":
        block = blocks.DepthwiseSeparableConv(C, C, **kwargs)
    else:
        block = blocks.EdgeResidual(C, C, exp_ratio=2.0, **kwargs)
    return block.to(F64)


@pytest.mark.parametrize("kind", ["InvertedResidual", "DepthwiseSeparableConv",
                                  "EdgeResidual"])
def test_a_lone_timm_block_converts_and_runs_its_branch_alone_without_the_skip(kind):
    theirs = _timm_block(kind)
    ours = ct.convert(copy.deepcopy(theirs))
    assert type(ours).__name__ == f"FusedTimm{kind}"
    last = ours.bn3 if kind == "InvertedResidual" else ours.bn2
    assert isinstance(last, ct.BatchNorm2d) and last.activation == "identity"
    _agree(theirs, ours, C)
    theirs.has_skip = ours.has_skip = False
    _agree(theirs, ours, C)


@pytest.mark.parametrize("change", ["drop_path", "pw_act", "version"])
def test_a_timm_block_whose_add_is_not_the_last_batch_norms_is_kept(change, monkeypatch):
    """drop_path scales the branch before the add; pw_act puts an activation between the
    batch norm and the add; another timm release may write another forward."""
    timm = import_timm()
    if change == "version":
        monkeypatch.setattr(timm, "__version__", "1.1.0")
    kind = "DepthwiseSeparableConv" if change == "pw_act" else "InvertedResidual"
    kwargs = {"drop_path_rate": 0.1} if change == "drop_path" else \
        {"pw_act": True} if change == "pw_act" else {}
    theirs = _timm_block(kind, **kwargs)
    ours = ct.convert(copy.deepcopy(theirs))
    assert type(ours) is type(theirs)
    last = ours.bn3 if kind == "InvertedResidual" else ours.bn2
    assert isinstance(last, ct.BatchNorm2d)
    assert last.activation == ("relu" if change == "pw_act" else "identity")
    theirs.eval()
    ours.eval()  # drop_path draws random numbers in training
    _agree(theirs, ours, C)


def test_random_draws_in_a_fused_block_come_in_torchvisions_order():
    """The fused block runs the shortcut after the branch, as torchvision's forward does:
    with dropout in both, the same seed gives the same masks and the same result."""
    tv = import_torchvision()
    theirs = _block(tv, downsample=True)
    theirs.downsample.append(nn.Dropout(0.5))
    theirs.conv2 = nn.Sequential(theirs.conv2, nn.Dropout(0.5))
    ours = ct.convert(copy.deepcopy(theirs))
    assert type(ours).__name__ == "FusedBasicBlock"
    x = torch.randn(2, 4, 6, 6, dtype=F64)
    torch.manual_seed(7)
    want = theirs(x)
    torch.manual_seed(7)
    torch.testing.assert_close(ours(x), want, rtol=1e-12, atol=1e-12)
