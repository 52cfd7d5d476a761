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
import functools
import threading
from collections.abc import Callable
from typing import Any


class _GradState(threading.local):
    # a class default, not getattr(local, name, True): a thread that never set the mode
    # reads it without the AttributeError a default costs (~0.4 us at every forward)
    enabled = True


_state = _GradState()


def is_grad_enabled() -> bool:
    """Whether native layers' forwards keep a context for a backward (this thread)."""
    return _state.enabled


def _set(mode: Any, what: str) -> bool:
    if not isinstance(mode, bool):
        raise TypeError(f"{what}: mode must be a bool, got {type(mode).__name__} {mode!r}")
    previous = _state.enabled
    _state.enabled = mode
    return previous


def _push(mode: bool) -> None:
    """Enter a block: the mode before it goes on this thread's stack (not on the block
    object, which a recursive decorated function or another thread enters again)."""
    saved = _state.__dict__.setdefault("saved", [])
    saved.append(_state.enabled)
    _state.enabled = mode


def _pop() -> None:
    _state.enabled = _state.saved.pop()


class set_grad_enabled:
    """Set grad mode now, as torch.set_grad_enabled: called alone it stays set; as a
    context manager it is restored on exit; as a decorator it applies at every call."""

    def __init__(self, mode: bool) -> None:
        self._mode = mode
        self._previous = _set(mode, "set_grad_enabled")

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        _state.enabled = self._previous

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:
        _state.enabled = self._previous  # a decorator changes nothing until a call
        mode = self._mode

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            _push(mode)
            try:
                return func(*args, **kwargs)
            finally:
                _pop()

        return wrapper


class _Mode(contextlib.ContextDecorator):
    _mode: bool

    def __new__(cls, func: Callable[..., Any] | None = None) -> Any:
        # `@no_grad` without parentheses, as torch takes it
        if func is not None:
            return cls()(func)
        return super().__new__(cls)

    def __enter__(self) -> None:
        _push(self._mode)

    def __exit__(self, *exc: object) -> None:
        _pop()


class no_grad(_Mode):
    """Forwards inside keep no context for a backward: `with convfuse.no_grad():`,
    `@convfuse.no_grad()` or `@convfuse.no_grad`, as torch.no_grad."""

    _mode = False


class enable_grad(_Mode):
    """Forwards inside keep their context, also within `no_grad()`, as torch.enable_grad."""

    _mode = True
