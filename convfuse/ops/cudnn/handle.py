"""What every cuDNN engine call needs besides its plan: a handle bound to the call's
stream, workspace from the call's allocator (device.py's ExecContext), and error messages
that name the call's shapes."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from ..._binding import cudnn
from ...backend import require_gpu
from ...errors import CudnnError
from ...plan.capture import refuse_in_capture
from .device import ExecContext, cupy_context

_local = threading.local()
# Every handle ever created, kept for the life of the process. cudnnDestroy synchronises
# the device (cudaDeviceSynchronize), and a thread-local handle would be destroyed when its
# worker thread ends, stalling every stream at an arbitrary point of the program. So a
# thread that ends gives its handles back to `_free`, and the next thread to need one on
# that device takes it there (PyTorch pools its cuDNN handles per device the same way):
# a program that starts a thread per request holds as many handles as it ever ran threads
# at once, not as many as it started.
_all_handles: list[Any] = []
_all_handles_lock = threading.Lock()
_free: dict[int, list[Any]] = {}


class _Bound(dict[int, list[Any]]):
    """A thread's {device: [handle, stream it holds]}; a dict subclass so that its end
    (with its thread's locals) can be watched (weakref.finalize)."""


def _give_back(owned: list[tuple[int, Any]]) -> None:
    with _all_handles_lock:
        for device, handle in owned:
            _free.setdefault(device, []).append(handle)


def get_handle(ctx: ExecContext | None = None) -> Any:
    """This thread's cuDNN handle for `ctx`'s device, bound to `ctx`'s stream (default:
    CuPy's current device and stream).

    One handle per (device, thread): cuDNN handles are not safe to share between threads
    that run concurrently, and a handle belongs to the device current at its creation
    (the engine's checks made `ctx.device` current). cudnnSetStream runs only when the
    call's stream differs from the one the handle holds: the handle is private to this
    module, so the stream it was last given is the one it has (Note [the pointer path]).
    """
    require_gpu("a cuDNN call")
    return _bound_handle(ctx if ctx is not None else cupy_context())  # pragma: gpu


def _bound_handle(ctx: ExecContext) -> Any:
    bound: dict[int, list[Any]] | None = getattr(_local, "bound", None)
    if bound is None:
        bound = _local.bound = _Bound()
        owned: list[tuple[int, Any]] = []
        _local.owned = owned
        # runs when the thread's locals go (the thread ended); not at exit
        weakref.finalize(bound, _give_back, owned).atexit = False
    entry = bound.get(ctx.device)
    if entry is None:
        with _all_handles_lock:
            pool = _free.get(ctx.device)
            handle = pool.pop() if pool else None
        if handle is None:
            # cudnnCreate allocates device memory, which a capture in torch's default
            # (global) mode refuses and is then invalidated: say so, and what to do
            refuse_in_capture("a cuDNN handle for this thread (its first cuDNN call)",
                              ctx.capture_stream)
            handle = cudnn().Handle()
            with _all_handles_lock:
                _all_handles.append(handle)
        _local.owned.append((ctx.device, handle))
        # a handle from the pool holds its last thread's stream: set it below
        entry = bound[ctx.device] = [handle, None]
    if entry[1] != ctx.stream_ptr:
        entry[0].setStream(ctx.stream_ptr)
        entry[1] = ctx.stream_ptr
    return entry[0]


class Workspace:
    """Device scratch memory for one call from `ctx`'s allocator; `ptr` is 0 for zero
    bytes. Freed when the object goes: both allocators order reuse on the call's stream."""

    __slots__ = ("mem", "ptr", "size")

    def __init__(self, nbytes: int, ctx: ExecContext) -> None:
        self.size = int(nbytes)
        self.mem = ctx.allocate(self.size) if self.size else None
        self.ptr = self.mem.ptr if self.mem is not None else 0


class context:  # lower case: used as a function, `with context(describe):`
    """Re-raise a CudnnError from the binding with `describe()` (shapes, dtype, algorithm).
    A class, not a generator context manager: it wraps calls on every step's path, where
    contextlib's generator costs several times as much."""

    __slots__ = ("describe",)

    def __init__(self, describe: Callable[[], str]) -> None:
        self.describe = describe

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: Any) -> None:
        if kind is not None and issubclass(kind, CudnnError):
            raise err.with_context(self.describe()) from None  # type: ignore[union-attr]
