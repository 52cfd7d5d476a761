"""GPU checks: every cuDNN-backed op on CuPy arrays against the float64 reference engine.

Each case runs for every dtype the device supports, on the tiny geometries of
reference_checks.GEOMETRIES (ranks 1-3, both layouts, groups and depthwise), with
config.allow_tf32=False so float32 is held to 1e-5 (gpu_suite.py also runs the float32 cases
with TF32 at its default, held to gpu_arrays.TF32_TOLERANCE). Outputs that take `out=` are poisoned
with NaN first; a NaN left behind counts as an infinite error (runner.relative_error).
Training-level cases (layers, autotune, optimizer, captured step) are in gpu_training.py;
gpu_suite.py runs both. Shared array helpers live in gpu_arrays.py, so neither case module
imports the other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from .. import activations, dtypes
from .gpu_arrays import dev, f64, host, host_inputs, poisoned, tolerance
from .reference_checks import geometries
from .runner import Outcome, Worst


def conv_bias_act_case(act: str, dtype: str) -> Outcome:  # pragma: gpu
    """The fused forward for one activation over every geometry, bias and residual varied."""
    import cupy as cp

    from .. import ops

    rng = np.random.default_rng(10)
    worst = Worst(tolerance(dtype))
    for i, geom in enumerate(geometries()):
        x, w, b, res = host_inputs(rng, dtype, geom.input_shape, geom.weight_shape,
                                   (geom.out_channels,), geom.output_shape)
        bias = b if i % 2 == 0 else None
        residual = res if i % 2 == 1 else None
        # Unpacked by name: a starred list could reach residual= as far as mypy can tell.
        xd, wd, bd, rd = dev(cp, x, w, bias, residual)
        with worst.attempt(geom.describe()):
            y, z = ops.conv_bias_act(xd, wd, bd, geom, act, residual=rd, residual_scale=0.5)
            x64, w64, b64, r64 = f64(x, w, bias, residual)
            y_ref, z_ref = ops.conv_bias_act(x64, w64, b64, geom, act, residual=r64,
                                             residual_scale=0.5)
            worst.compare(host(y), y_ref, f"{act} y, {geom.describe()}")
            if z_ref is not None:
                worst.compare(host(z), z_ref, f"{act} z, {geom.describe()}")
    return worst.outcome(f"{worst.count} outputs, ranks 1-3, both layouts, groups, residual")


def backward_case(which: str, dtype: str) -> Outcome:  # pragma: gpu
    """conv_backward_data / _filter / _bias into NaN-poisoned outputs (beta=0 overwrites),
    then again with beta=1 into the first result (accumulation doubles it)."""
    import cupy as cp

    from .. import ops

    rng = np.random.default_rng(11)
    worst = Worst(tolerance(dtype))
    for geom in geometries():
        x, w, dz = host_inputs(rng, dtype, geom.input_shape, geom.weight_shape,
                               geom.output_shape)
        x64, w64, dz64 = f64(x, w, dz)
        if which == "data":
            ref, shape = ops.conv_backward_data(dz64, w64, geom), geom.input_shape
            run = functools.partial(ops.conv_backward_data, cp.asarray(dz), cp.asarray(w), geom)
        elif which == "filter":
            ref, shape = ops.conv_backward_filter(x64, dz64, geom), geom.weight_shape
            run = functools.partial(ops.conv_backward_filter, cp.asarray(x), cp.asarray(dz),
                                    geom)
        else:
            ref, shape = ops.conv_backward_bias(dz64, geom), (geom.out_channels,)
            run = functools.partial(ops.conv_backward_bias, cp.asarray(dz), geom)
        out = poisoned(cp, shape, dtype)
        with worst.attempt(geom.describe()):
            run(out=out, beta=0.0)
            worst.compare(host(out), ref, f"backward {which} (beta=0), {geom.describe()}")
            run(out=out, beta=1.0)
            worst.compare(host(out), 2 * ref,
                          f"backward {which} (beta=1), {geom.describe()}")
    return worst.outcome(f"{worst.count} results, beta 0 and 1, every geometry")


def activation_case(dtype: str) -> Outcome:  # pragma: gpu
    """activation_forward/_backward/_backward_bias kernels for all nine activations."""
    import cupy as cp

    from .. import ops

    rng = np.random.default_rng(12)
    worst = Worst(tolerance(dtype))
    for geom in (geometries()[1], geometries()[2]):  # channels-last and channels-first
        for act in activations.ACTIVATIONS:
            z, dy = host_inputs(rng, dtype, geom.output_shape, geom.output_shape)
            z64, dy64 = f64(z, dy)
            y_ref = ops.activation_forward(z64, act)
            y = poisoned(cp, z.shape, dtype)
            ops.activation_forward(cp.asarray(z), act, out=y)
            worst.compare(host(y), y_ref, f"activation_forward {act}")
            pre = activations.saves(act) == "preactivation"
            saved = z if pre else np.asarray(host(y)).astype(z.dtype)
            saved64 = f64(saved)[0]
            dz_ref = ops.activation_backward(dy64, saved64, act)
            dz = poisoned(cp, z.shape, dtype)
            ops.activation_backward(cp.asarray(dy), cp.asarray(saved), act, out=dz)
            worst.compare(host(dz), dz_ref, f"activation_backward {act}")
            dz2, db = ops.activation_backward_bias(cp.asarray(dy), cp.asarray(saved), act, geom)
            dz2_ref, db_ref = ops.activation_backward_bias(dy64, saved64, act, geom)
            worst.compare(host(dz2), dz2_ref, f"activation_backward_bias dz {act}")
            worst.compare(host(db), db_ref, f"activation_backward_bias db {act}")
    return worst.outcome(f"{worst.count} results, 9 activations, both layouts")


def pooling_case(dtype: str) -> Outcome:  # pragma: gpu
    """Max and average pooling forward and backward, on inputs without ties (distinct small
    integers, exact in every dtype) so the max's position is unambiguous."""
    import cupy as cp

    from .. import ops
    from ..pool_geometry import PoolGeometry

    rng = np.random.default_rng(13)
    worst = Worst(tolerance(dtype))
    dt = dtypes.SUPPORTED[dtype]
    for mode, (shape, kernel, stride, pad, layout) in (
            ("max", ((2, 3, 6, 6), 2, None, 0, "NCHW")), ("max", ((1, 5, 5, 4), 3, 2, 1, "NHWC")),
            ("avg", ((2, 3, 6, 6), 3, 2, 1, "NCHW")), ("avg", ((1, 4, 4, 3), 2, 1, 0, "NHWC"))):
        pgeom = PoolGeometry.create(shape, kernel, stride, pad, mode, layout)
        size = int(np.prod(shape))
        x = (rng.permutation(size) - size // 2).reshape(shape).astype(dt)
        y_ref = ops.pool_forward(f64(x)[0], pgeom)
        (dy,) = host_inputs(rng, dtype, y_ref.shape)
        with worst.attempt(pgeom.describe()):
            y = ops.pool_forward(cp.asarray(x), pgeom)
            worst.compare(host(y), y_ref, f"pool_forward {pgeom.describe()}")
            dx = ops.pool_backward(cp.asarray(dy), cp.asarray(x), y, pgeom)
            worst.compare(host(dx), ops.pool_backward(f64(dy)[0], f64(x)[0], y_ref, pgeom),
                          f"pool_backward {pgeom.describe()}")
    return worst.outcome(f"{worst.count} results, max and average, both layouts")


OP_CASES: tuple[tuple[str, Callable[[str], Outcome]], ...] = (
    *((f"conv_bias_act {act}", functools.partial(conv_bias_act_case, act))
      for act in activations.ACTIVATIONS),
    ("conv_backward_data", functools.partial(backward_case, "data")),
    ("conv_backward_filter", functools.partial(backward_case, "filter")),
    ("conv_backward_bias", functools.partial(backward_case, "bias")),
    ("activation kernels", activation_case),
    ("pooling", pooling_case),
)
