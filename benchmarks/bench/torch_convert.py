"""What a PyTorch user would decide on: training steps per second of a torch.nn conv net
with plain nn.Conv2d + nn.ReLU, against the same net after `convfuse.torch.convert`.

    python benchmarks/bench/torch_convert.py [--quick] [--out torch_convert.json]

Both models hold the same weights and see the same batches in the same process. A step is
zero_grad, forward, cross-entropy, backward and an SGD step. The two are interleaved: each
round times a block of steps of one then the other, alternating which goes first, so a
drift of the machine (clock, other load) hits both alike; the result is the median over
rounds of steps per second, with min and max. Before timing, one step of each is compared
(loss and every gradient), and a disagreement is reported rather than timed.

Self-contained on purpose (its own timer, no import from the rest of bench/): the entry is
`run(quick) -> dict`. On the CPU it compares convfuse's NumPy reference engine with
PyTorch's CPU kernels and says so; that says nothing about either on a GPU.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

SCHEMA = 1


def _net(torch: Any, width: int, classes: int = 10) -> Any:
    """Two conv-ReLU pairs per stage, two stages: every conv is followed by its ReLU, so
    convert fuses all four."""
    nn = torch.nn
    w = width
    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1), nn.ReLU(), nn.Conv2d(w, w, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(),
        nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * w, classes),
    )


def _device(torch: Any) -> tuple[str, str]:
    import convfuse as cf

    if torch.cuda.is_available() and cf.gpu_available():  # pragma: gpu
        return "cuda", f"GPU {torch.cuda.get_device_name()}"
    why = ("PyTorch has no CUDA" if not torch.cuda.is_available()
           else cf.backend.gpu_unavailable_reason())
    return "cpu", f"CPU ({why}): convfuse's NumPy reference engine against PyTorch CPU"


def _step_fn(torch: Any, model: Any, batches: list[tuple[Any, Any]]) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    return train_step(torch, model, opt, batches)


def train_step(torch: Any, model: Any, opt: Any, batches: list[tuple[Any, Any]]) -> Any:
    """step(i): one cross-entropy training step of `model` with `opt` on batch i (cycling
    through `batches`); returns the loss, detached."""
    F = torch.nn.functional

    def step(i: int) -> Any:
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _check(torch: Any, plain: Any, fused: Any, batch: tuple[Any, Any], rtol: float) -> dict:
    """One forward/backward of each on the same batch: loss and gradients must agree."""
    F = torch.nn.functional
    losses = []
    for model in (plain, fused):
        model.zero_grad()
        loss = F.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        losses.append(float(loss.detach()))
    worst = 0.0
    for (_, a), (_, b) in zip(plain.named_parameters(), fused.named_parameters()):
        scale = float(a.grad.abs().max()) or 1.0
        worst = max(worst, float((a.grad - b.grad).abs().max()) / scale)
    loss_err = abs(losses[0] - losses[1]) / max(abs(losses[0]), 1e-30)
    ok = loss_err <= rtol and worst <= rtol
    plain.zero_grad()
    fused.zero_grad()
    return {"ok": ok, "loss_rel_err": loss_err, "grad_rel_err": worst, "rtol": rtol}


def _timed_block(torch: Any, device: str, step: Any, n: int, start: int) -> float:
    if device == "cuda":  # pragma: gpu
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        step(start + i)
    if device == "cuda":  # pragma: gpu
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _summary(rates: list[float]) -> dict:
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates),
            "rounds": len(rates), "samples": rates}


def _case(torch: Any, device: str, quick: bool, channels_last: bool, dtype: Any) -> dict:
    import convfuse.torch as ct

    if device == "cuda":  # pragma: gpu
        batch, size, width, rounds, per_round, warmup = (32, 32, 32, 7, 10, 5) if quick \
            else (64, 64, 64, 15, 25, 10)
    else:
        batch, size, width, rounds, per_round, warmup = (4, 12, 8, 5, 2, 1) if quick \
            else (16, 32, 16, 7, 3, 2)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    torch.manual_seed(0)
    plain = _net(torch, width).to(device=device, dtype=dtype, memory_format=fmt)
    fused = ct.convert(copy.deepcopy(plain))
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(batch, 3, size, size, generator=gen).to(device=device, dtype=dtype,
                                                             memory_format=fmt),
         torch.randint(0, 10, (batch,), generator=gen).to(device))
        for _ in range(4)
    ]
    rtol = 1e-9 if dtype == torch.float64 else 2e-3
    check = _check(torch, plain, fused, batches[0], rtol)
    record: dict[str, Any] = {
        "name": f"{'channels_last' if channels_last else 'contiguous'} "
                f"{str(dtype).replace('torch.', '')}",
        "shape": {"batch": batch, "image": [3, size, size], "width": width},
        "fused_convs": sum(isinstance(m, ct.Conv2d) for m in fused.modules()),
        "check": check,
    }
    if not check["ok"]:
        record["status"] = "check_failed"
        return record
    steps = {"plain": _step_fn(torch, plain, batches), "convert": _step_fn(torch, fused, batches)}
    for fn in steps.values():
        _timed_block(torch, device, fn, warmup, 0)
    rates: dict[str, list[float]] = {"plain": [], "convert": []}
    for r in range(rounds):
        order = ("plain", "convert") if r % 2 == 0 else ("convert", "plain")
        for name in order:
            seconds = _timed_block(torch, device, steps[name], per_round, r * per_round)
            rates[name].append(per_round / seconds)
    # the timed steps ran each signature's later calls (bound calls on a GPU), which the
    # check above did not: the converted model as it is now against torch.nn with its weights
    ref = copy.deepcopy(plain)
    ref.load_state_dict(fused.state_dict())
    record["check_after_timing"] = _check(torch, ref, fused, batches[0], rtol)
    if not record["check_after_timing"]["ok"]:
        record["status"] = "check_failed"
        return record
    record.update(status="measured", steps_per_s={k: _summary(v) for k, v in rates.items()})
    ratios = [c / p for c, p in zip(rates["convert"], rates["plain"])]
    record["speedup"] = {"median_of_round_ratios": statistics.median(ratios),
                         "min": min(ratios), "max": max(ratios),
                         "ratio_of_medians": statistics.median(rates["convert"])
                         / statistics.median(rates["plain"])}
    return record


def run(quick: bool) -> dict:
    """Measure; returns a JSON-ready dict (status 'skipped' with a reason without torch)."""
    try:
        import torch
    except ImportError:
        return {"schema": SCHEMA, "status": "skipped",
                "reason": "PyTorch is not installed (pip install 'convfuse[torch]')"}
    device, label = _device(torch)
    cases = [(False, torch.float32), (True, torch.float32)]
    if not quick and device == "cuda":  # pragma: gpu
        cases.append((True, torch.bfloat16))
    threads = torch.get_num_threads()
    records = [_case(torch, device, quick, cl, dt) for cl, dt in cases]
    return {
        "schema": SCHEMA, "status": "measured", "device": device, "label": label,
        "torch": torch.__version__, "torch_threads": threads, "quick": quick,
        "method": "interleaved rounds of training steps (SGD), alternating which model goes "
                  "first; steps/s median with min and max over rounds",
        "cases": records,
    }


def format_table(result: dict) -> str:
    if result.get("status") != "measured":
        return f"torch_convert: {result.get('status')} ({result.get('reason', '')})"
    lines = [f"torch.nn vs convfuse.torch.convert, training steps/s on {result['label']}",
             f"{'case':<24}{'torch.nn':>22}{'converted':>22}{'speedup':>10}"]
    for rec in result["cases"]:
        if rec["status"] != "measured":
            lines.append(f"{rec['name']:<24}  {rec['status']}: {rec['check']}")
            continue
        cells = []
        for k in ("plain", "convert"):
            s = rec["steps_per_s"][k]
            cells.append(f"{s['median']:8.2f} [{s['min']:.2f}-{s['max']:.2f}]")
        lines.append(f"{rec['name']:<24}{cells[0]:>22}{cells[1]:>22}"
                     f"{rec['speedup']['median_of_round_ratios']:>9.2f}x")
    if result["device"] == "cpu":
        lines.append("CPU run: the NumPy reference engine against PyTorch's CPU kernels; "
                     "nothing here is a GPU result.")
    return "\n".join(lines)


if __name__ == "__main__":
    here = Path(__file__).resolve()
    sys.path.insert(0, str(here.parents[2]))  # a checkout without an install
    quick = "--quick" in sys.argv
    result = run(quick)
    print(format_table(result))
    if "--out" in sys.argv:
        out = Path(sys.argv[sys.argv.index("--out") + 1])
        out.write_text(json.dumps(result, indent=1))
        print(f"JSON: {out}")
