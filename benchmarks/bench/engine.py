"""Where the benchmark runs: the GPU (CuPy arrays, cuDNN) or the CPU reference engine.

Both expose the same few things the sections need: an array module, random non-zero
inputs, a timer, a cache size for input rotation, and a way back to host memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from convfuse import dtypes
from convfuse.backend import gpu_unavailable_reason

from .timing import CpuTimer, CupyEventTimer, Timer, rotation_sets

CPU_LABEL = "CPU (convfuse NumPy reference engine)"
CPU_DISCLAIMER = ("CPU timings of the reference engine say nothing about GPU performance: "
                  "they show the harness runs end to end, nothing more.")


@dataclass
class Engine:
    kind: str  # "cpu" or "gpu"
    device: str  # what convfuse layers take: "cpu" or "cuda"
    label: str
    xp: Any
    timer: Timer
    cache_bytes: int
    max_sets: int
    memory_budget: int
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"

    def uniform(self, shape: tuple[int, ...], dtype: Any, seed: int, low: float = -1.0,
                high: float = 1.0) -> Any:
        """Random values in [low, high) cast once to `dtype` (never all zeros)."""
        dt = dtypes.canonical(dtype)
        if self.is_gpu:  # pragma: gpu
            rs = self.xp.random.RandomState(seed)
            return rs.uniform(low, high, shape, dtype=np.float32).astype(dt)
        rng = np.random.default_rng(seed)
        return rng.uniform(low, high, shape).astype(np.float32).astype(dt)

    def labels(self, n: int, classes: int, seed: int) -> Any:
        rng = np.random.default_rng(seed)
        return self.xp.asarray(rng.integers(0, classes, n).astype(np.int32))

    def to_host(self, a: Any) -> np.ndarray:
        if self.is_gpu:  # pragma: gpu
            return self.xp.asnumpy(a)
        return np.asarray(a)

    def sync(self) -> None:
        self.timer.sync()

    def rotation(self, working_set_bytes: int) -> int:
        return rotation_sets(working_set_bytes, self.cache_bytes, self.max_sets,
                             self.memory_budget)

    def release(self) -> None:
        """Return cached device memory between cases, so one case's buffers never crowd
        out the next case's (or PyTorch's) allocations."""
        if self.is_gpu:  # pragma: gpu
            self.sync()
            self.xp.get_default_memory_pool().free_all_blocks()


def cpu_cache_bytes() -> int:
    """The largest CPU cache the kernel reports (fallback 32 MiB)."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=32 << 20)


def cpu_engine() -> Engine:
    # Rotation matters little for a reference engine; keep it cheap in memory and time.
    return Engine("cpu", "cpu", CPU_LABEL, np, CpuTimer(), cpu_cache_bytes(), max_sets=4,
                  memory_budget=128 << 20)


def gpu_engine() -> Engine:  # pragma: gpu
    import cupy

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    info = {
        "name": name,
        "device_id": dev.id,
        "compute_capability": f"{props['major']}.{props['minor']}",
        "multiprocessors": props["multiProcessorCount"],
        "l2_cache_bytes": props["l2CacheSize"],
        "memory_bytes": props["totalGlobalMem"],
    }
    # Rotated input sets add up to twice the L2, within 1 GiB.
    return Engine("gpu", "cuda", f"GPU {name}", cupy, CupyEventTimer(cupy),
                  int(props["l2CacheSize"]), max_sets=64, memory_budget=1 << 30, info=info)


def make_engine(requested: str | None) -> tuple[Engine, str | None]:
    """The engine to run on, and a plain notice when there is no GPU to run on."""
    reason = gpu_unavailable_reason()
    if requested == "cpu":
        return cpu_engine(), "--device cpu: running the CPU reference engine. " + CPU_DISCLAIMER
    if reason is None:  # pragma: gpu
        return gpu_engine(), None
    if requested == "cuda":
        raise SystemExit(f"--device cuda: no GPU to benchmark: {reason}")
    return cpu_engine(), (
        f"NO GPU: {reason}. No GPU numbers were measured and none are reported. The same "
        f"harness runs on the CPU reference engine instead, labelled CPU. " + CPU_DISCLAIMER
    )
