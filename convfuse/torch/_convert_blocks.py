"""convert()'s rule for the residual blocks whose forward it knows (Note [residual blocks]).

Note [residual blocks]
convert() sees module objects, not what a forward() does with them, so outside an
nn.Sequential it cannot fold an activation or a residual add: torchvision's ResNet block
ends in `out = self.bn2(out); out += identity; out = self.relu(out)`, three passes (and
three autograd nodes) where convfuse's batch norm is one call. For the blocks whose forward
it knows, torchvision's `BasicBlock` and `Bottleneck` (ResNet, ResNeXt, Wide ResNet), it
does the rewrite itself. A block is taken only when nothing can differ from that forward:
its class is exactly one of the two (a subclass may compute anything), it has no forward
of its own on the instance, no hooks on it or its ReLU, its ReLU is an nn.ReLU, and every
batch norm it fuses converts. Then each batch norm followed by the ReLU becomes a convfuse
BatchNorm with `activation="relu"`, the last one also takes the identity as its residual,
and the block's class becomes a subclass of its own (`FusedBasicBlock`, `FusedBottleneck`)
whose forward makes those calls, as torch.nn.utils.parametrize swaps a module's class. The
submodules, attributes and state-dict keys stay; the block's ReLU stays as a submodule,
unused. The downsample runs before the main branch instead of after it: they share no
state (each batch norm updates its own statistics) and draw no random numbers. `out +=
identity` keeps `out`'s dtype, so an identity of another dtype (an input torch.autocast
left in float32) is cast to the main branch's before the fused call, where torch.nn rounds
the sum to that dtype instead. The classes are made on first use from the torchvision
that is already imported (convert never imports it), and are attributes of this module by
name, so a pickled converted model loads wherever torchvision is installed.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

_TORCHVISION = "torchvision.models.resnet"
#: block class name -> the batch norms its fused forward calls, in order
BATCH_NORMS = {"BasicBlock": ("bn1", "bn2"), "Bottleneck": ("bn1", "bn2", "bn3")}


def _basic_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """torchvision's BasicBlock.forward with bn1 and bn2 taking the ReLU and bn2 the
    identity (Note [residual blocks])."""
    identity = x if self.downsample is None else self.downsample(x)
    out = self.bn1(self.conv1(x))
    out = self.conv2(out)
    return self.bn2(out, residual=_as(identity, out))


def _bottleneck_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """torchvision's Bottleneck.forward with bn1, bn2 and bn3 taking the ReLU and bn3 the
    identity (Note [residual blocks])."""
    identity = x if self.downsample is None else self.downsample(x)
    out = self.bn1(self.conv1(x))
    out = self.bn2(self.conv2(out))
    out = self.conv3(out)
    return self.bn3(out, residual=_as(identity, out))


def _as(identity: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The identity in the dtype `out += identity` keeps (Note [residual blocks])."""
    return identity if identity.dtype == out.dtype else identity.to(out.dtype)


_FORWARDS = {"BasicBlock": _basic_forward, "Bottleneck": _bottleneck_forward}


def _fused_class(name: str) -> type[nn.Module]:
    """FusedBasicBlock or FusedBottleneck: torchvision's class with the fused forward."""
    made = globals().get("Fused" + name)
    if made is None:
        base = getattr(sys.modules[_TORCHVISION], name)
        made = type("Fused" + name, (base,), {
            "forward": _FORWARDS[name], "__module__": __name__,
            "__doc__": f"torchvision's {name} after convfuse.torch.convert: its batch norms "
                       "take the ReLU and the last one the identity (Note [residual blocks] "
                       "in convfuse/torch/_convert_blocks.py)."})
        globals()["Fused" + name] = made
    return made


def __getattr__(name: str) -> Any:
    """The fused classes by name, for unpickling (made from torchvision, imported here)."""
    if name.startswith("Fused") and name[5:] in _FORWARDS:
        __import__(_TORCHVISION)
        return _fused_class(name[5:])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _hooked(module: nn.Module) -> bool:
    return any(getattr(module, h, None) for h in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))


def residual_block(module: nn.Module) -> tuple[str, ...] | None:
    """The names of the batch norms convert may fuse in `module` when it is a block this
    rule takes (Note [residual blocks]), else None."""
    tv = sys.modules.get(_TORCHVISION)
    if tv is None:
        return None
    name = type(module).__name__
    if name not in BATCH_NORMS or type(module) is not getattr(tv, name, None):
        return None
    relu = module._modules.get("relu")
    if "forward" in module.__dict__ or _hooked(module) or type(relu) is not nn.ReLU \
            or _hooked(relu):
        return None
    return BATCH_NORMS[name]


def fuse(module: nn.Module) -> None:
    """Give a block `residual_block` took, its batch norms already converted with the ReLU,
    the fused forward (Note [residual blocks])."""
    module.__class__ = _fused_class(type(module).__name__)
