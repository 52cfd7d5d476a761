"""Activation names and what each needs saved for its backward pass.

Note [what backward saves]
Every activation's derivative is a function of its output y, except silu and gelu,
whose derivatives need the pre-activation z = conv(x) + bias + scale * residual:
- identity: nothing (dz = dy);
- relu: y (y > 0);  relu6: y (0 < y < 6);  leaky_relu: y (y > 0, since the slope is positive);
- sigmoid: y (y * (1 - y));  tanh: y (1 - y^2);
- elu (alpha 1): y (1 where y > 0, else y + 1, since y = exp(z) - 1 there);
- silu, gelu: z (their derivatives cannot be recovered from y).
So a layer saves exactly one activation-sized tensor, y or z, never both.
"""

from __future__ import annotations

ACTIVATIONS = (
    "identity", "relu", "sigmoid", "tanh", "elu", "relu6", "leaky_relu", "silu", "gelu",
)

# Activations that cudnnConvolutionBiasActivationForward applies itself (FACTS: RELU, IDENTITY).
FUSED_IN_CUDNN = frozenset({"identity", "relu"})

# Activations whose backward needs the pre-activation rather than the output.
NEEDS_PREACTIVATION = frozenset({"silu", "gelu"})

LEAKY_RELU_SLOPE = 0.01
ELU_ALPHA = 1.0
RELU6_CAP = 6.0

_ALIASES = {None: "identity", "none": "identity", "linear": "identity", "swish": "silu"}


def normalize(activation: str | None) -> str:
    """Canonical activation name; ValueError listing the valid names for anything else."""
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
