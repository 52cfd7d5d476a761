"""Count device-to-host copies and host synchronisations per training step, eager and
captured as a CUDA graph (scripts/gpu_acceptance.sh; the target is zero for both).

  python scripts/count_syncs.py --out syncs.json [--steps 20]
  python scripts/count_syncs.py --worker [--steps 1]      # just run the steps (sanitizer)

With Nsight Systems (`nsys`) on PATH, the steps run under `nsys profile -t cuda,nvtx`, each
inside an NVTX range, and every CUDA API call and GPU memcpy inside a range is classified
(`classify`): synchronisations (cuda{Device,Stream,Event}Synchronize, a synchronous
cudaMemcpy*, cudaFree, cudaStreamQuery is not one) and device-to-host copies. Without nsys
the counts are unknown (null), and two probes stand in:
- the capture probe: one eager step is recorded under cudaStreamCaptureModeGlobal, which
  CUDA aborts at the first synchronising or unsafe call on the capturing stream (or, for
  some calls, from any thread). It sees what a recorded step does, not what runs only
  outside a capture;
- the blocking probe (`blocking_probe`): a kernel keeps the device busy for SPIN_S
  (spinning on %globaltimer), then the step is called; a step that waits for the device
  anywhere (a sync, a copy to pageable host memory, a cudaFree) takes at least the rest
  of the spin on the host, one that only queues work returns in its own host time. It
  counts the steps, eager and replayed, that blocked; a spin the host never waited for
  shows the probe itself works.
Neither counts calls, as nsys does; both report what they saw.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if (REPO / "convfuse" / "__init__.py").is_file():
    # measure the checkout's convfuse, installed or not (the acceptance run builds in place)
    sys.path.insert(0, str(REPO))

RANGES = ("convfuse eager step", "convfuse captured step")
# Synchronising calls by name (nsys names carry _v<version>, and the per-thread default
# stream's _ptds/_ptsz): the explicit syncs, synchronous copies, and the frees that wait
# for the device (cudaFree, cudaFreeHost and their driver forms)
_SYNC_API = re.compile(r"^cuda(Device|Stream|Event|Ctx)Synchronize|"
                       r"^cudaMemcpy(2D|3D|ToSymbol|FromSymbol)?(_pt(ds|sz))?(_v\d+)?$|"
                       r"^cudaFree(Host)?(_v\d+)?$|^cuMemFree(Host)?(_v\d+)?$|"
                       r"^cu(Ctx|Stream|Event)Synchronize|^cuMemcpy[DH]to[DH](_v\d+)?$")
_D2H = re.compile(r"device-to-host|dtoh", re.I)


def classify(api_rows: list[dict], gpu_rows: list[dict], ranges: list[dict],
             steps: int) -> dict:
    """Per named NVTX range: syncs and D2H copies per step, and the API names seen."""
    out = {}
    for name in RANGES:
        spans = [(r["start"], r["end"]) for r in ranges if r["name"] == name]

        def inside(t: int, spans: list = spans) -> bool:
            return any(a <= t <= b for a, b in spans)

        syncs = [r["name"] for r in api_rows if _SYNC_API.search(r["name"]) and inside(r["start"])]
        copies = [r["name"] for r in gpu_rows if _D2H.search(r["name"]) and inside(r["start"])]
        out[name] = {"ranges": len(spans), "syncs_per_step": len(syncs) / max(steps, 1),
                     "d2h_copies_per_step": len(copies) / max(steps, 1),
                     "sync_calls": sorted(set(syncs)), "copy_kinds": sorted(set(copies))}
    return out


def read_csv(path: Path) -> list[dict]:
    """Rows of an `nsys stats -f csv` report with start/end/name normalised."""
    if not path.is_file():
        return []
    rows = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            keys = {k.lower(): k for k in row}
            start = next((keys[k] for k in keys if k.startswith("start")), None)
            end = next((keys[k] for k in keys if k.startswith("end")), None)
            dur = next((keys[k] for k in keys if k.startswith("duration")), None)
            name = next((keys[k] for k in keys if k in ("name", "operation")), None)
            if start is None or name is None:
                continue
            s = int(float(row[start]))
            e = int(float(row[end])) if end else s + int(float(row[dur] or 0)) if dur else s
            rows.append({"start": s, "end": e, "name": row[name]})
    return rows


#: How long the blocking probe keeps the device busy before each step, and the share of it
#: a step's host time must reach to count as blocked (a step's own host time is a few ms).
SPIN_S = 0.05
BLOCKED_SHARE = 0.5
SPIN_SOURCE = r"""
extern "C" __global__ void convfuse_spin(unsigned long long ns) {
    // bounded: a %globaltimer that never advances (a virtual device) must not hang the part;
    // 2^26 reads (about 1 s at 10-20 ns a read) leave a 50 ms spin room and keep a frozen
    // timer's steps well inside the part's 25 s cap
    unsigned long long start, now, spins = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns && ++spins < (1ull << 26));
}
"""


def blocked(host_s: float, waited_s: float) -> str:
    """One step's reading: "blocked" when its host time took at least BLOCKED_SHARE of the
    spin, "free" when the spin was still running after it returned (the host waited for
    the rest), "inconclusive" when neither (the spin was over before the step was)."""
    if host_s >= BLOCKED_SHARE * SPIN_S:
        return "blocked"
    if host_s + waited_s >= BLOCKED_SHARE * SPIN_S:
        return "free"
    return "inconclusive"


def summarize_blocking(readings: list[str]) -> dict:
    counts = {k: readings.count(k) for k in ("blocked", "free", "inconclusive")}
    return {"steps": len(readings), **counts}


def blocking_probe(cp, call, steps: int) -> dict:  # pragma: gpu
    """`call()` `steps` times, each right after a kernel that keeps the device busy for
    SPIN_S on CuPy's current stream: how many calls blocked on the device (module notes)."""
    import time

    import numpy as np

    spin = cp.RawKernel(SPIN_SOURCE, "convfuse_spin")
    stream = cp.cuda.get_current_stream()
    # one untimed call first: graph.capture hands the default pool's free blocks back, and
    # a first step allocating anew (cudaMalloc may wait for the device) is no finding
    call()
    stream.synchronize()
    readings = []
    for _ in range(steps):
        stream.synchronize()
        spin((1,), (1,), (np.uint64(int(SPIN_S * 1e9)),))
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        stream.synchronize()
        readings.append(blocked(t1 - t0, time.perf_counter() - t1))
    return summarize_blocking(readings)


def _model():  # pragma: gpu
    import convfuse as cf

    model = cf.Sequential(
        cf.Conv2d(1, 16, 3, padding=1, activation="relu", device="cuda", seed=0),
        cf.MaxPool2d(2),
        cf.Conv2d(16, 32, 3, padding=1, activation="relu", device="cuda", seed=1),
        cf.MaxPool2d(2),
        cf.Flatten(),
        cf.Linear(32 * 2 * 2, 10, device="cuda", seed=2),
    )
    loss_fn, opt, mean = cf.CrossEntropyLoss(), cf.optim.Adam(model.parameters(), lr=3e-3), \
        cf.metrics.Mean()

    def step(x, y):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        opt.step()
        mean.add(loss)
        return loss

    return step, mean


def worker(steps: int, nvtx: bool, out: Path | None) -> dict:  # pragma: gpu
    import cupy as cp
    import numpy as np

    import convfuse as cf

    rng = np.random.default_rng(0)
    x = cp.asarray(rng.random((32, 1, 8, 8), dtype=np.float32))
    y = cp.asarray(rng.integers(0, 10, 32).astype(np.int32))
    step, mean = _model()
    step(x, y)  # warm-up: plans, algorithms, kernels, buffers
    cp.cuda.get_current_stream().synchronize()
    push = cp.cuda.nvtx.RangePush if nvtx else (lambda name: None)
    pop = cp.cuda.nvtx.RangePop if nvtx else (lambda: None)
    for _ in range(steps):
        push(RANGES[0])
        step(x, y)
        pop()
    cp.cuda.get_current_stream().synchronize()
    probe = capture_probe(cp, step, x, y)
    captured = cf.graph.capture(step, x, y)
    captured.synchronize()
    for _ in range(steps):
        push(RANGES[1])
        captured(x, y)
        pop()
    captured.synchronize()
    blocking = {RANGES[0]: blocking_probe(cp, lambda: step(x, y), steps),
                RANGES[1]: blocking_probe(cp, lambda: captured(x, y), steps)}
    result = {"steps": steps, "capture_probe": probe, "blocking_probe": blocking,
              "mean_loss": mean.compute()}
    if out is not None:
        out.write_text(json.dumps(result))
    return result


def capture_probe(cp, step, x, y) -> str:  # pragma: gpu
    """Record one eager step under global capture mode: CUDA refuses any synchronising or
    unsafe call (from any thread) while it records. The recording is discarded."""
    from cupy_backends.cuda.api import runtime

    stream = cp.cuda.Stream(non_blocking=True)
    # CuPy's pool keeps its free blocks per stream: the first allocations on a brand-new
    # stream call cudaMalloc, which global capture mode refuses (a false failure). One
    # eager step on this stream first fills its arena (and convfuse's per-stream caches);
    # the recorded step then allocates only from cached blocks, as a real step would.
    try:
        with stream:
            step(x, y)
            stream.synchronize()
            stream.begin_capture(runtime.streamCaptureModeGlobal)
            try:
                step(x, y)
            except BaseException:
                # the step's own error names the call that synchronised; ending an
                # invalidated capture raises too, and must not replace it
                with contextlib.suppress(Exception):
                    stream.end_capture()
                raise
            stream.end_capture()
    except Exception as exc:  # the step synchronised or copied to the host
        return f"fail: {type(exc).__name__}: {exc}"[:500]
    return "pass"


def with_nsys(nsys: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        rep = Path(tmp) / "steps"
        run_out = Path(tmp) / "worker.json"
        cmd = [nsys, "profile", "-t", "cuda,nvtx", "--force-overwrite", "true", "-o", str(rep),
               sys.executable, __file__, "--worker", "--nvtx", "--steps", str(steps),
               "--worker-out", str(run_out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return {"method": "nsys", "error": proc.stderr[-2000:]}
        stats = Path(tmp) / "st"
        subprocess.run([nsys, "stats", "-q", "-f", "csv", "-o", str(stats), "-r",
                        "cuda_api_trace,cuda_gpu_trace,nvtx_pushpop_trace",
                        f"{rep}.nsys-rep"], capture_output=True, text=True)
        found = {p.name: p for p in Path(tmp).glob("st_*.csv")}

        def report(name: str) -> list[dict]:
            return read_csv(next((p for n, p in found.items() if name in n), Path("/none")))

        result = classify(report("cuda_api_trace"), report("cuda_gpu_trace"),
                          report("nvtx_pushpop_trace"), steps)
        worker_result = json.loads(run_out.read_text()) if run_out.is_file() else {}
        return {"method": "nsys", **result, **worker_result}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--worker", action="store_true", help="only run the steps")
    p.add_argument("--nvtx", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.steps, args.nvtx, args.worker_out)
        return 0
    nsys = shutil.which("nsys")
    if nsys and not os.environ.get("CONVFUSE_NO_NSYS"):
        result = with_nsys(nsys, args.steps)
    else:
        run = worker(args.steps, False, None)
        result = {"method": "capture-probe (nsys not found: counts unknown)",
                  **{name: {"syncs_per_step": None, "d2h_copies_per_step": None}
                     for name in RANGES}, **run}
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
