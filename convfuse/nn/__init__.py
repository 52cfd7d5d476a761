"""Layers: parameters plus one call into the ops, PyTorch-style."""

from .batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d
from .container import Flatten, Sequential
from .conv import Conv1d, Conv2d, Conv3d
from .linear import Linear
from .module import Layer, Module
from .parameter import Parameter
from .pooling import AvgPool2d, MaxPool2d
from .simple import Activation, Dropout, Identity, ReLU
from .state import IncompatibleKeys

__all__ = [
    "Activation", "AvgPool2d", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "Conv1d", "Conv2d",
    "Conv3d", "Dropout", "Flatten", "Identity",
    "IncompatibleKeys", "Layer", "Linear", "MaxPool2d", "Module", "Parameter", "ReLU",
    "Sequential",
]
