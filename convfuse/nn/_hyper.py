"""Hyperparameter checks shared by the layers' constructors and setters.

Each returns the normalised value or raises TypeError (wrong kind of value) or ValueError
(right kind, wrong value); the layer prefixes its own name (module.renamed).
NumPy integers are accepted wherever a Python int is; bools never count as numbers.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from .. import activations
from ..geometry import as_tuple, is_int
from ..ops._checks import as_float
from ..pad_geometry import PADDING_MODES, split_padding


def positive_int(value: Any, what: str) -> int:
    if not is_int(value):
        raise TypeError(f"{what} must be a positive int, got {type(value).__name__} {value!r}")
    if int(value) < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return int(value)


def int_tuple(value: Any, rank: int, what: str, low: int, op: str = "convolution"
              ) -> tuple[int, ...]:
    """An int or `rank` ints, each >= low."""
    if not (is_int(value) or isinstance(value, (tuple, list))):
        raise TypeError(f"{what} must be an int or {rank} ints, got {type(value).__name__} "
                        f"{value!r}")
    out = as_tuple(value, rank, what, op)
    if any(v < low for v in out):
        raise ValueError(f"{what} must be >= {low}, got {value!r}")
    return out


def padding(value: Any, rank: int, kernel: tuple[int, ...], stride: tuple[int, ...],
            dilation: tuple[int, ...]) -> tuple[int, ...] | str:
    """Ints >= 0, or 'valid'/'same' checked against the kernel, stride and dilation (an
    even kernel's 'same' pads its extra element at the end, as torch.nn)."""
    if isinstance(value, str):
        split_padding(value, "zeros", kernel, dilation, stride)  # ValueError when it cannot hold
        return value
    return int_tuple(value, rank, "padding", 0)


def padding_mode(value: Any) -> str:
    """One of torch.nn's Conv padding modes."""
    if not isinstance(value, str):
        raise TypeError(f"padding_mode must be a str, got {type(value).__name__} {value!r}")
    if value not in PADDING_MODES:
        raise ValueError(f"padding_mode must be one of {', '.join(map(repr, PADDING_MODES))}, "
                         f"got {value!r}")
    return value


def flag(value: Any, what: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def activation(value: Any) -> str:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"activation must be a str or None, got {type(value).__name__} "
                        f"{value!r}")
    if value in PADDING_MODES:
        # torch.nn's Conv takes padding_mode 9th, where convfuse's takes activation
        raise ValueError(f"activation {value!r} is a padding mode; pass padding_mode={value!r} "
                         "by keyword (convfuse's Conv takes activation where torch.nn's takes "
                         "padding_mode)")
    if isinstance(value, str) and value.split(":")[0].lower() in ("cpu", "cuda"):
        # torch.nn's Linear and BatchNorm take device where convfuse's take activation
        raise ValueError(f"activation {value!r} is a device; pass device={value!r} by keyword "
                         "(convfuse's layers take activation where torch.nn's Linear and "
                         "BatchNorm take device)")
    return activations.normalize(value)


def seed(value: Any) -> int | None:
    if value is not None and not is_int(value):
        raise TypeError(f"seed must be an int or None, got {type(value).__name__} {value!r}")
    return None if value is None else int(value)


def finite_real(value: Any, what: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a real number, got {type(value).__name__} {value!r}")
    out = as_float(value)
    if not math.isfinite(out):
        raise ValueError(f"{what} must be finite, got {value!r}")
    return out


def dtype_hint(layer_dtype: Any, got: Any) -> str:
    """How to fix an input of the wrong dtype, suggesting only supported dtypes."""
    from ..dtypes import SUPPORTED

    fix = f"cast the input (x.astype('{layer_dtype}'))"
    if got in SUPPORTED.values():
        fix += f" or build the layer with dtype='{got}'"
    return fix


def read_only(layer: str, name: str, why: str) -> AttributeError:
    return AttributeError(f"{layer}: {name} is fixed at construction ({why}); build a new "
                          "layer (and load its state_dict) to change it")


def activation_property() -> property:
    """A layer's `activation` attribute: validated on assignment (with the hints above),
    errors named by the layer."""
    return activations.attribute(activation)
