"""Does the core work? Stage 1's first part (scripts/gpu_acceptance.sh), about a minute.

  python scripts/gpu_smoke.py [--json smoke.json]

Prints a PASS/FAIL/SKIP table. Every item runs even when an earlier one failed; outputs
that take `out=` are NaN-poisoned first, inputs are fresh random draws (the seed is in the
JSON), and float32 runs with TF32 off against the NumPy engine in float64. Items:
  versions            driver, runtime, cuDNN, CuPy, torch (no GPU needed)
  cuDNN handle        a handle on the current device
  conv fp32 NCHW      conv + bias + ReLU forward and backward (data, filter, bias)
  fp16 NHWC identity  the fused IDENTITY call, and the forward path the plan recorded
  BN+add+ReLU fp16    BatchNorm + add + ReLU fused forward and backward, NHWC
  kernel compile      time to compile convfuse's kernels (NVRTC only, without a GPU)
  captured step       a training step captured and replayed, against the eager step
  torch side stream   a convfuse.torch conv on a torch side stream
  syncs per step      host syncs in an eager and a captured step (target 0)
Without a usable GPU each GPU item is SKIP with the reason, and the exit status is 0 only
if the items that need no GPU passed. Exit status 1 when any item failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if (REPO / "convfuse" / "__init__.py").is_file():
    sys.path.insert(0, str(REPO))  # test the checkout's convfuse, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOL = {"float32": 1e-5, "float16": 1e-2}


class Skip(Exception):
    """The item cannot run here; the message says why."""


@dataclass
class Item:
    name: str
    needs_gpu: bool
    run: Callable[[], str]


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL or SKIP
    seconds: float
    detail: str
    needs_gpu: bool = True
    traceback: str = field(default="", repr=False)


def run_items(items: list[Item], gpu_reason: str | None,
              done: Callable[[list[Result]], None] | None = None) -> list[Result]:
    """Run every item in order, whatever happened before; a GPU item without a GPU is a
    SKIP naming the reason. `done(results so far)` runs after each item, so a stage's time
    cap (SIGINT, then SIGKILL) leaves every finished item's result written; the item the
    SIGINT interrupts is recorded as cut, and the rest are not started."""
    results: list[Result] = []
    for item in items:
        if item.needs_gpu and gpu_reason:
            results.append(Result(item.name, "SKIP", 0.0, f"no usable GPU: {gpu_reason}",
                                  item.needs_gpu))
            continue
        t0 = time.perf_counter()
        cut = False
        try:
            detail, status, tb = item.run(), "PASS", ""
        except Skip as exc:
            detail, status, tb = str(exc), "SKIP", ""
        except KeyboardInterrupt:  # the stage's time cap
            detail, status, tb, cut = "cut by the time cap", "FAIL", "", True
        except Exception as exc:  # the table reports it; the next item still runs
            detail, status = f"{type(exc).__name__}: {exc}", "FAIL"
            tb = traceback.format_exc(limit=8)
        results.append(Result(item.name, status, time.perf_counter() - t0,
                              " ".join(detail.split())[:600], item.needs_gpu, tb))
        print(f"  {status:4s} {item.name}", flush=True)
        if done is not None:
            done(results)
        if cut:
            break
    return results


def table(results: list[Result]) -> str:
    width = max([len(r.name) for r in results] + [4])
    lines = [f"{'item':{width}s}  result  seconds  detail"]
    lines += [f"{r.name:{width}s}  {r.status:6s}  {r.seconds:7.2f}  {r.detail}" for r in results]
    return "\n".join(lines)


def exit_status(results: list[Result]) -> int:
    return 1 if any(r.status == "FAIL" for r in results) else 0


def rel_error(got: Any, want: np.ndarray) -> float:
    """max |got - want| / max |want| in float64; a NaN (a poisoned output left unwritten)
    or a shape mismatch is an infinite error."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape or not np.isfinite(got).all():
        return float("inf")
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    return float(np.abs(got - want).max(initial=0.0)) / scale


def check(errors: dict[str, float], tol: float) -> str:
    text = ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
    bad = {k: v for k, v in errors.items() if not v <= tol}
    if bad:
        raise AssertionError(f"error above {tol:g}: {text}")
    return f"max rel. errors (tol {tol:g}): {text}"


# ---- items that need no GPU ----

def versions() -> str:
    """Versions of what the run depends on; the driver and runtime only where present."""
    from importlib import metadata

    import convfuse
    from convfuse._binding import cudnn

    found = {"convfuse": convfuse.__version__, "cuDNN": str(cudnn().getVersion())}
    for dist in ("cupy-cuda13x", "cupy-cuda12x", "torch", "numpy"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[dist] = metadata.version(dist)
    try:
        from cupy.cuda import runtime

        found["CUDA runtime"] = str(runtime.runtimeGetVersion())
        driver = runtime.driverGetVersion()
        found["driver"] = str(driver) if driver else "none (no CUDA driver)"
    except Exception as exc:  # no driver: say so, the versions above still count
        found["driver"] = f"unavailable ({type(exc).__name__})"
    if int(found["cuDNN"]) < 90000:
        raise AssertionError(f"cuDNN {found['cuDNN']} is older than 9")
    return ", ".join(f"{k} {v}" for k, v in found.items())


def kernel_compile_nvrtc() -> str:
    """Without a GPU: every kernel through NVRTC for sm_90 with CuPy's options."""
    from convfuse import kernels

    times = {}
    for name in kernels.names():
        t0 = time.perf_counter()
        kernels.nvrtc_compile(name, "sm_90")
        times[name] = time.perf_counter() - t0
    return "NVRTC only (no device): " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items())


# ---- items that need a GPU ----

def kernel_compile_gpu() -> str:  # pragma: gpu
    from convfuse import kernels

    times = kernels.compile_all()
    return (f"{sum(times.values()):.1f} s for the current device: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))


def cudnn_handle() -> str:  # pragma: gpu
    import cupy as cp

    from convfuse.ops.cudnn.handle import get_handle

    get_handle()  # created, and bound to the current stream
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return f"created on {name} (sm_{props['major']}{props['minor']}, " \
           f"{props['totalGlobalMem'] / 2**30:.0f} GiB)"


def _poisoned(cp: Any, shape: tuple[int, ...], dtype: Any) -> Any:  # pragma: gpu
    return cp.full(shape, np.nan, dtype=dtype)


def conv_fp32_nchw(seed: int) -> str:  # pragma: gpu
    import cupy as cp

    import convfuse as cf
    from convfuse import ops
    from convfuse.geometry import ConvGeometry

    rng = np.random.default_rng(seed)
    geom = ConvGeometry.create((4, 8, 12, 12), (16, 8, 3, 3), padding=1)
    x, w = rng.standard_normal(geom.input_shape), rng.standard_normal(geom.weight_shape)
    b, dy = rng.standard_normal(16), rng.standard_normal(geom.output_shape)
    x32, w32, b32, dy32 = (a.astype(np.float32) for a in (x, w, b, dy))
    errors = {}
    with cf.config.flags(allow_tf32=False):
        y, _ = ops.conv_bias_act(cp.asarray(x32), cp.asarray(w32), cp.asarray(b32), geom, "relu")
        f64 = [a.astype(np.float64) for a in (x32, w32, b32, dy32)]
        y_ref, _ = ops.conv_bias_act(f64[0], f64[1], f64[2], geom, "relu")
        errors["y"] = rel_error(y.get(), y_ref)
        dz = (dy32 * (y_ref > 0)).astype(np.float32)  # ReLU's backward on the reference y
        dz64 = dz.astype(np.float64)
        dx = ops.conv_backward_data(cp.asarray(dz), cp.asarray(w32), geom,
                                    out=_poisoned(cp, geom.input_shape, np.float32))
        dw = ops.conv_backward_filter(cp.asarray(x32), cp.asarray(dz), geom,
                                      out=_poisoned(cp, geom.weight_shape, np.float32))
        db = ops.conv_backward_bias(cp.asarray(dz), geom,
                                    out=_poisoned(cp, geom.bias_shape, np.float32))
        errors["dx"] = rel_error(dx.get(), ops.conv_backward_data(dz64, f64[1], geom))
        errors["dw"] = rel_error(dw.get(), ops.conv_backward_filter(f64[0], dz64, geom))
        errors["db"] = rel_error(db.get(), ops.conv_backward_bias(dz64, geom))
    return check(errors, TOL["float32"])


def fp16_nhwc_identity(seed: int) -> str:  # pragma: gpu
    import cupy as cp

    from convfuse import ops
    from convfuse.geometry import ConvGeometry
    from convfuse.plan import forward_paths

    rng = np.random.default_rng(seed)
    geom = ConvGeometry.create((4, 10, 10, 8), (16, 3, 3, 8), padding=1, layout="NHWC")
    x = rng.standard_normal(geom.input_shape).astype(np.float16)
    w = rng.standard_normal(geom.weight_shape).astype(np.float16)
    b = rng.standard_normal(16).astype(np.float16)
    y, _ = ops.conv_bias_act(cp.asarray(x), cp.asarray(w), cp.asarray(b), geom, "identity")
    y_ref, _ = ops.conv_bias_act(*(a.astype(np.float64) for a in (x, w, b)), geom, "identity")
    error = check({"y": rel_error(y.get(), y_ref)}, TOL["float16"])
    paths = [(desc, p) for desc, p in forward_paths() if "NHWC" in desc and "float16" in desc
             and "identity" in desc]
    if not paths:
        raise AssertionError(f"no forward path recorded for the plan; {error}")
    desc, path = paths[-1]
    text = f"{error}; forward path: {path.path} ({path.reason})"
    if path.path != "fused":  # cuDNN documents this configuration as fusable
        raise AssertionError(f"fusion lost where cuDNN documents it: {text}; plan {desc}")
    return text


def batchnorm_add_relu_fp16(seed: int) -> str:  # pragma: gpu
    import cupy as cp

    from convfuse import ops

    rng = np.random.default_rng(seed)
    shape, c = (4, 6, 6, 8), 8
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(np.float16)
    r, dy = (rng.standard_normal(shape).astype(np.float16) for _ in range(2))
    w, b = rng.standard_normal(c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    rm, rv = np.zeros(c, np.float32), np.ones(c, np.float32)
    d = {k: cp.asarray(v) for k, v in dict(x=x, r=r, dy=dy, w=w, b=b, rm=rm, rv=rv).items()}
    f = {k: v.astype(np.float64) for k, v in dict(x=x, r=r, dy=dy, w=w, b=b, rm=rm, rv=rv).items()}
    y, saved = ops.batchnorm_forward_training(d["x"], d["w"], d["b"], d["rm"], d["rv"], "NHWC",
                                              1e-5, 0.1, "relu", d["r"])
    dw_out, db_out = _poisoned(cp, (c,), np.float32), _poisoned(cp, (c,), np.float32)
    dx, dw, db, dr = ops.batchnorm_backward(d["dy"], d["x"], d["w"], d["b"], saved, "NHWC",
                                            1e-5, "relu", True, weight_grad=dw_out,
                                            bias_grad=db_out)
    y_ref, s_ref = ops.batchnorm_forward_training(f["x"], f["w"], f["b"], f["rm"], f["rv"],
                                                  "NHWC", 1e-5, 0.1, "relu", f["r"])
    ref = ops.batchnorm_backward(f["dy"], f["x"], f["w"], f["b"], s_ref, "NHWC", 1e-5, "relu",
                                 True)
    errors = {"y": rel_error(y.get(), y_ref), "dx": rel_error(dx.get(), ref[0]),
              "dweight": rel_error(dw.get(), ref[1]), "dbias": rel_error(db.get(), ref[2]),
              "dresidual": rel_error(dr.get(), ref[3]),
              "running_var": rel_error(d["rv"].get(), f["rv"])}
    fused = bool(getattr(saved.engine_state, "fused", False))
    text = check(errors, TOL["float16"]) + f"; fused call: {fused}"
    if not fused:
        raise AssertionError(f"the unfused path ran where cuDNN documents the fused one: {text}")
    return text


def _training_model(cf: Any, seed: int) -> tuple[Any, Any, Callable]:  # pragma: gpu
    model = cf.Sequential(
        cf.Conv2d(1, 8, 3, padding=1, activation="relu", device="cuda", seed=seed),
        cf.MaxPool2d(2),
        cf.Flatten(),
        cf.Linear(8 * 4 * 4, 10, device="cuda", seed=seed + 1),
    )
    loss_fn, opt = cf.CrossEntropyLoss(), cf.optim.Adam(model.parameters(), lr=1e-2)

    def step(x: Any, y: Any) -> Any:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        opt.step()
        return loss

    return model, opt, step


def captured_step(seed: int) -> str:  # pragma: gpu
    import cupy as cp

    import convfuse as cf

    rng = np.random.default_rng(seed)
    x = cp.asarray(rng.random((16, 1, 8, 8), dtype=np.float32))
    y = cp.asarray(rng.integers(0, 10, 16).astype(np.int32))
    with cf.config.flags(allow_tf32=False, deterministic=True):
        eager, _, eager_step = _training_model(cf, seed)
        graphed, _, graphed_step = _training_model(cf, seed)
        eager_step(x, y)
        eager_loss = eager_step(x, y)
        captured = cf.graph.capture(graphed_step, x, y)  # one eager warm-up step inside
        captured_loss = captured(x, y)  # the replay is the second step
        captured.synchronize()
        errors = {"loss": rel_error(cp.asnumpy(captured_loss), cp.asnumpy(eager_loss))}
        for i, (a, b) in enumerate(zip(eager.parameters(), graphed.parameters())):
            errors[f"param{i}"] = rel_error(cp.asnumpy(b.data), cp.asnumpy(a.data))
    return check(errors, 1e-5) + " (2 steps each: eager, eager+replay)"


def torch_side_stream(seed: int) -> str:  # pragma: gpu
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as exc:
        raise Skip(f"torch not installed ({exc})") from exc
    if not torch.cuda.is_available():
        raise Skip(f"torch {torch.__version__} has no usable CUDA")
    import convfuse as cf
    import convfuse.torch as cft

    torch.manual_seed(seed)
    conv = cft.Conv2d(3, 8, 3, padding=1, activation="relu", device="cuda")
    x = torch.randn(4, 3, 16, 16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with cf.config.flags(allow_tf32=False), torch.cuda.stream(side):
        # poison the cache the outputs reuse: the caching allocator hands a block out again
        # on the stream that freed it, so the NaN blocks are made and freed on `side`; the
        # outputs here are small, served from the pool of blocks of at most 1 MiB
        poison = [torch.full((1 << 18,), float("nan"), device="cuda") for _ in range(8)]
        del poison
        y = conv(x)
        y.sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    x64, w64 = x.double().cpu().requires_grad_(True), conv.weight.detach().double().cpu()
    b64 = conv.bias.detach().double().cpu()
    y_ref = torch.relu(F.conv2d(x64, w64, b64, padding=1))
    errors = {"y": rel_error(y.detach().cpu().numpy(), y_ref.detach().numpy())}
    w_ref = w64.clone().requires_grad_(True)
    torch.relu(F.conv2d(x64.detach(), w_ref, b64, padding=1)).sum().backward()
    errors["dweight"] = rel_error(conv.weight.grad.cpu().numpy(), w_ref.grad.numpy())
    return check(errors, TOL["float32"]) + f" (torch {torch.__version__})"


def syncs_per_step(seed: int) -> str:  # pragma: gpu
    import cupy as cp
    import cupyx
    from count_syncs import capture_probe

    import convfuse as cf

    rng = np.random.default_rng(seed)
    x = cp.asarray(rng.random((16, 1, 8, 8), dtype=np.float32))
    y = cp.asarray(rng.integers(0, 10, 16).astype(np.int32))
    _, _, step = _training_model(cf, seed)
    step(x, y)  # warm-up: plans, algorithms, kernels, buffers
    cp.cuda.get_current_stream().synchronize()
    found = {}
    try:  # CuPy-initiated syncs (asnumpy, stream.synchronize, ...) raise here
        with cupyx.allow_synchronize(False):
            step(x, y)
        found["eager, CuPy syncs"] = "0"
    except Exception as exc:
        found["eager, CuPy syncs"] = f">= 1 ({type(exc).__name__}: {exc})"
    # the probe's warm-up runs on a stream of its own, which nothing orders after this
    # step's: the two must not update the same parameters at once
    cp.cuda.get_current_stream().synchronize()
    # any synchronising CUDA call, cuDNN's included, aborts a global-mode capture
    found["eager, capture probe"] = capture_probe(cp, step, x, y)
    _, _, step2 = _training_model(cf, seed)
    captured = cf.graph.capture(step2, x, y)
    captured.synchronize()
    try:
        with cupyx.allow_synchronize(False):
            captured(x, y)
        found["captured replay, CuPy syncs"] = "0"
    except Exception as exc:
        found["captured replay, CuPy syncs"] = f">= 1 ({type(exc).__name__}: {exc})"
    captured.synchronize()
    text = "; ".join(f"{k}: {v}" for k, v in found.items())
    if any(not (v == "0" or v == "pass") for v in found.values()):
        raise AssertionError(text)
    return text + " (counts with nsys-free methods; stage 2's syncs.json has the probe too)"


def items(seed: int, gpu: bool) -> list[Item]:
    return [
        Item("versions", False, versions),
        Item("cuDNN handle", True, cudnn_handle),
        Item("conv fp32 NCHW", True, lambda: conv_fp32_nchw(seed)),
        Item("fp16 NHWC identity", True, lambda: fp16_nhwc_identity(seed + 1)),
        Item("BN+add+ReLU fp16", True, lambda: batchnorm_add_relu_fp16(seed + 2)),
        Item("kernel compile", False, kernel_compile_gpu if gpu else kernel_compile_nvrtc),
        Item("captured step", True, lambda: captured_step(seed + 3)),
        Item("torch side stream", True, lambda: torch_side_stream(seed + 4)),
        Item("syncs per step", True, lambda: syncs_per_step(seed + 5)),
    ]


def gpu_unavailable() -> str | None:
    try:
        from convfuse.backend import gpu_unavailable_reason
    except Exception as exc:  # convfuse itself does not import: every item will say so
        return f"convfuse does not import ({type(exc).__name__}: {exc})"
    return gpu_unavailable_reason()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the table as JSON here")
    p.add_argument("--seed", type=int, default=None, help="default: drawn fresh each run")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    reason = gpu_unavailable()
    print(f"gpu_smoke: seed {seed}; " + (f"no usable GPU ({reason}): GPU items skipped"
                                         if reason else "GPU available"), flush=True)
    def write(results: list[Result]) -> None:
        if args.json:  # replaced whole (a kill mid-write leaves the previous file)
            tmp = args.json.with_name(args.json.name + ".tmp")
            tmp.write_text(json.dumps({"seed": seed, "gpu_unavailable_reason": reason,
                                       "exit_status": exit_status(results),
                                       "items": [asdict(r) for r in results]}, indent=1))
            os.replace(tmp, args.json)

    results = run_items(items(seed, reason is None), reason, write)
    print(table(results))
    write(results)
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
