"""Process-wide numerical and performance switches, read when a plan is built.

Each flag is an attribute of this module, read and assigned as PyTorch's
`torch.backends.cudnn.benchmark`: `convfuse.config.allow_tf32 = False`. Assignments are
validated (a wrong type or value raises TypeError/ValueError) and take effect at once:
plans key on the snapshot `config.get()`, so the next call builds (or finds) a plan for
the new flags. Assigning any other public name raises AttributeError. `set_flags(**kw)`
and the scoped `with config.flags(**kw):` do the same for several flags at once.

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
- max_array_bytes = None: the largest single array (parameter or layer output) convfuse
  allocates; larger ones raise ArrayTooLargeError before allocating. None: the device's
  total memory (convfuse/_memory.py).
"""

from __future__ import annotations

import contextlib
import numbers
import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class Flags:
    allow_tf32: bool = True
    deterministic: bool = False
    benchmark: bool = False
    workspace_limit: int | None = None
    bias_grad: str = "cudnn"
    max_array_bytes: int | None = None


_BIAS_GRAD_PATHS = ("cudnn", "fused")
_BOOLS = ("allow_tf32", "deterministic", "benchmark")
_SIZES = ("workspace_limit", "max_array_bytes")
_lock = threading.Lock()
_current = Flags()


def get() -> Flags:
    """The flags in force now (an immutable snapshot: plans key on it)."""
    return _current


def _checked(name: str, value: Any) -> Any:
    """One flag's value, normalised (NumPy bools/ints to Python ones), or a typed error."""
    if name in _BOOLS:
        if type(value).__name__ not in ("bool", "bool_"):
            raise TypeError(f"config.{name} must be a bool, got {type(value).__name__} "
                            f"{value!r}")
        return bool(value)
    if name in _SIZES:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"config.{name} must be an int (bytes) or None, got "
                            f"{type(value).__name__} {value!r}")
        if int(value) < 0:
            raise ValueError(f"config.{name} must be >= 0 or None, got {value}")
        return int(value)
    if name == "bias_grad":
        if not isinstance(value, str) or value not in _BIAS_GRAD_PATHS:
            raise ValueError(f"config.bias_grad must be one of {_BIAS_GRAD_PATHS}, "
                             f"got {value!r}")
        return value
    raise AssertionError(name)  # pragma: no cover - every Flags field is handled above


def set_flags(**changes: object) -> Flags:
    """Change flags for the whole process; returns the previous flags."""
    global _current
    known = {f.name for f in fields(Flags)}
    unknown = set(changes) - known
    if unknown:
        raise TypeError(f"unknown flag(s) {sorted(unknown)}; known: {sorted(known)}")
    checked = {k: _checked(k, v) for k, v in changes.items()}
    with _lock:
        previous = _current
        _current = replace(_current, **checked)
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


_FLAG_NAMES = frozenset(f.name for f in fields(Flags))


class _ConfigModule(types.ModuleType):
    """This module's class: flags read and assigned as attributes."""

    def __getattr__(self, name: str) -> Any:
        if name in _FLAG_NAMES:
            return getattr(_current, name)
        raise AttributeError(f"module 'convfuse.config' has no attribute {name!r}; "
                             f"flags: {sorted(_FLAG_NAMES)}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FLAG_NAMES:
            set_flags(**{name: value})
        elif name.startswith("_") or name in self.__dict__:
            super().__setattr__(name, value)  # module internals (and test monkeypatching)
        else:
            raise AttributeError(f"convfuse.config has no flag {name!r}; "
                                 f"flags: {sorted(_FLAG_NAMES)}")

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | _FLAG_NAMES)


sys.modules[__name__].__class__ = _ConfigModule
