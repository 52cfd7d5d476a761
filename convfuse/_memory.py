"""The memory-bomb rule: refuse, before allocating, one array that cannot fit.

An array larger than `convfuse.config.max_array_bytes` is refused with `ArrayTooLargeError`
stating the bytes needed. The default limit (None) is the device's total memory: physical
RAM on the CPU, the GPU's total memory on CUDA. Layers check their parameters at
construction and their outputs once per input shape (when the geometry is built), so the
check costs nothing per call. On the CPU a convolution also checks the reference engine's
largest temporaries: for stride 1 the padded flat input and the result at every output
position (ops/reference/conv_flat.py), otherwise the im2col buffer (C * prod(kernel) * N *
prod(output spatial) elements in the compute dtype).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import config
from .errors import ArrayTooLargeError


@functools.cache
def _host_total() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 62


@functools.cache
def _gpu_total(device_id: int) -> int:  # pragma: gpu
    import cupy

    with cupy.cuda.Device(device_id):
        return int(cupy.cuda.runtime.memGetInfo()[1])


def limit(device: str) -> int:
    """The largest array, in bytes, convfuse allocates on `device` ('cpu' or 'cuda')."""
    cap = config.get().max_array_bytes
    if cap is not None:
        return int(cap)
    if device == "cuda":  # pragma: gpu
        import cupy

        return _gpu_total(int(cupy.cuda.runtime.getDevice()))
    return _host_total()


def nbytes(shape: Sequence[int], dtype: Any) -> int:
    return math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize


def check_bytes(shape: Sequence[int], dtype: Any, device: str, what: str) -> None:
    """Raise ArrayTooLargeError when an array of `shape` and `dtype` exceeds the limit."""
    need = nbytes(shape, dtype)
    cap = limit(device)
    if need > cap:
        raise ArrayTooLargeError(
            f"{what} of shape {tuple(int(d) for d in shape)} ({np.dtype(dtype)}) needs "
            f"{need:,} bytes ({need / 2**30:.1f} GiB), more than the {cap:,} bytes "
            f"({cap / 2**30:.1f} GiB) allowed on {device} (convfuse.config.max_array_bytes; "
            "default: the device's total memory)"
        )


def check_conv(geom: Any, dtype: Any, device: str) -> None:
    """A convolution's output, and on the CPU the reference engine's largest buffers."""
    from .dtypes import compute_dtype
    from .ops.reference.conv import flat_choice

    check_bytes(geom.output_shape, dtype, device, "output")
    if device == "cpu":
        cd = compute_dtype(dtype)
        layout = flat_choice(geom, cd.itemsize)  # the form the engine takes
        if layout is not None:
            check_bytes((geom.in_channels, layout.length), cd, device,
                        "the CPU engine's padded input")
            check_bytes((geom.out_channels, layout.positions), cd, device,
                        "the CPU engine's GEMM result")
            return
        cols = (geom.in_channels * math.prod(geom.kernel_size), geom.batch,
                *geom.output_spatial)
        check_bytes(cols, cd, device, "the CPU engine's im2col buffer")
