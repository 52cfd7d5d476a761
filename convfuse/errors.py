"""The exceptions convfuse raises. Each also derives from the builtin a user would catch."""

from __future__ import annotations

import copy
import re

_OP_PREFIX = re.compile(r"^[a-z_][a-z0-9_]*: ")


class ConvfuseError(Exception):
    """Base of every convfuse-specific error."""


# cuDNN 9's statuses for memory it could not get (cudnn_graph.h): HOST_ALLOCATION_FAILED
# (also the deprecated CUDNN_STATUS_ALLOC_FAILED) and DEVICE_ALLOCATION_FAILED
_OUT_OF_MEMORY = frozenset({4003, 4004})


class CudnnError(ConvfuseError, RuntimeError):
    """A cuDNN call returned a status other than CUDNN_STATUS_SUCCESS.

    The binding raises it with the function, the status and `detail`, cuDNN's own message
    (cudnnGetLastErrorString: why a call was refused, where cuDNN says); the layers above
    re-raise it with `with_context` so the message also names the shapes and algorithm
    involved. `CudnnError(status, ...)` of an out-of-memory status makes a
    CudnnOutOfMemoryError, which a `except MemoryError` also catches.
    """

    def __new__(cls, status: int, *args: object, **kwargs: object) -> CudnnError:
        if cls is CudnnError and _status_int(status) in _OUT_OF_MEMORY:
            cls = CudnnOutOfMemoryError
        return super().__new__(cls, status, *args, **kwargs)

    def __init__(self, status: int, function: str, status_name: str = "", context: str = "",
                 detail: str = ""):
        self.status = int(status)
        self.function = function
        self.status_name = status_name or f"CUDNN_STATUS_{self.status}"
        self.context = context
        self.detail = " ".join(str(detail).split())  # cuDNN's own message, one line
        msg = f"{function} failed with {self.status_name} ({self.status})"
        if context:
            msg = f"{msg}: {context}"
        super().__init__(f"{msg} [cuDNN: {self.detail}]" if self.detail else msg)

    def __reduce__(self):
        return (type(self), (self.status, self.function, self.status_name, self.context,
                             self.detail))

    def with_context(self, context: str) -> CudnnError:
        joined = f"{self.context}; {context}" if self.context else context
        return type(self)(self.status, self.function, self.status_name, joined, self.detail)


class CudnnOutOfMemoryError(CudnnError, MemoryError):
    """cuDNN could not allocate host or device memory it needed for a call
    (CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED or _DEVICE_ALLOCATION_FAILED): a
    MemoryError, as CuPy's and the workspace's out-of-memory errors are, so one `except
    MemoryError` around a step catches every shortage."""


def _status_int(status: object) -> int | None:
    try:
        return int(status)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


class CudnnLoadError(ConvfuseError, ImportError):
    """libcudnn or the compiled binding could not be loaded; the message says how to fix it."""


class DeviceUnavailableError(ConvfuseError, RuntimeError):
    """A GPU operation was asked for, but no usable CUDA device or driver was found."""


class DeviceMismatchError(ConvfuseError, ValueError):
    """Arrays or a layer and its input live on different devices, or mix NumPy and CuPy."""


class BackwardBeforeForwardError(ConvfuseError, RuntimeError):
    """backward() was called without a forward pass whose results it could use."""


class CaptureError(ConvfuseError, RuntimeError):
    """A training step could not be captured as a CUDA graph; the message says why."""


class StateDictError(ConvfuseError, RuntimeError):
    """load_state_dict found missing, unexpected, mis-shaped or mis-typed entries; the
    message names every offending key. Nothing was loaded (RuntimeError, as PyTorch)."""


class SavedTensorModifiedError(ConvfuseError, RuntimeError):
    """A tensor the forward saved for backward was changed in place before the backward
    (PyTorch's "one of the variables needed for gradient computation has been modified by
    an inplace operation"). Run the forward again."""


class ArrayTooLargeError(ConvfuseError, MemoryError):
    """An array convfuse was about to allocate exceeds `convfuse.config.max_array_bytes`
    (by default the device's total memory); raised before allocating, naming the bytes."""


class TensorTooLargeError(ConvfuseError, ValueError):
    """A tensor a cuDNN call would describe has more than 2**31 - 1 elements, the most
    cuDNN's descriptors index (their dimensions, strides and sizes are 32-bit); raised
    before any cuDNN call on it, naming the tensor and its shape."""


def renamed(exc: BaseException, name: str) -> BaseException:
    """`exc` re-labelled `name: ...` (an op's own `op_name: ` prefix dropped), same type,
    attributes and traceback; `exc` itself when it already names `name`."""
    msg = str(exc)
    if msg.startswith(name):
        return exc
    match = _OP_PREFIX.match(msg)
    body = msg[match.end():] if match else msg
    try:
        new = copy.copy(exc)
        new.args = (f"{name}: {body}",)
    except Exception:  # an exception type that cannot be copied keeps its own words
        return exc
    return new.with_traceback(exc.__traceback__)
