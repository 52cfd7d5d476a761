"""Process-wide numerical and performance switches, read when a plan is built.

Defaults:
- allow_tf32 = True: float32 convolutions may use TF32 tensor cores (CUDNN_DEFAULT_MATH),
  as PyTorch allows for cuDNN convolutions by default. Set it False for full float32
  (CUDNN_FMA_MATH), e.g. when comparing against a float64 reference at 1e-5.
- deterministic = False: when True, only algorithms cuDNN reports as deterministic are used.
- benchmark = False: when True, plans autotune with cudnnFind*AlgorithmEx instead of the
  Get*_v7 heuristics (like torch.backends.cudnn.benchmark).
- workspace_limit = None: cap in bytes on a plan's workspace; None means what the pool gives.
- bias_grad = "cudnn": the bias-gradient path, "cudnn" (cudnnConvolutionBackwardBias) or
  "fused" (activation-backward + bias-gradient kernel); never a generic reduction. The
  default stays cuDNN's call until GPU benchmarks (benchmarks/) favour the fused kernel.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Flags:
    allow_tf32: bool = True
    deterministic: bool = False
    benchmark: bool = False
    workspace_limit: int | None = None
    bias_grad: str = "cudnn"


_BIAS_GRAD_PATHS = ("cudnn", "fused")
_lock = threading.Lock()
_current = Flags()


def get() -> Flags:
    """The flags in force now (an immutable snapshot: plans key on it)."""
    return _current


def _validated(flags: Flags) -> Flags:
    if flags.bias_grad not in _BIAS_GRAD_PATHS:
        raise ValueError(f"bias_grad must be one of {_BIAS_GRAD_PATHS}, got {flags.bias_grad!r}")
    if flags.workspace_limit is not None and flags.workspace_limit < 0:
        raise ValueError(f"workspace_limit must be >= 0 or None, got {flags.workspace_limit}")
    return flags


def set_flags(**changes: object) -> Flags:
    """Change flags for the whole process; returns the previous flags."""
    global _current
    known = {f.name for f in fields(Flags)}
    unknown = set(changes) - known
    if unknown:
        raise TypeError(f"unknown flag(s) {sorted(unknown)}; known: {sorted(known)}")
    with _lock:
        previous = _current
        _current = _validated(replace(_current, **changes))  # type: ignore[arg-type]
    return previous


@contextlib.contextmanager
def flags(**changes: object) -> Iterator[Flags]:
    """Temporarily change flags: `with convfuse.config.flags(allow_tf32=False): ...`."""
    global _current
    previous = set_flags(**changes)
    try:
        yield _current
    finally:
        with _lock:
            _current = previous
