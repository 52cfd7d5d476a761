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
from collections.abc import Callable, Iterator
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
# Note [a framework's switches]
# convfuse.torch is a drop-in for torch.nn, so PyTorch's own cuDNN switches must hold for
# its layers as they hold for torch.nn's: torch.backends.cudnn's TF32 precision for
# convolutions, deterministic and benchmark, and torch.use_deterministic_algorithms. The
# bridge hands them here (`constrain`, only when they change) and they combine with
# convfuse's own flags, each side able to ask for the safer choice: TF32 only where both
# allow it, deterministic algorithms or autotuning where either asks. `get()` is that
# combination (the flags themselves when the framework adds nothing); reading a flag
# (`config.allow_tf32`) gives convfuse's own setting, as assigning one sets it. The
# combination is process-wide, as both sides' switches are: the framework registers a
# `source` that reads its switches and calls `constrain` where they changed, and every
# GPU op asks it first (`refresh`, from the ops' engine choice and the bridge's CUDA
# calls), so a switch flipped between calls holds from the next call on, through either
# API.
_framework: tuple[bool, bool, bool] | None = None  # (allow_tf32, deterministic, benchmark)
_source: Callable[[], None] | None = None
_effective = _current
# one object per combined setting, so flipping a switch back finds the snapshot it had
_combinations: dict[Flags, Flags] = {}


def get() -> Flags:
    """The flags in force now (an immutable snapshot: plans key on it): convfuse's own,
    combined with a framework's switches (Note [a framework's switches])."""
    return _effective


def _combine() -> None:
    """Recompute `_effective` (under _lock): a new object only when the framework changes
    something, so that plans and bound calls see one snapshot per setting."""
    global _effective
    own, framework = _current, _framework
    if framework is None:
        _effective = own
        return
    tf32, deterministic, benchmark = framework
    combined = replace(own, allow_tf32=own.allow_tf32 and tf32,
                       deterministic=own.deterministic or deterministic,
                       benchmark=own.benchmark or benchmark)
    if combined == own:
        _effective = own
        return
    if len(_combinations) > 64:  # settings flipped back and forth without end
        _combinations.clear()
    _effective = _combinations.setdefault(combined, combined)


def set_source(source: Callable[[], None] | None) -> None:
    """Register what `refresh` runs: a framework's reader of its switches, which calls
    `constrain` where they changed (None: no framework; its constraint is dropped)."""
    global _source, _framework
    if source is not None and not callable(source):
        raise TypeError(f"config.set_source: source must be callable or None, got "
                        f"{type(source).__name__} {source!r}")
    with _lock:
        _source = source
        if source is None:
            _framework = None
            _combine()


def refresh() -> None:
    """Bring a registered framework's switches up to date (a GPU op's first step)."""
    source = _source
    if source is not None:
        source()


def constrain(allow_tf32: bool, deterministic: bool, benchmark: bool) -> None:
    """A framework's switches, combined with convfuse's own flags from now on (Note [a
    framework's switches]): TF32 only where both allow it, deterministic algorithms and
    autotuning where either asks. convfuse.torch calls it with PyTorch's."""
    global _framework
    switches = {"allow_tf32": allow_tf32, "deterministic": deterministic,
                "benchmark": benchmark}
    for name, value in switches.items():
        if type(value).__name__ not in ("bool", "bool_"):
            raise TypeError(f"config.constrain: {name} must be a bool, got "
                            f"{type(value).__name__} {value!r}")
    with _lock:
        _framework = (bool(allow_tf32), bool(deterministic), bool(benchmark))
        _combine()


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
    checked = _checked_changes(changes)
    with _lock:
        previous = _current
        _current = replace(_current, **checked)
        _combine()
    return previous


def _checked_changes(changes: dict[str, object]) -> dict[str, Any]:
    known = {f.name for f in fields(Flags)}
    unknown = set(changes) - known
    if unknown:
        raise TypeError(f"unknown flag(s) {sorted(unknown)}; known: {sorted(known)}")
    return {k: _checked(k, v) for k, v in changes.items()}


# Note [overlapping flags blocks]
# The flags are process-wide, and `flags()` blocks on several threads may overlap without
# nesting: A sets allow_tf32=False, B enters and sets False, A exits, B exits. Restoring
# what each block saw on entry would leave False for good (B saw A's value). So each flag
# a block changes keeps a stack of the open blocks' values over the value it had before
# the first of them: a block's exit removes its own entry and puts back the latest still
# open block's value, or, the last one out, that first value.
_open: dict[str, list[tuple[object, Any]]] = {}  # flag -> [(block, value)], oldest first
_before_open: dict[str, Any] = {}  # flag -> its value before the first open block


@contextlib.contextmanager
def flags(**changes: object) -> Iterator[Flags]:
    """Temporarily change flags: `with convfuse.config.flags(allow_tf32=False): ...`;
    yields convfuse's own flags (config.get() is what is in force: Note [a framework's
    switches]). The flags are process-wide; blocks on several threads may overlap (Note
    [overlapping flags blocks])."""
    global _current
    block = object()
    checked = _checked_changes(changes)
    with _lock:
        for k, v in checked.items():
            stack = _open.setdefault(k, [])
            if not stack:
                _before_open[k] = getattr(_current, k)
            stack.append((block, v))
        _current = replace(_current, **checked)
        _combine()
    try:
        yield _current
    finally:
        # only the flags this block changed: one assigned inside it, or by another thread
        # meanwhile, stays as it was set
        with _lock:
            restore: dict[str, Any] = {}
            for k in checked:
                stack = _open[k]
                stack[:] = [e for e in stack if e[0] is not block]
                restore[k] = stack[-1][1] if stack else _before_open.pop(k)
            _current = replace(_current, **restore)
            _combine()


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
