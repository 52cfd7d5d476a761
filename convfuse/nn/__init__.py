"""Layers: parameters plus one call into the ops, PyTorch-style."""

from .adaptive_pool import AdaptiveAvgPool2d
from .batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d
from .container import Flatten, ModuleList, Sequential
from .conv import Conv1d, Conv2d, Conv3d
from .conv_transpose import ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from .fold import fold_batchnorm
from .linear import Linear
from .module import Layer, Module
from .parameter import Parameter
from .pooling import AvgPool2d, MaxPool2d
from .residual import Residual
from .simple import Activation, Dropout, Identity, ReLU
from .state import IncompatibleKeys

__all__ = [
    "Activation", "AdaptiveAvgPool2d", "AvgPool2d", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
    "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "Dropout", "Flatten", "Identity",
    "IncompatibleKeys", "Layer", "Linear", "MaxPool2d", "Module", "ModuleList", "Parameter",
    "ReLU",
    "Residual", "Sequential", "fold_batchnorm",
]
