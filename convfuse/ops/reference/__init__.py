"""The NumPy reference engine: every op of `convfuse.ops` on NumPy arrays, on the CPU.

It is both the oracle GPU results are compared against and the engine convfuse runs on
without a GPU. Arithmetic is float64 for float64 data and float32 otherwise; float16 and
bfloat16 results are rounded once, at the end. Inputs are assumed validated (by
`convfuse.ops`) and are never modified; every result is a new C-contiguous array, or
`out` when one is given.
"""

from __future__ import annotations

from .activation import (
    activation_backward,
    activation_backward_bias,
    activation_forward,
    erf,
    erfc,
)
from .conv import (
    conv_backward_bias,
    conv_backward_data,
    conv_backward_filter,
    conv_bias_act,
    conv_forward,
)
from .pooling import pool_backward, pool_forward

__all__ = [
    "activation_backward",
    "activation_backward_bias",
    "activation_forward",
    "conv_backward_bias",
    "conv_backward_data",
    "conv_backward_filter",
    "conv_bias_act",
    "conv_forward",
    "erf",
    "erfc",
    "pool_backward",
    "pool_forward",
]
