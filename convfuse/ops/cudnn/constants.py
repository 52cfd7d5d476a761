"""Cached device constants (the fused call's zero bias, BatchNorm's ones and zeros for
affine=False), filled once and read by calls on any stream.

Note [cached constants across streams]
A constant is filled on the stream current at its first use, and later read by calls on
other streams: a torch side stream, convfuse.graph's capture stream, another thread's
stream. CUDA orders work only within one stream, so a reader on another stream could run
before the fill. So each constant records an event right after its fill, and every call
that reads it makes its own stream wait on that event first (cudaStreamWaitEvent: the
device orders the two, the host does not wait), until the host has seen the event
complete (cudaEventQuery, which does not block); from then on the fill is in the past for
every stream and no wait is needed. Inside a CUDA graph capture the wait is recorded with
cudaEventWaitExternal: waiting on an event recorded outside the capture is invalid
otherwise (CUDA Programming Guide, "Cross-stream Dependencies and Events"; PyTorch's
torch.cuda.Event(external=True) waits the same way), and the replays then wait on an
event long completed, at no cost. cudaEventQuery is not called while capturing: global
capture mode (torch.cuda.graph, scripts/count_syncs.py's probe) forbids it. The fill
itself cannot happen in a capture (the zeroing would be recorded, not run): Note [no plan
work inside a capture].

The arrays come from CuPy's default pool, never the current allocator: that may be a
capture's private pool, which frees its blocks when it goes, under the cache. The default
pool lives as long as the process, and the cache never frees into it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

from ...plan import capture
from .device import ExecContext

#: cudaEventWaitExternal (driver_types.h): a wait recorded into a graph as an external
#: event node.
EVENT_WAIT_EXTERNAL = 0x01
# Every event a capture recorded a wait on: an instantiated graph's external wait node
# refers to the event itself, which must outlive every graph (no CUDA call says when the
# last one is gone), while its DeviceConstant may not (an optimizer's, replaced at each
# lr assignment). One event per constant, at most, ever lands here.
_WAITED_IN_CAPTURE: list[Any] = []


class DeviceConstant:
    """Arrays filled on one stream, with the event that marks the end of the fill."""

    __slots__ = ("arrays", "complete", "event", "kept")

    def __init__(self, arrays: tuple[Any, ...], event: Any) -> None:
        self.arrays = arrays
        self.event = event
        self.complete = False  # the host has seen the fill finish
        self.kept = False  # the event is in _WAITED_IN_CAPTURE

    def ordered(self, cp: Any, ctx: ExecContext) -> tuple[Any, ...]:  # pragma: gpu
        """The arrays, with the call's stream made to wait for their fill when it may
        still be running (Note [cached constants across streams])."""
        if not self.complete:
            stream_ptr = ctx.stream_ptr
            if ctx.is_capturing():
                cp.cuda.runtime.streamWaitEvent(stream_ptr, self.event.ptr, EVENT_WAIT_EXTERNAL)
                if not self.kept:
                    self.kept = True
                    _WAITED_IN_CAPTURE.append(self.event)
            elif self.event.done:
                self.complete = True
            else:
                cp.cuda.runtime.streamWaitEvent(stream_ptr, self.event.ptr, 0)
        return self.arrays


def cached(cp: Any, cache: dict[Any, DeviceConstant], lock: threading.Lock,
           key: Hashable, what: str, make: Callable[[], tuple[Any, ...]], ctx: ExecContext,
           ) -> tuple[Any, ...]:  # pragma: gpu
    """cache[key]'s arrays, made by `make()` on first use (`what` names them if that is
    inside a capture), and ready for the call's stream (`ctx`'s). The fill runs on
    CuPy's current stream, which the event orders for every other."""
    with lock:
        item = cache.get(key)
        if item is None:
            capture.refuse_in_capture(what, ctx.capture_stream)
            with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
                arrays = make()
            event = cp.cuda.Event(block=False, disable_timing=True)
            event.record()  # on the current stream, after the fill
            item = cache[key] = DeviceConstant(arrays, event)
    return item.ordered(cp, ctx)
