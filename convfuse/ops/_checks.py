"""Validation every op runs before any engine (and so before any cuDNN call), and the
choice of engine by array type.

Checks run in stages over all of an op's arrays, so the first error reported is the most
basic one: not an array, NumPy mixed with CuPy, dtype, shape, contiguity, outputs
overlapping inputs, alignment, and last the device (which needs a GPU to ask about).
Arrays are only inspected, never copied or modified.
"""

from __future__ import annotations

import importlib
import math
import numbers
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from .. import activations, backend, config
from ..dtypes import SUPPORTED
from ..errors import DeviceMismatchError
from ..geometry import ConvGeometry

# cuDNN and the vectorised custom kernels may use 16-byte loads; CuPy's pool hands out
# 512-byte aligned blocks, so only views at odd offsets fail this.
ALIGNMENT = 16

# Ops whose output may be exactly one of their inputs (in-place activation). Safe because
# they are elementwise over arrays of one shape: the kernels read and write each element
# at the same index in the same thread (kernels/activation.cu), and the reference engine
# computes into a temporary before writing `out`. Any partial overlap is still refused.
IN_PLACE_OPS = frozenset({"activation_forward", "activation_backward"})


def zero_filled(xp: ModuleType, out: Any, shape: tuple[int, ...], dtype: Any,
                beta: float) -> Any:
    """An empty batch's weight or bias gradient, which no engine computes: beta * out
    (cuDNN's rule: beta = 0 never reads out), or new zeros."""
    if out is None:
        return xp.zeros(shape, dtype)
    if beta == 0.0:
        out.fill(0)
    elif beta != 1.0:
        out *= beta
    return out


class Arg(NamedTuple):
    """One array argument of an op: its name, value and required shape (None: any).

    `optional` arguments may be None; `output` ones are written by the op.
    """

    name: str
    array: Any
    shape: tuple[int, ...] | None
    optional: bool = False
    output: bool = False


def validate(op: str, args: Sequence[Arg], layout: str | None = None) -> ModuleType:
    """Check `args` for `op`; return NumPy or CuPy, the module of the arrays."""
    present = []
    kind: type | None = None  # the one class of every array given, if they share one
    complete = True  # every required array given
    for a in args:
        if a.array is None:
            complete = complete and a.optional
        else:
            present.append(a)
            cls = type(a.array)
            kind = cls if not kind or kind is cls else object
    if complete and (kind is np.ndarray or (kind is not None and kind is _cupy_ndarray())):
        # the common case: all NumPy or all CuPy, so no None, type or mix error is possible
        # and the stages below start at the dtypes (host time per call matters: Note
        # [layer call cache] in convfuse/nn/_conv_base.py)
        _check_dtypes(op, present)
        for a in present:
            _check_layout(op, a, layout)
        if any(a.output for a in present):
            _check_overlap(op, present)
        if kind is np.ndarray:
            return np
        _check_gpu_arrays(op, present)
        return backend.cupy_module()  # type: ignore[return-value]
    for a in args:
        if a.array is None and not a.optional:
            raise TypeError(f"{op}: {a.name} must be a NumPy or CuPy array, got None")
    for a in present:
        if not isinstance(a.array, np.ndarray) and not backend.is_cupy(a.array):
            raise TypeError(
                f"{op}: {a.name} must be a NumPy or CuPy array, got {type(a.array).__name__}"
            )
    on_gpu = [backend.is_cupy(a.array) for a in present]
    if any(on_gpu) and not all(on_gpu):
        kinds = ", ".join(
            f"{a.name}: {'CuPy' if g else 'NumPy'}" for a, g in zip(present, on_gpu, strict=True)
        )
        raise DeviceMismatchError(f"{op}: cannot mix NumPy and CuPy arrays in one call ({kinds})")
    _check_dtypes(op, present)
    for a in present:
        _check_layout(op, a, layout)
    _check_overlap(op, present)
    if any(on_gpu):
        _check_gpu_arrays(op, present)
        return backend.cupy_module()  # type: ignore[return-value]
    return np


_SUPPORTED_DTYPES = frozenset(SUPPORTED.values())


def _cupy_ndarray() -> type | None:
    """cupy.ndarray, or None without CuPy."""
    cp = backend.cupy_module()
    return None if cp is None else cp.ndarray


def _check_dtypes(op: str, present: Sequence[Arg]) -> None:
    supported = _SUPPORTED_DTYPES
    first = None
    for a in present:
        dt = a.array.dtype
        if dt not in supported:
            raise ValueError(
                f"{op}: {a.name} has unsupported dtype {dt}; convfuse supports "
                f"{', '.join(SUPPORTED)}"
            )
        if first is None:
            first = a
        elif dt != first.array.dtype:
            raise ValueError(
                f"{op}: {a.name} has dtype {dt} but {first.name} has dtype "
                f"{first.array.dtype}; all arrays of one call must share a dtype"
            )


def _check_layout(op: str, a: Arg, layout: str | None) -> None:
    shape = a.array.shape
    if a.shape is not None and shape != a.shape and tuple(shape) != tuple(a.shape):
        shape = tuple(shape)
        where = f" (layout {layout})" if layout else ""
        raise ValueError(
            f"{op}: {a.name} has shape {shape} but {tuple(a.shape)} is expected{where}"
        )
    if not a.array.flags.c_contiguous:
        raise ValueError(f"{op}: {a.name} is not C-contiguous; call ascontiguousarray")
    if a.output and isinstance(a.array, np.ndarray) and not a.array.flags.writeable:
        raise ValueError(f"{op}: {a.name} is read-only but the op writes its result there")


def _check_overlap(op: str, present: Sequence[Arg]) -> None:
    """Refuse an output sharing memory with an input: cuDNN and the reference engine read
    inputs while writing outputs, so neither can compute in place (IN_PLACE_OPS aside)."""
    inputs = [a for a in present if not a.output]
    for out in (a for a in present if a.output):
        for a in inputs:
            if not _overlaps(out.array, a.array):
                continue
            if op in IN_PLACE_OPS and _same_memory(out.array, a.array):
                continue
            hint = " (or the input itself, to compute in place)" if op in IN_PLACE_OPS else ""
            raise ValueError(
                f"{op}: {out.name} overlaps input '{a.name}' (cuDNN cannot compute in "
                f"place); pass a separate array{hint}"
            )


def _extent(a: Any) -> tuple[int, int]:
    """[start, end) of an array's bytes; exact because arrays are C-contiguous by now."""
    start = a.data.ptr if not isinstance(a, np.ndarray) else a.__array_interface__["data"][0]
    return start, start + a.nbytes


def _span(a: Any) -> tuple[int, int]:
    """[start, end) of the bytes any array spans, by its strides (negative ones included):
    for a caller's view, which may be neither C-contiguous nor start at its lowest byte."""
    start = a.data.ptr if not isinstance(a, np.ndarray) else a.__array_interface__["data"][0]
    if a.size == 0:
        return start, start
    lo = hi = 0
    for n, step in zip(a.shape, a.strides):
        if step < 0:
            lo += (n - 1) * step
        else:
            hi += (n - 1) * step
    return start + lo, start + hi + a.itemsize


def overlaps_view(a: Any, view: Any) -> bool:
    """`overlaps` for a `view` of any strides (a caller's array the ops never see)."""
    if isinstance(a, np.ndarray) or isinstance(view, np.ndarray):
        return _overlaps(a, view)  # NumPy's bounds follow strides; host and device never meet
    (a0, a1), (b0, b1) = _span(a), _span(view)
    return a0 < b1 and b0 < a1


def _overlaps(a: Any, b: Any) -> bool:
    a_host, b_host = isinstance(a, np.ndarray), isinstance(b, np.ndarray)
    if a_host and b_host:
        return bool(np.may_share_memory(a, b))  # a bounds check, no exact solve
    if a_host or b_host:
        return False  # host and device memory never overlap
    # CuPy: compare address ranges; cupy.shares_memory would need the device.
    (a0, a1), (b0, b1) = _extent(a), _extent(b)
    return a0 < b1 and b0 < a1


overlaps = _overlaps  # public: layers check gradient buffers with the same rule


def engine_ready(a: Any) -> Any:
    """`a`, or one copy of it as the ops take arrays: C-contiguous and, in device memory,
    at an ALIGNMENT-byte address. For layers and the functional API, which accept any
    array (the caller's is untouched): a C-contiguous slice of device data (a batch cut
    from a dataset on the GPU, `x[i:i + n]`) may start at any address, which the ops
    refuse. A new array comes from the pool, 512-byte aligned."""
    if not a.flags.c_contiguous:
        return backend.array_module(a).ascontiguousarray(a)
    if not isinstance(a, np.ndarray) and a.data.ptr % ALIGNMENT and hasattr(a, "copy"):
        return a.copy()
    return a


def _same_memory(a: Any, b: Any) -> bool:
    """Both arrays cover exactly the same bytes (the same array, or a view of all of it)."""
    return _extent(a) == _extent(b)


def _check_gpu_arrays(op: str, present: Sequence[Arg]) -> None:
    for a in present:
        ptr = a.array.data.ptr
        if ptr % ALIGNMENT:
            raise ValueError(
                f"{op}: {a.name} starts at address {ptr:#x}, which is not {ALIGNMENT}-byte "
                "aligned; pass a copy (cupy.ascontiguousarray(a.copy()))"
            )
    current = current_device()
    for a in present:
        dev = a.array.device.id
        if dev != current:
            raise DeviceMismatchError(
                f"{op}: {a.name} lives on CUDA device {dev} but the current device is "
                f"{current}; call it under `with cupy.cuda.Device({dev}):`"
            )


def current_device() -> int:
    """The current CUDA device id; DeviceUnavailableError when no GPU is usable."""
    cp = backend.require_gpu("an op on CuPy arrays")
    return int(cp.cuda.runtime.getDevice())  # pragma: gpu


def check_geometry(op: str, geom: Any) -> ConvGeometry:
    if not isinstance(geom, ConvGeometry):
        raise TypeError(
            f"{op}: geom must be a ConvGeometry (ConvGeometry.create(...)), got "
            f"{type(geom).__name__}"
        )
    return geom


def check_pool_geometry(op: str, pgeom: Any) -> Any:
    from ..pool_geometry import PoolGeometry

    if not isinstance(pgeom, PoolGeometry):
        raise TypeError(
            f"{op}: pgeom must be a PoolGeometry (PoolGeometry.create(...)), got "
            f"{type(pgeom).__name__}"
        )
    return pgeom


def as_float(value: Any) -> float:
    """float(value) for a real number, with an int beyond float's range (10**400) as +-inf
    rather than an OverflowError that names nothing: the callers' finiteness and range
    checks then refuse it, naming the argument."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def check_scalar(op: str, name: str, value: Any) -> float:
    """A finite real number, returned as a float."""
    if type(value) is float and math.isfinite(value):  # the common case, without the ABC
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {name} must be a real number, got {type(value).__name__}")
    out = as_float(value)
    if not math.isfinite(out):
        raise ValueError(f"{op}: {name} must be finite, got {value!r}")
    return out


def check_beta(op: str, beta: Any, out: Any, out_name: str = "out") -> float:
    """cuDNN's beta: 0 overwrites `out`, anything else accumulates into it (so needs it)."""
    b = check_scalar(op, "beta", beta)
    if b != 0.0 and out is None:
        raise ValueError(f"{op}: beta={beta!r} accumulates into {out_name}, but {out_name} is None")
    return b


# The array checks of the convolution ops, shared by the forward (ConvGeometry) and the
# transposed (ConvTransposeGeometry) ones: `g` is either, already checked, and both name
# their shapes alike (input, weight, bias and output in the user's layout).
def check_activation(op: str, activation: Any) -> str:
    """The canonical activation name; TypeError for a non-str, ValueError for an unknown
    name, each naming the op."""
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"{op}: activation must be a str or None, got "
                        f"{type(activation).__name__} {activation!r}")
    try:
        return activations.normalize(activation)
    except ValueError as err:
        raise ValueError(f"{op}: {err}") from None


def check_fused_args(op: str, g: Any, x: Any, w: Any, b: Any, residual: Any,
                     activation: str | None, residual_scale: Any
                     ) -> tuple[ModuleType, str, float]:
    """(array module, canonical activation, residual scale) of a fused bias_act op."""
    act = check_activation(op, activation)
    scale = check_scalar(op, "residual_scale", residual_scale)
    xp = validate(op, [
        Arg("x", x, g.input_shape), Arg("w", w, g.weight_shape),
        Arg("b", b, g.bias_shape, optional=True),
        Arg("residual", residual, g.output_shape, optional=True),
    ], g.layout)
    return xp, act, scale


def check_forward_args(op: str, g: Any, x: Any, w: Any) -> ModuleType:
    return validate(op, [Arg("x", x, g.input_shape), Arg("w", w, g.weight_shape)], g.layout)


def check_data_grad_args(op: str, g: Any, dz: Any, w: Any, out: Any, beta: Any
                         ) -> tuple[ModuleType, float]:
    """(array module, beta) of a gradient with respect to the input."""
    b = check_beta(op, beta, out)
    xp = validate(op, [
        Arg("dz", dz, g.output_shape), Arg("w", w, g.weight_shape),
        Arg("out", out, g.input_shape, optional=True, output=True),
    ], g.layout)
    return xp, b


def check_filter_grad_args(op: str, g: Any, x: Any, dz: Any, out: Any, beta: Any
                           ) -> tuple[ModuleType, float]:
    """(array module, beta) of a gradient with respect to the weight."""
    b = check_beta(op, beta, out)
    xp = validate(op, [
        Arg("x", x, g.input_shape), Arg("dz", dz, g.output_shape),
        Arg("out", out, g.weight_shape, optional=True, output=True),
    ], g.layout)
    return xp, b


def engine(xp: ModuleType, kind: str) -> ModuleType:
    """The engine module for `kind` ("conv", "activation", "pooling"): the NumPy
    reference for NumPy arrays, cuDNN for CuPy arrays. Ops look the function up on this
    module at every call, so tests see which engine ran by patching it there."""
    if xp is not np:
        config.refresh()  # a framework's cuDNN switches (Note [a framework's switches])
    name = f"convfuse.ops.{'reference' if xp is np else 'cudnn'}.{kind}"
    module = sys.modules.get(name)  # imported once; import_module's lookup costs per call
    return module if module is not None else importlib.import_module(name)
