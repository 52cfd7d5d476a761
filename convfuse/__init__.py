"""convfuse: cuDNN-backed fused convolution layers for training, with a NumPy reference engine."""

from __future__ import annotations

__version__ = "0.1.0"

from . import config
from .backend import gpu_available
from .errors import (
    BackwardBeforeForwardError,
    CaptureError,
    ConvfuseError,
    CudnnError,
    CudnnLoadError,
    DeviceMismatchError,
    DeviceUnavailableError,
)
from .nn.parameter import Parameter

__all__ = [
    "BackwardBeforeForwardError",
    "CaptureError",
    "ConvfuseError",
    "CudnnError",
    "CudnnLoadError",
    "DeviceMismatchError",
    "DeviceUnavailableError",
    "Parameter",
    "__version__",
    "config",
    "gpu_available",
]
