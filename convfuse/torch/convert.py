"""`convert(model)`: swap torch.nn convolutions and batch norms (and the activation after
them) for convfuse's fused layers, sharing the same Parameters and buffers.

Note [conversion rules]
Inside an nn.Sequential the order of the children is the order of the forward, so a run of
children can be fused: each rule in `RULES` looks at the children from position i on and
returns the fused module and how many children it replaced (the first becomes the fused
module, the others nn.Identity, so indices and state-dict keys stay the same). The first rule
that matches wins. Outside nn.Sequential the forward order is unknown (ResNet's BasicBlock
applies one ReLU twice, once after the residual add), so convolutions and batch norms are
converted alone. BatchNorm needs no rule of its own for Conv -> BatchNorm -> activation:
the conv rule sees a BatchNorm next (not an activation) and converts the conv alone, then
the BatchNorm rule folds the activation into the convfuse BatchNorm. The same rule fuses a
pre-activation BatchNorm -> ReLU -> Conv. convfuse does not fold BatchNorm into the
convolution's weights: in training the statistics are the batch's, so they cannot be.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from .batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d, _BatchNormNd
from .conv import Conv1d, Conv2d, Conv3d, _ConvLayer, _ConvNd
from .conv_transpose import ConvTranspose1d, ConvTranspose2d, ConvTranspose3d, _ConvTransposeNd

L = TypeVar("L", bound=_ConvLayer)

_CONVS: dict[type, type[_ConvNd]] = {nn.Conv1d: Conv1d, nn.Conv2d: Conv2d, nn.Conv3d: Conv3d}
_CONV_TRANSPOSES: dict[type, type[_ConvTransposeNd]] = {
    nn.ConvTranspose1d: ConvTranspose1d, nn.ConvTranspose2d: ConvTranspose2d,
    nn.ConvTranspose3d: ConvTranspose3d}
_BATCHNORMS: dict[type, type[_BatchNormNd]] = {
    nn.BatchNorm1d: BatchNorm1d, nn.BatchNorm2d: BatchNorm2d, nn.BatchNorm3d: BatchNorm3d}


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
    return _on_parameters_of(conv, cls, (
        conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
        conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode), activation)


def fused_conv_transpose(conv: nn.Module,
                         activation: str | None = None) -> _ConvTransposeNd | None:
    """fused_conv for nn.ConvTranspose1d/2d/3d: the same Parameters, or None (with a
    warning saying why) when convfuse cannot run it."""
    cls = _CONV_TRANSPOSES.get(type(conv))
    if cls is None:
        return None
    return _on_parameters_of(conv, cls, (
        conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
        conv.output_padding, conv.groups, conv.bias is not None, conv.dilation,
        conv.padding_mode), activation)


def _on_parameters_of(conv: nn.Module, cls: type[L], args: tuple[Any, ...],
                      activation: str | None) -> L | None:
    """cls(*args) (torch.nn's constructor arguments, read off `conv`) on `conv`'s own
    weight and bias, or None with a warning naming what convfuse refused."""
    try:
        new = cls(*args, device="meta", dtype=conv.weight.dtype, activation=activation)
    except (ValueError, TypeError) as exc:
        warnings.warn(f"convfuse.torch.convert: kept {conv!r} as PyTorch's ({exc})",
                      stacklevel=4)
        return None
    new.weight = conv.weight
    new.bias = conv.bias
    new.train(conv.training)
    return new


def fused_batchnorm(bn: nn.Module, activation: str | None = None) -> _BatchNormNd | None:
    """A convfuse BatchNorm computing activation(bn(x)) with `bn`'s own Parameters and
    buffers (the same tensors), or None (with a warning) when convfuse cannot run it."""
    cls = _BATCHNORMS.get(type(bn))
    if cls is None:
        return None
    like = bn.weight if bn.weight is not None else bn.running_mean
    try:
        new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                  device="meta", dtype=like.dtype if like is not None else None,
                  activation=activation, bias=bn.bias is not None or not bn.affine)
    except (ValueError, TypeError) as exc:
        warnings.warn(f"convfuse.torch.convert: kept {bn!r} as PyTorch's ({exc})",
                      stacklevel=3)
        return None
    for name in ("weight", "bias"):
        setattr(new, name, getattr(bn, name))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        new._buffers[name] = bn._buffers.get(name)
    new.train(bn.training)
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


def _conv_transpose_activation(children: list[nn.Module],
                               i: int) -> tuple[nn.Module, int] | None:
    if type(children[i]) not in _CONV_TRANSPOSES:
        return None
    act = activation_of(children[i + 1]) if i + 1 < len(children) else None
    fused = fused_conv_transpose(children[i], act)
    if fused is None:
        return None
    return fused, (2 if act is not None else 1)


def _batchnorm_activation(children: list[nn.Module], i: int) -> tuple[nn.Module, int] | None:
    if type(children[i]) not in _BATCHNORMS:
        return None
    act = activation_of(children[i + 1]) if i + 1 < len(children) else None
    fused = fused_batchnorm(children[i], act)
    if fused is None:
        return None
    return fused, (2 if act is not None else 1)


RULES: list[Rule] = [_conv_activation, _conv_transpose_activation, _batchnorm_activation]


def convert(model: nn.Module) -> nn.Module:
    """Replace, in place, every nn.Conv1d/2d/3d, nn.ConvTranspose1d/2d/3d and
    nn.BatchNorm1d/2d/3d by convfuse's fused layer with the same Parameters and buffers,
    folding an activation that immediately follows it in an nn.Sequential (Note [conversion
    rules]); returns the model (or the new layer, if `model` is a conv or a batch norm).

    The Parameters and buffers are the same objects, so an optimizer built before the
    conversion keeps working. Every convolution or batch norm left in torch.nn's hands gets
    one warning naming it and why: layers convfuse cannot run (integer or complex dtypes),
    kinds it has no layer for (the lazy modules) and batch-norm
    subclasses (SyncBatchNorm).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert expects a torch.nn.Module, got {type(model).__name__}")
    alone = _alone(model)
    if alone is not None:
        return alone
    _warn_if_left(model)
    _convert_children(model)
    return model


def _warn_if_left(module: nn.Module) -> None:
    """Warn once for a module of a kind convert() would be expected to handle (a torch.nn
    convolution or batch norm of any sort) that it leaves in torch.nn's hands, and why
    (Note [conversion rules])."""
    kind = type(module)
    if kind in _CONVS or kind in _CONV_TRANSPOSES or kind in _BATCHNORMS:
        return  # converted, or already warned about by fused_conv*/fused_batchnorm
    if isinstance(module, nn.modules.conv._ConvNd):
        why = f"convfuse has no fused layer for {kind.__name__}"
    elif isinstance(module, nn.modules.batchnorm._BatchNorm):
        why = (f"{kind.__name__} is not torch.nn.BatchNorm1d/2d/3d itself (convfuse has no "
               "cross-rank or lazy batch norm)")
    else:
        return
    warnings.warn(f"convfuse.torch.convert: kept {kind.__name__} {module!r} as PyTorch's "
                  f"({why})", stacklevel=4)


def _convert_children(parent: nn.Module) -> None:
    names = [n for n, m in parent._modules.items() if m is not None]
    children = [m for m in parent._modules.values() if m is not None]  # names' order
    i = 0
    while i < len(children):
        if isinstance(parent, nn.Sequential):  # the rules also try each layer alone
            match = _match(children, i)
        else:
            fused = _alone(children[i])
            match = (fused, 1) if fused is not None else None
        if match is None:
            _warn_if_left(children[i])
            _convert_children(children[i])
            i += 1
            continue
        fused, used = match
        parent._modules[names[i]] = fused
        for j in range(i + 1, i + used):
            parent._modules[names[j]] = nn.Identity()
        i += used


def _alone(module: nn.Module) -> nn.Module | None:
    """`module` converted on its own (no activation folded), or None."""
    if type(module) in _CONVS:
        return fused_conv(module)
    if type(module) in _CONV_TRANSPOSES:
        return fused_conv_transpose(module)
    if type(module) in _BATCHNORMS:
        return fused_batchnorm(module)
    return None


def _match(children: list[nn.Module], i: int) -> tuple[nn.Module, int] | None:
    for rule in RULES:
        found = rule(children, i)
        if found is not None:
            return found
    return None
