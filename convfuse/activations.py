"""Activation names and what each needs saved for its backward pass.

Note [what backward saves]
relu, relu6, leaky_relu, sigmoid and tanh have derivatives that are functions of their
output y; elu, silu and gelu save the pre-activation z = conv(x) + bias + scale * residual:
- identity: nothing (dz = dy);
- relu: y (y > 0);  relu6: y (0 < y < 6);  leaky_relu: y (y > 0, since the slope is positive);
- sigmoid: y (y * (1 - y));  tanh: y (1 - y^2);
- elu (alpha 1): z (1 where z > 0, else exp(z), as torch.nn.ELU computes it from its input).
  exp(z) = y + 1 could come from y, but near y = -1 that sum cancels: in float16 the
  gradient would be exactly 0 below z ~ -8.3 (bfloat16 ~ -6.2, float32 ~ -16.6) and 13-16%
  off at z = -5 in bfloat16, where torch is within a few ulps. Either way backward keeps
  one activation-sized tensor (z is a buffer of its own, where y is the output that the
  next layer often keeps anyway, as for silu and gelu);
- silu, gelu: z (their derivatives cannot be recovered from y).
So a layer saves exactly one activation-sized tensor, y or z, never both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ACTIVATIONS = (
    "identity", "relu", "sigmoid", "tanh", "elu", "relu6", "leaky_relu", "silu", "gelu",
)

# Activations that cudnnConvolutionBiasActivationForward applies itself (FACTS: RELU, IDENTITY).
FUSED_IN_CUDNN = frozenset({"identity", "relu"})

# Activations whose backward needs the pre-activation rather than the output (elu: for
# accuracy, Note [what backward saves]).
NEEDS_PREACTIVATION = frozenset({"elu", "silu", "gelu"})

LEAKY_RELU_SLOPE = 0.01
ELU_ALPHA = 1.0
RELU6_CAP = 6.0

_ALIASES = {None: "identity", "none": "identity", "linear": "identity", "swish": "silu"}


def normalize(activation: str | None) -> str:
    """Canonical activation name; TypeError unless a str or None, ValueError listing the
    valid names for any other str."""
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"activation must be a str or None, got {type(activation).__name__} "
                        f"{activation!r}")
    key = activation.lower() if isinstance(activation, str) else activation
    if key in _ALIASES:
        return _ALIASES[key]
    if key in ACTIVATIONS:
        return key
    raise ValueError(
        f"unknown activation {activation!r}: expected None or one of {', '.join(ACTIVATIONS)}"
    )


def saves(activation: str) -> str:
    """'none', 'output' or 'preactivation': what backward needs (Note [what backward saves])."""
    act = normalize(activation)
    if act == "identity":
        return "none"
    return "preactivation" if act in NEEDS_PREACTIVATION else "output"


def attribute(check: Callable[[Any], str] = normalize) -> property:
    """A layer's assignable `activation`: `check`ed on assignment (so a bad name is refused
    there, not by the op at the next call after state may have changed), errors named by
    the layer's class; the canonical name is kept in `_activation`."""

    def get(self: Any) -> str:
        d = self.__dict__
        try:
            return d["_activation"]
        except KeyError:  # pickled when the layer kept a plain attribute
            if "activation" in d:
                return d["activation"]
        raise AttributeError(f"{type(self).__name__} has no activation set")

    def set_(self: Any, value: Any) -> None:
        try:
            name = check(value)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{type(self).__name__}: {exc}") from None
        self.__dict__["_activation"] = name
        self.__dict__.pop("activation", None)

    return property(get, set_, doc="The activation's canonical name; assignable (validated).")
