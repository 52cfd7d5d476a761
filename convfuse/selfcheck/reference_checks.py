"""CPU checks of the NumPy reference engine against the selfcheck's own tiny oracle.

The reference engine is what every GPU result is compared with, so it is checked first:
forward against plain loops, gradients through adjoint identities and finite differences,
narrow dtypes against float64, pooling and a CPU layer.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import activations
from ..geometry import ConvGeometry
from . import oracle
from .report import TOLERANCES
from .runner import CheckFailed, Outcome, Worst

EXACT = 1e-12  # float64 engine against float64 loops: a few ulps of accumulated rounding

# (x shape, w shape, stride, padding, dilation, groups, layout): tiny, every feature once.
GEOMETRIES = (
    ((2, 4, 7), (6, 2, 3), 2, 1, 1, 2, "NCW"),
    ((1, 5, 6, 3), (6, 3, 2, 1), 1, (1, 0), (1, 2), 3, "NHWC"),  # depthwise, channels-last
    ((2, 3, 5, 5), (4, 3, 3, 3), (2, 1), 1, 1, 1, "NCHW"),
    ((1, 2, 4, 3, 3), (2, 2, 2, 2, 2), 1, (1, 0, 1), (1, 1, 2), 1, "NCDHW"),
    ((1, 3, 3, 3, 2), (4, 2, 2, 2, 1), 1, 0, 1, 2, "NDHWC"),
)


def geometries() -> list[ConvGeometry]:
    return [ConvGeometry.create(*g) for g in GEOMETRIES]


def to_cf(a: np.ndarray, geom: ConvGeometry) -> np.ndarray:
    """Channels-first view of an array in the geometry's layout (written out, not imported)."""
    return np.moveaxis(a, -1, 1) if geom.channels_last else a


def from_cf(a: np.ndarray, geom: ConvGeometry) -> np.ndarray:
    return np.moveaxis(a, 1, -1) if geom.channels_last else a


def expected_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, geom: ConvGeometry,
                     act: str, residual: np.ndarray | None, scale: float
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(y, z) from the loop oracle, in the geometry's layout."""
    z = oracle.conv(to_cf(x, geom), to_cf(w, geom), geom.stride, geom.padding, geom.dilation,
                    geom.groups)
    if b is not None:
        z = z + b.reshape(1, -1, *([1] * geom.rank))
    if residual is not None:
        z = z + scale * to_cf(residual, geom)
    return from_cf(oracle.activation(act, z), geom), from_cf(z, geom)


def _inputs(geom: ConvGeometry, rng: np.random.Generator, dtype: Any = np.float64
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = rng.standard_normal(geom.input_shape).astype(dtype)
    w = rng.standard_normal(geom.weight_shape).astype(dtype)
    b = rng.standard_normal(geom.out_channels).astype(dtype)
    return x, w, b


def forward_vs_loops() -> Outcome:
    """conv_bias_act for every activation, with and without bias and residual."""
    from .. import ops

    rng = np.random.default_rng(0)
    worst = Worst(EXACT)
    for i, (geom, act) in enumerate(itertools.product(geometries(), activations.ACTIVATIONS)):
        x, w, b = _inputs(geom, rng)
        bias = b if i % 3 else None
        res = rng.standard_normal(geom.output_shape) if i % 2 else None
        scale = 0.5 if res is not None else 1.0
        copies = [a.copy() for a in (x, w, b)]
        y, z = ops.conv_bias_act(x, w, bias, geom, act, residual=res, residual_scale=scale)
        _unchanged(zip((x, w, b), copies), "conv_bias_act")
        y_ref, z_ref = expected_forward(x, w, bias, geom, act, res, scale)
        worst.compare(y, y_ref, f"{act} y, {geom.describe()}")
        if activations.saves(act) == "preactivation":
            worst.compare(z, z_ref, f"{act} z, {geom.describe()}")
        elif z is not None:
            raise CheckFailed(f"{act}: z returned although only silu, gelu and elu save it")
    return worst.outcome(f"{worst.count} outputs of conv_bias_act equal plain loops "
                         f"(ranks 1-3, both layouts, groups/depthwise, 9 activations)")


def _unchanged(pairs: Any, op: str) -> None:
    for a, copy in pairs:
        if not np.array_equal(a, copy, equal_nan=True):
            raise CheckFailed(f"{op} modified its input")


def _adjoint_error(lhs: float, rhs: float, terms: np.ndarray) -> float:
    """|<Ax, g> - <x, A^T g>| relative to the sum of |products|, the sum's own scale."""
    return abs(lhs - rhs) / max(float(np.sum(np.abs(terms))), 1e-300)


def gradients_adjoint() -> Outcome:
    """conv_backward_data/filter are the adjoints of the loop forward; bias grad is a sum."""
    from .. import ops

    rng = np.random.default_rng(1)
    worst = Worst(EXACT)
    for geom in geometries():
        x, w, _ = _inputs(geom, rng)
        g = rng.standard_normal(geom.output_shape)
        y = from_cf(oracle.conv(to_cf(x, geom), to_cf(w, geom), geom.stride, geom.padding,
                                geom.dilation, geom.groups), geom)
        lhs = float(np.sum(y * g))
        dx = ops.conv_backward_data(g, w, geom)
        worst.record(_adjoint_error(lhs, float(np.sum(x * dx)), x * dx),
                     f"<conv(x), g> = <x, dX(g)>, {geom.describe()}")
        dw = ops.conv_backward_filter(x, g, geom)
        worst.record(_adjoint_error(lhs, float(np.sum(w * dw)), w * dw),
                     f"<conv(x), g> = <w, dW(g)>, {geom.describe()}")
        db = ops.conv_backward_bias(g, geom)
        worst.compare(db, to_cf(g, geom).sum(axis=tuple(a for a in range(g.ndim) if a != 1)),
                      f"bias gradient, {geom.describe()}")
    return worst.outcome(f"{worst.count} gradient identities hold (data, filter, bias)")


def _away_from_kinks(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Pre-activations at least 0.2 from relu/relu6's kinks, so differences are smooth."""
    z = rng.uniform(0.2, 3.0, shape) * rng.choice((-1.0, 1.0), shape)
    z.flat[::7] = 6.5  # past relu6's cap
    return z


def activation_gradients() -> Outcome:
    """activation_backward and activation_backward_bias against central differences."""
    from .. import ops

    rng = np.random.default_rng(2)
    geom = geometries()[2]
    worst = Worst(1e-6)
    h = 1e-6
    for act in activations.ACTIVATIONS:
        z = _away_from_kinks(rng, geom.output_shape)
        dy = rng.standard_normal(z.shape)
        slope = (oracle.activation(act, z + h) - oracle.activation(act, z - h)) / (2 * h)
        saved = z if activations.saves(act) == "preactivation" else oracle.activation(act, z)
        dz = ops.activation_backward(dy, saved, act)
        worst.compare(dz, dy * slope, f"activation_backward {act}")
        dz2, db = ops.activation_backward_bias(dy, saved, act, geom)
        worst.compare(dz2, dy * slope, f"activation_backward_bias dz {act}")
        worst.compare(db, (dy * slope).sum(axis=(0, 2, 3)), f"activation_backward_bias db {act}")
    return worst.outcome(f"{worst.count} activation gradients match central differences")


def narrow_dtype(name: str) -> Outcome:
    """A float32/float16/bfloat16 result stays in its dtype and near the float64 result
    computed from the same (already rounded) inputs."""
    from .. import dtypes, ops

    rng = np.random.default_rng(3)
    dt = dtypes.SUPPORTED[name]
    worst = Worst(TOLERANCES[name])
    for geom in geometries()[1:3]:
        x, w, b = _inputs(geom, rng, dt)
        x64, w64, b64 = (a.astype(np.float64) for a in (x, w, b))
        for act in ("relu", "gelu"):
            y, _ = ops.conv_bias_act(x, w, b, geom, act)
            if y.dtype != dt:
                raise CheckFailed(f"{name} conv_bias_act returned {y.dtype}")
            worst.compare(y, ops.conv_bias_act(x64, w64, b64, geom, act)[0],
                          f"{name} {act} forward, {geom.describe()}")
        g = rng.standard_normal(geom.output_shape).astype(dt)
        g64 = g.astype(np.float64)
        worst.compare(ops.conv_backward_data(g, w, geom), ops.conv_backward_data(g64, w64, geom),
                      f"{name} backward data, {geom.describe()}")
        worst.compare(ops.conv_backward_filter(x, g, geom),
                      ops.conv_backward_filter(x64, g64, geom),
                      f"{name} backward filter, {geom.describe()}")
    return worst.outcome(f"{worst.count} {name} results near float64 (forward, data, filter)")


def average_pooling() -> Outcome:
    """Average pooling (padding counted) is a depthwise convolution with weights 1/k^r."""
    from .. import ops
    from ..pool_geometry import PoolGeometry

    rng = np.random.default_rng(4)
    worst = Worst(EXACT)
    for shape, kernel, stride, pad, layout in (((2, 3, 7), 3, 2, 1, "NCW"),
                                               ((1, 5, 5, 2), 2, None, 1, "NHWC"),
                                               ((1, 2, 4, 4, 3), 2, 1, 0, "NCDHW")):
        pgeom = PoolGeometry.create(shape, kernel, stride, pad, "avg", layout)
        x = rng.standard_normal(shape)
        xc = np.moveaxis(x, -1, 1) if pgeom.channels_last else x
        rank, c = x.ndim - 2, xc.shape[1]
        ones = np.full((c, 1, *pgeom.kernel_size), 1.0 / np.prod(pgeom.kernel_size))
        ref = oracle.conv(xc, ones, pgeom.stride, pgeom.padding, (1,) * rank, c)
        ref = np.moveaxis(ref, 1, -1) if pgeom.channels_last else ref
        y = ops.pool_forward(x, pgeom)
        worst.compare(y, ref, f"avg pool {pgeom.describe()}")
        g = rng.standard_normal(y.shape)
        dx = ops.pool_backward(g, x, y, pgeom)
        worst.record(_adjoint_error(float(np.sum(ref * g)), float(np.sum(x * dx)), x * dx),
                     f"avg pool adjoint {pgeom.describe()}")
    return worst.outcome(f"{worst.count} average-pooling results and adjoints agree")


def conv_layer_on_cpu() -> Outcome:
    """A Conv2d layer on the CPU: forward equals loops; backward is the forward's adjoint."""
    import convfuse

    rng = np.random.default_rng(5)
    layer = convfuse.Conv2d(4, 6, 3, stride=2, padding=1, groups=2, dtype="float64",
                            device="cpu", seed=0)
    assert layer.bias is not None  # built with the default bias=True
    geom = ConvGeometry.create((2, 4, 6, 5), layer.weight.shape, 2, 1, 1, 2, "NCHW")
    x = rng.standard_normal(geom.input_shape)
    w, b = layer.weight.data.copy(), layer.bias.data.copy()
    worst = Worst(EXACT)
    y = layer(x)
    y_ref, _ = expected_forward(x, w, b, geom, "identity", None, 1.0)
    worst.compare(y, y_ref, "Conv2d forward")
    g = rng.standard_normal(y.shape)
    layer.zero_grad()
    dx = layer.backward(g)
    lhs = float(np.sum((y_ref - b.reshape(1, -1, 1, 1)) * g))
    worst.record(_adjoint_error(lhs, float(np.sum(x * dx)), x * dx), "Conv2d dx adjoint")
    dw = layer.weight.grad
    worst.record(_adjoint_error(lhs, float(np.sum(w * dw)), w * dw), "Conv2d dW adjoint")
    worst.compare(layer.bias.grad, g.sum(axis=(0, 2, 3)), "Conv2d bias gradient")
    return worst.outcome("Conv2d(4, 6, 3, stride=2, padding=1, groups=2) on the CPU engine")


REFERENCE_CHECKS: tuple[tuple[str, Callable[[], Outcome]], ...] = (
    ("reference forward = loops", forward_vs_loops),
    ("reference gradients (adjoints)", gradients_adjoint),
    ("activation gradients (FD)", activation_gradients),
    *((f"reference {name} vs float64", functools.partial(narrow_dtype, name))
      for name in ("float32", "float16", "bfloat16")),
    ("average pooling", average_pooling),
    ("Conv2d layer on the CPU", conv_layer_on_cpu),
)
