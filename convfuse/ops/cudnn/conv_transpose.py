"""Transposed convolution on cuDNN: the forward convolution G's calls with x and y swapped
(Note [transposed convolution as a swapped convolution] in convfuse/transpose_geometry.py),
through G's cached plan, so algorithm choice, workspace, the walk down the ranking on
refusal or out-of-memory, and the capture rules are the convolution's (ranked.py).

Forward: convolutionBackwardData writes y, then one pass of convfuse's bias + activation
(+ scaled residual) kernel over y (Note [bias + activation pass] in kernels/activation.cu),
none when there is no bias, no residual and the activation is identity. silu and gelu save
their pre-activation, so they write it with that pass and apply the activation in a second.
"""

from __future__ import annotations

from typing import Any

from ... import activations
from ..._binding import cudnn
from ...plan import Candidate, get_transpose_plan
from ...transpose_geometry import ConvTransposeGeometry
from .. import elementwise
from .handle import Workspace, get_handle
from .ranked import forward_into, run_ranked


def conv_transpose_forward(x: Any, w: Any, tgeom: ConvTransposeGeometry) -> Any:  # pragma: gpu
    import cupy as cp

    handle = get_handle()
    plan = get_transpose_plan(tgeom, x.dtype)
    g = tgeom.conv
    core = cp.empty(g.input_shape, dtype=x.dtype)

    def call(cand: Candidate, ws: Workspace) -> None:
        cudnn().convolutionBackwardData(
            handle, 1.0, plan.w_desc, w.data.ptr, plan.y_desc, x.data.ptr,
            plan.conv_desc_for(cand), cand.algo, ws.ptr, ws.size, 0.0, plan.x_desc,
            core.data.ptr)

    run_ranked(plan, "bwd_data", handle, (w.data.ptr, x.data.ptr), call,
               f"conv_transpose_forward ({tgeom.describe()})")
    return tgeom.from_conv_output(core, cp)


def conv_transpose_bias_act(x: Any, w: Any, b: Any, tgeom: ConvTransposeGeometry,
                            activation: str = "identity", residual: Any = None,
                            residual_scale: float = 1.0) -> tuple[Any, Any]:  # pragma: gpu
    import cupy as cp

    act = activations.normalize(activation)
    y = conv_transpose_forward(x, w, tgeom)
    if b is None and residual is None and act == "identity":
        return y, None
    epi = tgeom.epilogue
    if activations.saves(act) != "preactivation":
        elementwise.bias_act_forward(y, b, residual, float(residual_scale), act, epi)
        return y, None
    elementwise.bias_act_forward(y, b, residual, float(residual_scale), "identity", epi)
    out = cp.empty_like(y)
    elementwise.activation_forward(y, act, out)
    return out, y


def conv_transpose_backward_data(dz: Any, w: Any, tgeom: ConvTransposeGeometry, out: Any = None,
                                 beta: float = 0.0) -> Any:  # pragma: gpu
    import cupy as cp

    handle = get_handle()
    plan = get_transpose_plan(tgeom, dz.dtype)
    dx = out if out is not None else cp.empty(tgeom.input_shape, dtype=dz.dtype)
    src = tgeom.to_conv_output(dz, cp)
    if out is None or float(beta) == 0.0:
        forward_into(plan, handle, src, w, dx, f"conv_transpose_backward_data "
                     f"({tgeom.describe()})")
        return dx
    b = float(beta)

    def call(cand: Candidate, ws: Workspace) -> None:
        cudnn().convolutionForward(
            handle, 1.0, plan.x_desc, src.data.ptr, plan.w_desc, w.data.ptr,
            plan.conv_desc_for(cand), cand.algo, ws.ptr, ws.size, b, plan.y_desc, dx.data.ptr)

    run_ranked(plan, "fwd", handle, (src.data.ptr, w.data.ptr), call,
               f"conv_transpose_backward_data ({tgeom.describe()})")
    return dx


def conv_transpose_backward_filter(x: Any, dz: Any, tgeom: ConvTransposeGeometry,
                                   out: Any = None, beta: float = 0.0) -> Any:  # pragma: gpu
    import cupy as cp

    handle = get_handle()
    plan = get_transpose_plan(tgeom, x.dtype)
    dw = out if out is not None else cp.empty(tgeom.weight_shape, dtype=x.dtype)
    b = float(beta) if out is not None else 0.0
    src = tgeom.to_conv_output(dz, cp)

    def call(cand: Candidate, ws: Workspace) -> None:
        cudnn().convolutionBackwardFilter(
            handle, 1.0, plan.x_desc, src.data.ptr, plan.y_desc, x.data.ptr,
            plan.conv_desc_for(cand), cand.algo, ws.ptr, ws.size, b, plan.w_desc, dw.data.ptr)

    run_ranked(plan, "bwd_filter", handle, (src.data.ptr, x.data.ptr), call,
               f"conv_transpose_backward_filter ({tgeom.describe()})")
    return dw
