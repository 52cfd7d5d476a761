"""What convert() can take: the kinds of module it knows (torch.nn's convolutions and batch
norms, and the model zoos' own classes), how each becomes a convfuse layer on the same
Parameters and buffers, and, for a convolution or batch norm it cannot take, the reason.

Note [which subclasses convert]
A module converts when a class it derives from is a known kind (first match in its MRO)
and what convfuse's layer replaces is all the module does: the methods the kind's forward
runs (`methods`), and `train`, are the kind's own, not a subclass's override nor set on
the instance; its Parameters, buffers and submodules are the kind's, under the kind's
names (nothing the new layer would drop); no hooks of any kind (forward, backward or
state-dict: the new layer would not run them, and folding an activation changes what a
forward or backward hook would see); no parametrization. So torchvision's Conv3DSimple (an
nn.Conv3d that only changes __init__) converts, and a subclass with its own forward is
left, with a warning naming the class whose forward would be lost. timm's classes are
found without importing timm: they are looked up in sys.modules, where they are when a
model holds them.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from torch import nn
from torch.nn.modules import module as _module_hooks
from torch.nn.utils import parametrize

from . import zoo_layers
from .batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d, _BatchNormNd
from .conv import Conv1d, Conv2d, Conv3d, _ConvLayer
from .conv_transpose import ConvTranspose1d, ConvTranspose2d, ConvTranspose3d

L = TypeVar("L", bound=_ConvLayer)
B = TypeVar("B", bound=_BatchNormNd)
State = tuple[frozenset[str], frozenset[str], frozenset[str]]  # parameters, buffers, modules
Build = Callable[[nn.Module, type, "str | None"], "nn.Module | None"]


class Kind(NamedTuple):
    family: str  # "conv", "conv_transpose" or "batchnorm"
    methods: tuple[str, ...]  # what the kind's forward runs: a subclass must not override
    state: State  # its Parameters', buffers' and submodules' names
    build: Build  # (module, kind's class, activation) -> the convfuse layer, or None (warned)
    folds_next: bool = True  # takes the activation after it in an nn.Sequential


#: A module's own hook dicts, by what they are called in a warning: those a call runs,
#: then the state dict's.
CALL_HOOKS = (("_forward_hooks", "forward"), ("_forward_pre_hooks", "forward-pre"),
              ("_backward_hooks", "backward"), ("_backward_pre_hooks", "backward-pre"))
HOOKS = (*CALL_HOOKS,
         ("_state_dict_hooks", "state-dict"), ("_state_dict_pre_hooks", "state-dict-pre"),
         ("_load_state_dict_pre_hooks", "load-state-dict-pre"),
         ("_load_state_dict_post_hooks", "load-state-dict-post"))


#: torch.nn.modules.module's hooks that run at every module's call (register_module_*_hook).
GLOBAL_CALL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks",
                     "_global_backward_hooks", "_global_backward_pre_hooks")


def global_hooks() -> bool:
    """Whether hooks registered for every module's call are in place: they would see the
    activations that folding or a fused block stops calling."""
    return any(getattr(_module_hooks, attr, None) for attr in GLOBAL_CALL_HOOKS)


def runs_hooks(module: nn.Module) -> bool:
    """Whether calling `module` runs a hook: its own call hooks, or global ones."""
    return any(getattr(module, attr, None) for attr, _ in CALL_HOOKS) or global_hooks()


def hooks_of(module: nn.Module) -> list[str]:
    """The kinds of hook registered on `module` itself (empty: none)."""
    return [what for attr, what in HOOKS if getattr(module, attr, None)]


def activation_of(module: nn.Module) -> str | None:
    """The convfuse activation that equals `module` exactly, or None (also for one whose
    instance has its own forward: a patched module computes something else)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"activation_of expects a torch.nn.Module, got "
                        f"{type(module).__name__}")
    if "forward" in module.__dict__:
        return None
    kind = type(module)
    if kind is nn.ReLU6:  # a Hardtanh: its forward reads the bounds, which may be reassigned
        return "relu6" if (module.min_val, module.max_val) == (0.0, 6.0) else None
    simple = {nn.ReLU: "relu", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.SiLU: "silu"}
    if kind in simple:
        return simple[kind]
    if kind is nn.GELU and module.approximate == "none":
        return "gelu"
    if kind is nn.ELU and module.alpha == 1.0:
        return "elu"
    if kind is nn.LeakyReLU and module.negative_slope == 0.01:
        return "leaky_relu"
    return None


def _warn_kept(module: nn.Module, why: object) -> None:
    warnings.warn(f"convfuse.torch.convert: kept {type(module).__name__} {module!r} "
                  f"unconverted ({why})", stacklevel=5)


def _conv_args(conv: Any, padding: Any = None, padding_mode: str | None = None) -> tuple:
    return (conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
            conv.padding if padding is None else padding, conv.dilation, conv.groups,
            conv.bias is not None, padding_mode or conv.padding_mode)


def on_parameters_of(conv: nn.Module, cls: type[L], args: tuple[Any, ...],
                     activation: str | None, **extra: Any) -> L | None:
    """cls(*args, **extra) (constructor arguments read off `conv`) on `conv`'s own
    Parameters, or None with a warning naming what convfuse refused."""
    try:
        new = cls(*args, device="meta", dtype=conv.weight.dtype, activation=activation,
                  **extra)
    except (ValueError, TypeError) as exc:
        _warn_kept(conv, exc)
        return None
    for name in new._parameters:
        new._parameters[name] = conv._parameters.get(name)  # StdConv2d: gain None
    new.train(conv.training)
    _carry_attributes(conv, new)
    return new


def _carry_attributes(old: nn.Module, new: nn.Module) -> None:
    """What a user set on `old` beyond its class's state (`conv.is_stem = True`: public
    names the new layer has neither on itself nor on its class) comes along, so code that
    reads it finds it after conversion."""
    mine, cls = vars(new), type(new)
    for name, value in vars(old).items():
        if not name.startswith("_") and name not in mine and not hasattr(cls, name):
            mine[name] = value


def on_buffers_of(bn: Any, cls: type[B], activation: str | None, **extra: Any) -> B | None:
    """cls (a convfuse batch norm) on `bn`'s own Parameters and buffers, or None with a
    warning naming what convfuse refused."""
    like = bn.weight if bn.weight is not None else bn.running_mean
    try:
        new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                  device="meta", dtype=like.dtype if like is not None else None,
                  activation=activation, bias=bn.bias is not None or not bn.affine, **extra)
    except (ValueError, TypeError) as exc:
        _warn_kept(bn, exc)
        return None
    for name in ("weight", "bias"):
        new._parameters[name] = bn._parameters[name]
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        new._buffers[name] = bn._buffers[name]
    new.training = bn.training  # not train(): the children keep their own flags
    _carry_attributes(bn, new)
    return new


_FUSED: dict[type, type] = {
    nn.Conv1d: Conv1d, nn.Conv2d: Conv2d, nn.Conv3d: Conv3d,
    nn.ConvTranspose1d: ConvTranspose1d, nn.ConvTranspose2d: ConvTranspose2d,
    nn.ConvTranspose3d: ConvTranspose3d,
    nn.BatchNorm1d: BatchNorm1d, nn.BatchNorm2d: BatchNorm2d, nn.BatchNorm3d: BatchNorm3d}


def _torch_conv(conv: Any, base: type, activation: str | None) -> nn.Module | None:
    new = on_parameters_of(conv, _FUSED[base], _conv_args(conv), activation)
    if new is not None:
        # torch.nn pads a padding_mode other than 'zeros' by this, set at construction and
        # kept when `padding` is reassigned after it (_carry_attributes skips private names)
        new._reversed_padding_repeated_twice = copy.copy(conv._reversed_padding_repeated_twice)
    return new


def _torch_conv_transpose(conv: Any, base: type, activation: str | None) -> nn.Module | None:
    return on_parameters_of(conv, _FUSED[base], (
        conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
        conv.output_padding, conv.groups, conv.bias is not None, conv.dilation,
        conv.padding_mode), activation)


def _torch_batchnorm(bn: Any, base: type, activation: str | None) -> nn.Module | None:
    return on_buffers_of(bn, _FUSED[base], activation)


def _timm_conv2d_same(conv: Any, base: type, activation: str | None) -> nn.Module | None:
    # timm's forward pads, then F.conv2d with no padding, whatever padding_mode says
    return on_parameters_of(conv, zoo_layers.Conv2dSame, _conv_args(conv, 0, "zeros"),
                            activation)


def _timm_std_conv(conv: Any, base: type, activation: str | None) -> nn.Module | None:
    # timm's forward: F.conv2d with self.padding, whatever padding_mode says
    scaled = "gain" in conv._parameters  # ScaledStdConv2d(Same)
    return on_parameters_of(conv, zoo_layers.StdConv2d, _conv_args(conv, None, "zeros"),
                            activation, eps=conv.eps, scale=conv.scale if scaled else None,
                            same_pad=bool(getattr(conv, "same_pad", False)))


def _timm_batchnorm_act(bn: Any, base: type, activation: str | None) -> nn.Module | None:
    if activation is not None:  # (convert's block rule declines this before asking)
        raise ValueError("timm's BatchNormAct2d takes no further activation: its own `act` "
                         "is the one convert() folds")
    drop, act = bn.drop, bn.act
    # an act with hooks stays a module of its own, its hooks running (as convert's rule for
    # an activation after a conv in a Sequential)
    folded = activation_of(act) if type(drop) is nn.Identity and not runs_hooks(act) else None
    return on_buffers_of(bn, zoo_layers.BatchNormAct2d, folded, drop=drop,
                         act=nn.Identity() if folded is not None else act)


_NONE: frozenset[str] = frozenset()
_CONV_STATE: State = (frozenset({"weight", "bias"}), _NONE, _NONE)
_BN_STATE: State = (frozenset({"weight", "bias"}),
                    frozenset({"running_mean", "running_var", "num_batches_tracked"}), _NONE)

_TORCH_KINDS: dict[type, Kind] = {
    **{c: Kind("conv", ("forward", "_conv_forward"), _CONV_STATE, _torch_conv)
       for c in (nn.Conv1d, nn.Conv2d, nn.Conv3d)},
    **{c: Kind("conv_transpose", ("forward", "_output_padding"), _CONV_STATE,
               _torch_conv_transpose)
       for c in (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)},
    **{c: Kind("batchnorm", ("forward", "_check_input_dim"), _BN_STATE, _torch_batchnorm)
       for c in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)},
}

# timm's classes by module and name; the module's forward is what convfuse's layer computes.
_TIMM: dict[tuple[str, str], Kind] = {
    ("timm.layers.conv2d_same", "Conv2dSame"):
        Kind("conv", ("forward",), _CONV_STATE, _timm_conv2d_same),
    **{("timm.layers.std_conv", name): Kind("conv", ("forward",), _CONV_STATE, _timm_std_conv)
       for name in ("StdConv2d", "StdConv2dSame")},
    **{("timm.layers.std_conv", name): Kind(
        "conv", ("forward",), (frozenset({"weight", "bias", "gain"}), _NONE, _NONE), _timm_std_conv)
       for name in ("ScaledStdConv2d", "ScaledStdConv2dSame")},
    ("timm.layers.norm_act", "BatchNormAct2d"):
        Kind("batchnorm", ("forward",), (_BN_STATE[0], _BN_STATE[1],
                                         frozenset({"drop", "act"})),
             _timm_batchnorm_act, folds_next=False),
}


def known_kinds() -> dict[type, Kind]:
    """torch.nn's kinds, and timm's where timm is imported (never importing it)."""
    kinds = dict(_TORCH_KINDS)
    for (module, name), kind in _TIMM.items():
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            kinds[cls] = kind
    return kinds


def classify(module: nn.Module, kinds: dict[type, Kind],
             ) -> tuple[type | None, Kind | None, str | None]:
    """(the known class `module` derives from, its kind, None) when convert() can take
    `module` (Note [which subclasses convert]); (None, None, why) for a convolution or batch
    norm it cannot take; (None, None, None) for anything else."""
    cls = type(module)
    name = cls.__name__
    if isinstance(module, nn.modules.lazy.LazyModuleMixin):
        return None, None, (f"convfuse has no fused layer for {name}, a lazy module: convert "
                            "after the first forward, when its parameters exist")
    base = next((c for c in cls.__mro__ if c in kinds), None)
    if base is None:
        if isinstance(module, nn.SyncBatchNorm):
            why = f"{name}: convfuse has no cross-rank (synchronised) batch norm"
        elif isinstance(module, nn.modules.conv._ConvNd):
            why = f"convfuse has no fused layer for {name}"
        elif isinstance(module, nn.modules.batchnorm._BatchNorm):
            why = (f"{name} derives from none of torch.nn.BatchNorm1d/2d/3d: convfuse has "
                   "no layer for it")
        else:
            return None, None, None
        return None, None, why
    kind = kinds[base]
    if parametrize.is_parametrized(module):
        owned: Any = module.parametrizations
        names = ", ".join(owned.keys())
        return None, None, (f"{name}'s {names} is parametrized (torch.nn.utils.parametrize): "
                            "convfuse's layer would drop the parametrization")
    hooks = hooks_of(module)
    if hooks:
        return None, None, (f"{name} has {', '.join(hooks)} hooks, which convfuse's layer "
                            "would not run")
    patched = [m for m in (*kind.methods, "train") if m in module.__dict__]
    if patched:  # set on the instance (offloading hooks, LoRA-style patches)
        return None, None, (f"{name} has its own {patched[0]} set on the instance, which "
                            "convfuse's layer would not run")
    for method in (*kind.methods, "train"):
        mine = getattr(cls, method, None)
        if mine is not getattr(base, method, None):
            owner = next(c for c in cls.__mro__ if method in vars(c))
            return None, None, (f"{name} has its own {method} ({owner.__qualname__}."
                                f"{method}), which convfuse's {base.__name__} would not run")
    have = tuple(frozenset(d) for d in (module._parameters, module._buffers, module._modules))
    if have != kind.state:
        extra = sorted(set().union(*(h - k for h, k in zip(have, kind.state))))
        missing = sorted(set().union(*(k - h for h, k in zip(have, kind.state))))
        differs = " and ".join(([f"holds {extra} beyond"] if extra else [])
                               + ([f"lacks {missing} of"] if missing else []))
        return None, None, (f"{name} {differs} {base.__name__}'s parameters, buffers and "
                            "submodules: convfuse's layer would not have the same state")
    return base, kind, None
