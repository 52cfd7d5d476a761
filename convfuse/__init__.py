"""convfuse: cuDNN-backed fused convolution layers for training, with a NumPy reference engine."""

from __future__ import annotations

__version__ = "0.1.0"

from . import backend, config, functional, graph, metrics, ops, optim
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
from .loss import CrossEntropyLoss
from .nn import (
    AvgPool2d,
    Conv1d,
    Conv2d,
    Conv3d,
    Flatten,
    Linear,
    MaxPool2d,
    Parameter,
    Sequential,
)

__all__ = [
    "AvgPool2d",
    "BackwardBeforeForwardError",
    "CaptureError",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvfuseError",
    "CrossEntropyLoss",
    "CudnnError",
    "CudnnLoadError",
    "DeviceMismatchError",
    "DeviceUnavailableError",
    "Flatten",
    "Linear",
    "MaxPool2d",
    "Parameter",
    "Sequential",
    "__version__",
    "backend",
    "config",
    "functional",
    "gpu_available",
    "graph",
    "metrics",
    "ops",
    "optim",
]
