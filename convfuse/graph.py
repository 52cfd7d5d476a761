"""Capture a whole training step as a CUDA graph and replay it with one launch.

Launch overhead dominates small shapes, so a step of forward, loss, backward and optimizer
update is recorded once and replayed. Rules the captured step must follow:
- it takes only the static input arrays and reads everything else from the layers and
  optimizer (whose parameters, gradients, lr and step count already live on the device);
- it does no device-to-host transfer (`float(loss)`, `.item()`, `.get()`, printing arrays):
  those are syncs, which capture forbids; accumulate metrics on the device instead;
- it calls no CuPy vendor-library wrapper (cuBLAS `@`/`matmul`, cuRAND, cuSOLVER,
  cuSPARSE): CuPy raises during capture (see FACTS). convfuse itself calls cuDNN through
  its own binding and its own kernels, so its layers, loss and optimizers are capturable.

Warm-up steps run eagerly before capture, on the capture stream, so plans, cuDNN handles,
algorithm choices, compiled kernels and optimizer buffers exist before recording. They are
real training steps. Memory allocated while capturing comes from a private pool that lives
as long as the returned `CapturedStep`: keep it alive as long as you use the step's outputs.
Only device-resident values can change between replays: the learning rate and step count
(and the inputs). Assign `lr` on the stream that calls the replays (CuPy's current one then,
as for the inputs): a replay is ordered after that stream's work, not after other streams'.
The returned CapturedStep keeps `step_fn` alive, and with it what the graph reads and
writes; a capture that runs out of device memory raises CaptureError. Hyperparameters
passed by value (momentum, betas, eps, weight decay, residual_scale) are fixed at capture;
capture again after changing them. A step whose graph holds an NCCL collective
(convfuse.distributed.allreduce_gradients) must be dropped, and collected, before
`torch.distributed.destroy_process_group()`: NCCL's teardown waits for every graph that
references its communicator to be destroyed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from .backend import is_cupy, require_gpu
from .errors import CaptureError


class CapturedStep:
    """A recorded step: call it with new inputs to copy them in and replay the graph. One
    thread at a time: the static inputs, the outputs and the ordering events are shared
    by every replay."""

    def __init__(self, graph: Any, stream: Any, pool: Any, inputs: list[Any], outputs: Any,
                 step_fn: Callable[..., Any]):
        self._graph, self._stream, self._pool = graph, stream, pool
        # a tuple: replacing a static input would free a buffer every replay reads
        self.static_inputs = tuple(inputs)
        self.outputs = outputs
        # The graph reads and writes what step_fn reaches (the layers' parameters, the
        # optimizer's flat buffers and state, metrics): held here, or a step captured in a
        # function that returns only this object would replay into freed memory.
        self._step_fn = step_fn
        self._events: tuple[Any, Any] | None = None  # made at the first replay

    def __call__(self, *inputs: Any) -> Any:
        # Every input is checked before the first is copied: a bad later input must not
        # leave earlier static buffers overwritten (and the step half-fed) behind its error.
        self._check(inputs)
        return self._replay(inputs)  # pragma: gpu

    def _check(self, inputs: tuple[Any, ...]) -> None:
        if len(inputs) not in (0, len(self.static_inputs)):
            raise TypeError(
                f"captured step takes {len(self.static_inputs)} inputs, got {len(inputs)}"
            )
        for i, (static, new) in enumerate(zip(self.static_inputs, inputs)):
            shape, dtype = getattr(new, "shape", None), getattr(new, "dtype", None)
            if shape is None or dtype is None:
                raise TypeError(f"captured step: input {i} must be a NumPy or CuPy array, "
                                f"got {type(new).__name__}")
            if tuple(shape) != tuple(static.shape) or dtype != static.dtype:
                raise ValueError(
                    f"input {i} has shape {tuple(shape)} and dtype {dtype}, but the "
                    f"step was captured with {tuple(static.shape)} and {static.dtype}"
                )

    def _replay(self, inputs: tuple[Any, ...]) -> Any:  # pragma: gpu
        import cupy

        if self._events is None:
            self._events = (_event(), _event())
        before, after = self._events
        caller = cupy.cuda.get_current_stream()
        # Order the replay after the caller's pending work (e.g. the copies that made the
        # inputs) and the caller's later work after the replay, without a host sync. An
        # event is reused across replays: a wait takes the record made before it.
        _wait(self._stream, caller, before)
        with self._stream:
            for static, new in zip(self.static_inputs, inputs):
                if is_cupy(new):
                    cupy.copyto(static, new)
                else:
                    static.set(new, stream=self._stream)
            self._graph.launch(self._stream)
        _wait(caller, self._stream, after)
        return self.outputs

    def synchronize(self) -> None:  # pragma: gpu
        self._stream.synchronize()


def capture(step_fn: Callable[..., Any], *example_inputs: Any, warmup: int = 1) -> CapturedStep:
    """Record `step_fn(*static_inputs)` as a CUDA graph (see the module notes for the rules).

    `example_inputs` (NumPy or CuPy arrays) are copied into static device buffers, which the
    returned callable refills at each replay. Its return value is `step_fn`'s outputs, whose
    device arrays are rewritten by each replay. A NumPy input is copied from pageable host
    memory, a copy the driver may make the host wait for (behind the previous replay);
    CuPy inputs keep a replay asynchronous.
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        # Plans, cuDNN handles, algorithm searches and kernel compilation cannot happen
        # inside a capture: at least one eager step must create them first.
        raise ValueError(f"warmup must be an int >= 1, got {warmup!r}")
    cp = require_gpu("convfuse.graph.capture")
    return _capture(cp, step_fn, example_inputs, warmup)  # pragma: gpu


def _event() -> Any:  # pragma: gpu
    import cupy

    return cupy.cuda.Event(block=False, disable_timing=True)


def _wait(stream: Any, on: Any, event: Any = None) -> None:  # pragma: gpu
    """Make `stream` wait for the work queued so far on `on` (device-side, no host sync),
    through `event` (a new one by default)."""
    event = event if event is not None else _event()
    event.record(on)
    stream.wait_event(event)


def _capture(  # pragma: gpu
    cp: Any, step_fn: Callable[..., Any], example_inputs: tuple, warmup: int
) -> CapturedStep:
    stream = cp.cuda.Stream(non_blocking=True)
    pool = cp.cuda.MemoryPool(allocator=_capture_malloc)
    caller = cp.cuda.get_current_stream()
    _wait(stream, caller)
    with stream:
        static = [cp.array(a, copy=True) for a in example_inputs]
        # Warm-up allocates from the ordinary pool: what it caches (metrics buffers, zero
        # biases, optimizer scratch) must outlive the graph, and only the capture's own
        # memory belongs to the private pool kept alive by the CapturedStep.
        for _ in range(warmup):
            step_fn(*static)
        stream.synchronize()
    # The capture allocates its step's temporaries again, from the private pool: hand the
    # warm-up's cached free blocks back first, or a step that fits eagerly could need twice
    # its temporary memory to be captured.
    cp.get_default_memory_pool().free_all_blocks()
    with cp.cuda.using_allocator(pool.malloc), stream:
        stream.begin_capture()
        try:
            outputs = step_fn(*static)
        except BaseException as exc:
            _abort_capture(stream)  # a KeyboardInterrupt too: the stream must not stay capturing
            if isinstance(exc, CaptureError) or not isinstance(exc, Exception):
                raise  # convfuse's own refusal says why already; an interrupt is no finding
            raise CaptureError(_explain(exc)) from exc
        try:
            graph = stream.end_capture()
        except Exception as exc:
            raise CaptureError(_explain(exc)) from exc
    _wait(caller, stream)
    return CapturedStep(graph, stream, pool, static, outputs, step_fn)


_CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation, what CuPy's pool retries on


def _capture_malloc(size: int) -> Any:  # pragma: gpu
    """The private pool's cudaMalloc. Out of memory raises CaptureError: CuPy's pool would
    answer the CUDARuntimeError by freeing its free blocks and trying again, and among them
    is memory the step freed earlier in this capture, whose addresses the recorded graph
    still writes (PyTorch's allocator has the same rule: never cudaFree a capture's
    memory before its replays)."""
    import cupy
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    try:
        return cupy.cuda.MemoryPointer(cupy.cuda.Memory(size), 0)
    except CUDARuntimeError as exc:
        if exc.status != _CUDA_ERROR_MEMORY_ALLOCATION:
            raise
        raise CaptureError(
            f"out of device memory while capturing the step ({size:,} bytes more were "
            f"needed: {exc}); free memory before capturing, or capture a smaller step"
        ) from exc


def _abort_capture(stream: Any) -> None:  # pragma: gpu
    # The capture may already be invalidated; either way the stream is usable again after.
    with contextlib.suppress(Exception):
        stream.end_capture()


def _explain(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    hints = []
    low = text.lower()
    capture_words = ("unsupported", "not permitted", "invalidated", "disallowed")
    # "captur": CuPy's refusal of a host read says "the current stream is capturing, so D2H
    # transfers are disallowed" (cupy/cuda/memory.pyx), the case this hint is for
    if "captur" in low and any(word in low for word in capture_words):
        hints.append(
            "the step did something a CUDA graph cannot record, most often a device-to-host "
            "sync (float(loss), .item(), .get(), printing an array); keep metrics on the device"
        )
    if any(lib in low for lib in ("cublas", "curand", "cusolver", "cusparse")):
        hints.append(
            "CuPy's vendor-library wrappers (matmul/@, random, linalg) raise during capture; "
            "use convfuse layers (Linear runs through cuDNN) and pre-generated random data"
        )
    hint = "; ".join(hints) or "see convfuse.graph's module notes for what a step may do"
    return f"the training step could not be captured as a CUDA graph ({text}). Why: {hint}"
