"""`convert(model)`: swap torch.nn convolutions and batch norms (and the activation after
them) for convfuse's fused layers, sharing the same Parameters and buffers.

Note [conversion rules]
Inside an nn.Sequential that runs nn.Sequential's own forward the order of the children is
the order of the forward, so a convolution or batch norm followed by an activation
convfuse has (activation_of), with no hooks, becomes one fused module: it takes the
convolution's place and the activation becomes nn.Identity, so indices and state-dict keys
stay the same (code that runs a slice of the Sequential ending at the convolution, a
feature tap, now gets the activation's output: convert such a model with the tap's
activation kept, or tap after it). Outside such an nn.Sequential (a subclass with its own
forward included) the forward order is unknown (ResNet's BasicBlock applies one ReLU
twice, once after the residual add), so convolutions and batch norms are converted alone,
except in the few blocks whose forward convert knows (torchvision's and timm's ResNet
blocks: Note [residual blocks] in _convert_blocks.py), whose batch norms take their
activations and the residual, and the MobileNet and EfficientNet blocks of torchvision and
timm (Note [inverted residual blocks]), whose last batch norm takes the block's input.
Conv -> BatchNorm -> activation needs no rule of its own: the conv sees a BatchNorm next
(not an activation) and converts alone, then the BatchNorm folds the activation; the same
fuses a pre-activation BatchNorm -> ReLU -> Conv. convfuse does not fold BatchNorm into
the convolution's weights: in training the statistics are the batch's, so they cannot be.
Which modules count as a convolution or a batch norm, subclasses and the model zoos' own
classes included, is _convert_kinds.py's (Note [which subclasses convert]); every one that
is left gets one warning with the reason.
"""

from __future__ import annotations

import contextvars
import warnings
from collections import Counter
from typing import Any

from torch import nn

from .. import activations
from . import _convert_blocks
from ._convert_kinds import Kind, activation_of, classify, global_hooks, known_kinds, runs_hooks
from .batchnorm import _BatchNormNd
from .conv import _ConvNd
from .conv_transpose import _ConvTransposeNd

__all__ = ["activation_of", "convert", "fused_batchnorm", "fused_conv", "fused_conv_transpose"]


_FUNCTIONS = {"conv": "fused_conv", "conv_transpose": "fused_conv_transpose",
              "batchnorm": "fused_batchnorm"}


def _fused(module: nn.Module, family: str, activation: str | None) -> nn.Module | None:
    fn = _FUNCTIONS[family]
    # the caller's arguments, refused as such (not as a module kept unconverted)
    if not isinstance(module, nn.Module):
        raise TypeError(f"{fn} expects a torch.nn.Module, got {type(module).__name__}")
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"{fn}: activation must be a str or None, got "
                        f"{type(activation).__name__} {activation!r}")
    try:
        activations.normalize(activation)
    except ValueError as exc:
        raise ValueError(f"{fn}: {exc}") from None
    base, kind, why = classify(module, known_kinds())
    if why is not None and family in _family_of(module):
        warnings.warn(f"convfuse.torch.convert: kept {type(module).__name__} {module!r} "
                      f"unconverted ({why})", stacklevel=3)
    if kind is None or kind.family != family:
        return None
    return kind.build(module, base, activation)


def _family_of(module: nn.Module) -> tuple[str, ...]:
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        return ("conv_transpose",)
    if isinstance(module, nn.modules.conv._ConvNd):
        return ("conv",)
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return ("batchnorm",)
    return ()


def fused_conv(conv: nn.Module, activation: str | None = None) -> _ConvNd | None:
    """A convfuse layer computing activation(conv(x)) with `conv`'s own Parameters, for an
    nn.Conv1d/2d/3d (or a subclass that keeps torch.nn's forward, or timm's Conv2dSame,
    StdConv2d, ScaledStdConv2d and their Same variants); None for anything else, with a
    warning saying why when `conv` is a convolution convfuse cannot run."""
    return _fused(conv, "conv", activation)  # type: ignore[return-value]


def fused_conv_transpose(conv: nn.Module,
                         activation: str | None = None) -> _ConvTransposeNd | None:
    """fused_conv for nn.ConvTranspose1d/2d/3d (and subclasses that keep torch.nn's
    forward): the same Parameters, or None (with a warning saying why)."""
    return _fused(conv, "conv_transpose", activation)  # type: ignore[return-value]


def fused_batchnorm(bn: nn.Module, activation: str | None = None) -> _BatchNormNd | None:
    """A convfuse BatchNorm computing activation(bn(x)) with `bn`'s own Parameters and
    buffers (the same tensors), for nn.BatchNorm1d/2d/3d (or a subclass that keeps torch.nn's
    forward) and timm's BatchNormAct2d (whose own act is folded: `activation` must be None);
    None for anything else, with a warning saying why when `bn` is a batch norm convfuse
    cannot run."""
    return _fused(bn, "batchnorm", activation)  # type: ignore[return-value]


def convert(model: nn.Module) -> nn.Module:
    """Replace, in place, every convolution and batch norm convfuse has a layer for by that
    layer with the same Parameters and buffers, folding an activation that immediately
    follows it in an nn.Sequential (Note [conversion rules]), and in torchvision's and timm's
    ResNet blocks handing each batch norm its activation and the last one the residual (Note
    [residual blocks]), in MobileNet's the last batch norm the block's input (Note
    [inverted residual blocks]); returns the model (or the new layer, if `model` is a conv
    or a batch norm).

    Taken: nn.Conv1d/2d/3d, nn.ConvTranspose1d/2d/3d, nn.BatchNorm1d/2d/3d and their
    subclasses that keep torch.nn's forward (torchvision's Conv3DSimple); timm's
    BatchNormAct2d (its activation folded when convfuse has it), Conv2dSame, StdConv2d,
    ScaledStdConv2d and their Same variants (Note [which subclasses convert]). The
    Parameters and buffers are the same objects, so an optimizer built before the conversion
    keeps working. Every convolution or batch norm left in torch.nn's hands gets one warning
    naming it and why: a subclass with its own forward, extra state, hooks of any kind
    (forward, backward, state-dict) or a parametrization; an activation with hooks is not
    folded, and with hooks registered for every module's call none is (one warning).
    Attributes a user set on a converted module come along. Also left: a module
    with its own forward (or train) set on the instance; batch norms under a module whose
    class overrides train() (it may switch them by isinstance, which the new layers fail);
    dtypes convfuse cannot run (integer or complex); the lazy modules; SyncBatchNorm. A
    conversion that raises part-way (a warning turned into an error) changes nothing.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert expects a torch.nn.Module, got {type(model).__name__}")
    kinds = known_kinds()
    if global_hooks():
        warnings.warn("convfuse.torch.convert: hooks for every module's call are registered "
                      "(torch.nn.modules.module.register_module_*_hook): no activation is "
                      "folded and no residual block fused, so each module they see still "
                      "runs", stacklevel=2)
    guard = _train_override(model, None)
    alone = _convert_one(model, None, kinds, guard)
    if alone is not None:
        return alone[0]
    # all or nothing: a raise part-way (a warning turned into an error, a refusal) puts
    # every module's class and children back as they were
    before = [(m, m.__class__, dict(m._modules)) for m in model.modules()]
    # registrations, not paths: a container used twice holds its children once
    uses = Counter(id(child) for parent in model.modules()
                   for child in parent._modules.values() if child is not None)
    token = _SHARED.set(({i for i, n in uses.items() if n > 1}, {}))
    try:
        if guard is not None or not _fuse_block(model, kinds):
            _convert_children(model, kinds, guard)
    except BaseException:
        for m, cls, children in before:
            m.__class__ = cls
            m._modules.clear()
            m._modules.update(children)
        raise
    finally:
        _SHARED.reset(token)
    return model


# Note [a module used in several places]: a module registered under two names (a shared
# batch norm) is one object in torch.nn, so .to() and .double() move its buffers once; it
# converts to one object too, looked up here by the original's id, and folds no activation
# (its uses may be followed by different ones). (module ids used more than once, {id: the
# converted module}) for the conversion running in this context.
_SHARED: contextvars.ContextVar[tuple[set[int], dict[int, nn.Module]]] = \
    contextvars.ContextVar("convfuse_convert_shared")


#: Names whose use in a train() override says it may set batch norms' mode itself.
_SWITCHES_NORMS = frozenset({"eval", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "_BatchNorm",
                             "_NormBase", "SyncBatchNorm", "norm_eval", "freeze_bn"})


def _names(code: Any) -> set[str]:
    """Every name a function's code refers to, nested code (comprehensions) included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names(const)
    return names


def _train_override(module: nn.Module, guard: str | None) -> str | None:
    """The class name of `module` or an ancestor whose own train() may switch batch norms
    (mmdetection's norm_eval / frozen-BN backbones call m.eval() on every
    isinstance(m, nn.BatchNorm2d), which convfuse's layers are not), else None. An
    override that only keeps a cache (timm's attention biases) or calls super() is not."""
    if guard is not None:
        return guard
    train = getattr(type(module).train, "__code__", None)
    if type(module).train is nn.Module.train or train is None:
        return None
    return type(module).__qualname__ if _names(train) & _SWITCHES_NORMS else None


def _convert_one(module: nn.Module, follower: nn.Module | None,
                 kinds: dict[type, Kind], guard: str | None = None,
                 ) -> tuple[nn.Module, int] | None:
    """`module` converted, folding `follower` (the next child in an nn.Sequential, or None)
    when it is an activation convfuse has, and how many children that replaced; None, with
    one warning if `module` is a convolution or batch norm, when it stays. Under `guard`
    (an enclosing module's own train()) a batch norm stays."""
    base, kind, why = classify(module, kinds)
    if why is None and kind is not None and kind.family == "batchnorm" and guard is not None:
        why = (f"{guard} overrides train(), which may set its batch norms' mode by "
               "isinstance(m, nn.BatchNorm*d): convfuse's BatchNorm is not one")
        kind = None
    if why is not None:
        warnings.warn(f"convfuse.torch.convert: kept {type(module).__name__} {module!r} "
                      f"unconverted ({why})", stacklevel=4)
    if kind is None:
        return None
    shared, done = _SHARED.get((set(), {}))
    if id(module) in shared:  # Note [a module used in several places]
        if id(module) in done:
            return done[id(module)], 1
        follower = None
    # a hooked activation stays: nn.Identity in its place would run none of its hooks
    act = activation_of(follower) if (follower is not None and kind.folds_next
                                       and not runs_hooks(follower)) else None
    fused = kind.build(module, base, act)
    if fused is None:  # refused by convfuse's constructor, which warned
        return None
    if id(module) in shared:
        done[id(module)] = fused
    return fused, (2 if act is not None else 1)


def _convert_children(parent: nn.Module, kinds: dict[type, Kind],
                      guard: str | None = None) -> None:
    names = [n for n, m in parent._modules.items() if m is not None]
    children = [m for m in parent._modules.values() if m is not None]  # names' order
    # only nn.Sequential's own forward runs the children in their order, each on the last
    # one's output: a subclass's forward may use them otherwise (a skip around them)
    sequential = (isinstance(parent, nn.Sequential) and "forward" not in parent.__dict__
                  and type(parent).forward is nn.Sequential.forward)
    i = 0
    while i < len(children):
        follower = children[i + 1] if sequential and i + 1 < len(children) else None
        child_guard = _train_override(children[i], guard)
        match = _convert_one(children[i], follower, kinds, child_guard)
        if match is None:
            if child_guard is not None or not _fuse_block(children[i], kinds):
                _convert_children(children[i], kinds, child_guard)
            i += 1
            continue
        fused, used = match
        parent._modules[names[i]] = fused
        for j in range(i + 1, i + used):
            parent._modules[names[j]] = nn.Identity()
        i += used


def _fuse_block(block: nn.Module, kinds: dict[type, Kind]) -> bool:
    """Convert a residual block whose forward convert knows, its batch norms taking their
    activations and the last one the identity (Note [residual blocks] in
    _convert_blocks.py), or an inverted residual block whose last batch norm takes the
    input (Note [inverted residual blocks]); False, with nothing changed, for any other
    module or where a batch norm would stay."""
    inverted = _convert_blocks.inverted_block(block)
    if inverted is not None:
        _convert_children(block, kinds)
        bn = _convert_blocks.inverted_batchnorm(block, inverted)
        if isinstance(bn, _BatchNormNd) and bn.activation == "identity" and all(
                type(bn._modules.get(n, nn.Identity())) is nn.Identity for n in ("drop", "act")):
            _convert_blocks.fuse(block, inverted)
        return True
    taken = _convert_blocks.residual_block(block)
    if taken is None:
        return False
    fused_name, bns = taken
    shared = _SHARED.get((set(), {}))[0]
    for name, _ in bns:
        bn = block._modules.get(name)
        if bn is None or id(bn) in shared:  # Note [a module used in several places]
            return False
        _, kind, why = classify(bn, kinds)
        if kind is None or kind.family != "batchnorm" or why is not None:
            return False  # converted alone below, with its warning
    try:
        fused = [_fused(block._modules[name], "batchnorm", act) for name, act in bns]
    except ValueError as exc:  # a batch norm that takes no activation (timm's BatchNormAct2d)
        warnings.warn(f"convfuse.torch.convert: left {type(block).__name__} unfused ({exc}); "
                      "its layers convert alone", stacklevel=4)
        return False
    if any(f is None for f in fused):  # refused by convfuse's constructor, which warned
        return False
    for (name, _), f in zip(bns, fused):
        block._modules[name] = f
    _convert_children(block, kinds)
    _convert_blocks.fuse(block, fused_name)
    return True
