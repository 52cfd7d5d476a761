"""Layers: parameters plus one call into the ops, PyTorch-style."""

from .container import Flatten, Sequential
from .conv import Conv1d, Conv2d, Conv3d
from .linear import Linear
from .module import Layer
from .parameter import Parameter
from .pooling import AvgPool2d, MaxPool2d

__all__ = [
    "AvgPool2d", "Conv1d", "Conv2d", "Conv3d", "Flatten", "Layer", "Linear", "MaxPool2d",
    "Parameter", "Sequential",
]
