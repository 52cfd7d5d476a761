"""ResNet-18 training step: convfuse (eager, captured) against PyTorch, and how much of the
step is spent outside convolutions.

    python benchmarks/bench/resnet.py [--quick] [--out resnet.json]

Self-contained (it imports nothing else from bench/): `run(quick) -> dict`.

One step = zero_grad, forward, cross-entropy, backward, SGD with momentum 0.9, on a fixed
device-resident batch of random images and labels.

GPU cases: torchvision's ResNet-18 (convfuse.models.resnet18), batch 64 at 224x224 with 1000
classes and batch 256 at 32x32 with 10 classes, each in fp16 and bf16. Forms:
- convfuse eager: the model in that dtype, channels-last (NHWC), fused SGD;
- convfuse captured: the same step recorded once with convfuse.graph.capture and replayed;
- PyTorch eager: the identical architecture (written out below; torchvision is not needed)
  with cudnn.benchmark=True, channels_last, fused SGD, on convfuse's batch, only when
  PyTorch has CUDA: `pytorch_eager` with the model in that dtype, as convfuse's (the
  ratios' reference), and `pytorch_amp` with AMP autocast to it (GradScaler for fp16), what
  PyTorch users run. The first step's losses, from the same initial weights, must agree
  within 3% (`first_loss`); the table flags a mismatch.
CPU cases (the NumPy reference engine, labelled CPU): the same ResNet-18 scaled down to
batch 8 at 32x32, 10 classes (--quick: batch 4), float32, NCHW, against PyTorch CPU eager
float32 when installed. No GPU number is produced without a GPU.

Reported per form: steps/s as the median over interleaved repeats (each repeat runs every
form in turn, so drift hits all forms alike) with min and max; the ratio to PyTorch
per repeat (median, min, max); and for convfuse eager the fraction of the step spent
outside convolutions: every convolution op (forward, data, filter and bias gradients; fc
runs as a 1x1 convolution and counts as one) is timed separately in extra profiled steps
(CUDA events on the GPU, no sync inside the step; perf_counter on the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import convfuse as cf
from convfuse import ops
from convfuse.models import resnet18

LR, MOMENTUM = 0.01, 0.9
CONV_OPS = ("conv_bias_act", "conv_backward_data", "conv_backward_filter", "conv_backward_bias")
GPU_SHAPES = ((64, 224, 1000), (256, 32, 10))  # (batch, image size, classes)
GPU_DTYPES = ("float16", "bfloat16")


def run(quick: bool = False) -> dict[str, Any]:
    """All ResNet-18 cases for this machine, as one JSON-ready dict."""
    gpu = cf.gpu_available()
    out: dict[str, Any] = {
        "benchmark": "resnet18_train_step",
        "engine": "cuDNN (GPU)" if gpu else "CPU reference engine (NumPy)",
        "quick": bool(quick),
        "step": "zero_grad + forward + cross-entropy + backward + SGD(momentum 0.9)",
        "cases": [],
    }
    if gpu:  # pragma: gpu
        repeats, steps = (3, 5) if quick else (7, 20)
        for batch, size, classes in GPU_SHAPES:
            for dtype in GPU_DTYPES:
                out["cases"].append(_guarded(lambda b=batch, s=size, c=classes, d=dtype:
                                             _gpu_case(b, s, c, d, repeats, steps)))
    else:
        out["notice"] = ("no usable GPU: the CPU reference engine runs ResNet-18 scaled down "
                         "(NumPy im2col + BLAS); these numbers say nothing about cuDNN")
        # Batch 4 at least: at 2, layer4's BatchNorm sees 2 values per channel and float32
        # results of two correct engines already differ by ~1e-3 (ill-conditioned).
        batch = 4 if quick else 8
        repeats, steps = (3, 1) if quick else (5, 2)
        with _one_thread() as threads:
            out["cases"].append(_guarded(lambda: _cpu_case(batch, 32, 10, repeats, steps)))
        out["cpu_threads"] = threads
    return out


@contextlib.contextmanager
def _one_thread() -> Iterator[str]:
    """One BLAS thread for NumPy and one intra-op thread for PyTorch: equal footing, and
    on a shared machine oversubscribed threads measured PyTorch ~8x slower than one."""
    torch = _import_torch()
    before = torch.get_num_threads() if torch is not None else None
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        limits = contextlib.nullcontext()
        note = "PyTorch 1 thread; NumPy's BLAS threads as configured (no threadpoolctl)"
    else:
        limits = threadpool_limits(1)
        note = "1 thread each (NumPy's BLAS via threadpoolctl, PyTorch's intra-op)"
    with limits:
        if torch is not None:
            torch.set_num_threads(1)
        try:
            yield note
        finally:
            if torch is not None:
                torch.set_num_threads(before)


def _guarded(fn: Callable[[], dict]) -> dict:
    try:
        return fn()
    except Exception as exc:  # a failed case is recorded, the others still run
        return {"error": f"{type(exc).__name__}: {exc}"}


# -- convfuse -------------------------------------------------------------------------------
class ConvfuseStep:
    def __init__(self, batch: int, size: int, classes: int, dtype: str, layout: str,
                 device: str, seed: int = 0) -> None:
        self.model = resnet18(num_classes=classes, layout=layout, dtype=dtype, device=device,
                              seed=seed)
        self.loss_fn = cf.CrossEntropyLoss()
        self.opt = cf.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
        xp = cf.backend.xp_for(device)
        rng = np.random.default_rng(seed)
        shape = (batch, 3, size, size) if layout == "NCHW" else (batch, size, size, 3)
        self.x = xp.asarray(rng.standard_normal(shape).astype(cf.dtypes.canonical(dtype)))
        self.y = xp.asarray(rng.integers(0, classes, batch).astype(np.int32))

    def __call__(self, x: Any, y: Any) -> Any:
        self.opt.zero_grad()
        loss = self.loss_fn(self.model(x), y)
        self.model.backward(self.loss_fn.backward())
        self.opt.step()
        return loss


@contextlib.contextmanager
def _conv_timer(gpu: bool) -> Iterator[list[float]]:
    """Time every convolution op called inside the block; yields a list that ends up
    holding the seconds (GPU: CUDA event pairs, read after the block's final sync)."""
    spans: list[Any] = []
    saved = {name: getattr(ops, name) for name in CONV_OPS}
    result: list[float] = []

    def wrap(fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if gpu:  # pragma: gpu
                import cupy

                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                spans.append((start, end))
                return out
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spans.append(time.perf_counter() - t0)
            return out

        return timed

    for name, fn in saved.items():
        setattr(ops, name, wrap(fn))
    try:
        yield result
    finally:
        for name, fn in saved.items():
            setattr(ops, name, fn)
    if gpu:  # pragma: gpu
        import cupy

        cupy.cuda.get_current_stream().synchronize()
        result.append(sum(cupy.cuda.get_elapsed_time(a, b) for a, b in spans) / 1e3)
    else:
        result.append(float(sum(spans)))


def _outside_conv_fraction(step: Callable[[], Any], sync: Callable[[], None], gpu: bool,
                           n: int) -> dict[str, float]:
    sync()
    t0 = time.perf_counter()
    with _conv_timer(gpu) as conv:
        for _ in range(n):
            step()
        sync()
    total = time.perf_counter() - t0
    # the spies make the layers call the public, validated ops instead of their direct ones
    # (convfuse.functional's _Direct.checked): the profiled steps carry more host work than
    # the timed ones, so on the GPU the fraction is an upper bound
    return {"conv_s_per_step": conv[0] / n, "step_s_per_step": total / n,
            "outside_conv_fraction": max(0.0, 1.0 - conv[0] / total),
            "note": "profiled through the public ops (the spies turn off the direct path): "
                    "an upper bound on the time outside convolutions"}


# -- PyTorch: torchvision's ResNet-18, written out ---------------------------------------------
def torch_resnet18(torch: Any, classes: int) -> Any:
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                                nn.BatchNorm2d(cout))

        def forward(self, x: Any) -> Any:
            idn = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            return self.relu(self.bn2(self.conv2(out)) + idn)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            cin = 64
            for i, w in enumerate((64, 128, 256, 512)):
                s = 1 if i == 0 else 2
                setattr(self, f"layer{i + 1}", nn.Sequential(Block(cin, w, s), Block(w, w, 1)))
                cin = w
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(512, classes)

        def forward(self, x: Any) -> Any:
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    return Net()


class TorchStep:
    def __init__(self, torch: Any, batch: int, size: int, classes: int, device: str,
                 amp_dtype: Any, weights: dict[str, np.ndarray], seed: int = 0) -> None:
        self.torch = torch
        model = torch_resnet18(torch, classes)
        model.load_state_dict({k: torch.from_numpy(v.astype(np.float32)
                                                   if v.dtype.kind == "f" else v)
                               for k, v in weights.items()})
        fmt = torch.channels_last if device == "cuda" else torch.contiguous_format
        self.model = model.to(device=device, memory_format=fmt)
        self.device, self.amp_dtype = device, amp_dtype
        kw = {"fused": True} if device == "cuda" else {}
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM, **kw)
        self.scaler = (torch.amp.GradScaler("cuda") if amp_dtype == torch.float16 else None)
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(batch, 3, size, size, generator=gen).to(device, memory_format=fmt)
        self.y = torch.randint(0, classes, (batch,), generator=gen).to(device)

    def __call__(self) -> Any:
        torch = self.torch
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device, dtype=self.amp_dtype,
                            enabled=self.amp_dtype is not None):
            loss = torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        if self.scaler is not None:  # pragma: gpu
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            self.opt.step()
        return loss


def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


# -- timing -----------------------------------------------------------------------------------
def _interleaved(forms: dict[str, Callable[[], Any]], sync: Callable[[], None], repeats: int,
                 steps: int, reference: str | None) -> dict[str, Any]:
    per: dict[str, list[float]] = {name: [] for name in forms}
    names = list(forms)
    for r in range(repeats):
        # the order rotates, so that no form always runs right after the same other one
        for name in names[r % len(names):] + names[:r % len(names)]:
            step = forms[name]
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            per[name].append(steps / (time.perf_counter() - t0))
    out: dict[str, Any] = {}
    for name, rates in per.items():
        row: dict[str, Any] = {"steps_per_s": _summary(rates), "repeats": repeats,
                               "steps_per_repeat": steps}
        if reference is not None and name != reference and reference in per:
            ratios = [a / b for a, b in zip(rates, per[reference])]
            row["ratio_to_pytorch"] = _summary(ratios)
        out[name] = row
    return out


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _cpu_case(batch: int, size: int, classes: int, repeats: int, steps: int) -> dict:
    cfs = ConvfuseStep(batch, size, classes, "float32", "NCHW", "cpu")
    rec: dict[str, Any] = {
        "device": "cpu", "dtype": "float32", "layout": "NCHW",
        "shape": f"N{batch} 3x{size}x{size} -> {classes} classes",
        "scaled_from": "GPU cases batch 64 at 224x224 and batch 256 at 32x32",
    }
    forms: dict[str, Callable[[], Any]] = {"convfuse_eager": lambda: cfs(cfs.x, cfs.y)}
    torch = _import_torch()
    reference = None
    if torch is not None:
        ts = TorchStep(torch, batch, size, classes, "cpu", None, cfs.model.state_dict())
        ts.x = torch.from_numpy(cfs.x.copy())
        ts.y = torch.from_numpy(cfs.y.astype(np.int64))
        # Same weights, same batch: the first losses must agree (float32).
        ours, theirs = float(cfs(cfs.x, cfs.y)), float(ts().detach())
        rec["first_loss"] = {"convfuse": ours, "pytorch": theirs,
                             "match": abs(ours - theirs) <= 1e-3 * max(1.0, abs(theirs))}
        forms["pytorch_eager"] = ts
        reference = "pytorch_eager"
        rec["pytorch"] = f"PyTorch {torch.__version__} CPU eager, float32"
    else:
        rec["pytorch"] = "not installed"
    rec["forms"] = _interleaved(forms, lambda: None, repeats, steps, reference)
    rec["convfuse_eager_profile"] = _outside_conv_fraction(
        lambda: cfs(cfs.x, cfs.y), lambda: None, False, max(1, steps))
    return rec


def _gpu_case(batch: int, size: int, classes: int, dtype: str, repeats: int,
              steps: int) -> dict:  # pragma: gpu
    import cupy

    def sync() -> None:
        cupy.cuda.get_current_stream().synchronize()

    cfs = ConvfuseStep(batch, size, classes, dtype, "NHWC", "cuda")
    rec: dict[str, Any] = {"device": "cuda", "dtype": dtype, "layout": "NHWC",
                           "shape": f"N{batch} 3x{size}x{size} -> {classes} classes",
                           "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    # plans, algorithm choice, kernel compilation; the first step's loss, from the initial
    # weights, is checked against PyTorch's below
    first = float(cfs(cfs.x, cfs.y))
    cfs(cfs.x, cfs.y)
    forms: dict[str, Callable[[], Any]] = {"convfuse_eager": lambda: cfs(cfs.x, cfs.y)}
    try:  # a capture that fails is a finding; the eager and PyTorch figures still stand
        captured = cf.graph.capture(cfs, cfs.x, cfs.y)
        captured(cfs.x, cfs.y)  # the first replay uploads the graph: not a timed step
        sync()
        forms["convfuse_captured"] = lambda: captured(cfs.x, cfs.y)
    except Exception as exc:
        rec["convfuse_captured"] = f"error: {type(exc).__name__}: {exc}"
    torch = _import_torch()
    reference = None
    if torch is not None and torch.cuda.is_available():
        torch.backends.cudnn.benchmark = True
        half = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        weights = resnet18(num_classes=classes, device="cpu", seed=0).state_dict()
        # convfuse's batch (NHWC -> an NCHW channels_last view) and labels for both forms;
        # through int16 bits, which cross DLPack whatever the library's bfloat16 support
        x = torch.from_dlpack(cfs.x.view(cupy.int16)).view(half).permute(0, 3, 1, 2)
        y = torch.from_dlpack(cfs.y).long()
        # like for like: the model in `dtype` (no fp32 master weights, no loss scaling), as
        # convfuse's step; and what PyTorch users run, AMP autocast (+ GradScaler for fp16)
        pure = TorchStep(torch, batch, size, classes, "cuda", None, weights)
        pure.model.to(dtype=half)  # in place: the optimizer keeps the same Parameters
        amp = TorchStep(torch, batch, size, classes, "cuda", half, weights)
        firsts = {"convfuse": first}
        for name, ts in (("pytorch_eager", pure), ("pytorch_amp", amp)):
            ts.x, ts.y = x, y
            firsts[name] = float(ts().detach())  # from the same initial weights
            for _ in range(2):  # cudnn.benchmark autotuning
                ts()
        torch.cuda.synchronize()
        # half precision through 18 layers: a wrong step is off by far more than 3%
        rec["first_loss"] = {**firsts, "match": all(
            abs(v - first) <= 3e-2 * max(1.0, abs(v)) for v in firsts.values())}
        forms["pytorch_eager"], forms["pytorch_amp"] = pure, amp
        reference = "pytorch_eager"
        rec["pytorch"] = (f"PyTorch {torch.__version__}, cudnn.benchmark, channels_last: "
                          f"pytorch_eager in {dtype} (the ratios' reference), pytorch_amp "
                          f"AMP {dtype}" + (" + GradScaler" if dtype == "float16" else ""))

        def sync() -> None:  # both libraries' queues
            cupy.cuda.get_current_stream().synchronize()
            torch.cuda.synchronize()
    else:
        rec["pytorch"] = "skipped: PyTorch with CUDA is not installed"
    rec["forms"] = _interleaved(forms, sync, repeats, steps, reference)
    rec["convfuse_eager_profile"] = _outside_conv_fraction(
        lambda: cfs(cfs.x, cfs.y), sync, True, steps)
    return rec


def table(result: dict[str, Any]) -> str:
    """The result as a text table (one row per case and form), for the runner's report."""
    lines = [f"ResNet-18 training step on the {result['engine']}"
             + (" (--quick)" if result.get("quick") else "")]
    if result.get("notice"):
        lines.append(result["notice"])
    lines.append(f"{'case':<40} {'form':<18} {'steps/s [min-max]':>26} {'vs PyTorch':>18}")
    for case in result["cases"]:
        if "error" in case:
            lines.append(f"{'(failed)':<40} {case['error']}")
            continue
        name = f"{case['shape']} {case['dtype']} {case['layout']}"
        for form, row in case["forms"].items():
            r = row["steps_per_s"]
            rate = f"{r['median']:.3g} [{r['min']:.3g}-{r['max']:.3g}]"
            ratio = row.get("ratio_to_pytorch")
            vs = f"{ratio['median']:.2f}x [{ratio['min']:.2f}-{ratio['max']:.2f}]" if ratio \
                else ""
            lines.append(f"{name:<40} {form:<18} {rate:>26} {vs:>18}")
        prof = case["convfuse_eager_profile"]
        lines.append(f"{name:<40} convfuse eager: {prof['outside_conv_fraction']:.0%} of the "
                     "step outside convolutions")
        lines.append(f"{'':<40} PyTorch: {case.get('pytorch')}")
        first = case.get("first_loss")
        if first:
            losses = ", ".join(f"{k} {v:.4g}" for k, v in first.items() if k != "match")
            lines.append(f"{'':<40} first losses: {losses}"
                         + ("" if first["match"] else "  MISMATCH: the timings are suspect"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = run(args.quick)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0 if all("error" not in c for c in result["cases"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
