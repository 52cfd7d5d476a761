"""The `activation` attribute the fused convfuse.torch layers share."""

from __future__ import annotations

from typing import Any

from torch import nn

from .. import activations


class FusedActivation(nn.Module):
    """A layer's assignable `activation`, validated on assignment (a bad name assigned later
    was refused only by the op, after a batch norm had counted the call)."""

    activation = activations.attribute()

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "activation":  # to the validating property: nn.Module's own __setattr__
            object.__setattr__(self, name, value)  # would register a Module value as a child
            return
        super().__setattr__(name, value)
