"""Peak bandwidth and FLOP rates: the inputs to every floor time.

Known devices use the vendor's datasheet numbers (dense, i.e. without 2:4 sparsity).
These are spec-sheet inputs, not measurements. Any other device (and the CPU) uses
measured rates: a large device-to-device copy for bandwidth and a large GEMM per precision
for FLOP/s. A measured rate is below the true peak, so floors from it are longer and the
fractions of roofline higher than a datasheet would give; the JSON says which was used.
On a known device the measured rates are recorded too, as a sanity check of the table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from .engine import Engine
from .roofline import Work
from .timing import Budget, CpuTimer, measure

TB = 1e12
# Far above the last-level cache: a 64 MiB copy read about 2x too high a bandwidth here.
COPY_BYTES = 256 << 20
PRECISION_KEYS = ("fp32", "tf32", "fp16", "bf16")

_A100 = "NVIDIA A100 Tensor Core GPU datasheet (dense rates; bandwidth per memory variant)"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (dense rates: half the sparsity figures)"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (dense rates: half the sparsity figures)"


@dataclass(frozen=True)
class Peaks:
    device: str
    source: str
    bandwidth: float  # bytes/s
    flops: dict[str, float]  # FLOP/s per precision key
    measured: bool

    def floor(self, work: Work, precision: str) -> float:
        return work.floor_seconds(self.flops[precision], self.bandwidth)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "source": self.source, "measured": self.measured,
                "bandwidth_Bps": self.bandwidth, "flops_per_s": dict(self.flops)}


@dataclass(frozen=True)
class DatasheetEntry:
    pattern: str  # matched against the normalised CUDA device name
    name: str
    bandwidth_tbs: float
    fp32: float  # TFLOP/s, CUDA cores
    tf32: float  # TFLOP/s, tensor cores, dense
    fp16: float  # TFLOP/s, tensor cores, dense (BF16 is the same on these parts)
    source: str

    def peaks(self, device: str) -> Peaks:
        rates = {"fp32": self.fp32 * TB, "tf32": self.tf32 * TB, "fp16": self.fp16 * TB,
                 "bf16": self.fp16 * TB}
        return Peaks(device, f"{self.name}: {self.source}", self.bandwidth_tbs * TB, rates,
                     measured=False)


# Order matters: the first match wins. Variants not listed (H100 NVL, H200 NVL, GH200, ...)
# fall through to measured rates rather than borrowing a sibling's numbers.
DATASHEET: tuple[DatasheetEntry, ...] = (
    DatasheetEntry(r"\ba100\b.*sxm.*80gb", "A100 SXM4 80GB", 2.039, 19.5, 156, 312, _A100),
    DatasheetEntry(r"\ba100\b.*sxm.*40gb", "A100 SXM4 40GB", 1.555, 19.5, 156, 312, _A100),
    DatasheetEntry(r"\ba100\b.*(80gb.*pcie|pcie.*80gb)", "A100 PCIe 80GB", 1.935, 19.5, 156,
                   312, _A100),
    DatasheetEntry(r"\ba100\b.*(40gb.*pcie|pcie.*40gb)", "A100 PCIe 40GB", 1.555, 19.5, 156,
                   312, _A100),
    DatasheetEntry(r"\bh100\b.*pcie", "H100 PCIe", 2.0, 51, 378, 756, _H100),
    DatasheetEntry(r"\bh100\b.*(sxm|hbm3)", "H100 SXM5", 3.35, 67, 494.5, 989.5, _H100),
    DatasheetEntry(r"^nvidia h200( sxm.*)?$", "H200 SXM", 4.8, 67, 494.5, 989.5, _H200),
)


def normalise(device_name: str) -> str:
    return " ".join(device_name.lower().replace("-", " ").replace("_", " ").split())


def datasheet_entry(device_name: str) -> DatasheetEntry | None:
    key = normalise(device_name)
    for entry in DATASHEET:
        if re.search(entry.pattern, key):
            return entry
    return None


def measured_cpu() -> Peaks:
    """NumPy copy bandwidth and float32 GEMM rate on this CPU (all precisions use it: the
    reference engine computes every storage dtype in float32)."""
    budget = Budget(warmup=1, min_reps=3, max_reps=10, seconds=0.2)
    timer = CpuTimer()
    n = COPY_BYTES
    src = np.random.default_rng(0).random(n // 4, dtype=np.float32) + 1.0
    dst = np.empty_like(src)
    copy = measure(timer, lambda i: np.copyto(dst, src), 1, budget)
    size = 1024
    a = np.random.default_rng(1).random((size, size), dtype=np.float32)
    b = np.random.default_rng(2).random((size, size), dtype=np.float32)
    out = np.empty_like(a)
    gemm = measure(timer, lambda i: np.matmul(a, b, out=out), 1, budget)
    rate = 2 * size**3 / gemm.min
    return Peaks("CPU", f"measured on this CPU: np.copyto of {n >> 20} MiB (one thread; "
                 f"bytes read + written / fastest time), float32 GEMM {size}^3 with NumPy's "
                 "BLAS (fastest repetition)", 2 * n / copy.min,
                 dict.fromkeys(PRECISION_KEYS, rate), measured=True)


def measured_gpu(engine: Engine, quick: bool) -> tuple[Peaks, dict[str, str]]:  # pragma: gpu
    """Device-to-device copy bandwidth and a large GEMM per precision, on this GPU."""
    cp = engine.xp
    from cupy._core import _routines_linalg as linalg

    budget = Budget(warmup=3, min_reps=10, max_reps=50, seconds=0.5)
    notes: dict[str, str] = {}
    nbytes = (256 if quick else 1024) << 20
    bandwidth = _copy_bandwidth(engine, nbytes, budget)
    engine.release()
    size = 4096 if quick else 8192
    rates: dict[str, float] = {}
    plans = {"fp32": ("float32", linalg.COMPUTE_TYPE_FP32),
             "tf32": ("float32", linalg.COMPUTE_TYPE_TF32),
             "fp16": ("float16", None), "bf16": ("bfloat16", None)}
    for key, (dtype, compute) in plans.items():
        try:
            a = engine.uniform((size, size), dtype, 11)
            b = engine.uniform((size, size), dtype, 12)
            out = cp.empty_like(a)
            previous = linalg.get_compute_type(a.dtype)
            if compute is not None:
                linalg.set_compute_type(a.dtype, compute)
            try:
                stats = measure(engine.timer, lambda i, a=a, b=b, out=out: cp.matmul(a, b, out=out),
                                1, budget)
            finally:
                linalg.set_compute_type(a.dtype, previous)
            rates[key] = 2 * size**3 / stats.min
        except Exception as exc:  # e.g. no bfloat16 GEMM in this CuPy: say so, use fp16's rate
            notes[key] = f"GEMM not measurable ({type(exc).__name__}: {exc})"
        engine.release()
    for key in PRECISION_KEYS:
        if key not in rates:
            fallback = "fp16" if key == "bf16" and "fp16" in rates else "fp32"
            rates[key] = rates.get(fallback, float("nan"))
            notes[key] = notes.get(key, "") + f"; using the {fallback} rate"
    source = (f"measured on this GPU: {nbytes >> 20} MiB device-to-device copy, "
              f"{size}^3 GEMM per precision with cupy.matmul (fastest repetition)")
    return Peaks(engine.info.get("name", "GPU"), source, bandwidth, rates, measured=True), notes


def _copy_bandwidth(engine: Engine, nbytes: int, budget: Budget) -> float:  # pragma: gpu
    src = engine.xp.ones(nbytes, dtype=engine.xp.uint8)
    dst = engine.xp.empty_like(src)
    copy = measure(engine.timer, lambda i: dst.data.copy_from_device_async(src.data, nbytes),
                   1, budget)
    return 2 * nbytes / copy.min  # each byte is read once and written once


def resolve(engine: Engine, quick: bool,
            measure: bool = True) -> tuple[Peaks, dict[str, Any]]:
    """The peaks floors use, and a JSON record of how they were obtained. Without
    `measure` (no chosen section has a floor: host-overhead alone) a GPU in the datasheet
    is not measured: its copy and GEMM runs would take seconds of a capped part."""
    if engine.is_gpu:  # pragma: gpu
        return _resolve_gpu(engine, quick, measure)
    peaks = measured_cpu()
    return peaks, {"used": peaks.to_json(), "datasheet": None, "measured": peaks.to_json()}


def _resolve_gpu(engine: Engine, quick: bool,
                 measure: bool) -> tuple[Peaks, dict[str, Any]]:  # pragma: gpu
    name = engine.info["name"]
    entry = datasheet_entry(name)
    if not measure and entry is not None:
        used = entry.peaks(name)
        return used, {"used": used.to_json(), "datasheet": used.to_json(), "measured": None,
                      "measurement_notes": "not measured: no chosen section has a floor"}
    measured, notes = measured_gpu(engine, quick)
    used = entry.peaks(name) if entry else measured
    return used, {"used": used.to_json(),
                  "datasheet": entry.peaks(name).to_json() if entry else None,
                  "measured": measured.to_json(), "measurement_notes": notes}
