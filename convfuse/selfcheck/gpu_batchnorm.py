"""GPU checks of batch normalization: the ops in training and evaluation, on the fused
(cudnnBatchNormalization*Ex) and plain paths, with a residual and ReLU; and one training
step of a tiny ResNet (conv + BatchNorm + residual blocks, SGD), each against float64.

Which path ran is checked, not assumed (Note [BatchNorm in cuDNN] in plan/batchnorm.py): a
configuration cuDNN documents as fusable must run the fused calls unless the plan recorded
a refusal or an out-of-memory back-off (which warned, FusedFallbackWarning); any other
configuration must run the plain calls. With NumPy standing in for CuPy (the CPU dry run
of tests/test_selfcheck_pieces.py) there is no engine state and the path is not checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..dtypes import compute_dtype
from .gpu_arrays import dev, f64, host, host_inputs, poisoned, tolerance
from .runner import CheckFailed, Outcome, Worst

EPS, FACTOR = 1e-3, 0.25
# One SGD step through a dozen layers with BatchNorm accumulates float32 rounding.
RESNET_TOLERANCE = 1e-4

# (shape, layout, activation, residual): channels-last half with C % 4 == 0 and ReLU is
# cuDNN's documented fused configuration (with and without the residual add); the rest
# run the plain calls: channels-first, 1-D lifted to 4-D, (N, C), C % 4 != 0, identity.
BN_CONFIGS = (
    ((4, 3, 3, 8), "NHWC", "relu", True),
    ((4, 3, 3, 8), "NHWC", "relu", False),
    ((4, 3, 2, 6), "NHWC", "relu", True),
    ((4, 8, 3, 3), "NCHW", "relu", True),
    ((4, 6, 5), "NCHW", "identity", False),
    ((6, 4), "NCHW", "relu", False),
)

# The BatchNorm backward subtracts sums of the batch (cancellation), and a half-precision
# dx is rounded once more: hold it to twice the dtype's tolerance.
BACKWARD_SLACK = 2.0


def _check_path(saved: Any, geom: Any, dtype: str, act: str, residual: bool,
                what: str) -> None:  # pragma: gpu
    from ..plan.batchnorm import fused_documented, fused_ops_name, get_batchnorm_plan

    state = saved.engine_state
    if state is None:  # the NumPy engine (CPU dry run): no cuDNN path to check
        return
    plan = get_batchnorm_plan(geom, dtype, act, residual)
    expected = fused_documented(geom, dtype) and fused_ops_name(act, residual) is not None
    if state.fused and not expected:
        raise CheckFailed(f"{what}: ran the fused Ex calls outside the documented configuration")
    if expected and not state.fused and not plan.fell_back:
        raise CheckFailed(f"{what}: the documented fused configuration ran the plain calls "
                          "and the plan recorded no refusal or out-of-memory")


def batchnorm_case(dtype: str) -> Outcome:  # pragma: gpu
    """Training forward (running statistics updated in place) and backward into poisoned
    parameter gradients, then evaluation forward and backward with the updated statistics."""
    import cupy as cp

    from .. import ops
    from ..plan.batchnorm import BatchNormGeometry

    rng = np.random.default_rng(30)
    worst = Worst(tolerance(dtype))
    loose = Worst(BACKWARD_SLACK * tolerance(dtype))
    cd = compute_dtype(dtype)
    fused_runs = 0
    for shape, layout, act, residual in BN_CONFIGS:
        geom = BatchNormGeometry.create(shape, layout)
        c = geom.channels
        x, res_in, dy = host_inputs(rng, dtype, shape, shape, shape)
        res = res_in if residual else None
        w = rng.uniform(0.5, 1.5, c).astype(cd)
        b, rm = (rng.standard_normal(c) * 0.2).astype(cd), rng.standard_normal(c).astype(cd)
        rv = rng.uniform(0.5, 2.0, c).astype(cd)
        x64, res64, dy64, w64, b64, rm64, rv64 = f64(x, res, dy, w, b, rm, rv)
        what = f"{geom.describe()} {act} residual={residual}"
        for training in (True, False):
            kind = "train" if training else "eval"
            gx, gres, gw, gb, grm, grv = dev(cp, x, res, w, b, rm, rv)
            if training:
                y, saved = ops.batchnorm_forward_training(gx, gw, gb, grm, grv, layout, EPS,
                                                          FACTOR, act, gres)
                y_ref, s_ref = ops.batchnorm_forward_training(x64, w64, b64, rm64, rv64,
                                                              layout, EPS, FACTOR, act, res64)
                worst.compare(host(grm), rm64, f"{what} running_mean")
                worst.compare(host(grv), rv64, f"{what} running_var")
                _check_path(saved, geom, dtype, act, residual, what)
                fused_runs += bool(getattr(saved.engine_state, "fused", False))
            else:  # rm64/rv64 now hold the statistics the training step left
                gx, gres, grm, grv = dev(cp, x, res, rm64.astype(cd), rv64.astype(cd))
                y, saved = ops.batchnorm_forward_inference(gx, gw, gb, grm, grv, layout, EPS,
                                                           act, gres)
                y_ref, s_ref = ops.batchnorm_forward_inference(x64, w64, b64, rm64, rv64,
                                                               layout, EPS, act, res64)
            worst.compare(host(y), y_ref, f"{what} {kind} y")
            dw, db = poisoned(cp, (c,), cd.name), poisoned(cp, (c,), cd.name)
            dx, dw, db, dres = ops.batchnorm_backward(cp.asarray(dy), gx, gw, gb, saved, layout,
                                                      EPS, act, residual, weight_grad=dw,
                                                      bias_grad=db)
            ref = ops.batchnorm_backward(dy64, x64, w64, b64, s_ref, layout, EPS, act, residual)
            for name, got, want in zip(("dx", "dweight", "dbias", "dresidual"),
                                       (dx, dw, db, dres), ref):
                if want is not None:
                    loose.compare(host(got), want, f"{what} {kind} {name}")
    # The backward's error is reported scaled to the forward's tolerance (both passed).
    return Outcome(f"{worst.count + loose.count} results: train/eval, fused and plain "
                   f"configurations, residual + ReLU ({fused_runs} fused training runs)",
                   max(worst.error, loose.error / BACKWARD_SLACK), worst.tolerance)


def _tiny_resnet(dtype: str, layout: str, device: str) -> Any:  # pragma: gpu
    from ..models import ResNet

    return ResNet((1, 1), (4, 8), num_classes=5, in_channels=3, stem="small", layout=layout,
                  dtype=dtype, device=device, seed=0)


def resnet_step_case(dtype: str) -> Outcome:  # pragma: gpu
    """One SGD step of a tiny ResNet (stem, two BasicBlocks, one with a downsample) in
    both layouts: loss, every parameter after the step and every BatchNorm buffer against
    the same model run in float64 on the CPU from the same (rounded) weights."""
    import cupy as cp

    import convfuse
    from convfuse import optim

    rng = np.random.default_rng(31)
    worst = Worst(RESNET_TOLERANCE if dtype == "float32" else tolerance(dtype))
    losses = []
    for layout in ("NCHW", "NHWC"):
        gpu = _tiny_resnet(dtype, layout, "cpu").to("cuda")  # built on the host, as a twin
        twin = _tiny_resnet("float64", layout, "cpu")
        twin.load_state_dict(gpu.state_dict())
        shape = (4, 3, 6, 6) if layout == "NCHW" else (4, 6, 6, 3)
        (x,) = host_inputs(rng, dtype, shape)
        labels = rng.integers(0, 5, size=4).astype(np.int64)

        def step(model: Any, xb: Any, lab: Any) -> Any:
            opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            loss_fn = convfuse.CrossEntropyLoss()
            opt.zero_grad()
            loss = loss_fn(model(xb), lab)
            model.backward(loss_fn.backward())
            opt.step()
            return loss

        loss = float(step(gpu, cp.asarray(x), cp.asarray(labels)))
        loss_ref = float(step(twin, x.astype(np.float64), labels))
        losses.append(loss)
        worst.compare([loss], [loss_ref], f"{layout} loss")
        want = twin.state_dict()
        for k, v in gpu.state_dict().items():
            worst.compare(host(v), np.asarray(want[k], np.float64), f"{layout} {k}")
    return worst.outcome("one SGD step, both layouts: loss, parameters, running statistics "
                         "(losses " + ", ".join(f"{v:.4f}" for v in losses) + ")")


resnet_step_case.dtypes = ("float32",)  # type: ignore[attr-defined]

BATCHNORM_CASES: tuple[tuple[str, Callable[[str], Outcome]], ...] = (
    ("batchnorm train/eval, fused/plain", batchnorm_case),
    ("tiny ResNet training step", resnet_step_case),
)
