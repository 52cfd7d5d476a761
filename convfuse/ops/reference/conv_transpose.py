"""Transposed convolution on the reference engine: the forward convolution G's reference
functions with x and y swapped (Note [transposed convolution as a swapped convolution] in
convfuse/transpose_geometry.py), plus the bias + activation epilogue."""

from __future__ import annotations

import numpy as np

from ... import activations as acts
from ...dtypes import compute_dtype
from ...transpose_geometry import ConvTransposeGeometry
from . import conv as ref
from .activation import activation_backward_bias, apply_activation, finish


def conv_transpose_forward(x: np.ndarray, w: np.ndarray,
                           tgeom: ConvTransposeGeometry) -> np.ndarray:
    return tgeom.from_conv_output(ref.conv_backward_data(x, w, tgeom.conv), np)


def conv_transpose_bias_act(
    x: np.ndarray, w: np.ndarray, b: np.ndarray | None, tgeom: ConvTransposeGeometry,
    activation: str | None = "identity", residual: np.ndarray | None = None,
    residual_scale: float = 1.0,
) -> tuple[np.ndarray, np.ndarray | None]:
    """(y, z): z = conv_transpose(x, w) + b + residual_scale * residual, y = act(z); z only
    when the activation's backward needs it, else None."""
    act = acts.normalize(activation)
    if b is None and residual is None and act == "identity":
        return conv_transpose_forward(x, w, tgeom), None  # no pass at all
    cd = compute_dtype(x.dtype)
    if cd == x.dtype:
        z = conv_transpose_forward(x, w, tgeom)  # this call's own array, in cd already
    else:  # float16/bfloat16: kept in float32 until the epilogue rounds once, as torch.nn
        conv = tgeom.conv
        z = tgeom.from_conv_output(
            ref.conv_backward_data(x, w, conv, out=np.empty(conv.input_shape, cd)), np)
    if b is not None:
        shape = [1] * z.ndim
        shape[tgeom.channel_axis] = -1
        z += b.astype(cd).reshape(shape)
    if residual is not None:
        z += cd.type(residual_scale) * residual.astype(cd)
    z_out = finish(z, x.dtype) if acts.saves(act) == "preactivation" else None
    out = z if act == "identity" else apply_activation(z, act)
    return finish(out, x.dtype), z_out


def conv_transpose_backward_data(dz: np.ndarray, w: np.ndarray, tgeom: ConvTransposeGeometry,
                                 out: np.ndarray | None = None,
                                 beta: float = 0.0) -> np.ndarray:
    dx = ref.conv_forward(tgeom.to_conv_output(dz, np), w, tgeom.conv)
    return dx if out is None else finish(dx, dz.dtype, out, beta)


def conv_transpose_backward_filter(x: np.ndarray, dz: np.ndarray,
                                   tgeom: ConvTransposeGeometry, out: np.ndarray | None = None,
                                   beta: float = 0.0) -> np.ndarray:
    return ref.conv_backward_filter(tgeom.to_conv_output(dz, np), x, tgeom.conv, out, beta)


def conv_transpose_activation_backward_bias(
    dy: np.ndarray, saved: np.ndarray | None, activation: str, tgeom: ConvTransposeGeometry,
    db_out: np.ndarray | None = None, beta: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    return activation_backward_bias(dy, saved, activation, tgeom.epilogue, db_out, beta)
