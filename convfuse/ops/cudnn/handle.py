"""What every cuDNN engine call needs besides its plan: a handle bound to the current
stream, workspace from CuPy's pool, and error messages that name the call's shapes."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..._binding import cudnn
from ...backend import require_gpu
from ...errors import CudnnError

_local = threading.local()
# Every handle ever created, kept for the life of the process. cudnnDestroy synchronises
# the device (cudaDeviceSynchronize), and a thread-local handle would be destroyed when its
# worker thread ends, stalling every stream at an arbitrary point of the program. A handle
# per (device, thread) is small; a thread pool reuses its threads.
_all_handles: list[Any] = []
_all_handles_lock = threading.Lock()


def get_handle() -> Any:
    """This thread's cuDNN handle for the current device, bound to the current stream.

    One handle per (device, thread): cuDNN handles are not safe to share between threads
    that run concurrently, and a handle belongs to the device current at its creation.
    The stream is re-bound at every call because CuPy's current stream can change between
    calls (`with stream:` blocks, graph capture).
    """
    cp = require_gpu("a cuDNN call")
    return _bound_handle(cp)  # pragma: gpu


def _bound_handle(cp: Any) -> Any:  # pragma: gpu
    handles: dict[int, Any] | None = getattr(_local, "handles", None)
    if handles is None:
        handles = _local.handles = {}
    device = int(cp.cuda.runtime.getDevice())
    handle = handles.get(device)
    if handle is None:
        handle = cudnn().Handle()
        handles[device] = handle
        with _all_handles_lock:
            _all_handles.append(handle)
    handle.setStream(cp.cuda.get_current_stream().ptr)
    return handle


class Workspace:
    """Device scratch memory from CuPy's pool for one call; `ptr` is 0 for zero bytes."""

    __slots__ = ("mem", "ptr", "size")

    def __init__(self, nbytes: int) -> None:  # pragma: gpu
        import cupy

        self.size = int(nbytes)
        self.mem = cupy.cuda.alloc(self.size) if self.size else None
        self.ptr = self.mem.ptr if self.mem is not None else 0


@contextlib.contextmanager
def context(describe: Callable[[], str]) -> Iterator[None]:
    """Re-raise a CudnnError from the binding with `describe()` (shapes, dtype, algorithm)."""
    try:
        yield
    except CudnnError as err:
        raise err.with_context(describe()) from None
