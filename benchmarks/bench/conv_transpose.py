"""ConvTranspose: the decoder layers of a U-Net (512->256, 256->128, 128->64 channels,
stride 2, kernel 2 and kernel 4) at batch 32, forward and backward, three forms in one run:

- fused:   convfuse's transposed convolution: cudnnConvolutionBackwardData, then one pass of
           the bias + ReLU kernel; backward: G's forward (dx), G's filter gradient (dw) and
           the fused activation-backward + bias-gradient kernel (dz and db);
- unfused: the same BackwardData, then a separate bias pass and a separate ReLU pass;
           backward: a separate ReLU-backward pass and a generic sum for db (the array
           library's dz.sum), then the same dx and dw;
- torch:   torch.nn.functional.conv_transpose2d + relu, forward and autograd backward
           (cudnn.benchmark on a GPU).

Each case is checked first (y, dx, dw and db of the three forms agree), then timed in
interleaved rounds (each round runs every form once, the order rotating), median with min
and max. The floor of each case is max(flops / peak GEMM rate, bytes / copy bandwidth),
both measured on the machine at the start of the run; `floor/median` says how close a form
gets. Without a GPU the same harness runs convfuse's NumPy reference engine against
PyTorch's CPU kernels on shapes scaled down (labelled CPU): nothing there is a GPU result.

    python benchmarks/bench/conv_transpose.py [--quick] [--out conv_transpose.json]

Self-contained like torch_convert.py: the entry is `run(quick) -> dict`, and
`format_table(result)` prints it.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SCHEMA = 1
FORMS = ("fused", "unfused", "torch")


@dataclass(frozen=True)
class Case:
    name: str
    cin: int
    cout: int
    kernel: int
    padding: int
    size: int  # input spatial size (square)
    batch: int

    def scaled(self, batch: int, channel_div: int, size_div: int) -> Case:
        return Case(self.name, max(1, self.cin // channel_div), max(1, self.cout // channel_div),
                    self.kernel, self.padding, max(2, self.size // size_div), batch)

    def describe(self) -> str:
        return (f"x[{self.batch},{self.cin},{self.size},{self.size}] k{self.kernel} s2 "
                f"p{self.padding} -> {self.cout}")


def unet_cases() -> list[Case]:
    """A U-Net decoder for 256x256 images: 16->32, 32->64, 64->128 up-sampling steps."""
    out = []
    for (cin, cout, size), (k, p) in [(c, kp) for c in ((512, 256, 16), (256, 128, 32),
                                                        (128, 64, 64)) for kp in ((2, 0), (4, 1))]:
        out.append(Case(f"up {cin}->{cout} k{k}", cin, cout, k, p, size, 32))
    return out


class Engine:
    """The array library, its timer and its measured peaks."""

    def __init__(self, gpu: bool) -> None:
        self.gpu = gpu
        if gpu:  # pragma: gpu
            import cupy

            self.xp = cupy
            self.label = f"GPU {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}"
        else:
            self.xp = np
            import convfuse as cf

            self.label = (f"CPU ({cf.backend.gpu_unavailable_reason()}): convfuse's NumPy "
                          "reference engine against PyTorch CPU, shapes scaled down")

    def sync(self) -> None:
        if self.gpu:  # pragma: gpu
            self.xp.cuda.Device().synchronize()

    def host(self, a: Any) -> np.ndarray:
        return np.asarray(a.get() if self.gpu else a, dtype=np.float64)

    def peaks(self) -> dict[str, float]:
        """GEMM flop/s and copy bytes/s measured now (best of a few runs)."""
        xp = self.xp
        n = 2048 if self.gpu else 512
        a = xp.ones((n, n), np.float32)
        src = xp.ones(1 << (26 if self.gpu else 24), np.uint8)
        dst = xp.empty_like(src)
        best_mm = best_cp = math.inf
        with _gemm_math(self.gpu) as math_name:
            for _ in range(5):
                self.sync()
                t0 = time.perf_counter()
                a @ a
                self.sync()
                best_mm = min(best_mm, time.perf_counter() - t0)
                t0 = time.perf_counter()
                dst[...] = src
                self.sync()
                best_cp = min(best_cp, time.perf_counter() - t0)
        return {"gemm_flops": 2 * n ** 3 / best_mm, "copy_bytes": 2 * src.nbytes / best_cp,
                "gemm_math": math_name}


@contextlib.contextmanager
def _gemm_math(gpu: bool) -> Iterator[str]:
    """The math the GEMM peak runs in: TF32 on a GPU where convfuse's config allows it (the
    cases' convolutions run in it; a plain-fp32 peak would put their compute floors some
    8x too high), fp32 otherwise; CuPy's compute type restored after."""
    import convfuse as cf

    if not gpu or not cf.config.get().allow_tf32:
        yield "fp32"
        return
    from cupy._core import _routines_linalg as linalg  # pragma: gpu

    previous = linalg.get_compute_type(np.float32)  # pragma: gpu
    linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32)  # pragma: gpu
    try:  # pragma: gpu
        yield "tf32"
    finally:
        linalg.set_compute_type(np.float32, previous)


def _forms(eng: Engine, torch: Any, case: Case, layout: str) -> tuple[dict, dict, dict]:
    """(forward callables, backward callables, inputs) per form."""
    from convfuse import ops
    from convfuse.functional_transpose import (
        conv_transpose_bias_act_backward,
        conv_transpose_bias_act_forward,
    )
    from convfuse.transpose_geometry import ConvTransposeGeometry

    xp = eng.xp
    rng = np.random.default_rng(0)
    cl = layout == "NHWC"
    k = case.kernel
    x_cf = rng.standard_normal((case.batch, case.cin, case.size, case.size)).astype(np.float32)
    w_cf = (rng.standard_normal((case.cin, case.cout, k, k)) / math.sqrt(case.cin * k * k)
            ).astype(np.float32)
    b = rng.standard_normal(case.cout).astype(np.float32)
    to_layout = (lambda a: np.ascontiguousarray(np.moveaxis(a, 1, -1))) if cl else (lambda a: a)
    x, w, bd = xp.asarray(to_layout(x_cf)), xp.asarray(to_layout(w_cf)), xp.asarray(b)
    geom = ConvTransposeGeometry.create(x.shape, w.shape, 2, case.padding, 0, 1, 1, layout)
    dy = xp.asarray(rng.standard_normal(geom.output_shape).astype(np.float32))
    bshape = [1] * 4
    bshape[geom.channel_axis] = -1
    axes = geom.epilogue.reduce_axes

    def fused_fwd() -> Any:
        return conv_transpose_bias_act_forward(x, w, bd, activation="relu", geom=geom)

    state: dict[str, Any] = {"fused": fused_fwd()[1]}

    def unfused_fwd() -> Any:
        y = ops.conv_transpose_forward(x, w, geom)
        y += bd.reshape(bshape)                    # the bias pass
        return ops.activation_forward(y, "relu", out=y)  # the activation pass

    state["unfused_y"] = unfused_fwd()

    def fused_bwd() -> Any:
        return conv_transpose_bias_act_backward(dy, state["fused"])

    def unfused_bwd() -> Any:
        dz = ops.activation_backward(dy, state["unfused_y"], "relu")  # the ReLU-backward pass
        db = dz.sum(axis=axes)                                        # the generic reduction
        dw = ops.conv_transpose_backward_filter(x, dz, geom)
        dx = ops.conv_transpose_backward_data(dz, w, geom)
        return dx, dw, db

    fwd = {"fused": fused_fwd, "unfused": unfused_fwd}
    bwd = {"fused": fused_bwd, "unfused": unfused_bwd}
    if torch is not None:
        dev = "cuda" if eng.gpu else "cpu"
        fmt = torch.channels_last if cl else torch.contiguous_format
        tx = torch.from_numpy(x_cf).to(dev).to(memory_format=fmt).requires_grad_()
        tw = torch.from_numpy(w_cf).to(dev).requires_grad_()
        tb = torch.from_numpy(b).to(dev).requires_grad_()
        tdy = torch.from_numpy(np.moveaxis(eng.host(dy), -1, 1) if cl else eng.host(dy)).to(
            dev, torch.float32).contiguous(memory_format=fmt)
        F = torch.nn.functional

        def torch_fwd() -> Any:
            with torch.no_grad():
                return torch.relu(F.conv_transpose2d(tx, tw, tb, 2, case.padding))

        ty = torch.relu(F.conv_transpose2d(tx, tw, tb, 2, case.padding))

        def torch_bwd() -> Any:
            return torch.autograd.grad(ty, (tx, tw, tb), tdy, retain_graph=True)

        fwd["torch"], bwd["torch"] = torch_fwd, torch_bwd
    return fwd, bwd, {"geom": geom, "cl": cl}


def _check(eng: Engine, fwd: dict, bwd: dict, cl: bool) -> dict:
    """Every form's y, dx, dw and db against the fused form's (relative to its max)."""
    def cf_host(a: Any, weight: bool = False) -> np.ndarray:
        h = a.detach().cpu().numpy().astype(np.float64) if hasattr(a, "detach") else eng.host(a)
        if cl and not hasattr(a, "detach") and h.ndim == 4:
            h = np.moveaxis(h, -1, 1)
        return h

    ref_y = cf_host(fwd["fused"]()[0])
    g = bwd["fused"]()
    ref = {"dx": cf_host(g.dx), "dw": cf_host(g.dweight), "db": cf_host(g.dbias)}
    worst = 0.0
    for form in fwd:
        if form == "fused":
            continue
        y = fwd[form]()
        grads = bwd[form]()
        got = {"y": cf_host(y), "dx": cf_host(grads[0]), "dw": cf_host(grads[1]),
               "db": cf_host(grads[2])}
        for key, want in (("y", ref_y), *ref.items()):
            err = float(np.abs(got[key] - want).max()) / max(float(np.abs(want).max()), 1e-30)
            worst = max(worst, err)
    tol = 2e-2 if eng.gpu else 1e-4  # TF32 on a GPU
    return {"ok": worst <= tol, "max_rel_err": worst, "tol": tol}


def _time(eng: Engine, fns: dict, rounds: int, per_round: int) -> dict:
    samples: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for fn in fns.values():
        fn()
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            eng.sync()
            t0 = time.perf_counter()
            for _ in range(per_round):
                fns[name]()
            eng.sync()
            samples[name].append((time.perf_counter() - t0) / per_round)
    return {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v),
                "rounds": len(v)} for k, v in samples.items()}


def _work(geom: Any) -> dict[str, dict[str, float]]:
    """Flops and compulsory bytes (float32) of the forward and the backward."""
    flops = geom.flops()
    x, w, y = (math.prod(s) * 4 for s in (geom.input_shape, geom.weight_shape,
                                          geom.output_shape))
    b = geom.out_channels * 4
    return {"forward": {"flops": flops, "bytes": x + w + b + y},
            "backward": {"flops": 2 * flops, "bytes": 2 * y + x + w + x + w + b}}


def _guarded(eng: Engine, torch: Any, case: Case, layout: str, peaks: dict,
             quick: bool) -> dict:
    """_case, or a record of its error: one case that fails ends no run (the sections
    after this one, the final JSON)."""
    try:
        return _case(eng, torch, case, layout, peaks, quick)
    except Exception as exc:  # reported, as records.guarded reports a section's case
        return {"name": case.name, "layout": layout, "shape": case.describe(),
                "status": "error", "error": f"{type(exc).__name__}: {exc}"}


def _case(eng: Engine, torch: Any, case: Case, layout: str, peaks: dict, quick: bool) -> dict:
    rec: dict[str, Any] = {"name": case.name, "layout": layout, "shape": case.describe()}
    fwd, bwd, info = _forms(eng, torch, case, layout)
    rec["check"] = _check(eng, fwd, bwd, info["cl"])
    if not rec["check"]["ok"]:
        rec["status"] = "check_failed"
        return rec
    rounds, per_round = ((5, 3) if quick else (9, 10)) if eng.gpu else ((3, 1) if quick
                                                                      else (5, 1))
    rec["forward"] = _time(eng, fwd, rounds, per_round)
    rec["backward"] = _time(eng, bwd, rounds, per_round)
    rec["floor_s"] = {}
    for phase, work in _work(info["geom"]).items():
        floor = max(work["flops"] / peaks["gemm_flops"], work["bytes"] / peaks["copy_bytes"])
        rec["floor_s"][phase] = floor
        for t in rec[phase].values():
            t["floor/median"] = floor / t["median_s"]
    for phase in ("forward", "backward"):
        t = rec[phase]
        rec.setdefault("speedup", {})[phase] = {
            other: t[other]["median_s"] / t["fused"]["median_s"] for other in t
            if other != "fused"}
    rec["status"] = "measured"
    return rec


def run(quick: bool) -> dict:
    """Measure every case; a JSON-ready dict."""
    import convfuse as cf

    eng = Engine(cf.gpu_available())
    try:
        import torch

        if eng.gpu:  # pragma: gpu
            torch.backends.cudnn.benchmark = True
    except ImportError:
        torch = None
    cases = unet_cases()
    if eng.gpu:  # pragma: gpu
        layouts = ("NCHW", "NHWC")
        if quick:
            cases = [c.scaled(8, 1, 1) for c in cases]
    else:
        layouts = ("NCHW",) if quick else ("NCHW", "NHWC")
        cases = [c.scaled(2, 16, 8) if quick else c.scaled(4, 8, 4) for c in cases]
    peaks = eng.peaks()
    with cf.config.flags(benchmark=eng.gpu):
        records = [_guarded(eng, torch, c, lay, peaks, quick) for c in cases
                   for lay in layouts]
    return {"schema": SCHEMA, "status": "measured", "device": "cuda" if eng.gpu else "cpu",
            "label": eng.label, "quick": quick, "peaks": peaks,
            "torch": None if torch is None else torch.__version__,
            "forms": {"fused": "BackwardData + one bias/ReLU pass; backward: fused "
                               "ReLU-backward + bias-gradient kernel",
                      "unfused": "BackwardData, bias pass, ReLU pass; backward: ReLU-backward "
                                 "pass, generic sum for db",
                      "torch": "F.conv_transpose2d + relu, autograd"},
            "cases": records}


def format_table(result: dict) -> str:
    lines = [f"ConvTranspose (U-Net decoder layers) on {result['label']}: median ms, "
             "speedup of fused over each form, floor/median"]
    lines.append(f"{'case':<28}{'layout':<7}{'phase':<9}" + "".join(
        f"{f:>12}" for f in FORMS) + f"{'floor':>10}{'x unfused':>11}{'x torch':>9}")
    for rec in result["cases"]:
        if rec["status"] != "measured":
            why = rec.get("error", rec.get("check"))
            lines.append(f"{rec['name']:<28}{rec['layout']:<7}{rec['status']}: {why}")
            continue
        for phase in ("forward", "backward"):
            t = rec[phase]
            cells = "".join(f"{t[f]['median_s'] * 1e3:12.3f}" if f in t else f"{'-':>12}"
                            for f in FORMS)
            sp = rec["speedup"][phase]
            lines.append(f"{rec['name']:<28}{rec['layout']:<7}{phase:<9}{cells}"
                         f"{rec['floor_s'][phase] * 1e3:10.3f}{sp['unfused']:10.2f}x"
                         + (f"{sp['torch']:8.2f}x" if "torch" in sp else f"{'-':>9}"))
    if result["device"] == "cpu":
        lines.append("CPU run: the NumPy reference engine against PyTorch's CPU kernels on "
                     "shapes scaled down; nothing here is a GPU result.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a checkout, no install
    res = run("--quick" in sys.argv)
    print(format_table(res))
    if "--out" in sys.argv:
        out = Path(sys.argv[sys.argv.index("--out") + 1])
        out.write_text(json.dumps(res, indent=1))
        print(f"JSON: {out}")
