"""What a ConvPlan has chosen: one direction's ranked algorithms, with the out-of-memory
back-off, and the forward path (fused or unfused) with the reason for it."""

from __future__ import annotations

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
    plan that really lacks the memory pays a failed allocation rarely. Algorithms cuDNN
    refused to run are removed from `ranked` for good: a refusal does not change.
    """

    ranked: tuple[Candidate, ...]
    index: int
    forced: bool
    retry_in: int = 0  # calls until the best is tried again; 0: not demoted by memory
    backoff: int = 0

    @property
    def candidate(self) -> Candidate:
        return self.ranked[self.index]

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

