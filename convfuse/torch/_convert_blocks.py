"""convert()'s rule for the residual blocks whose forward it knows (Note [residual blocks]).

Note [residual blocks]
convert() sees module objects, not what a forward() does with them, so outside an
nn.Sequential it cannot fold an activation or a residual add: torchvision's ResNet block
ends in `out = self.bn2(out); out += identity; out = self.relu(out)`, three passes (and
three autograd nodes) where convfuse's batch norm is one call. For the blocks whose forward
it knows it does the rewrite itself: torchvision's `BasicBlock` and `Bottleneck` (ResNet,
ResNeXt, Wide ResNet) and timm 1.0's `BasicBlock` and `Bottleneck` (timm's ResNets and
their variants, where those blocks are plain). Each is a chain of conv -> batch norm ->
activation with the last batch norm's output added to the identity (the block's input, or
its downsample's output) before the last activation. A block is taken only when nothing can
differ from that: its class is exactly one of these (a subclass may compute anything), it
has no forward of its own on the instance, no hooks on it or its activations, each
activation is one convfuse has (torchvision's: its one ReLU, an exact nn.ReLU), timm's
optional parts are absent (`drop_block` and `aa` nn.Identity, no `se`, no `drop_path`), the
timm release is a 1.0 one (the forward the tests check), and every batch norm converts.
Then each batch norm becomes a convfuse BatchNorm with the activation after it, the last
one also takes the identity as its residual, and the block's class becomes a subclass of
its own (`FusedBasicBlock`, `FusedTimmBottleneck`, ...) whose forward makes those calls,
as torch.nn.utils.parametrize swaps a module's class. The submodules, attributes and
state-dict keys stay; the activation modules stay as submodules, unused. The downsample
runs after the main branch's last convolution, as the blocks' own forwards run it: a
downsample with dropout draws its random numbers in the same order. `out += identity` keeps `out`'s
dtype, so an identity of another dtype (an input torch.autocast left in float32) is cast to
the main branch's before the fused call, where torch.nn rounds the sum to that dtype
instead. The classes are made on first use from the library already imported (convert
never imports torchvision or timm), and are attributes of this module by name, so a pickled
converted model loads wherever that library is installed.

Note [inverted residual blocks]
MobileNet's and EfficientNet's blocks end the other way round: torchvision's MobileNetV2
`InvertedResidual` returns `x + self.conv(x)` and MobileNetV3's `result = self.block(input);
result += input` (when `use_res_connect`), the branch an nn.Sequential whose last module is
the projection's batch norm (V3: the last child of its last child, a Conv2dNormActivation
with no activation); timm 1.0's `InvertedResidual`, `DepthwiseSeparableConv` and
`EdgeResidual` (EfficientNet, MobileNetV3, MixNet, MnasNet, FBNet, ...) run named
submodules in a fixed order and end in `x = self.drop_path(x) + shortcut` (when
`has_skip`). No activation follows the add, so the fusion is batch norm + add: the last
batch norm takes the block's input as its residual, one pass instead of two. The rule's
conditions are those of Note [residual blocks], for the block and for the Sequentials the
fused forward walks through instead of calling (exactly nn.Sequential's forward, no hooks):
the block's class exactly the library's, its skip flag set, timm's `drop_path` an
nn.Identity (a DropPath scales the branch before the add) and a timm 1.0 release, and the
last batch norm converted with no activation of its own (timm's with `pw_act` has one
before the add). The fused forward runs the branch's modules in order (timm's absent
space-to-depth ones skipped, as timm's forward skips them) and hands the last batch norm the
residual; a block whose skip flag is false runs its branch alone, as before. The adds round
as torch's: V3's in-place add keeps the branch's dtype (the input is cast to it, as for
ResNet's), while V2's `x + branch` and timm's `branch + shortcut` promote, so where the
dtypes differ (an input autocast left in float32) those add after the batch norm as
torch.nn does.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import torch
from torch import nn

from ._convert_kinds import activation_of, runs_hooks


class Block(NamedTuple):
    """A block class convert knows: where it lives, its conv -> batch norm pairs in order,
    the activation after each batch norm, the parts that must be nn.Identity and those
    that must be None (Note [residual blocks])."""

    module: str
    name: str
    pairs: tuple[tuple[str, str], ...]
    acts: tuple[str, ...]
    relu_only: bool  # the activations must be exactly nn.ReLU (a forward that calls relu)
    identities: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()
    version: str = ""  # the release the library's __version__ must start with


_TWO = (("conv1", "bn1"), ("conv2", "bn2"))
_THREE = (*_TWO, ("conv3", "bn3"))
_TV, _TIMM = "torchvision.models.resnet", "timm.models.resnet"
_TIMM_PARTS = (("drop_block", "aa"), ("se", "drop_path"), "1.0.")
#: fused class name -> the block it fuses
BLOCKS = {
    "FusedBasicBlock": Block(_TV, "BasicBlock", _TWO, ("relu",) * 2, True),
    "FusedBottleneck": Block(_TV, "Bottleneck", _THREE, ("relu",) * 3, True),
    "FusedTimmBasicBlock": Block(_TIMM, "BasicBlock", _TWO, ("act1", "act2"), False,
                                 *_TIMM_PARTS),
    "FusedTimmBottleneck": Block(_TIMM, "Bottleneck", _THREE, ("act1", "act2", "act3"),
                                 False, *_TIMM_PARTS),
}


class Inverted(NamedTuple):
    """An inverted residual block convert knows (Note [inverted residual blocks]): where it
    lives, the attribute saying whether it adds its input, whether that add keeps the
    branch's dtype (in place) or promotes (`x + branch(x)`), and its branch: torchvision's
    an nn.Sequential attribute (`nested`: the last batch norm is the last child of its
    last child), timm's the submodules `chain` names, in forward order (an absent or None
    one skipped, as timm's forward skips it), then the batch norm `last`; `identities`
    must be nn.Identity, and `version` starts the library's __version__."""

    module: str
    name: str
    skip: str
    in_place: bool
    branch: str = ""
    nested: bool = False
    chain: tuple[str, ...] = ()
    last: str = ""
    identities: tuple[str, ...] = ()
    version: str = ""


_MOBILENET = "torchvision.models.mobilenetv"
_EFFICIENT = "timm.models._efficientnet_blocks"
_S2D = ("conv_s2d", "bn_s2d")


def _timm(name: str, chain: tuple[str, ...], last: str) -> Inverted:
    return Inverted(_EFFICIENT, name, "has_skip", False, chain=chain, last=last,
                    identities=("drop_path",), version="1.0.")


#: fused class name -> the inverted residual block it fuses
INVERTED = {
    "FusedInvertedResidual": Inverted(_MOBILENET + "2", "InvertedResidual", "use_res_connect",
                                      False, "conv"),
    "FusedInvertedResidualV3": Inverted(_MOBILENET + "3", "InvertedResidual",
                                        "use_res_connect", True, "block", nested=True),
    "FusedTimmInvertedResidual": _timm("InvertedResidual", (
        *_S2D, "conv_pw", "bn1", "conv_dw", "bn2", "aa", "se", "conv_pwl"), "bn3"),
    "FusedTimmDepthwiseSeparableConv": _timm("DepthwiseSeparableConv", (
        *_S2D, "conv_dw", "bn1", "aa", "se", "conv_pw"), "bn2"),
    "FusedTimmEdgeResidual": _timm("EdgeResidual", (
        "conv_exp", "bn1", "aa", "se", "conv_pwl"), "bn2"),
}


def _chain(block: nn.Module, spec: Inverted) -> list[nn.Module]:
    """The modules an inverted block's branch runs, in order, the last batch norm last."""
    mods: list[Any]
    if spec.branch:
        mods = [m for m in block._modules[spec.branch]._modules.values()  # type: ignore
                if m is not None]
        if spec.nested and mods:
            mods += [m for m in mods.pop()._modules.values() if m is not None]
        return mods
    own: dict[str, Any] = block._modules
    last = own.get(spec.last)
    return [] if last is None else [*(own[n] for n in spec.chain if own.get(n) is not None), last]


def _inverted_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """The block's forward with its last batch norm adding the input (Note [inverted
    residual blocks])."""
    spec: Inverted = type(self)._inverted
    *head, bn = _chain(self, spec)
    out = x
    for m in head:
        out = m(out)
    if not getattr(self, spec.skip):
        return bn(out)
    if x.dtype != out.dtype:
        if not spec.in_place:  # `x + branch(x)` promotes: add after, as torch.nn does
            return x + bn(out)
        return bn(out, residual=x.to(out.dtype))
    return bn(out, residual=x)


def _fused_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """The block's forward with each batch norm taking its activation and the last one the
    identity (Note [residual blocks])."""
    *pairs, (conv, bn) = type(self)._fused_pairs
    out = x
    for c, b in pairs:
        out = getattr(self, b)(getattr(self, c)(out))
    out = getattr(self, conv)(out)
    # the shortcut after the branch, as torchvision's and timm's forwards run them: a
    # downsample with dropout then draws its random numbers in the same order
    identity = x if self.downsample is None else self.downsample(x)
    if identity.dtype != out.dtype:  # `out += identity` keeps out's dtype
        identity = identity.to(out.dtype)
    return getattr(self, bn)(out, residual=identity)


def _fused_class(fused: str) -> type[nn.Module]:
    """The class `fused` names: its block's class with the fused forward."""
    made = globals().get(fused)
    if made is None:
        block = BLOCKS.get(fused)
        spec = block if block is not None else INVERTED[fused]
        base = getattr(sys.modules[spec.module], spec.name)
        body: dict[str, Any] = {"__module__": __name__}
        if block is not None:
            body.update(forward=_fused_forward, _fused_pairs=block.pairs, __doc__=(
                f"{spec.module}.{spec.name} after convfuse.torch.convert: its batch norms "
                "take their activations and the last one the identity (Note [residual "
                "blocks] in convfuse/torch/_convert_blocks.py)."))
        else:
            body.update(forward=_inverted_forward, _inverted=spec, __doc__=(
                f"{spec.module}.{spec.name} after convfuse.torch.convert: its last batch "
                "norm adds the block's input (Note [inverted residual blocks] in "
                "convfuse/torch/_convert_blocks.py)."))
        made = type(fused, (base,), body)
        globals()[fused] = made
    return made


def __getattr__(name: str) -> Any:
    """The fused classes by name, for unpickling (made from their library, imported here)."""
    spec = BLOCKS.get(name) or INVERTED.get(name)
    if spec is not None:
        __import__(spec.module)
        return _fused_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _imported(block: Block | Inverted) -> type | None:
    """The block's class where its library is imported (convert never imports it)."""
    lib = sys.modules.get(block.module)
    return None if lib is None else getattr(lib, block.name, None)


def residual_block(module: nn.Module) -> tuple[str, list[tuple[str, str]]] | None:
    """(the fused class's name, [(batch norm, its activation)]) where `module` is a block
    this rule takes (Note [residual blocks]), else None."""
    fused = next((f for f, b in BLOCKS.items() if type(module) is _imported(b)), None)
    if fused is None:
        return None
    block = BLOCKS[fused]
    top = sys.modules.get(block.module.split(".")[0])
    if not str(getattr(top, "__version__", "")).startswith(block.version):
        return None
    if not _plain(module):
        return None
    mods = module._modules
    if any(type(mods.get(n)) is not nn.Identity for n in block.identities) \
            or any(getattr(module, n, None) is not None for n in block.absent):
        return None
    found = []
    for (_, bn), name in zip(block.pairs, block.acts):
        act = mods.get(name)
        if act is None or runs_hooks(act):
            return None
        kind = ("relu" if type(act) is nn.ReLU else None) if block.relu_only \
            else activation_of(act)
        if kind is None:
            return None
        found.append((bn, kind))
    return fused, found


def _plain(module: nn.Module) -> bool:
    """No forward on the instance and no hooks: calling it is calling its class's forward."""
    return "forward" not in module.__dict__ and not runs_hooks(module)


def _plain_sequential(module: Any) -> bool:
    return (isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward
            and _plain(module))


def inverted_block(module: nn.Module) -> str | None:
    """The fused class's name where `module` is an inverted residual block whose branch this
    rule may walk (Note [inverted residual blocks]), before conversion; else None."""
    fused = next((f for f, b in INVERTED.items() if type(module) is _imported(b)), None)
    if fused is None or not _plain(module):
        return None
    spec = INVERTED[fused]
    top = sys.modules.get(spec.module.split(".")[0])
    if not str(getattr(top, "__version__", "")).startswith(spec.version) \
            or getattr(module, spec.skip, None) is not True \
            or any(type(module._modules.get(n)) is not nn.Identity for n in spec.identities):
        return None
    if spec.branch:
        branch: Any = module._modules.get(spec.branch)
        if not _plain_sequential(branch) or not branch._modules:
            return None
        if spec.nested and not _plain_sequential(list(branch._modules.values())[-1]):
            return None
    return fused if _chain(module, spec) else None


def inverted_batchnorm(module: nn.Module, fused: str) -> nn.Module:
    """The module that takes the residual in a block `inverted_block` took: the last of its
    branch's chain (a batch norm, converted or not)."""
    return _chain(module, INVERTED[fused])[-1]


def fuse(module: nn.Module, fused: str) -> None:
    """Give a block `residual_block` took, its batch norms already converted with their
    activations, the fused forward (Note [residual blocks])."""
    module.__class__ = _fused_class(fused)
