"""Training step of the digits net: forward, loss, backward and Adam, in several forms.

- fused:   convfuse layers, CrossEntropyLoss and fused Adam, run eagerly;
- unfused: the same net from unfused operations (bench/unfused_net.py);
- graph:   the fused step captured once as a CUDA graph and replayed (GPU only);
- torch_eager / torch_compile: PyTorch with cudnn.benchmark=True (CUDA PyTorch only;
  PyTorch CPU eager is compared on the CPU when installed, labelled as such).
Random 8x8 images and labels; every form starts from the same weights, and their losses
and gradients are compared on one batch before any timing.
"""

from __future__ import annotations

from typing import Any

import convfuse as cf

from . import cases, checks, records, roofline, unfused_net
from .records import Context

LR = 1e-3
GRAD_TOL = {"cpu": 1e-4, "gpu": 2e-2}  # the GPU's default config allows TF32 convolutions
FORMS = ("fused", "unfused", "graph", "torch_eager", "torch_compile")


def run(ctx: Context) -> list[dict[str, Any]]:
    return [run_one(ctx, batch) for batch in cases.TRAIN_BATCHES]


def run_one(ctx: Context, batch: int) -> dict[str, Any]:
    rec = records.new("train", f"digits-net batch {batch}", batch=batch, precision=_prec(ctx),
                      shape=f"N{batch} 1x8x8 -> conv16-pool-conv32-pool-linear10", forms={})
    return records.guarded(ctx, rec, f"train batch {batch}", lambda: _measure(ctx, batch, rec))


def _prec(ctx: Context) -> str:
    """The precision the step runs in: float32 data with convfuse's default math mode."""
    if not ctx.engine.is_gpu:
        return "fp32"
    return "tf32" if cf.config.get().allow_tf32 else "fp32"  # pragma: gpu


class FusedStep:
    """The example's step: zero_grad, forward, loss, backward, Adam; returns the loss."""

    def __init__(self, device: str, seed: int) -> None:
        self.net = unfused_net.build_fused(cf, device, seed)
        if hasattr(self.net, "needs_input_grad"):  # the images need no gradient
            self.net.needs_input_grad = False
        self.loss_fn = cf.CrossEntropyLoss()
        self.opt = cf.optim.Adam(self.net.parameters(), lr=LR)

    def grads(self, x: Any, labels: Any) -> tuple[Any, list[Any]]:
        self.opt.zero_grad()
        loss = self.loss_fn(self.net(x), labels)
        self.net.backward(self.loss_fn.backward())
        return loss, [p.grad for p in self.net.parameters()]

    def __call__(self, x: Any, labels: Any) -> Any:
        loss, _ = self.grads(x, labels)
        self.opt.step()
        return loss


def _measure(ctx: Context, batch: int, rec: dict) -> None:
    eng = ctx.engine
    n_sets = eng.rotation(batch * (unfused_net.IMAGE**2 * 4 + 4))
    xs = [eng.uniform((batch, 1, 8, 8), "float32", ctx.seed + i, 0.0, 1.0) for i in range(n_sets)]
    ys = [eng.labels(batch, unfused_net.CLASSES, ctx.seed + i) for i in range(n_sets)]
    rec["input_sets"] = n_sets
    fused = FusedStep(eng.device, ctx.seed)
    weights = [eng.to_host(p.data).copy() for p in fused.net.parameters()]
    slow = unfused_net.UnfusedDigitNet(eng.xp, [eng.xp.asarray(w) for w in weights], batch, LR)

    tol = GRAD_TOL[eng.kind]
    loss_f, grads_f = fused.grads(xs[0], ys[0])
    # copies: the loss and the gradients live in buffers that later steps overwrite
    want_loss = eng.to_host(loss_f).copy()
    want_grads = [eng.to_host(g).copy() for g in grads_f]
    loss_u, grads_u = slow.forward_backward(xs[0], ys[0])
    rec["checks"].append(checks.compare("unfused vs fused loss", eng.to_host(loss_u),
                                        want_loss, tol))
    for i, (gu, gf) in enumerate(zip(grads_u, want_grads)):
        rec["checks"].append(checks.compare(f"unfused vs fused grad {i}", eng.to_host(gu),
                                            gf, tol))
    if not checks.all_ok(rec["checks"]):
        records.check_failed(rec, checks.failures(rec["checks"]))
        return

    forms: dict[str, Any] = {"fused": lambda i: fused(xs[i], ys[i]),
                             "unfused": lambda i: slow.step(xs[i], ys[i])}
    rec["forms"]["fused"] = rec["forms"]["unfused"] = "measured"
    if eng.is_gpu:  # pragma: gpu
        _graph(ctx, xs, ys, rec, n_sets, forms)
    else:
        rec["forms"]["graph"] = "skipped: CUDA graphs need a GPU"
    try:
        if ctx.torch is not None:
            try:
                forms.update(ctx.torch.train_forms(ctx, weights, xs, ys, LR, want_loss,
                                                   want_grads, rec))
            except Exception as exc:  # PyTorch's own failure is a note, not a convfuse error
                rec["notes"].append(f"PyTorch: {type(exc).__name__}: {exc}")
        else:
            for form in ("torch_eager", "torch_compile"):
                rec["forms"][form] = f"skipped: {ctx.torch_note}"
        for name, st in ctx.time_many(forms, n_sets).items():
            records.put_timing(rec, name, st)
    finally:
        if ctx.torch is not None:
            ctx.torch.release()
    records.ratio(rec, "fused/unfused", "fused", "unfused")
    records.ratio(rec, "graph/fused", "graph", "fused")
    records.ratio(rec, "convfuse/pytorch", "fused", "torch_eager")
    # torch.compile's default mode captures no CUDA graph: this compares convfuse's graph
    # replay with PyTorch's compiled eager step, which the name says
    records.ratio(rec, "graph/torch_compile_no_graphs", "graph", "torch_compile")
    work = step_works(batch)
    prec = rec["precision"]
    floor = roofline.floor_seconds(work, ctx.peaks.flops[prec], ctx.peaks.bandwidth)
    records.put_floor(rec, roofline.total(work), floor, prec, FORMS)


def _graph(ctx: Context, xs: list, ys: list, rec: dict, n_sets: int,
           forms: dict) -> None:  # pragma: gpu
    """Check a replayed step against an eager one from the same state; add it to `forms`."""
    eng = ctx.engine
    eager = FusedStep(eng.device, ctx.seed)
    graphed = FusedStep(eng.device, ctx.seed)
    eager(xs[0], ys[0])
    try:
        captured = cf.graph.capture(graphed, xs[0], ys[0])  # its warm-up: the same first step
    except Exception as exc:  # the other forms' timings stand
        rec["forms"]["graph"] = f"error: {type(exc).__name__}: {exc}"
        return
    want = eng.to_host(eager(xs[1 % n_sets], ys[1 % n_sets]))
    got = eng.to_host(captured(xs[1 % n_sets], ys[1 % n_sets]))
    check = checks.compare("graph replay vs eager loss", got, want, GRAD_TOL["gpu"])
    rec["checks"].append(check)
    if not check["ok"]:
        rec["forms"]["graph"] = "check failed: " + checks.failures([check])
        return
    forms["graph"] = lambda i: captured(xs[i], ys[i])
    rec["forms"]["graph"] = "measured (input copy + one graph launch per step)"


def step_works(batch: int) -> list[roofline.Work]:
    """Each operation of one step at its own floor (float32 storage)."""
    g = unfused_net.layer_geometries(batch)
    dt = "float32"
    n_params = (16 * 9 + 16) + (32 * 16 * 9 + 32) + (128 * 10 + 10)
    return [
        roofline.conv_forward(g["conv1"], dt, "relu"),
        roofline.pool_forward(g["conv1"].output_shape, g["pool1"].output_shape, 4, dt),
        roofline.conv_forward(g["conv2"], dt, "relu"),
        roofline.pool_forward(g["conv2"].output_shape, g["pool2"].output_shape, 4, dt),
        roofline.linear_forward(batch, 128, unfused_net.CLASSES, dt),
        roofline.cross_entropy(batch, unfused_net.CLASSES, dt),
        roofline.linear_backward(batch, 128, unfused_net.CLASSES, dt),
        roofline.pool_backward(g["conv2"].output_shape, g["pool2"].output_shape, dt),
        roofline.conv_backward(g["conv2"], dt, "relu", need_dx=True),
        roofline.pool_backward(g["conv1"].output_shape, g["pool1"].output_shape, dt),
        roofline.conv_backward(g["conv1"], dt, "relu", need_dx=False),
        roofline.adam(n_params, dt),
    ]
