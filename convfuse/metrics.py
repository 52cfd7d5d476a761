"""Running means of device scalars (loss, correct counts) without per-step host syncs."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from .backend import array_module, device_of, is_cupy
from .errors import CaptureError, DeviceMismatchError


class Mean:
    """Sum of values over sum of counts, accumulated where the values live.

    `add(value, count=1)` adds a 0-d NumPy/CuPy array (or a Python number) to a float64
    total on the value's device, and `count` to a count held beside it, by in-place
    device operations: no host sync, so it may run inside a captured CUDA graph, where
    each replay adds again (the first add, which creates the buffer, must come before the
    capture; CaptureError otherwise). `compute()` (or `float(acc)`) does the one host read.

    For a mean loss per batch: `add(loss)`; weighted by batch size: `add(loss * n, n)`;
    for accuracy: `add(loss_fn.correct, count=batch_size)`. `reset()` zeroes the totals in
    place, so a graph that captured `add` keeps adding into the same buffer.
    """

    def __init__(self) -> None:
        self._buffer: Any = None  # float64 [total, count] on the values' device
        self._total: Any = None  # views of _buffer, updated in place
        self._count: Any = None

    @property
    def device(self) -> str | None:
        """'cpu' or 'cuda' once something was added, else None."""
        return None if self._buffer is None else device_of(self._buffer)

    def add(self, value: Any, count: int = 1) -> None:
        """Add a 0-d array (or a host number) and its count; the first add picks the device.
        A refused value or count raises, naming Mean.add, with nothing added."""
        try:
            self._add(value, count)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"Mean.add: {exc}") from None

    def _add(self, value: Any, count: int) -> None:
        if isinstance(count, bool) or not isinstance(count, numbers.Integral):
            raise TypeError(f"count must be an int, got {type(count).__name__}")
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        # the float64 total and count take them: checked before either changes
        _fits_float64(count, "count")
        if _is_host_number(value):
            _fits_float64(value, "value")
            value = float(value)  # a kernel argument on the GPU: no transfer, no sync
            if self._buffer is None:
                self._init_buffer(np, None)
        else:
            _check_scalar_array(value)
            if self._buffer is None:
                self._init_buffer(array_module(value), value)
            else:
                array_module(self._buffer, value)  # DeviceMismatchError for NumPy + CuPy
        if is_cupy(self._buffer):  # pragma: gpu
            _add_on_gpu(self, value, int(count))
            return
        self._total += value
        self._count += int(count)

    def _init_buffer(self, xp: Any, value: Any) -> None:
        if xp is np:
            self._buffer = np.zeros(2, dtype=np.float64)
        else:  # pragma: gpu
            with value.device:
                if xp.cuda.get_current_stream().is_capturing():
                    # The zeroing would be recorded too, and reset the totals at every replay.
                    raise CaptureError(
                        "Mean.add() was first called while a CUDA graph was being captured: "
                        "creating its device buffer then would record the zeroing into the "
                        "graph and reset the totals at every replay. Add to it once before "
                        "capturing (convfuse.graph.capture's warm-up does, with warmup >= 1)"
                    )
                # CuPy's default pool, not the current allocator: that may be a capture's
                # private pool, whose blocks are freed with it, under a Mean that lives on.
                # The default pool lives as long as the process, and returning a block to
                # it is no cudaFree, so dropping a Mean costs no hidden device sync.
                with xp.cuda.using_allocator(xp.get_default_memory_pool().malloc):
                    self._buffer = xp.zeros(2, dtype=np.float64)
        # 1-element slices are views in NumPy and CuPy alike (NumPy's a[0] is a copy).
        self._total, self._count = self._buffer[0:1], self._buffer[1:2]

    def compute(self) -> float:
        """total / count, read from the device once."""
        if self._buffer is None:
            raise ValueError("Mean.compute(): nothing was added since the last reset()")
        total, count = (float(v) for v in _to_host(self._buffer))
        if count == 0:
            raise ValueError("Mean.compute(): the counts added since the last reset() sum to 0")
        return total / count

    def __float__(self) -> float:
        return self.compute()

    def reset(self) -> None:
        """Zero the totals in place (keeping the buffer that captured graphs write to)."""
        if self._buffer is not None:
            self._buffer.fill(0)

    def __repr__(self) -> str:
        return f"Mean(device={self.device!r})"


#: The same class under the name the training scripts of other libraries use.
Accumulator = Mean


def _is_host_number(value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError("value must be a number or a 0-d array, got a bool")
    return isinstance(value, numbers.Real)  # NumPy scalars included


def _check_scalar_array(value: Any) -> None:
    device_of(value)  # TypeError for anything but a NumPy or CuPy array
    if value.ndim != 0:
        raise ValueError(f"value must be 0-d (a loss or a count), got shape {tuple(value.shape)}")
    if value.dtype.kind not in "iuf" and value.dtype.name != "bfloat16":
        raise TypeError(f"value must be a real number, got dtype {value.dtype}")


def _add_on_gpu(acc: Mean, value: Any, count: int) -> None:  # pragma: gpu
    if is_cupy(value) and value.device.id != acc._buffer.device.id:
        raise DeviceMismatchError(
            f"Mean accumulates on GPU {acc._buffer.device.id}, got a value on GPU "
            f"{value.device.id}"
        )
    with acc._buffer.device:
        acc._total += value
        acc._count += count


def _to_host(buffer: Any) -> Any:
    return buffer.get() if is_cupy(buffer) else buffer


def _fits_float64(value: Any, name: str) -> None:
    try:
        float(value)
    except OverflowError:
        raise ValueError(f"{name} is too large for a float64 (an int of "
                         f"{len(str(abs(int(value))))} digits)") from None
