"""Grad mode for convfuse's own layers, as torch's: `with convfuse.no_grad(): y = model(x)`.

A native layer keeps its forward's context (its input, a saved output, on the CPU its
im2col columns) on itself until its backward, because the backward is the layer's own
call. In inference nothing ever reads it, and a model in eval mode would hold about a
training step's activations between calls. Under `no_grad()` forwards keep nothing (a
backward then raises BackwardBeforeForwardError saying why), and a batch norm in eval mode
skips the statistics only a backward reads. The mode is per thread, as torch's; it does
not touch torch's own grad mode, which `convfuse.torch` layers follow.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any


class _GradState(threading.local):
    # a class default, not getattr(local, name, True): a thread that never set the mode
    # reads it without the AttributeError a default costs (~0.3 us at every forward)
    enabled = True


_state = _GradState()


def is_grad_enabled() -> bool:
    """Whether native layers' forwards keep a context for a backward (this thread)."""
    return _state.enabled


def _set(mode: Any, what: str) -> bool:
    if not isinstance(mode, bool):
        raise TypeError(f"{what}: mode must be a bool, got {type(mode).__name__} {mode!r}")
    previous = is_grad_enabled()
    _state.enabled = mode
    return previous


class set_grad_enabled:
    """Set grad mode now, as torch.set_grad_enabled: called alone it stays set; as a
    context manager it is restored on exit."""

    def __init__(self, mode: bool) -> None:
        self._previous = _set(mode, "set_grad_enabled")

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        _state.enabled = self._previous


class no_grad(contextlib.ContextDecorator):
    """Forwards inside keep no context for a backward: `with convfuse.no_grad():` or
    `@convfuse.no_grad()`, as torch.no_grad."""

    def __enter__(self) -> None:
        self._previous = _set(False, "no_grad")

    def __exit__(self, *exc: object) -> None:
        _state.enabled = self._previous


class enable_grad(contextlib.ContextDecorator):
    """Forwards inside keep their context, also within `no_grad()`, as torch.enable_grad."""

    def __enter__(self) -> None:
        self._previous = _set(True, "enable_grad")

    def __exit__(self, *exc: object) -> None:
        _state.enabled = self._previous
