"""Stateless ops (DESIGN.md "Ops"): validate the arrays, then dispatch on their type.

NumPy arrays run on the reference engine (`convfuse.ops.reference.<kind>`), CuPy arrays
on cuDNN (`convfuse.ops.cudnn.<kind>`), kind being conv, conv_transpose, activation,
pooling or batchnorm. Every
check (convfuse.ops._checks) runs before any engine code, so bad input never reaches
cuDNN. Arrays passed in are never modified; `out=` arguments are written.

Which engine ran: the ops look the engine function up on its module at every call, so a
test observes (or replaces) an engine by patching e.g.
`convfuse.ops.reference.conv.conv_forward` with monkeypatch.setattr.
"""

from __future__ import annotations

from .activation import activation_backward, activation_backward_bias, activation_forward
from .batchnorm import (
    BatchNormSaved,
    batchnorm_backward,
    batchnorm_forward_inference,
    batchnorm_forward_training,
)
from .conv import (
    conv_backward_bias,
    conv_backward_data,
    conv_backward_filter,
    conv_bias_act,
    conv_forward,
)
from .conv_transpose import (
    conv_transpose_activation_backward_bias,
    conv_transpose_backward_bias,
    conv_transpose_backward_data,
    conv_transpose_backward_filter,
    conv_transpose_bias_act,
    conv_transpose_forward,
)
from .pad import pad_backward, pad_forward
from .pooling import pool_backward, pool_forward

__all__ = [
    "BatchNormSaved",
    "activation_backward",
    "activation_backward_bias",
    "activation_forward",
    "batchnorm_backward",
    "batchnorm_forward_inference",
    "batchnorm_forward_training",
    "conv_backward_bias",
    "conv_backward_data",
    "conv_backward_filter",
    "conv_bias_act",
    "conv_forward",
    "conv_transpose_activation_backward_bias",
    "conv_transpose_backward_bias",
    "conv_transpose_backward_data",
    "conv_transpose_backward_filter",
    "conv_transpose_bias_act",
    "conv_transpose_forward",
    "pad_backward",
    "pad_forward",
    "pool_backward",
    "pool_forward",
]
