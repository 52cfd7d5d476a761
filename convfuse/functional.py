"""Fused convolution for users who keep their own parameters.

`conv_bias_act_forward` is the forward, `conv_bias_act_backward` the matching backward
(`conv_bias_act` is the forward alone, for inference). The forward returns `(y, ctx)`, ctx a
`ConvContext` holding exactly what the backward needs:
- x, for the filter gradient (padded, when the forward padded it explicitly);
- the weight, for the data gradient;
- one activation-sized tensor, the output or the pre-activation, per
  convfuse.activations Note [what backward saves];
- on the CPU, the forward's im2col columns while the engine's cap allows (reference/conv.py
  Note [kept columns]): the filter gradient then reads x as the forward read it.

Contracts of both functions:
- Arrays that are not C-contiguous are copied once into contiguous ones (one extra read
  and write of that array; the caller's array is never modified). The ops below stay
  strict and refuse them.
- Wrong Python types raise TypeError naming the argument (`conv_bias_act: x must be ...`),
  wrong values ValueError; both name the arguments as the signature does (weight, bias).
- Saved tensors: on the CPU the saved activation tensor (the output y, which the caller
  also holds, or the pre-activation z) is made read-only (not by the forward alone, which
  keeps nothing: its y is the caller's to write), so an in-place write to it
  between forward and backward raises at the write instead of corrupting the gradients.
  The input x and the weight are the caller's arrays and are not protected here (the
  layers detect a changed weight through Parameter versions); CuPy arrays have no
  read-only flag, so on the GPU only the layers' version check applies.
- The backward checks dy and every output buffer (shape, dtype, device, writable,
  contiguous, no memory shared with the forward's saved tensors or dy) before its first
  write, so a refused call changes nothing.
"""

from __future__ import annotations

import contextlib
import copy
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from . import activations, dtypes, ops
from .backend import array_module, device_of, is_cupy
from .errors import ConvfuseError, DeviceMismatchError, renamed
from .geometry import ConvGeometry, ConvShapes, IntOrTuple, is_int
from .ops import _checks as ops_checks
from .ops._checks import check_scalar, engine_ready, overlaps
from .ops.reference import conv as reference_conv
from .pad_geometry import PadGeometry, padded_conv


class _ForwardContext(Protocol):
    """What the backward checks read of a forward's context: ConvContext and
    functional_transpose.ConvTransposeContext both hold it."""

    @property
    def geom(self) -> ConvShapes: ...
    @property
    def x(self) -> Any: ...
    @property
    def weight(self) -> Any: ...
    @property
    def saved(self) -> Any: ...
    @property
    def has_bias(self) -> bool: ...


@dataclass(frozen=True)
class ConvContext:
    """What `conv_bias_act_backward` needs from the forward, and nothing more."""

    geom: ConvGeometry
    activation: str
    x: Any
    weight: Any
    saved: Any  # y, z or None (Note [what backward saves])
    has_bias: bool
    has_residual: bool
    residual_scale: float
    # the forward's im2col columns on the CPU, for the filter gradient (reference/conv.py
    # Note [kept columns]); None when not kept
    columns: Any = None
    # the explicit padding before the convolution (padding_mode, asymmetric 'same'); geom
    # is then the convolution of the padded input
    pad: PadGeometry | None = None


class ConvGrads(NamedTuple):
    dx: Any
    dweight: Any
    dbias: Any
    dresidual: Any


def _array(op: str, name: str, a: Any, optional: bool = False) -> Any:
    """`a` checked to be a NumPy/CuPy array (or None when optional), made C-contiguous (and
    on the GPU aligned: ops/_checks.engine_ready)."""
    if a is None and optional:
        return None
    if not (isinstance(a, np.ndarray) or is_cupy(a)):
        raise TypeError(f"{op}: {name} must be a NumPy or CuPy array, got {type(a).__name__}")
    return engine_ready(a)


def _activation(op: str, activation: Any) -> str:
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"{op}: activation must be a str or None, got "
                        f"{type(activation).__name__} {activation!r}")
    return activations.normalize(activation)


def check_geometry_types(op: str, **args: Any) -> None:
    """TypeError naming the argument for a geometry argument of a wrong Python type (the
    geometry's own checks then give ValueError for wrong values): ints or int sequences,
    padding also a str, groups an int, layout and padding_mode str."""
    for name, value in args.items():
        if name in ("layout", "padding_mode"):
            ok = isinstance(value, str)
            want = "a str"
        elif name == "groups":
            ok = is_int(value) or _is_index(value)
            want = "an int"
        elif name == "output_size":
            ok = value is None or _int_sequence(value)
            want = "None or a sequence of ints"
        else:
            ok = is_int(value) or isinstance(value, (tuple, list)) or _is_index(value) \
                or (name == "padding" and isinstance(value, str))
            want = "an int, a tuple of ints" + (" or a str" if name == "padding" else "")
        if not ok:
            raise TypeError(f"{op}: {name} must be {want}, got {type(value).__name__} "
                            f"{value!r}")


def _int_sequence(value: Any) -> bool:
    """A sequence (tuple, list, 1-d array, torch.Size) of ints; not a str or a 0-d array."""
    if isinstance(value, str):
        return False
    try:
        return all(is_int(v) or _is_index(v) for v in value)
    except TypeError:  # not iterable (an int, a 0-d array)
        return False


def _is_index(value: Any) -> bool:
    """An integer by operator.index (a torch SymInt, an integer tensor), never a bool."""
    if isinstance(value, (bool, np.bool_)):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


# the ops name the weight and bias w and b; the functional API's signature says weight, bias
_OP_ARG_NAMES = re.compile(r"(?<=: )(w|b)(?= (?:has|is|must) )|(?<=but )(w|b)(?= has )"
                           r"|(?<=input ')(w|b)(?=')")


def with_signature_names(exc: BaseException, op: str) -> BaseException:
    """`renamed(exc, op)` with the ops' argument names w and b as the signature's."""
    exc = renamed(exc, op)
    msg = str(exc)
    new = _OP_ARG_NAMES.sub(lambda m: "weight" if m.group(0) == "w" else "bias", msg)
    if new == msg:
        return exc
    try:
        out = copy.copy(exc)
        out.args = (new,)
    except Exception:  # an exception type that cannot be copied keeps its own words
        return exc
    return out.with_traceback(exc.__traceback__)


def _fused_args(op: str, x: Any, weight: Any, bias: Any, residual: Any, activation: Any,
                residual_scale: Any) -> tuple[Any, Any, Any, Any, str, float]:
    """A fused forward's arrays (checked, contiguous, on one engine), its activation's
    canonical name and its residual scale."""
    act = _activation(op, activation)
    x = _array(op, "x", x)
    weight = _array(op, "weight", weight)
    bias = _array(op, "bias", bias, optional=True)
    residual = _array(op, "residual", residual, optional=True)
    scale = check_scalar(op, "residual_scale", residual_scale)
    array_module(x, weight, bias, residual)  # refuses NumPy/CuPy mixes up front
    return x, weight, bias, residual, act, scale


def _saved(act: str, y: Any, z: Any) -> Any:
    """What backward keeps of the forward's output (Note [what backward saves])."""
    saved = {"none": None, "output": y, "preactivation": z}[activations.saves(act)]
    if isinstance(saved, np.ndarray):
        saved.flags.writeable = False  # an in-place write would corrupt the gradients
    return saved


def conv_bias_act_forward(
    x: Any,
    weight: Any,
    bias: Any = None,
    stride: IntOrTuple = 1,
    padding: IntOrTuple | str = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
    activation: str | None = None,
    residual: Any = None,
    residual_scale: float = 1.0,
    layout: str = "NCHW",
    geom: ConvGeometry | None = None,
    *,
    padding_mode: str = "zeros",
    pad: PadGeometry | None = None,
) -> tuple[Any, ConvContext]:
    """act(conv(x, weight) + bias + residual_scale * residual), and the backward's context.

    On CuPy arrays identity and relu are one cudnnConvolutionBiasActivationForward call;
    other activations add exactly one activation kernel. On NumPy arrays the reference
    engine computes the same thing. `padding_mode` ('zeros', 'reflect', 'replicate',
    'circular') and padding='same' follow torch.nn's Conv, an even kernel's 'same'
    included (convfuse.pad_geometry.split_padding): what cuDNN's symmetric zero padding cannot
    do is padded explicitly first (convfuse.ops.pad_forward). Pass `geom` (and `pad`, from
    convfuse.pad_geometry.padded_conv) to skip re-validating a known geometry; stride,
    padding, dilation, groups, layout and padding_mode are then ignored.
    """
    try:
        return _forward(x, weight, bias, stride, padding, dilation, groups, activation,
                        residual, residual_scale, layout, geom, padding_mode, pad)
    except (TypeError, ValueError, ConvfuseError) as exc:
        raise with_signature_names(exc, "conv_bias_act") from None


def _forward(x: Any, weight: Any, bias: Any, stride: Any, padding: Any, dilation: Any,
             groups: Any, activation: Any, residual: Any, residual_scale: Any, layout: Any,
             geom: Any, padding_mode: Any, pad: Any) -> tuple[Any, ConvContext]:
    op = "conv_bias_act"
    x, weight, bias, residual, act, scale = _fused_args(op, x, weight, bias, residual,
                                                        activation, residual_scale)
    if geom is None:
        from ._memory import check_conv

        if pad is not None:
            raise ValueError(f"{op}: pad was given without its geom (both come from "
                             "convfuse.pad_geometry.padded_conv)")
        check_geometry_types(op, stride=stride, padding=padding, dilation=dilation,
                             groups=groups, layout=layout, padding_mode=padding_mode)
        pad, geom = padded_conv(x.shape, weight.shape, stride, padding, dilation, groups, layout,
                                padding_mode)
        check_conv(geom, x.dtype, device_of(x))
    elif not isinstance(geom, ConvGeometry):
        raise TypeError(f"{op}: geom must be a ConvGeometry or None, got {type(geom).__name__}")
    elif pad is not None and not isinstance(pad, PadGeometry):
        raise TypeError(f"{op}: pad must be a PadGeometry or None, got {type(pad).__name__}")
    elif pad is not None and pad.output_shape != geom.input_shape:
        raise ValueError(f"{op}: pad's output shape {pad.output_shape} is not geom's input "
                         f"shape {geom.input_shape}")
    return _run_forward(x, weight, bias, residual, act, scale, geom, pad)


def conv_bias_act_known(x: Any, weight: Any, bias: Any, residual: Any, act: str, scale: float,
                        geom: ConvGeometry, pad: PadGeometry | None = None
                        ) -> tuple[Any, ConvContext]:
    """The forward of a signature already checked: C-contiguous arrays of the kinds, shapes
    and dtypes that `conv_bias_act_forward` accepted with this geom and pad, a canonical
    activation and a float scale (Note [layer call cache] in convfuse/nn/_conv_base.py).
    On NumPy arrays the op's own checks run again (cheap there). On device arrays the
    op's checks of the signature are not redone (Note [a known signature on the device]);
    ops are the one entry to the engines, which tests and convfuse.selfcheck patch to see
    what ran, so a replaced op is called as ever."""
    return _run_forward(x, weight, bias, residual, act, scale, geom, pad, known=True)


# Note [a known signature on the device]
# On CuPy arrays an op's checks cost about as much host time as the engine's call itself
# (each array attribute is a Cython property), and for a signature the layer's call cache
# knows, they can only pass: the arrays' classes, shapes, dtypes and contiguity, the
# geometry, activation and scale are what the op accepted before. What a signature does
# not fix, the address of each array and the device it is on, is checked per call
# (_Direct.checked); then the op's validated entry runs, as the torch bridge's calls do
# (Note [per-signature decisions] in convfuse/torch/_signature.py). Where the op or its
# entry was replaced (a test's or the selfcheck's spy), or an address or device would not
# pass, the public op runs and decides, with its own errors. The backward of a
# convolution on device arrays runs the same way after its own checks (_backward).


def _run_forward(x: Any, weight: Any, bias: Any, residual: Any, act: str, scale: float,
                 geom: ConvGeometry, pad: PadGeometry | None,
                 known: bool = False) -> tuple[Any, ConvContext]:
    if pad is not None:
        # validates x against the padding (shape, dtype, contiguity) before any engine runs
        x = ops.pad_forward(x, pad)
    kept = None
    if isinstance(x, np.ndarray):
        with reference_conv.keep_columns(x) as kept:
            y, z = ops.conv_bias_act(
                x, weight, bias, geom, activation=act, residual=residual, residual_scale=scale,
            )
    else:  # pragma: gpu
        # an empty batch takes the public op, which returns it without an engine call
        direct = _Direct.checked(("conv_bias_act",), (x, weight, bias, residual)) \
            if known and geom.batch else None
        y, z = direct.conv_bias_act(x, weight, bias, geom, act, residual, scale) \
            if direct is not None else ops.conv_bias_act(
                x, weight, bias, geom, activation=act, residual=residual, residual_scale=scale)
    saved = _saved(act, y, z)
    columns = kept if kept is not None and kept.cols is not None else None
    ctx = ConvContext(geom, act, x, weight, saved, bias is not None, residual is not None, scale,
                      columns, pad)
    return y, ctx


def conv_bias_act(
    x: Any,
    weight: Any,
    bias: Any = None,
    stride: IntOrTuple = 1,
    padding: IntOrTuple | str = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
    activation: str | None = None,
    residual: Any = None,
    residual_scale: float = 1.0,
    layout: str = "NCHW",
    *,
    padding_mode: str = "zeros",
) -> Any:
    """The forward alone: act(conv(x, weight) + bias + residual_scale * residual). Nothing
    is kept for a backward, so y is writable, as torch.nn.functional's outputs."""
    y, _ = conv_bias_act_forward(
        x, weight, bias, stride, padding, dilation, groups, activation, residual,
        residual_scale, layout, padding_mode=padding_mode,
    )
    return released(y)


def released(y: Any) -> Any:
    """`y` writable again where the forward made it read-only as a saved tensor (the
    forward alone discards the context that saved it)."""
    if isinstance(y, np.ndarray) and not y.flags.writeable:
        with contextlib.suppress(ValueError):  # a view of memory that is not writable
            y.flags.writeable = True
    return y


def conv_bias_act_backward(
    dy: Any,
    ctx: ConvContext,
    *,
    need_dx: bool = True,
    dweight: Any = None,
    dbias: Any = None,
    accumulate: bool = False,
) -> ConvGrads:
    """Gradients of `conv_bias_act` w.r.t. x, weight, bias and residual.

    `dweight`/`dbias`, when given, are written in place; with `accumulate=True` the new
    gradient is added to what they hold (cuDNN's beta = 1, so no extra kernel). The bias
    gradient comes from cudnnConvolutionBackwardBias or the fused activation-backward +
    bias kernel (convfuse.config bias_grad), never from a generic reduction.

    Everything is checked before the first write: a refused call changes neither buffer.
    `dweight`/`dbias` sharing memory with the forward's saved tensors (ctx.x, ctx.weight,
    ctx.saved), with dy or with each other are refused with ValueError.
    """
    try:
        return _backward(dy, ctx, need_dx, dweight, dbias, accumulate)
    except (TypeError, ValueError, ConvfuseError) as exc:
        raise with_signature_names(exc, "conv_bias_act_backward") from None


def _backward(dy: Any, ctx: Any, need_dx: Any, dweight: Any, dbias: Any, accumulate: Any
              ) -> ConvGrads:
    op = "conv_bias_act_backward"
    if not isinstance(ctx, ConvContext):
        raise TypeError(f"{op}: ctx must be the ConvContext conv_bias_act_forward returned, "
                        f"got {type(ctx).__name__}")
    given, dy = dy, _array(op, "dy", dy)
    geom = ctx.geom
    _check_dy(dy, ctx)
    _check_outputs(op, dy, ctx, dweight, dbias, accumulate, given, need_dx)
    beta = 1.0 if accumulate else 0.0
    o: Any = ops
    if not isinstance(dy, np.ndarray):  # pragma: gpu
        o = _Direct.checked(_BACKWARD_OPS, (dy, ctx.x, ctx.weight, ctx.saved, dweight,
                                            dbias)) if geom.batch else None
        if o is None:  # an array the ops would refuse (or a spy, or N = 0): outputs first
            check_device_outputs(op, dweight, dbias)
            o = ops
    dz, db = _bias_act_backward(dy, ctx, dbias, beta, o.conv_backward_bias,
                                o.activation_backward_bias, o.activation_backward)
    if ctx.columns is not None:
        with reference_conv.given_columns(ctx.columns):
            dw = ops.conv_backward_filter(ctx.x, dz, geom, out=dweight, beta=beta)
    else:
        dw = o.conv_backward_filter(ctx.x, dz, geom, out=dweight, beta=beta)
    dx = o.conv_backward_data(dz, ctx.weight, geom) if need_dx else None
    if dx is not None and ctx.pad is not None:
        dx = ops.pad_backward(dx, ctx.pad)
    return ConvGrads(dx, dw, db, _residual_grad(dy, dz, ctx))


def _bias_act_backward(dy: Any, ctx: Any, dbias: Any, beta: float,
                       backward_bias: Callable[..., Any],
                       activation_backward_bias: Callable[..., Any],
                       activation_backward: Callable[..., Any] | None = None
                       ) -> tuple[Any, Any]:
    """(dz, db): the activation's and the bias's gradient, in one pass where there are both;
    `backward_bias` and `activation_backward_bias` are the convolution's ops for them,
    `activation_backward` the activation's (default: ops.activation_backward)."""
    if ctx.activation == "identity":
        db = backward_bias(dy, ctx.geom, out=dbias, beta=beta) if ctx.has_bias else None
        return dy, db
    if ctx.has_bias:
        return activation_backward_bias(dy, ctx.saved, ctx.activation, ctx.geom,
                                        db_out=dbias, beta=beta)
    act_backward = activation_backward or ops.activation_backward
    return act_backward(dy, ctx.saved, ctx.activation), None


# The ops _Direct runs as their validated entries: each public op and its entry as
# defined, to tell a replaced one (a spy) apart.
_BACKWARD_OPS = ("conv_backward_bias", "activation_backward_bias", "activation_backward",
                 "conv_backward_filter", "conv_backward_data")
_PUBLIC = {name: getattr(ops, name) for name in ("conv_bias_act", *_BACKWARD_OPS)}
_VALIDATED = {name: getattr(ops.validated, name) for name in _PUBLIC}


class _Direct:  # pragma: gpu
    """Convolution ops on device arrays as their validated entries (Note [a known
    signature on the device]). The forward: for a signature the layer's call cache knows.
    The backward: its own checks (_check_dy, _check_outputs: classes, shapes, dtypes,
    contiguity, overlaps, against the forward's context, which the forward's op checked)
    cover what the ops would check. What neither fixes, each array's address and device,
    `checked` checks per call."""

    __slots__ = ("act", "conv")

    def __init__(self, xp: Any) -> None:
        self.conv = ops_checks.engine(xp, "conv")
        self.act = ops_checks.engine(xp, "activation")

    @classmethod
    def checked(cls, names: tuple[str, ...], arrays: tuple[Any, ...]) -> _Direct | None:
        """The direct ops, or None where the public ones must run: one of `names` was
        replaced (a spy), or one of `arrays` (the first is an array) is at an address or
        on a device the ops would refuse."""
        for name in names:
            if getattr(ops, name) is not _PUBLIC[name] or \
                    getattr(ops.validated, name) is not _VALIDATED[name]:
                return None
        device = ops_checks.current_device()
        for a in arrays:
            if a is not None and (a.data.ptr % ops_checks.ALIGNMENT or a.device.id != device):
                return None
        return cls(array_module(arrays[0]))

    def conv_bias_act(self, x: Any, w: Any, b: Any, geom: Any, act: str, residual: Any,
                      scale: float) -> tuple[Any, Any]:
        return ops.validated.conv_bias_act(self.conv, x, w, b, geom, act, residual, scale)

    def conv_backward_bias(self, dz: Any, geom: Any, out: Any = None,
                           beta: float = 0.0) -> Any:
        return ops.validated.conv_backward_bias(self.conv, dz, geom, out, beta)

    def activation_backward_bias(self, dy: Any, saved: Any, act: str, geom: Any,
                                 db_out: Any = None, beta: float = 0.0) -> tuple[Any, Any]:
        return ops.validated.activation_backward_bias(self.act, dy, saved, act, geom, db_out,
                                                      beta)

    def activation_backward(self, dy: Any, saved: Any, act: str) -> Any:
        return ops.validated.activation_backward(self.act, dy, saved, act)

    def conv_backward_filter(self, x: Any, dz: Any, geom: Any, out: Any = None,
                             beta: float = 0.0) -> Any:
        return ops.validated.conv_backward_filter(self.conv, x, dz, geom, out, beta)

    def conv_backward_data(self, dz: Any, w: Any, geom: Any) -> Any:
        return ops.validated.conv_backward_data(self.conv, dz, w, geom)


def _residual_grad(dy: Any, dz: Any, ctx: Any) -> Any:
    if not ctx.has_residual:
        return None
    scale = ctx.residual_scale
    if scale == 1.0:  # dz may be the caller's dy (identity): a new array, never an alias
        return dz.copy() if dz is dy else dz
    # in the compute dtype, rounded once, as the forward scales the residual: a scale
    # rounded to float16/bfloat16 first was another number (0.3 -> 0.30078125 in bfloat16)
    # and overflowed (1e5 -> inf in float16)
    cd = dtypes.compute_dtype(dz.dtype)
    if cd == dz.dtype:
        return dz * cd.type(scale)
    return (dz.astype(cd) * cd.type(scale)).astype(dz.dtype)


def _check_outputs(op: str, dy: Any, ctx: _ForwardContext, dweight: Any, dbias: Any,
                   accumulate: Any, given: Any = None, need_dx: Any = True) -> None:
    """The output buffers, checked as the ops would check them, before any op writes
    (`given`: the caller's dy, where `dy` is a contiguous copy of it)."""
    geom = ctx.geom
    if not isinstance(accumulate, (bool, np.bool_)):
        raise TypeError(f"{op}: accumulate must be a bool, got {type(accumulate).__name__}")
    if not isinstance(need_dx, (bool, np.bool_)):  # "no" would count as true
        raise TypeError(f"{op}: need_dx must be a bool, got {type(need_dx).__name__} "
                        f"{need_dx!r}")
    if accumulate and (dweight is None or (ctx.has_bias and dbias is None)):
        missing = "dweight" if dweight is None else "dbias"
        raise ValueError(f"{op}: accumulate=True adds into {missing}, but {missing} is None")
    outs = [("dweight", dweight, geom.weight_shape)]
    if ctx.has_bias:
        outs.append(("dbias", dbias, geom.bias_shape))
    elif dbias is not None:
        raise ValueError(f"{op}: dbias was given, but the forward had no bias")
    saved = [("ctx.x", ctx.x), ("ctx.weight", ctx.weight), ("ctx.saved", ctx.saved),
             ("dy", dy)]
    # the caller's dy where `dy` is a copy of it: a write there would change their array
    view = given if given is not None and given is not dy else None
    checked: list[tuple[str, Any]] = []
    for name, out, shape in outs:
        if out is None:
            continue
        if not (isinstance(out, np.ndarray) or is_cupy(out)):
            raise TypeError(f"{op}: {name} must be a NumPy or CuPy array or None, got "
                            f"{type(out).__name__}")
        if device_of(out) != device_of(dy):
            raise DeviceMismatchError(f"{op}: {name} is on {device_of(out)!r} but dy is on "
                                      f"{device_of(dy)!r}")
        if tuple(out.shape) != tuple(shape) or out.dtype != dy.dtype:
            raise ValueError(f"{op}: {name} has shape {tuple(out.shape)} and dtype {out.dtype}, "
                             f"expected {tuple(shape)} and {dy.dtype}")
        if not out.flags.c_contiguous:
            raise ValueError(f"{op}: {name} is not C-contiguous (it is written in place)")
        for other, arr in [*saved, *checked]:
            if arr is not None and overlaps(out, arr):
                raise ValueError(
                    f"{op}: {name} shares memory with {other}, which backward reads while "
                    f"writing {name}; pass a separate array"
                )
        if view is not None and ops_checks.overlaps_view(out, view):
            raise ValueError(f"{op}: {name} shares memory with dy, which backward reads "
                             f"while writing {name}; pass a separate array")
        if isinstance(out, np.ndarray) and not out.flags.writeable:
            raise ValueError(f"{op}: {name} is read-only but the gradient is written there")
        checked.append((name, out))


def check_device_outputs(op: str, dweight: Any, dbias: Any) -> None:  # pragma: gpu
    """The ops' own checks of device outputs (alignment, device id), made before the first
    write: dbias is written before the filter gradient's op would refuse dweight."""
    outs = [ops_checks.Arg(name, out, None, output=True)
            for name, out in (("dweight", dweight), ("dbias", dbias)) if out is not None]
    if outs:
        ops_checks._check_gpu_arrays(op, outs)


def _check_dy(dy: Any, ctx: _ForwardContext) -> None:
    try:
        array_module(dy, ctx.x)
    except DeviceMismatchError as exc:
        raise DeviceMismatchError(
            f"dy and the forward's input are on different devices: {exc}"
        ) from None
    if tuple(dy.shape) != ctx.geom.output_shape:
        raise ValueError(
            f"dy has shape {tuple(dy.shape)}, but the forward's output has shape "
            f"{ctx.geom.output_shape} ({ctx.geom.layout})"
        )
    if dy.dtype != ctx.x.dtype:
        raise ValueError(f"dy has dtype {dy.dtype}, but the forward ran in {ctx.x.dtype}")
