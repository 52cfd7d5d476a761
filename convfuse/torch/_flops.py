"""FLOP formulas for the custom ops, so torch.utils.flop_counter.FlopCounterMode (and the
MFU figures people compute with it) counts convfuse's convolutions as it counts
aten.convolution and aten.convolution_backward: the same multiply-adds, by torch's own
formulas (bias, residual and activation count nothing there, nor here). Under the mode
the layers run the custom ops (a dispatch mode is active: Note [two call paths]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import flop_counter

_OPS = torch.ops.convfuse


def _forward(transposed: bool) -> Any:
    def flops(x_shape: Any, w_shape: Any, *args: Any, out_shape: Any = None,
              **kwargs: Any) -> int:
        return flop_counter.conv_flop_count(x_shape, w_shape, out_shape[0], transposed)
    return flops


def _backward(transposed: bool) -> Any:
    def flops(dy_shape: Any, x_shape: Any, w_shape: Any, saved: Any, stride: Any,
              padding: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        # (..., need_dx, need_dw, need_db, need_dz): the last four arguments
        need_dx, need_dw, need_db = args[-4:-1]
        # torch's formula, through the wrapper its registry put on it (which maps out_val's
        # tensors to shapes: these are shapes already)
        torch_formula: Any = flop_counter.conv_backward_flop
        return torch_formula(dy_shape, x_shape, w_shape, None, stride, padding, None,
                             transposed, None, None, [need_dx, need_dw, need_db],
                             out_val=out_shape)
    return flops


def _conv_forward(x_shape: Any, w_shape: Any, *args: Any, out_shape: Any = None,
                  **kwargs: Any) -> int:
    return flop_counter.conv_flop_count(x_shape, w_shape, out_shape)


def _data_grad(dz_shape: Any, w_shape: Any, *args: Any, out_shape: Any = None,
               **kwargs: Any) -> int:
    return flop_counter.conv_flop_count(dz_shape, w_shape, out_shape, transposed=True)


def _filter_grad(x_shape: Any, dz_shape: Any, weight_size: Any, *args: Any,
                 out_shape: Any = None, **kwargs: Any) -> int:
    return flop_counter.conv_flop_count(x_shape, list(weight_size), dz_shape)


def register() -> None:
    """Register the formulas (once, at import)."""
    register = getattr(flop_counter, "register_flop_formula", None)
    if register is None:  # pragma: no cover - a torch older than the registry
        return
    for op, formula in ((_OPS.conv_bias_act, _forward(False)),
                        (_OPS.conv_transpose_bias_act, _forward(True)),
                        (_OPS.conv_bias_act_backward, _backward(False)),
                        (_OPS.conv_transpose_bias_act_backward, _backward(True)),
                        (_OPS.conv_forward, _conv_forward),
                        (_OPS.conv_data_grad, _data_grad),
                        (_OPS.conv_filter_grad, _filter_grad)):
        register(op)(formula)
