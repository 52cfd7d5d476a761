"""Note [no plan work inside a capture]: what a plan may not do while a CUDA graph is
being recorded, and how it tells."""

from __future__ import annotations

from ..backend import gpu_available
from ..errors import CaptureError


def stream_is_capturing(stream_ptr: int | None = None) -> bool:
    """Whether the stream `stream_ptr` (default: CuPy's current stream) is recording a
    graph (False without a GPU). The pointer path names its caller's stream, which need
    not be CuPy's current one (Note [the pointer path] in ops/cudnn/device.py)."""
    if not gpu_available():
        return False
    import cupy  # pragma: gpu

    if stream_ptr is None:  # pragma: gpu
        return bool(cupy.cuda.get_current_stream().is_capturing())
    return bool(cupy.cuda.runtime.streamIsCapturing(stream_ptr))  # pragma: gpu


def refuse_in_capture(what: str, stream_ptr: int | None = None) -> None:
    """Raise CaptureError naming `what` when the current stream is capturing: choosing an
    algorithm (Find*Ex runs kernels and syncs), timing the forward paths or creating cached
    device buffers cannot be recorded into a CUDA graph; the step's warm-up must do them."""
    # stream_is_capturing() alone for CuPy's current stream: tests stand in for it so
    capturing = stream_is_capturing() if stream_ptr is None else stream_is_capturing(stream_ptr)
    if capturing:
        raise CaptureError(
            f"{what} was needed while a CUDA graph was being captured. Plans, algorithm "
            "choices and cached buffers must exist before capture: run the step eagerly "
            "first (convfuse.graph.capture's warm-up does), with the same shapes, dtypes "
            "and flags, and keep the number of distinct convolutions under the plan "
            "cache's size so none is evicted between warm-up and capture"
        )
