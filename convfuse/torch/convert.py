"""`convert(model)`: swap torch.nn convolutions (and the activation after them) for
convfuse's fused layers, sharing the same Parameters.

Note [conversion rules]
Inside an nn.Sequential the order of the children is the order of the forward, so a run of
children can be fused: each rule in `RULES` looks at the children from position i on and
returns the fused module and how many children it replaced (the first becomes the fused
module, the others nn.Identity, so indices and state-dict keys stay the same). The first rule
that matches wins. Outside nn.Sequential the forward order is unknown (ResNet's BasicBlock
applies one ReLU twice, once after the residual add), so convolutions are converted alone.
BatchNorm folds in here, in one place, once convfuse has BatchNorm ops: a rule matching
(Conv, BatchNorm[, activation]) placed before `_conv_activation`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch import nn

from .conv import Conv1d, Conv2d, Conv3d, _ConvNd

_CONVS: dict[type, type[_ConvNd]] = {nn.Conv1d: Conv1d, nn.Conv2d: Conv2d, nn.Conv3d: Conv3d}


def activation_of(module: nn.Module) -> str | None:
    """The convfuse activation that equals `module` exactly, or None."""
    kind = type(module)
    simple = {nn.ReLU: "relu", nn.ReLU6: "relu6", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh",
              nn.SiLU: "silu"}
    if kind in simple:
        return simple[kind]
    if kind is nn.GELU and module.approximate == "none":
        return "gelu"
    if kind is nn.ELU and module.alpha == 1.0:
        return "elu"
    if kind is nn.LeakyReLU and module.negative_slope == 0.01:
        return "leaky_relu"
    return None


def fused_conv(conv: nn.Module, activation: str | None = None) -> _ConvNd | None:
    """A convfuse layer computing activation(conv(x)) with `conv`'s own Parameters, or None
    (with a warning saying why) when convfuse cannot run this convolution."""
    cls = _CONVS.get(type(conv))
    if cls is None:
        return None
    try:
        new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                  conv.padding, conv.dilation, conv.groups, conv.bias is not None,
                  activation, device="meta", dtype=conv.weight.dtype,
                  padding_mode=conv.padding_mode)
    except (ValueError, TypeError) as exc:
        warnings.warn(f"convfuse.torch.convert: kept {conv!r} as PyTorch's ({exc})",
                      stacklevel=3)
        return None
    new.weight = conv.weight
    new.bias = conv.bias
    new.train(conv.training)
    return new


Rule = Callable[[list[nn.Module], int], "tuple[nn.Module, int] | None"]


def _conv_activation(children: list[nn.Module], i: int) -> tuple[nn.Module, int] | None:
    if type(children[i]) not in _CONVS:
        return None
    act = activation_of(children[i + 1]) if i + 1 < len(children) else None
    fused = fused_conv(children[i], act)
    if fused is None:
        return None
    return fused, (2 if act is not None else 1)


RULES: list[Rule] = [_conv_activation]


def convert(model: nn.Module) -> nn.Module:
    """Replace, in place, every nn.Conv1d/2d/3d by convfuse's fused layer with the same
    Parameters, folding an activation that immediately follows it in an nn.Sequential
    (Note [conversion rules]); returns the model (or the new layer, if `model` is a conv).

    The Parameters are the same objects, so an optimizer built before the conversion
    keeps working. Convolutions convfuse cannot run (padding modes other than zeros,
    asymmetric 'same' padding, integer dtypes) stay PyTorch's, with a warning.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert expects a torch.nn.Module, got {type(model).__name__}")
    if type(model) in _CONVS:
        return fused_conv(model) or model
    _convert_children(model)
    return model


def _convert_children(parent: nn.Module) -> None:
    names = [n for n, m in parent._modules.items() if m is not None]
    children = [parent._modules[n] for n in names]
    i = 0
    while i < len(children):
        match = _match(children, i) if isinstance(parent, nn.Sequential) else None
        if match is None and type(children[i]) in _CONVS:
            fused = fused_conv(children[i])
            match = (fused, 1) if fused is not None else None
        if match is None:
            _convert_children(children[i])
            i += 1
            continue
        fused, used = match
        parent._modules[names[i]] = fused
        for j in range(i + 1, i + used):
            parent._modules[names[j]] = nn.Identity()
        i += used


def _match(children: list[nn.Module], i: int) -> tuple[nn.Module, int] | None:
    for rule in RULES:
        found = rule(children, i)
        if found is not None:
            return found
    return None
