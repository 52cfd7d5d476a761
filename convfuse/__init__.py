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
    StateDictError,
)
from .loss import CrossEntropyLoss
from .nn import (
    Activation,
    AvgPool2d,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    Conv1d,
    Conv2d,
    Conv3d,
    Dropout,
    Flatten,
    Identity,
    Linear,
    MaxPool2d,
    Module,
    Parameter,
    ReLU,
    Sequential,
)

__all__ = [
    "Activation",
    "AvgPool2d",
    "BackwardBeforeForwardError",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
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
    "Dropout",
    "Flatten",
    "Identity",
    "Linear",
    "MaxPool2d",
    "Module",
    "Parameter",
    "ReLU",
    "Sequential",
    "StateDictError",
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
