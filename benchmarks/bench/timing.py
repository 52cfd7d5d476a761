"""Timing: warm-up, then timed repetitions until the median is pinned down; median with
min, max and the spread of the median, interleaved when forms are compared.

Note [spread and unstable figures]
A figure's `spread` is the relative width of a distribution-free ~95% confidence interval
of its median: the order statistics j = floor(n/2 - 0.98 sqrt(n)) and k = ceil(n/2 +
0.98 sqrt(n)) of the n sorted samples (the binomial bound), divided by the median.
Repetitions continue until every compared form's spread is at most TARGET_SPREAD, or the
budget's seconds or max_reps run out. A time whose spread exceeds UNSTABLE_SPREAD is
flagged unstable; a ratio of medians gets the interval [lo_a / hi_b, hi_a / lo_b] and is
flagged when that interval's relative width exceeds UNSTABLE_RATIO_SPREAD (it compounds
two intervals). Compared forms are timed interleaved: one call of each per round, the
order rotating, so load that comes and goes on a shared machine hits every form alike.

On the GPU each repetition is bracketed by two CUDA events recorded on the current stream,
and the host does not wait between repetitions: the events measure device time, plus any
gap the host leaves by launching more slowly than the device runs (which is the real cost
of a launch-bound eager step). On the CPU, perf_counter brackets each call.

Note [a GPU sample starts from an idle queue]
An interleaved round waits for each form's sample before the next form's (the rotation is
the point), so each GPU sample starts with nothing queued: its begin event fires at once
and the device then idles through the host's Python for the first launch, which a
device-bound call in a running step never pays. So in interleaved rounds a GPU sample
brackets `calls` consecutive calls, as many as bring a sample's time (from a pilot) to
GPU_SAMPLE_S, at most MAX_CALLS, and counts its time divided by them: the first launch's
latency is spread over them, and a launch-bound call still shows its host gap per call.

`fn(i)` runs the operation on input set `i`; the caller passes how many sets it made so
consecutive repetitions read different memory when one set would sit in cache.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

PILOT_REPS = 3
GPU_SAMPLE_S = 5e-4  # Note [a GPU sample starts from an idle queue]
MAX_CALLS = 32
TARGET_SPREAD = 0.05
UNSTABLE_SPREAD = 0.10
UNSTABLE_RATIO_SPREAD = 0.20


def median_interval(values: Sequence[float]) -> tuple[float, float]:
    """A distribution-free ~95% interval of the median (Note [spread and unstable figures])."""
    xs = sorted(values)
    n = len(xs)
    half = 0.98 * math.sqrt(n)
    j = max(0, math.floor(n / 2 - half))
    k = min(n - 1, math.ceil(n / 2 + half) - 1)
    return xs[j], xs[max(j, k)]


@dataclass(frozen=True)
class Stats:
    median: float
    min: float
    max: float
    mean: float
    samples: tuple[float, ...]

    @property
    def reps(self) -> int:
        return len(self.samples)

    @property
    def interval(self) -> tuple[float, float]:
        return median_interval(self.samples)

    @property
    def spread(self) -> float:
        lo, hi = self.interval
        return (hi - lo) / self.median if self.median > 0 else math.inf

    @property
    def unstable(self) -> bool:
        return self.spread > UNSTABLE_SPREAD

    def to_json(self) -> dict[str, Any]:
        lo, hi = self.interval
        return {"median_s": self.median, "min_s": self.min, "max_s": self.max,
                "mean_s": self.mean, "reps": self.reps, "ci_low_s": lo, "ci_high_s": hi,
                "spread": self.spread, "unstable": self.unstable,
                "samples_s": list(self.samples)}


def summarize(samples: Sequence[float]) -> Stats:
    if not samples:
        raise ValueError("no timing samples to summarize")
    values = tuple(float(s) for s in samples)
    return Stats(statistics.median(values), min(values), max(values), statistics.fmean(values),
                 values)


@dataclass(frozen=True)
class Budget:
    """Warm-up calls, then as many repetitions as fit in `seconds`, within [min, max]."""

    warmup: int
    min_reps: int
    max_reps: int
    seconds: float

    def reps_for(self, seconds_per_call: float) -> int:
        if seconds_per_call <= 0:
            return self.max_reps
        wanted = math.ceil(self.seconds / seconds_per_call)
        return max(self.min_reps, min(self.max_reps, wanted))


class Timer(Protocol):
    kind: str

    def sync(self) -> None: ...

    def sample(self, fn: Callable[[int], Any], n_sets: int, start: int, reps: int) -> list[float]:
        """Seconds per call of `reps` calls of fn on input sets start, start + 1, ... (mod
        n_sets); the GPU timers also take `calls`: each sample then brackets that many
        consecutive calls (Note [a GPU sample starts from an idle queue])."""
        ...


class CpuTimer:
    kind = "cpu: time.perf_counter around each call"

    def sync(self) -> None:
        return None

    def sample(self, fn: Callable[[int], Any], n_sets: int, start: int, reps: int) -> list[float]:
        out = []
        for r in range(reps):
            t0 = time.perf_counter()
            fn((start + r) % n_sets)
            out.append(time.perf_counter() - t0)
        return out


class HostTimer(CpuTimer):
    """Host time per call on a GPU: the device is synchronised before each timed sample,
    outside it, so a call's host time never absorbs another form's queued work (a launch
    into a full queue waits for the device) and every form starts from an idle queue."""

    kind = "host: time.perf_counter around each call, the device synchronised before it"

    def __init__(self, synchronize: Callable[[], None]) -> None:
        self._synchronize = synchronize

    def sync(self) -> None:
        self._synchronize()

    def sample(self, fn: Callable[[int], Any], n_sets: int, start: int, reps: int) -> list[float]:
        out = []
        for r in range(reps):
            self._synchronize()
            t0 = time.perf_counter()
            fn((start + r) % n_sets)
            out.append(time.perf_counter() - t0)
        return out


class CupyEventTimer:  # pragma: gpu
    """CUDA events from CuPy on the current stream (the stream convfuse's ops use)."""

    kind = "gpu: cupy.cuda.Event pairs on the current stream"

    def __init__(self, cupy: Any) -> None:
        self._cp = cupy

    def sync(self) -> None:
        self._cp.cuda.get_current_stream().synchronize()

    def sample(self, fn: Callable[[int], Any], n_sets: int, start: int, reps: int,
               calls: int = 1) -> list[float]:
        cp = self._cp
        pairs = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(reps)]
        for r, (begin, end) in enumerate(pairs):
            begin.record()
            for c in range(calls):
                fn((start + r * calls + c) % n_sets)
            end.record()
        pairs[-1][1].synchronize()
        return [cp.cuda.get_elapsed_time(begin, end) / 1e3 / calls for begin, end in pairs]


class TorchEventTimer:  # pragma: gpu
    """torch.cuda.Event pairs on PyTorch's current stream (PyTorch may not use CuPy's)."""

    kind = "gpu: torch.cuda.Event pairs on PyTorch's current stream"

    def __init__(self, torch: Any) -> None:
        self._torch = torch

    def sync(self) -> None:
        self._torch.cuda.synchronize()

    def sample(self, fn: Callable[[int], Any], n_sets: int, start: int, reps: int,
               calls: int = 1) -> list[float]:
        cuda = self._torch.cuda
        pairs = [(cuda.Event(enable_timing=True), cuda.Event(enable_timing=True))
                 for _ in range(reps)]
        for r, (begin, end) in enumerate(pairs):
            begin.record()
            for c in range(calls):
                fn((start + r * calls + c) % n_sets)
            end.record()
        pairs[-1][1].synchronize()
        return [begin.elapsed_time(end) / 1e3 / calls for begin, end in pairs]


def measure(timer: Timer, fn: Callable[[int], Any], n_sets: int, budget: Budget) -> Stats:
    """Warm up, size the run from a short pilot, then time `reps` calls of `fn`."""
    if n_sets < 1:
        raise ValueError(f"n_sets must be >= 1, got {n_sets}")
    for i in range(budget.warmup):
        fn(i % n_sets)
    timer.sync()
    pilot = timer.sample(fn, n_sets, budget.warmup, PILOT_REPS)
    reps = budget.reps_for(statistics.median(pilot))
    return summarize(timer.sample(fn, n_sets, budget.warmup + PILOT_REPS, reps))


Form = tuple[Timer, Callable[[int], Any]]


def measure_interleaved(forms: dict[str, Form], n_sets: int, budget: Budget,
                        clock: Callable[[], float] = time.perf_counter) -> dict[str, Stats]:
    """Time several forms of one operation interleaved (Note [spread and unstable figures]).

    Each round times one call of every form, rotating the order; rounds go on from
    budget.min_reps until every median's spread is <= TARGET_SPREAD, or budget.seconds of
    wall time or budget.max_reps rounds are used up.
    """
    if n_sets < 1:
        raise ValueError(f"n_sets must be >= 1, got {n_sets}")
    if not forms:
        raise ValueError("no forms to measure")
    names = list(forms)
    calls: dict[str, int] = {}
    for name in names:
        timer, fn = forms[name]
        for i in range(budget.warmup):
            fn(i % n_sets)
        timer.sync()
        calls[name] = _calls_per_sample(timer, fn, n_sets, budget.warmup)
    samples: dict[str, list[float]] = {name: [] for name in names}
    start = clock()
    rounds = 0
    while rounds < budget.max_reps:
        order = names[rounds % len(names):] + names[:rounds % len(names)]
        for name in order:
            timer, fn = forms[name]
            k = calls[name]
            if k == 1:
                samples[name] += timer.sample(fn, n_sets, budget.warmup + rounds, 1)
            else:  # Note [a GPU sample starts from an idle queue]
                samples[name] += timer.sample(fn, n_sets, budget.warmup + rounds * k, 1,
                                              calls=k)  # type: ignore[call-arg]
        rounds += 1
        if rounds < budget.min_reps:
            continue
        if clock() - start >= budget.seconds:
            break
        if all(summarize(v).spread <= TARGET_SPREAD for v in samples.values()):
            break
    return {name: summarize(v) for name, v in samples.items()}


def _calls_per_sample(timer: Timer, fn: Callable[[int], Any], n_sets: int, start: int) -> int:
    """1 off the GPU; on it, the calls that bring a sample to GPU_SAMPLE_S, from a pilot
    (Note [a GPU sample starts from an idle queue])."""
    if not timer.kind.startswith("gpu"):
        return 1
    per_call = statistics.median(timer.sample(fn, n_sets, start, PILOT_REPS))
    if per_call <= 0:
        return MAX_CALLS
    return max(1, min(MAX_CALLS, math.ceil(GPU_SAMPLE_S / per_call)))


def ratio_interval(a: Stats, b: Stats) -> tuple[float, float, float, bool]:
    """(ratio of medians, low, high, unstable) for a / b."""
    (alo, ahi), (blo, bhi) = a.interval, b.interval
    r = a.median / b.median
    lo, hi = alo / bhi, ahi / blo if blo > 0 else math.inf
    return r, lo, hi, (hi - lo) / r > UNSTABLE_RATIO_SPREAD


def rotation_sets(working_set_bytes: int, cache_bytes: int, max_sets: int,
                  memory_budget_bytes: int) -> int:
    """How many input sets to rotate among so that repetitions do not hit a warm cache.

    A set at least as large as the cache needs no rotation. A smaller one is repeated
    until the sets together are twice the cache, within `max_sets` and the memory budget.
    """
    if working_set_bytes <= 0 or working_set_bytes >= cache_bytes:
        return 1
    wanted = math.ceil(2 * cache_bytes / working_set_bytes)
    affordable = max(1, memory_budget_bytes // working_set_bytes)
    return max(1, min(wanted, max_sets, affordable))
