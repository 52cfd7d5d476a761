"""Python's share of the CUDA call path (convfuse.torch's, and convfuse's own layers' on
CuPy arrays), timed on a machine without a GPU.

    python benchmarks/emulated_cuda_path.py [--quick] [--out FILE.json]

On tests/_fake_cuda.py's fake device every cuDNN call and kernel launch is a no-op and
torch.empty makes CPU tensors (for convfuse's own layers, the last rows: CuPy arrays over
fake device memory), so what is timed is everything else a layer call does on a GPU: the
bridge's path and signature lookups, its DeviceArrays, the engine's plan, handle and
workspace bookkeeping, the autograd node. This is NOT a GPU figure: a real call adds
cuDNN's own host time and the caching allocator's, on another CPU. It says whether a change
made the CUDA path's Python cheaper or dearer, on any machine, between GPU leases; the GPU
figure is the host-overhead section of fused_vs_unfused.py (acceptance stage 2). The rows
are the host-overhead section's calls and shapes (bench/host_overhead.py), each the median
over rounds of the per-call time of `inner` calls (one thread).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = 1


def _rows(torch: Any, cft: Any) -> dict[str, tuple[str, Callable[[], Any]]]:
    """name -> (shape, one call), the host-overhead section's layers on the fake device."""
    nn = torch.nn
    gen = torch.Generator().manual_seed(0)

    def tensor(*shape: int, grad: bool = False) -> Any:
        return torch.randn(*shape, generator=gen).requires_grad_(grad)

    conv = cft.convert(nn.Conv2d(1, 1, 3, padding=1))
    bn = cft.convert(nn.BatchNorm2d(1)).train()
    transpose = cft.convert(nn.ConvTranspose2d(1, 1, 3, padding=1))
    x, xg, xb = tensor(1, 1, 4, 4), tensor(1, 1, 4, 4, grad=True), tensor(2, 1, 4, 4, grad=True)
    dy, dyb = tensor(1, 1, 4, 4), tensor(2, 1, 4, 4)

    def no_grad() -> Any:
        with torch.no_grad():
            return conv(x)

    return {
        "conv_forward_nograd": ("x 1x1x4x4, Conv2d(1, 1, 3, padding=1), no_grad", no_grad),
        "conv_forward_backward": ("x 1x1x4x4 (requires grad), Conv2d(1, 1, 3, padding=1), "
                                  "y.backward(dy)", lambda: conv(xg).backward(dy)),
        "batchnorm2d_train_fwd_bwd": ("x 2x1x4x4 (requires grad), BatchNorm2d(1) training, "
                                      "y.backward(dy)", lambda: bn(xb).backward(dyb)),
        "conv_transpose2d_fwd_bwd": ("x 1x1x4x4 (requires grad), ConvTranspose2d(1, 1, 3, "
                                     "padding=1), y.backward(dy)",
                                     lambda: transpose(xg).backward(dy)),
    }


def _cupy_rows(gpu: Any) -> dict[str, tuple[str, Callable[[], Any]]]:
    """name -> (shape, one call), convfuse's own Conv2d on CuPy arrays over the fake GPU
    (the host-overhead section's NumPy row, on the device)."""
    import numpy as np

    import convfuse as cf

    conv = cf.nn.Conv2d(1, 1, 3, padding=1, device="cuda", seed=0)
    x, dy = gpu.array((1, 1, 4, 4), np.float32), gpu.array((1, 1, 4, 4), np.float32)

    def forward_backward() -> None:
        conv(x)
        conv.backward(dy)

    return {
        "cupy_conv2d_forward": ("x 1x1x4x4, convfuse.nn.Conv2d(1, 1, 3, padding=1) on CuPy",
                                lambda: conv(x)),
        "cupy_conv2d_fwd_bwd": ("x 1x1x4x4, convfuse.nn.Conv2d(1, 1, 3, padding=1) on CuPy, "
                                "forward + backward(dy)", forward_backward),
    }


def _row(name: str, shape: str, call: Callable[[], Any], inner: int,
         rounds: int) -> dict[str, Any]:
    times = _time(call, inner, rounds)
    return {"name": name, "shape": shape, "us_per_call": statistics.median(times),
            "min_us": min(times), "max_us": max(times)}


def _time(call: Callable[[], Any], inner: int, rounds: int) -> list[float]:
    """Microseconds per call, one figure per round of `inner` calls."""
    for _ in range(inner):  # warm-up: signatures validated, plans built, algorithms chosen
        call()
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(inner):
            call()
        out.append((time.perf_counter() - start) / inner * 1e6)
    return out


def run(quick: bool) -> dict[str, Any]:
    """The rows' figures, or a record saying why there are none."""
    import pytest
    import torch

    sys.path.insert(0, str(ROOT))
    import convfuse.torch as cft
    from convfuse import backend
    from convfuse.plan.batchnorm import clear_batchnorm_plan_cache
    from tests import _fake_cuda

    if backend.gpu_available():  # pragma: gpu
        return {"schema": SCHEMA, "skipped": "a GPU is present: time the real path "
                "(fused_vs_unfused.py --sections host-overhead)"}
    inner, rounds = (20, 7) if quick else (50, 15)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        with pytest.MonkeyPatch.context() as mp:
            _fake_cuda.install(mp, record=False)
            timed = _rows(torch, cft)
            rows += [_row(name, shape, call, inner, rounds)
                     for name, (shape, call) in timed.items()]
        with pytest.MonkeyPatch.context() as mp:
            gpu = _fake_cuda.cupy_layers(mp, record=False)
            rows += [_row(name, shape, call, inner, rounds)
                     for name, (shape, call) in _cupy_rows(gpu).items()]
    finally:
        torch.set_num_threads(threads)
        clear_batchnorm_plan_cache()
        _fake_cuda.forget_signatures()
    return {"schema": SCHEMA, "what": "Python's share of the CUDA call path, on a fake device "
            "(not a GPU figure)", "torch": torch.__version__, "inner": inner, "rounds": rounds,
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    result = run(args.quick)
    if "skipped" in result:
        print(f"skipped: {result['skipped']}")
    else:
        print(f"{result['what']}; us per call, median [min-max] of {result['rounds']} rounds")
        for row in result["rows"]:
            print(f"  {row['name']:28s} {row['us_per_call']:8.1f}  "
                  f"[{row['min_us']:.1f}-{row['max_us']:.1f}]  {row['shape']}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
