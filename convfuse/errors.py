"""The exceptions convfuse raises. Each also derives from the builtin a user would catch."""

from __future__ import annotations


class ConvfuseError(Exception):
    """Base of every convfuse-specific error."""


class CudnnError(ConvfuseError, RuntimeError):
    """A cuDNN call returned a status other than CUDNN_STATUS_SUCCESS.

    The binding raises it with the function and status; the layers above re-raise it
    with `with_context` so the message also names the shapes and algorithm involved.
    """

    def __init__(self, status: int, function: str, status_name: str = "", context: str = ""):
        self.status = int(status)
        self.function = function
        self.status_name = status_name or f"CUDNN_STATUS_{self.status}"
        self.context = context
        msg = f"{function} failed with {self.status_name} ({self.status})"
        super().__init__(f"{msg}: {context}" if context else msg)

    def __reduce__(self):
        return (type(self), (self.status, self.function, self.status_name, self.context))

    def with_context(self, context: str) -> CudnnError:
        joined = f"{self.context}; {context}" if self.context else context
        return CudnnError(self.status, self.function, self.status_name, joined)


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
