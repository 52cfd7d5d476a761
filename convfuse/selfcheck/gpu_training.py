"""GPU checks above the ops: layers, one plan autotune, the fused optimizers, and a training
step captured as a CUDA graph, each against a float64 run of the same thing on the CPU.

Layers and data are built on the host from fixed seeds and moved to the GPU, so the
float64 CPU twin starts from exactly the same (dtype-rounded) values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import config, dtypes
from ..geometry import ConvGeometry
from .gpu_arrays import f64, host, host_inputs, poisoned, tolerance
from .runner import CheckFailed, Outcome, Worst

# Three SGD steps through a small net accumulate float32 rounding: compare at 1e-4.
TRAINING_TOLERANCE = 1e-4


# (layer, x shape, layout, config.bias_grad): every conv layer class, both layouts and
# both bias-gradient paths; groups=2, relu and a residual throughout.
CONV_LAYERS = (
    ("Conv2d", (2, 4, 5, 6), "NCHW", "cudnn"),
    ("Conv2d", (2, 5, 6, 4), "NHWC", "cudnn"),
    ("Conv2d", (2, 4, 5, 6), "NCHW", "fused"),
    ("Conv2d", (2, 5, 6, 4), "NHWC", "fused"),
    ("Conv1d", (2, 4, 9), "NCW", "cudnn"),
    ("Conv3d", (1, 3, 4, 5, 4), "NDHWC", "fused"),
)


def conv_layers_case(dtype: str) -> Outcome:  # pragma: gpu
    """Conv1d/2d/3d forward and backward (y, dx, dresidual, weight and bias grads)."""
    import cupy as cp

    import convfuse
    from convfuse import ops

    rng = np.random.default_rng(20)
    worst = Worst(tolerance(dtype))
    for cls, x_shape, layout, bias_grad in CONV_LAYERS:
        layer = getattr(convfuse, cls)(4, 6, 3, padding=1, groups=2, activation="relu",
                                       layout=layout, dtype=dtype, device="cpu",
                                       seed=0).to("cuda")
        layer.residual_scale = 0.5
        geom = ConvGeometry.create(x_shape, layer.weight.shape, 1, 1, 1, 2, layout)
        x, res, dy = host_inputs(rng, dtype, x_shape, geom.output_shape, geom.output_shape)
        w64, b64 = host(layer.weight.data), host(layer.bias.data)
        x64, res64, dy64 = f64(x, res, dy)
        with config.flags(bias_grad=bias_grad):
            y = layer(cp.asarray(x), residual=cp.asarray(res))
            layer.zero_grad()
            dx, dres = layer.backward(cp.asarray(dy))
        y_ref, _ = ops.conv_bias_act(x64, w64, b64, geom, "relu", residual=res64,
                                     residual_scale=0.5)
        dz = ops.activation_backward(dy64, y_ref, "relu")
        what = f"{cls} {layout} bias_grad={bias_grad}"
        worst.compare(host(y), y_ref, f"{what} y")
        worst.compare(host(dx), ops.conv_backward_data(dz, w64, geom), f"{what} dx")
        worst.compare(host(dres), 0.5 * dz, f"{what} dresidual")
        worst.compare(host(layer.weight.grad), ops.conv_backward_filter(x64, dz, geom),
                      f"{what} weight.grad")
        worst.compare(host(layer.bias.grad), ops.conv_backward_bias(dz, geom),
                      f"{what} bias.grad")
    return worst.outcome(f"{worst.count} results: Conv1d/2d/3d, both layouts, both "
                         "bias-gradient paths")


def pool_layers_case(dtype: str) -> Outcome:  # pragma: gpu
    """MaxPool2d and AvgPool2d forward and backward, on tie-free inputs."""
    import cupy as cp

    import convfuse
    from convfuse import ops
    from convfuse.pool_geometry import PoolGeometry

    rng = np.random.default_rng(25)
    worst = Worst(tolerance(dtype))
    for cls, mode, layout in (("MaxPool2d", "max", "NCHW"), ("AvgPool2d", "avg", "NHWC")):
        layer = getattr(convfuse, cls)(3, stride=2, padding=1, layout=layout).to("cuda")
        shape = (2, 3, 7, 6) if layout == "NCHW" else (2, 7, 6, 3)
        size = int(np.prod(shape))
        x = (rng.permutation(size) - size // 2).reshape(shape).astype(dtypes.SUPPORTED[dtype])
        pgeom = PoolGeometry.create(shape, 3, 2, 1, mode, layout)
        y = layer(cp.asarray(x))
        y_ref = ops.pool_forward(f64(x)[0], pgeom)
        (dy,) = host_inputs(rng, dtype, y_ref.shape)
        dx = layer.backward(cp.asarray(dy))
        worst.compare(host(y), y_ref, f"{cls} y")
        worst.compare(host(dx), ops.pool_backward(f64(dy)[0], f64(x)[0], y_ref, pgeom), f"{cls} dx")
    return worst.outcome("MaxPool2d (NCHW) and AvgPool2d (NHWC), kernel 3, stride 2, pad 1")


def linear_layer_case(dtype: str) -> Outcome:  # pragma: gpu
    """Linear with gelu, against x @ W.T + b and its gradients written out in float64."""
    import cupy as cp

    import convfuse
    from convfuse import ops

    rng = np.random.default_rng(21)
    worst = Worst(tolerance(dtype))
    layer = convfuse.Linear(12, 5, activation="gelu", dtype=dtype, device="cpu",
                            seed=0).to("cuda")
    assert layer.bias is not None  # built with the default bias=True
    x, dy = host_inputs(rng, dtype, (4, 12), (4, 5))
    x64, dy64 = f64(x, dy)
    w64, b64 = host(layer.weight.data), host(layer.bias.data)
    y = layer(cp.asarray(x))
    layer.zero_grad()
    dx = layer.backward(cp.asarray(dy))
    z = x64 @ w64.T + b64
    dz = ops.activation_backward(dy64, z, "gelu")
    worst.compare(host(y), ops.activation_forward(z, "gelu"), "Linear y")
    worst.compare(host(dx), dz @ w64, "Linear dx")
    worst.compare(host(layer.weight.grad), dz.T @ x64, "Linear weight.grad")
    worst.compare(host(layer.bias.grad), dz.sum(axis=0), "Linear bias.grad")
    return worst.outcome("Linear(12, 5, gelu): y, dx, weight/bias grads")


def autotune_case(dtype: str) -> Outcome:  # pragma: gpu
    """config.benchmark=True: a new plan autotunes with cudnnFind*AlgorithmEx and its
    forward, data and filter results are still right."""
    import cupy as cp

    from convfuse import ops, plan

    from .reference_checks import geometries

    rng = np.random.default_rng(22)
    worst = Worst(tolerance(dtype))
    geom = geometries()[2]
    x, w, b, dz = host_inputs(rng, dtype, geom.input_shape, geom.weight_shape,
                              (geom.out_channels,), geom.output_shape)
    x64, w64, b64, dz64 = f64(x, w, b, dz)
    before = plan.plan_cache_info()
    with config.flags(benchmark=True):
        y, _ = ops.conv_bias_act(cp.asarray(x), cp.asarray(w), cp.asarray(b), geom, "relu")
        dx = ops.conv_backward_data(cp.asarray(dz), cp.asarray(w), geom,
                                    out=poisoned(cp, geom.input_shape, dtype))
        dw = ops.conv_backward_filter(cp.asarray(x), cp.asarray(dz), geom,
                                      out=poisoned(cp, geom.weight_shape, dtype))
    if plan.plan_cache_info().misses <= before.misses:
        raise CheckFailed("benchmark=True did not build a new (autotuned) plan")
    worst.compare(host(y), ops.conv_bias_act(x64, w64, b64, geom, "relu")[0], "autotuned y")
    worst.compare(host(dx), ops.conv_backward_data(dz64, w64, geom), "autotuned dx")
    worst.compare(host(dw), ops.conv_backward_filter(x64, dz64, geom), "autotuned dw")
    return worst.outcome(f"Find*Ex autotune on {geom.describe()}")


autotune_case.dtypes = ("float32",)  # type: ignore[attr-defined]


def optimizer_case(kind: str, dtype: str) -> Outcome:  # pragma: gpu
    """Three fused steps (lr changed between them) against the NumPy optimizer in float64."""
    import cupy as cp

    from convfuse import Parameter, optim

    rng = np.random.default_rng(23)
    worst = Worst(tolerance(dtype))
    shapes = ((6, 3, 3, 3), (6,), (10, 24), (10,))
    values = host_inputs(rng, dtype, *shapes)
    on_gpu = [Parameter(cp.asarray(v)) for v in values]
    on_cpu = [Parameter(v.astype(np.float64)) for v in values]
    make = {"Adam": lambda ps: optim.Adam(ps, lr=1e-2, weight_decay=1e-2),
            "AdamW": lambda ps: optim.AdamW(ps, lr=1e-2),
            "SGD": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                        weight_decay=1e-3)}[kind]
    opt_gpu, opt_cpu = make(on_gpu), make(on_cpu)
    for step in range(3):
        if step == 2:
            opt_gpu.lr = opt_cpu.lr = opt_cpu.lr / 2
        for pg, pc, g in zip(on_gpu, on_cpu, host_inputs(rng, dtype, *shapes)):
            pg.grad[...] = cp.asarray(g)
            pc.grad[...] = g.astype(np.float64)
        opt_gpu.step()
        opt_cpu.step()
    for i, (pg, pc) in enumerate(zip(on_gpu, on_cpu)):
        worst.compare(host(pg.data), pc.data, f"{kind} parameter {i} after 3 steps")
    return worst.outcome(f"{kind}: 4 parameters, 3 steps, lr changed on the device")


def _net(dtype: str) -> Any:  # pragma: gpu
    import convfuse

    return convfuse.Sequential(
        convfuse.Conv2d(1, 4, 3, padding=1, activation="relu", dtype=dtype, device="cpu",
                        seed=1),
        convfuse.MaxPool2d(2),
        convfuse.Flatten(),
        convfuse.Linear(4 * 4 * 4, 10, dtype=dtype, device="cpu", seed=2),
    )


def _trainer(net: Any) -> tuple[Any, Callable[[Any, Any], Any]]:  # pragma: gpu
    import convfuse
    from convfuse import optim

    opt = optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loss_fn = convfuse.CrossEntropyLoss()

    def step(x: Any, labels: Any) -> Any:
        opt.zero_grad()
        loss = loss_fn(net(x), labels)
        net.backward(loss_fn.backward())
        opt.step()
        return loss

    return opt, step


def captured_step_case(dtype: str) -> Outcome:  # pragma: gpu
    """conv-relu-maxpool-flatten-linear + cross-entropy + SGD: a captured CUDA graph
    replayed, the same steps run eagerly on the GPU, and a float64 CPU twin agree."""
    import cupy as cp

    from convfuse import graph

    rng = np.random.default_rng(24)
    dt = dtypes.SUPPORTED[dtype]
    batches = [(rng.standard_normal((8, 1, 8, 8)).astype(dt),
                rng.integers(0, 10, size=8).astype(np.int64)) for _ in range(4)]
    eager = _net(dtype).to("cuda")
    _, eager_step = _trainer(eager)
    eager_losses = [float(eager_step(cp.asarray(x), cp.asarray(lab))) for x, lab in batches]
    twin = _net("float64")
    _, twin_step = _trainer(twin)
    twin_losses = [float(twin_step(x.astype(np.float64), lab)) for x, lab in batches]
    replayed = _net(dtype).to("cuda")
    _, replay_step = _trainer(replayed)
    # capture() runs one eager warm-up step on its example inputs (batch 0), then records.
    captured = graph.capture(replay_step, cp.asarray(batches[0][0]), cp.asarray(batches[0][1]))
    replay_losses = [eager_losses[0]]
    for x, lab in batches[1:]:
        loss = captured(cp.asarray(x), cp.asarray(lab))
        captured.synchronize()
        replay_losses.append(float(loss))
    worst = Worst(TRAINING_TOLERANCE)
    worst.compare(eager_losses, twin_losses, "eager GPU losses vs float64 CPU")
    worst.compare(replay_losses, eager_losses, "captured-graph losses vs eager")
    for i, (pe, pr, pt) in enumerate(zip(eager.parameters(), replayed.parameters(),
                                         twin.parameters())):
        worst.compare(host(pe.data), pt.data, f"eager parameter {i} vs float64 CPU")
        worst.compare(host(pr.data), host(pe.data), f"captured parameter {i} vs eager")
    return worst.outcome("4 SGD steps: graph replay = eager = float64 CPU (losses "
                         + ", ".join(f"{v:.3f}" for v in eager_losses) + ")")


captured_step_case.dtypes = ("float32",)  # type: ignore[attr-defined]


TRAINING_CASES: tuple[tuple[str, Callable[[str], Outcome]], ...] = (
    ("conv layers", conv_layers_case),
    ("Linear layer", linear_layer_case),
    ("pooling layers", pool_layers_case),
    ("plan autotune", autotune_case),
    *((f"fused {kind}", functools.partial(optimizer_case, kind))
      for kind in ("SGD", "Adam", "AdamW")),
    ("captured training step", captured_step_case),
)
