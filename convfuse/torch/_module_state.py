"""A layer's parameters and buffers read from nn.Module's dicts (Note [reading a layer's
state]).

Note [reading a layer's state]
`self.weight` on an nn.Module is not a plain attribute read: Parameters and buffers live in
`_parameters` and `_buffers`, and Python reaches them through nn.Module.__getattr__ only
after the instance dict and the class have missed. That costs about a microsecond per name,
and at the sizes where host time decides a step a whole torch.nn convolution call is about
twenty. Where the class defines none of the names (no property or class attribute: not a
torch.nn.utils.parametrize class, whose properties compute the weight) and keeps nn.Module's
own attribute lookup (no __getattr__ or __getattribute__ of its own), attribute access
returns exactly the dict's entry, so a layer reads the dict. A name missing from the dict
(the old weight_norm hook moves `weight` out of `_parameters` into a plain attribute) takes
attribute access, as does every name of any other class.
"""

from __future__ import annotations

import contextlib

from torch import nn


class PlainClasses:
    """The classes whose instances reach each of `names` through nn.Module.__getattr__,
    decided once per class (Note [reading a layer's state])."""

    __slots__ = ("known", "names")

    def __init__(self, *names: str) -> None:
        self.names = names
        self.known: dict[type, bool] = {}

    def __contains__(self, cls: type) -> bool:
        hit = self.known.get(cls)
        if hit is None:
            hit = self.known[cls] = (
                cls.__getattr__ is nn.Module.__getattr__  # type: ignore[attr-defined]
                and cls.__getattribute__ is nn.Module.__getattribute__
                and not any(hasattr(cls, n) for n in self.names))
        return hit


# Note [a parametrized weight, once per call]
# A layer's call reads its weight and bias in several places (the checks, the call key, the
# window, the op's arguments); with torch.nn.utils.parametrize each read computes them
# again, which a spectral norm in training makes a power iteration each (its u and v drift
# from torch.nn's, which reads once) and a random parametrization a draw each. A
# parametrized layer's call therefore runs under parametrize.cached(): one computation per
# call, as torch.nn's. An unparametrized layer's call pays one dict lookup (not a _PLAIN
# test: under dynamo that would guard on _PLAIN's dict, which eager calls keep filling).
def parametrized(module: nn.Module) -> bool:
    """Whether torch.nn.utils.parametrize computes any of the module's tensors."""
    children = module.__dict__.get("_modules")
    return children is not None and "parametrizations" in children


def once_per_call() -> contextlib.AbstractContextManager[None]:
    """The context a parametrized layer's call runs in (Note [a parametrized weight, once
    per call])."""
    from torch.nn.utils import parametrize

    return parametrize.cached()
