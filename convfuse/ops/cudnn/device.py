"""What the cuDNN engine runs on: arrays that are device pointers, and the stream and
allocator of one call.

Note [the pointer path]
The engine reads five things of an array: `.data.ptr`, `.shape`, `.dtype`, `.size` and
`.device.id` (the ops' checks add `.flags.c_contiguous` and `.nbytes`). A CuPy ndarray
has them; so does `DeviceArray`, a view of C-contiguous device memory that a caller owns
(a torch tensor, say), built with no DLPack exchange and no CuPy object. Every engine
call takes its `ExecContext` from its first array (`context_of`): a DeviceArray carries
the context of its caller (stream pointer, device, an allocator of the caller's), a CuPy
array gets `cupy_context()`, CuPy's current device, stream and allocator (its pool, or a
capture's private pool), cached per (device, stream). So both kinds of array run the same
engine code: handles are bound to `ctx.stream_ptr` (only when it differs from the stream
the handle holds, handle.py), workspace and scratch come from `ctx.allocate`, outputs
from `ctx.empty`, and convfuse's kernels are launched on `ctx.stream`
(ops/elementwise.py). No context manager, no thread-local state and no conversion is
entered per call on this path.

What the pointer path cannot serve, because it needs CuPy array arithmetic, runs through
`on_cupy`: the DeviceArrays become CuPy views inside `ctx.cupy_scope()` (the caller's
device, stream and allocator made CuPy's current ones), the CuPy engine code runs, and
CuPy results come back as DeviceArrays (`ctx.adopt`, inside the scope: a torch caller
takes them over as tensors there, on one stream). That is: float64
channels-last convolutions (layout.py's copies, Note [float64 runs channels-first]), a
windowed transposed convolution (its crop or zero-fill), explicit padding (pad.py),
batch normalization in inference and its evaluation-mode backward (CuPy arithmetic on
the statistics), and an op's own arithmetic on an output (`DeviceArray.fill` and `*=`, an
empty batch's gradient in ops/conv_transpose.py).

Choosing a plan's algorithm (once per plan and direction) probes workspace and, with
config.benchmark, runs Find*Ex with memory from `ctx.choice_allocator`: the caller's
allocator on the pointer path. Not on it, by design: the cached constants come from CuPy's
default pool (constants.py), and an empty batch of a transposed convolution returns CuPy
arrays made by the op itself (ops/conv_transpose.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ... import backend
from ...dtypes import canonical


class DeviceRef:
    """What the engine asks of a device: its id (CuPy's `ndarray.device.id`)."""

    __slots__ = ("id",)

    def __init__(self, device_id: int) -> None:
        self.id = int(device_id)


class StreamRef:
    """A stream as CuPy's kernel launch reads it: `stream.ptr` (Function.__call__'s
    `stream=` argument, cupy/cuda/function.pyx `_get_stream` in CuPy 14.2)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = int(ptr)


class _Flags:
    __slots__ = ()
    c_contiguous = True
    writeable = True


_C_CONTIGUOUS = _Flags()


class DeviceArray:
    """A C-contiguous array in device memory owned by `owner` (kept alive by this view),
    with the ExecContext of the call that made it (Note [the pointer path]).

    `data` is the array itself, so `a.data.ptr` reads as it does for a CuPy array."""

    __slots__ = ("ctx", "dtype", "owner", "ptr", "shape")

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype, ctx: ExecContext,
                 owner: Any) -> None:
        self.ptr = ptr
        self.shape = shape
        self.dtype = dtype
        self.ctx = ctx
        self.owner = owner

    @property
    def data(self) -> DeviceArray:
        return self

    @property
    def device(self) -> DeviceRef:
        return self.ctx.device_ref

    @property
    def flags(self) -> _Flags:
        return _C_CONTIGUOUS

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return int(self.dtype.itemsize)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def strides(self) -> tuple[int, ...]:
        out, step = [], self.itemsize
        for s in reversed(self.shape):
            out.append(step)
            step *= max(int(s), 1)
        return tuple(reversed(out))

    # The ops' own CuPy arithmetic on an output (an empty batch's zero or scaled gradient,
    # ops/_checks.py `zero_filled`): a CuPy kernel on the caller's stream.
    def fill(self, value: Any) -> None:
        on_cupy(lambda a: a.fill(value), self)

    def __imul__(self, value: Any) -> DeviceArray:
        on_cupy(lambda a: a.__imul__(value), self)
        return self

    def __repr__(self) -> str:
        return (f"DeviceArray(ptr={self.ptr:#x}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, device={self.ctx.device}, stream={self.ctx.stream_ptr:#x})")


class ExecContext:
    """Where one engine call runs: a device, a stream, and an allocator whose blocks the
    caller's memory system owns. Subclasses supply `allocate`, `empty` and `cupy_scope`."""

    __slots__ = ("device", "device_ref", "stream", "stream_ptr")

    def __init__(self, device: int, stream_ptr: int) -> None:
        self.device = int(device)
        self.device_ref = DeviceRef(device)
        self.stream_ptr = int(stream_ptr)
        self.stream = StreamRef(stream_ptr)

    def allocate(self, nbytes: int) -> Any:
        """`nbytes` of device memory usable on this stream (an object with `.ptr` that owns
        it); CuPy's OutOfMemoryError (a MemoryError) when there is none."""
        raise NotImplementedError

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A new C-contiguous array for an output."""
        raise NotImplementedError

    def cupy_scope(self) -> contextlib.AbstractContextManager[Any]:
        """CuPy's current device, stream and allocator made this context's, for `on_cupy`."""
        raise NotImplementedError

    @property
    def capture_stream(self) -> int | None:
        """The stream plan/capture.py asks about: this one (None: CuPy's current one)."""
        return self.stream_ptr

    @property
    def choice_allocator(self) -> Callable[[int], Any] | None:
        """What a plan's algorithm choice allocates trial and Find*Ex memory with
        (ConvPlan.choice; None: its default, CuPy's current allocator)."""
        return self.allocate

    def is_capturing(self) -> bool:
        """Whether this call's stream is recording a CUDA graph."""
        from ...plan import capture

        ptr = self.capture_stream
        return capture.stream_is_capturing() if ptr is None else \
            capture.stream_is_capturing(ptr)

    def adopt(self, a: Any) -> DeviceArray:
        """A CuPy result of `on_cupy` (C-contiguous, made inside `cupy_scope`) as a
        DeviceArray; called inside that scope."""
        return DeviceArray(int(a.data.ptr), tuple(a.shape), canonical(a.dtype), self, a)

    def copy(self, a: Any) -> Any:
        """A new array holding a copy of `a` (one device-to-device copy on the stream)."""
        import cupy

        out = self.empty(tuple(a.shape), a.dtype)
        if a.size:
            cupy.cuda.runtime.memcpyAsync(out.data.ptr, a.data.ptr, a.size * a.dtype.itemsize,
                                          cupy.cuda.runtime.memcpyDeviceToDevice,
                                          self.stream_ptr)
        return out


class CupyContext(ExecContext):
    """CuPy's current device and stream, allocating from CuPy's current allocator."""

    __slots__ = ()

    def allocate(self, nbytes: int) -> Any:
        import cupy

        return cupy.cuda.alloc(nbytes)

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        import cupy

        return cupy.empty(shape, dtype=dtype)

    def cupy_scope(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    @property
    def capture_stream(self) -> int | None:
        return None  # CuPy's current stream is this context's by construction

    @property
    def choice_allocator(self) -> Callable[[int], Any] | None:
        return None  # plan/conv.py's pool_alloc: CuPy's current allocator, as ever

    def copy(self, a: Any) -> Any:
        return a.copy()


backend.register_device_array_type(DeviceArray)

#: Contexts kept per (device, stream) before the cache starts over (a context is a few
#: small objects; a dropped one is only rebuilt).
MAX_CONTEXTS = 256
_cupy_contexts: dict[tuple[int, int], CupyContext] = {}
_cupy_contexts_lock = threading.Lock()


def cupy_context() -> CupyContext:
    """The context of CuPy's current device and stream (one object per pair)."""
    import cupy

    key = (int(cupy.cuda.runtime.getDevice()), int(cupy.cuda.get_current_stream().ptr))
    ctx = _cupy_contexts.get(key)
    if ctx is None:
        with _cupy_contexts_lock:
            if len(_cupy_contexts) >= MAX_CONTEXTS:  # streams made and dropped in a loop
                _cupy_contexts.clear()
            ctx = _cupy_contexts.setdefault(key, CupyContext(*key))
    return ctx


def context_of(a: Any) -> ExecContext:
    """The ExecContext an engine call on `a` runs in (Note [the pointer path])."""
    if type(a) is DeviceArray:
        return a.ctx
    return cupy_context()


def is_device_array(*arrays: Any) -> bool:
    """Whether any of `arrays` is a DeviceArray (the call came by the pointer path)."""
    return any(type(a) is DeviceArray for a in arrays)


def on_cupy(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) with every DeviceArray among `args` (also inside tuples) seen as a CuPy
    view, inside its context's `cupy_scope()`; CuPy arrays in the result come back as
    DeviceArrays (`ctx.adopt`; the very views passed in as themselves, one DeviceArray per
    CuPy array). The fallback of Note [the pointer path] for engine code that needs CuPy
    array arithmetic."""
    ctx = next(_device_arrays(args)).ctx
    views: dict[int, tuple[DeviceArray, Any]] = {}  # the views stay alive: ids stay theirs
    with ctx.cupy_scope():
        result = fn(*_map(args, lambda a: _as_cupy(a, views)))
        return _map(result, lambda a: _from_cupy(a, views, ctx))


def _device_arrays(obj: Any) -> Iterator[DeviceArray]:
    if type(obj) is DeviceArray:
        yield obj
    elif isinstance(obj, tuple):
        for item in obj:
            yield from _device_arrays(item)


def _map(obj: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(obj, tuple):
        items = [_map(item, fn) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)  # NamedTuple
    return fn(obj)


def _as_cupy(a: Any, views: dict[int, tuple[DeviceArray, Any]]) -> Any:
    if type(a) is not DeviceArray:
        return a
    import cupy

    mem = cupy.cuda.UnownedMemory(a.ptr, a.nbytes, a, a.ctx.device)
    view = cupy.ndarray(tuple(a.shape), a.dtype, cupy.cuda.MemoryPointer(mem, 0))
    views[id(view)] = (a, view)
    return view


def _from_cupy(a: Any, views: dict[int, tuple[DeviceArray, Any]], ctx: ExecContext) -> Any:
    cp = backend.cupy_module()
    if cp is None or not isinstance(a, cp.ndarray):
        return a
    known = views.get(id(a))
    if known is None:
        known = views[id(a)] = (ctx.adopt(a), a)
    return known[0]
