"""What a ConvPlan has chosen: one direction's ranked algorithms, with the out-of-memory
back-off, and the forward path (fused or unfused) with the reason for it."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .algorithms import Candidate

#: Calls a plan runs on a demoted choice before it retries the better one that ran out of
#: memory (Note [transient out-of-memory]); doubled after each failed retry, up to the cap.
OOM_RETRY_FIRST = 8
OOM_RETRY_CAP = 1024


@dataclass
class Chosen:
    """One slot's ranked candidates and the one in use.

    Note [transient out-of-memory]
    An algorithm whose workspace could not be allocated is skipped for the next ranked one,
    but memory comes back (the caller frees arrays, CuPy's pool is flushed), so the skip is
    not for good: after `retry_in` more calls the slot goes back to the best candidate, and
    the next allocation decides again. Each failed retry doubles the wait (capped), so a
    plan that really lacks the memory pays a failed allocation rarely: on the GPU that is
    CuPy's pool freeing its cached blocks and retrying (cudaFree, a device sync). Algorithms cuDNN
    refused to run are removed from `ranked` for good: a refusal does not change.
    """

    ranked: tuple[Candidate, ...]
    index: int
    forced: bool
    retry_in: int = 0  # calls until the best is tried again; 0: not demoted by memory
    backoff: int = 0

    @property
    def exhausted(self) -> bool:
        """Whether cuDNN refused every ranked candidate (the index is then past the end)."""
        return self.index >= len(self.ranked)

    @property
    def candidate(self) -> Candidate:
        return self.ranked[self.index]

    def holds(self, cand: Candidate) -> bool:
        """Whether `cand` is still the one in use, with no memory back-off pending: what
        `ConvPlan.choice` returns without changing anything (Note [bound calls] in
        ops/cudnn/bound.py)."""
        ranked, index = self.ranked, self.index
        # after the last ranked one was refused, index is past the end
        return (not self.retry_in and not self.backoff and index < len(ranked)
                and ranked[index] is cand)

    @property
    def remaining(self) -> tuple[Candidate, ...]:
        return self.ranked[self.index + 1:]


def next_backoff(backoff: int) -> int:
    return min(max(2 * backoff, OOM_RETRY_FIRST), OOM_RETRY_CAP)


@dataclass(frozen=True)
class ForwardPath:
    """How a plan runs conv + bias + activation, for the selfcheck and the benchmark.

    path: "fused" (one convolutionBiasActivationForward) or "unfused" (convolutionForward
    plus convfuse's bias + activation (+ residual) kernel). reason: "heuristics" (the
    default: fused whenever cuDNN accepts it), "timed" (config.benchmark timed both, times
    in milliseconds), or "refused" (cuDNN refused the fused call; see fused_refusal).
    """

    path: str
    reason: str
    fused_ms: float | None = None
    unfused_ms: float | None = None



class FusedFallbackState:
    """What a plan remembers about its fused call(s) falling back, shared by the conv and
    BatchNorm plans: a refusal (for good), a memory back-off (Note [transient
    out-of-memory]) and one FusedFallbackWarning per plan, whatever the cause. Thread-safe:
    of the threads that hit a fallback together, exactly one is told to warn."""

    def _init_fused_state(self) -> None:
        self._lock = threading.Lock()
        self._fused_refusal: Exception | None = None
        self._fused_warned = False
        self._fused_skip = 0  # calls left on the plain path after a fused out-of-memory
        self._fused_backoff = 0

    @property
    def fused_refusal(self) -> Exception | None:
        """Why the fused call is off for good (cuDNN's refusal, or no usable algorithm)."""
        return self._fused_refusal

    @property
    def fell_back(self) -> bool:
        """Whether this plan ever ran plain instead of fused (it warned then, once)."""
        return self._fused_warned

    def refuse_fused(self, err: Exception) -> bool:
        """Record that the fused call cannot run this plan; True when the caller should warn
        (the plan's first fallback)."""
        with self._lock:
            if self._fused_refusal is None:
                self._fused_refusal = err
            return self._warn_once()

    def fused_out_of_memory(self) -> bool:
        """The fused call's workspace (or reserve space) could not be allocated: run plain
        for a while; True when the caller should warn."""
        with self._lock:
            self._fused_backoff = next_backoff(self._fused_backoff)
            self._fused_skip = self._fused_backoff
            return self._warn_once()

    def fused_ran(self) -> None:
        if self._fused_backoff:
            with self._lock:
                self._fused_backoff = 0

    def fused_settled(self) -> bool:
        """Whether the fused call runs with no fallback state to count down or reset: no
        refusal, no memory back-off (Note [bound calls] in ops/cudnn/bound.py)."""
        return self._fused_refusal is None and not self._fused_skip and not self._fused_backoff

    def _backing_off(self) -> bool:
        """Counts down a memory back-off: True while this call should stay plain."""
        if not self._fused_skip:
            return False
        with self._lock:
            if self._fused_skip:
                self._fused_skip -= 1
                return True
            return False

    def _warn_once(self) -> bool:
        first = not self._fused_warned
        self._fused_warned = True
        return first
