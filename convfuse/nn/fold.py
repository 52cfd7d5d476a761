"""fold_batchnorm: an evaluation model with every Conv -> BatchNorm chain folded into the conv.

In evaluation BatchNorm is affine per channel: bn(z) = (z - mean) * s + beta with
s = gamma / sqrt(var + eps). After a convolution z = conv(x, w) + b, that is
conv(x, w * s) + (b - mean) * s + beta, so the pair becomes one convolution with folded
weight and bias. The BatchNorm's activation and residual move onto the convolution, which
computes act(conv(x) + bias + residual) in one cudnnConvolutionBiasActivationForward.

The folding protocol: `fold_layer(m)` returns a new, equivalent evaluation layer.
- a layer with a `_fold()` method folds itself (residual blocks, ResNet);
- a Sequential folds its chain: Conv followed by BatchNorm becomes one Conv, and a
  standalone activation layer right after it joins the fused call;
- any other layer is copied, with each of its children replaced by its folded form (a
  folded child computes the same function, so the parent's forward is unchanged).
The input model is never modified; the result shares no array with it.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

import numpy as np

from ..backend import array_module
from .batchnorm import _BatchNorm
from .container import Sequential
from .conv import _ConvNd
from .module import Layer
from .parameter import Parameter
from .simple import Activation, ReLU

L = TypeVar("L", bound=Layer)


def fold_batchnorm(model: Layer) -> Layer:
    """A NEW evaluation model equal to `model.eval()` in which each Conv -> BatchNorm
    (-> activation, -> residual) chain is one fused convolution. `model` must already be
    in evaluation mode (folding uses the running statistics); it is left untouched."""
    if not isinstance(model, Layer):
        raise TypeError(f"fold_batchnorm: model must be a convfuse layer, "
                        f"got {type(model).__name__}")
    training = [name or type(m).__name__ for name, m in model.named_modules() if m.training]
    if training:
        raise ValueError(
            f"fold_batchnorm: the model is in training mode ({len(training)} module(s), e.g. "
            f"{training[0]!r}); folding uses BatchNorm's running statistics, which only "
            "evaluation uses: call model.eval() first"
        )
    folded = fold_layer(model)
    folded.eval()
    return folded


def fold_layer(layer: Layer) -> Layer:
    """A new layer computing what `layer` computes in evaluation, with BatchNorm folded."""
    own = getattr(layer, "_fold", None)
    if own is not None:
        return own()
    if isinstance(layer, Sequential):
        named = list(layer.named_children())
        if [name for name, _ in named] == [str(i) for i in range(len(named))]:
            # numbered: renumbered, as torch's Sequential numbers (a gap would make a later
            # append reuse a name and replace that layer)
            seq = Sequential(*fold_chain([child for _, child in named]))
        else:
            # named (a forward or a checkpoint may reach a child by name): a fused Conv ->
            # BatchNorm (-> activation) takes the conv's; add_module's rules, which any name
            # the model has passed, not the constructor's stricter ones
            seq = Sequential()
            for name, child in fold_named_chain(named):
                seq.add_module(name, child)
                seq._take_device(child)
        for i, child in enumerate(seq):
            if i:
                child.needs_input_grad = True
        seq.needs_input_grad = layer.needs_input_grad
        return seq
    new = clone(layer)
    for name, child in list(layer.named_children()):
        setattr(new, name, fold_layer(child))
    return new


def fold_chain(layers: list[Layer]) -> list[Layer]:
    """Fold a chain run in order (a Sequential's layers or a block's body). When the chain
    takes a residual its last layer gets it: a folded Conv -> BatchNorm at the end is a conv,
    which takes it too."""
    return [layer for _, layer in fold_named_chain([(str(i), x) for i, x in enumerate(layers)])]


def fold_named_chain(named: list[tuple[str, Layer]]) -> list[tuple[str, Layer]]:
    """fold_chain over (name, layer) pairs: a fused layer takes its first layer's name."""
    layers = [layer for _, layer in named]
    out: list[tuple[str, Layer]] = []
    i = 0
    while i < len(layers):
        layer, name = layers[i], named[i][0]
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        if foldable(layer, nxt):
            conv = fold_conv_bn(layer, nxt)  # type: ignore[arg-type]
            i += 2
            follower = layers[i] if i < len(layers) else None
            if conv.activation == "identity" and type(follower) in _PLAIN_ACTIVATIONS:
                conv.activation = follower.activation  # type: ignore[union-attr]
                i += 1
            out.append((name, conv))
        else:
            out.append((name, fold_layer(layer)))
            i += 1
    return out


# Exactly these (not subclasses, whose forward may do more) join a folded conv's fused call.
_PLAIN_ACTIVATIONS = (Activation, ReLU)


def foldable(conv: Any, bn: Any) -> bool:
    """Conv (no activation of its own) followed by a BatchNorm that uses running statistics
    in evaluation, over the same channels and layout."""
    return (
        isinstance(conv, _ConvNd) and isinstance(bn, _BatchNorm)
        and conv.activation == "identity" and conv.residual_scale == 1.0
        and bn.running_mean is not None and bn.running_var is not None
        and bn.num_features == conv.out_channels
        and (bn.layout == "NHWC") == conv.channels_last  # a Conv1d may say "NCW"
    )


def fold_conv_bn(conv: _ConvNd, bn: _BatchNorm) -> _ConvNd:
    """A new conv equal to bn(conv(x)) in evaluation (bn's activation included), computed
    in float64 on the parameters' device and stored in the conv's dtype."""
    xp = array_module(conv.weight.data)
    acc = np.float64
    var = bn.running_var.astype(acc)
    mean = bn.running_mean.astype(acc)
    scale = 1.0 / xp.sqrt(var + bn.eps)
    shift = xp.zeros_like(mean)
    # each on its own: a weight without a bias (bias=False, torch 2.13's) scales all the same
    if bn.weight is not None:
        scale = scale * bn.weight.data.astype(acc)
    if bn.bias is not None:
        shift = bn.bias.data.astype(acc)
    w = conv.weight.data.astype(acc)
    # The output channel is axis 0 of the weight in both layouts ((K, C/g, *k), (K, *k, C/g)).
    w = w * scale.reshape((-1,) + (1,) * (w.ndim - 1))
    b = conv.bias.data.astype(acc) if conv.bias is not None else xp.zeros_like(mean)
    b = (b - mean) * scale + shift
    new = clone(conv)
    new.weight = Parameter(xp.ascontiguousarray(w.astype(conv.dtype)), "weight")
    new.bias = Parameter(b.astype(conv.dtype), "bias")
    new.activation = bn.activation
    new.residual_scale = 1.0
    new.training = False
    return new


def clone(layer: L) -> L:
    """A deep copy sharing nothing with `layer`, without the forward contexts it may hold
    (those are the last step's activations, not state, and may be large)."""
    memo: dict[int, Any] = {}
    for mod in layer.modules():
        ctx = getattr(mod, "_ctx", None)
        # deepcopy consults the memo by id for every object, so a shared immutable (True,
        # 0, an interned string, the empty tuple) must never be mapped to None.
        if ctx is not None and not isinstance(ctx, _SHARED_IMMUTABLES) and not _is_empty_tuple(ctx):
            memo[id(ctx)] = None
    new = copy.deepcopy(layer, memo)
    for mod in new.modules():
        mod._ctx = None
    return new


_SHARED_IMMUTABLES = (bool, int, float, str, bytes)


def _is_empty_tuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and len(obj) == 0
