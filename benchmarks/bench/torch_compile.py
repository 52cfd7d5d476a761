"""compile section: a torchvision ResNet-18 training step (forward, cross-entropy, backward,
SGD step) with `torch.compile(model, backend="convfuse")` against torch.compile's default
(Inductor) and against eager torch.nn.

All three models hold the same weights and see the same batches; before timing, one step
of each is compared with eager torch.nn (loss and every gradient), and a disagreement is
reported instead of timed. Compilation happens in that first step and is reported apart
(seconds per form), never inside the timed steps. On the CPU this times convfuse's NumPy
reference engine inside the compiled graph against PyTorch's CPU kernels (Inductor's C++
there), at a tiny size, and says so: it says nothing about either on a GPU.
"""

from __future__ import annotations

import copy
import sys
import time
from typing import Any

from . import records
from .records import Context
from .timing import CpuTimer, TorchEventTimer
from .torch_convert import train_step

FORMS = ("eager", "inductor", "convfuse")
#: The backend under each compiled form's name: convfuse's wraps Inductor, as
#: backend="convfuse" does (the object, not the name, so a checkout without the installed
#: entry point runs too). Tests swap in "eager" to skip Inductor's C++ compilation.
INNER = {"inductor": "inductor", "convfuse": "inductor"}


def _torchvision() -> Any:
    """torchvision for its models; on torch's CPU wheel its C ops fail to register (built for
    the CUDA torch), and declaring the two schemas it checks at import lets the models build
    (tests/_zoo.py does the same)."""
    import torch

    try:
        import torchvision
        return torchvision
    except RuntimeError:
        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for schema in ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                       "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"):
            if not hasattr(torch.ops.torchvision, schema.split("(")[0]):
                lib.define(schema)
        _KEEP.append(lib)
        import torchvision
        return torchvision


_KEEP: list[Any] = []  # the Library object must outlive the schemas it declared


def run(ctx: Context) -> list[dict[str, Any]]:
    gpu = ctx.engine.is_gpu
    batch, size = ((32, 64) if ctx.quick else (64, 128)) if gpu else (2, 64)
    import convfuse as cf

    # on a GPU both sides may run float32 convolutions in TF32: the label says which
    tf32 = gpu and cf.config.get().allow_tf32
    rec = records.new("compile", "resnet18 training step", precision="tf32" if tf32 else "fp32",
                      shape=f"batch {batch}, 3x{size}x{size}, 10 classes",
                      device="cuda" if gpu else "cpu")
    try:
        import torch
        _torchvision()
    except ImportError as exc:
        return [records.skip(rec, f"needs torch and torchvision ({exc})")]
    if not gpu:
        rec["notes"].append("CPU: convfuse's NumPy reference engine inside the compiled graph "
                            "against PyTorch's CPU kernels; not a GPU result")
    return [records.guarded(ctx, rec, "compile resnet18",
                            lambda: _measure(ctx, rec, torch, gpu, batch, size))]


def _measure(ctx: Context, rec: dict[str, Any], torch: Any, gpu: bool, batch: int,
             size: int) -> None:
    device = "cuda" if gpu else "cpu"
    torch.manual_seed(ctx.seed)
    base = _torchvision().models.resnet18(num_classes=10).to(device)
    if gpu:  # pragma: gpu
        base = base.to(memory_format=torch.channels_last)
    gen = torch.Generator().manual_seed(ctx.seed + 1)
    batches = [(torch.randn(batch, 3, size, size, generator=gen).to(device),
                torch.randint(0, 10, (batch,), generator=gen).to(device)) for _ in range(2)]
    models = {name: copy.deepcopy(base) for name in FORMS}
    import convfuse.torch as ct

    torch._dynamo.reset()
    runners = {"eager": models["eager"],
               "inductor": torch.compile(models["inductor"], backend=INNER["inductor"]),
               "convfuse": torch.compile(models["convfuse"],
                                         backend=ct.backend(INNER["convfuse"]))}
    rec["inner"] = dict(INNER)
    steps, compile_s, losses, grads = {}, {}, {}, {}
    for name, runner in runners.items():
        opt = torch.optim.SGD(models[name].parameters(), lr=1e-3, momentum=0.9)
        steps[name] = train_step(torch, runner, opt, batches)
        t0 = time.perf_counter()
        losses[name] = float(steps[name](0))  # compiles; the check's step
        compile_s[name] = time.perf_counter() - t0
        grads[name] = [p.grad.detach().clone() for p in models[name].parameters()]
    rec["compile_s"] = compile_s
    # on a GPU both sides may round convolutions to TF32 (the flags earlier sections set),
    # as the train and conv_transpose sections allow for
    rtol = 2e-2 if ctx.engine.is_gpu else 2e-3
    for name in ("inductor", "convfuse"):
        worst = max(float((a - b).abs().max()) / (float(b.abs().max()) or 1.0)
                    for a, b in zip(grads[name], grads["eager"]))
        loss_err = abs(losses[name] - losses["eager"]) / max(abs(losses["eager"]), 1e-30)
        rec["checks"].append({"form": name, "loss_rel_err": loss_err, "grad_rel_err": worst,
                              "rtol": rtol, "ok": worst <= rtol and loss_err <= rtol})
    bad = [c for c in rec["checks"] if not c["ok"]]
    if bad:
        records.check_failed(rec, f"{bad} against eager torch.nn")
        return
    timer = TorchEventTimer(torch) if gpu else CpuTimer()
    stats = ctx.time_many({name: (timer, steps[name]) for name in FORMS}, len(batches))
    # the compiled model as the timed steps left it, against eager torch.nn with its weights
    # (the check above ran each form's first, compiling call)
    ref = copy.deepcopy(models["eager"])
    ref.load_state_dict(models["convfuse"].state_dict())
    check = _after_timing(torch, runners["convfuse"], ref, batches[0], rtol)
    rec["checks"].append(check)
    if not check["ok"]:
        records.check_failed(rec, f"{check} against eager torch.nn, after timing")
        return
    for name, s in stats.items():
        records.put_timing(rec, name, s)
    for name in ("inductor", "convfuse"):
        m = records.median(rec, name)
        if m:
            rec["ratios"][f"eager/{name}"] = (records.median(rec, "eager") or 0.0) / m
    conv, ind = records.median(rec, "convfuse"), records.median(rec, "inductor")
    if conv and ind:
        rec["ratios"]["inductor/convfuse"] = ind / conv



def _after_timing(torch: Any, runner: Any, ref: Any, batch: tuple[Any, Any],
                  rtol: float) -> dict[str, Any]:
    """The loss of one forward of the compiled `runner` against eager `ref`
    holding the same weights. The loss only: after training steps, a small batch's early
    gradients are rounding noise that near-degenerate batch norms amplify (a ResNet's
    last stage normalises a few values per channel), on either side; the gradients were
    compared at the first call, and the torch_convert extra compares them after timing."""
    F = torch.nn.functional
    # with grad enabled, as the timed steps ran: dynamo guards on the grad mode, so no_grad
    # would compile again
    losses = [float(F.cross_entropy(run(batch[0]), batch[1]).detach()) for run in (runner, ref)]
    loss_err = abs(losses[0] - losses[1]) / max(abs(losses[1]), 1e-30)
    return {"form": "convfuse, after timing", "loss_rel_err": loss_err, "rtol": rtol,
            "ok": loss_err <= rtol}
