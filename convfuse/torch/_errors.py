"""The layers' input errors, each also the RuntimeError torch.nn raises in its place.

torch.nn's layers raise RuntimeError for an input of the wrong shape, dtype or device
(ATen's checks); convfuse's convention is ValueError for a value, TypeError for a type and
DeviceMismatchError for a device. A drop-in must satisfy both: code written for torch.nn
catches RuntimeError, code written for convfuse the precise class. So each is both.
"""

from __future__ import annotations

from ..errors import ConvfuseError, DeviceMismatchError


class InputShapeError(ConvfuseError, ValueError, RuntimeError):
    """An input torch.nn's layer refuses for its shape (torch raises RuntimeError there,
    convfuse's convention is ValueError: this is both)."""


class InputTypeError(ConvfuseError, TypeError, RuntimeError):
    """An input (or residual) whose dtype the layer cannot take: torch.nn's RuntimeError
    and convfuse's TypeError."""


class TransformError(ConvfuseError, NotImplementedError):
    """A second-order torch.func transform (hessian, jacfwd(jacrev(f)), grad(grad(f)))
    around a fused convolution, whose backward and jvp run custom ops torch.func cannot
    differentiate (Note [a fused convolution under torch.func] in _functorch.py); a
    NotImplementedError, so also the RuntimeError torch raises there."""


class InputDeviceError(DeviceMismatchError, TypeError, RuntimeError):
    """An input (or residual) on another device than the layer's parameters: torch.nn's
    RuntimeError and convfuse's DeviceMismatchError (a ValueError); also a TypeError, which
    a residual on the wrong device raised before this class existed."""
