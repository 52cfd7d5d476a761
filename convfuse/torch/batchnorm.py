"""BatchNorm1d, BatchNorm2d, BatchNorm3d as torch.nn.Modules running convfuse's batch
normalization, with a fused residual add and activation.

Parameters and buffers are created, named and initialised exactly as torch.nn.BatchNorm*d's
(weight, bias, running_mean, running_var, num_batches_tracked; same dtypes, same state-dict
version), so state dicts are interchangeable, and train/eval, momentum=None (cumulative
average) and track_running_stats=False follow PyTorch's rules line for line.
`forward(x, residual=None)` computes act(batchnorm(x) + residual) in one convfuse op
(_bn_ops.py). The classes do not subclass torch.nn.BatchNorm*d: code that rewrites
PyTorch's batch norms by isinstance (SyncBatchNorm.convert_sync_batchnorm, fusers) must
not take them for PyTorch's own.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..geometry import is_int
from . import _bn_plan, _eager, _host_arrays
from ._activation import FusedActivation
from ._arrays import SUPPORTED_DTYPES
from ._bn_ops import batchnorm_call, refuse_a_training_trace
from ._errors import InputDeviceError, InputShapeError, InputTypeError
from ._functorch import torch_activation
from ._module_state import PlainClasses, once_per_call, parametrized
from ._signature import SignatureCache, keyable

_HALF = (torch.float16, torch.bfloat16)


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _scalar(v: Any) -> Any:
    """A hyperparameter's value: a 0-d tensor's number (it may change in place, and a
    tensor hashes by identity), anything else as it is."""
    if type(v) is float or v is None:  # the common cases first: this runs at every call
        return v
    if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_complex():
        return v.item()
    return v


def _torch_allows_zero_eps_in_eval() -> bool:
    """Whether the installed torch.nn accepts eps=0 with running statistics (2.13 does,
    2.11 refuses any eps <= 0)."""
    try:
        torch.nn.functional.batch_norm(torch.ones(2, 1), torch.zeros(1), torch.ones(1),
                                       training=False, eps=0.0)
    except ValueError:
        return False
    return True


_ZERO_EPS_IN_EVAL = _torch_allows_zero_eps_in_eval()

#: Signatures whose input checks passed -> their BatchNormCall, or GENERAL (Note
#: [batch-norm call plans] in _bn_plan.py).
CALLS = SignatureCache()
GENERAL = "general"  # a checked call the layer's general path runs
_PLAIN = PlainClasses("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


class _BatchNormNd(FusedActivation, _host_arrays.HoldsViews):
    """The shared body of BatchNorm1d/2d/3d; `_ndims` are the accepted input ranks."""

    _version = 2  # torch.nn's: version 2 added num_batches_tracked
    _ndims: tuple[int, ...] = ()
    # Buffers (None without running stats); nn.Module's __getattr__ would type them Tensor | Module.
    running_mean: Any
    running_var: Any
    num_batches_tracked: Any

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        activation: str | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        # Python or NumPy numbers (a count read off an array's shape is a NumPy integer;
        # torch.nn takes them too), never a bool
        if not is_int(num_features) or num_features < 1:
            raise ValueError(f"{name}: num_features must be a positive int, got {num_features!r}")
        num_features = int(num_features)
        if not _is_real(eps) or eps != eps:
            raise ValueError(f"{name}: eps must be a number, got {eps!r}")
        if momentum is not None and not _is_real(momentum):
            raise TypeError(f"{name}: momentum must be a number or None, got "
                            f"{type(momentum).__name__} {momentum!r}")
        if momentum is not None and not 0.0 <= momentum <= 1.0:
            raise ValueError(f"{name}: momentum must lie in [0, 1] or be None, got {momentum!r}")
        factory = {"device": device, "dtype": dtype}
        pdtype = torch.empty(0, **factory).dtype
        if pdtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: dtype {pdtype} is not supported; convfuse computes in "
                            "float32, float64, float16 or bfloat16")
        self.activation = activation
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        if affine:
            self.weight = nn.Parameter(torch.empty(num_features, **factory))
            if bias:
                self.bias = nn.Parameter(torch.empty(num_features, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(num_features, **factory))
            self.register_buffer("running_var", torch.ones(num_features, **factory))
            self.register_buffer("num_batches_tracked",
                                 torch.tensor(0, dtype=torch.long, device=device))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        if self.affine:
            nn.init.ones_(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        # torch.nn's rule: a state dict older than version 2 has no num_batches_tracked.
        version = local_metadata.get("version", None)
        key = prefix + "num_batches_tracked"
        if (version is None or version < 2) and self.track_running_stats \
                and key not in state_dict:
            nbt = self.num_batches_tracked
            state_dict[key] = nbt if nbt is not None and nbt.device.type != "meta" \
                else torch.tensor(0, dtype=torch.long)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)

    def _check(self, x: torch.Tensor, residual: torch.Tensor | None,
               use_batch_stats: bool) -> None:
        name = type(self).__name__
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: input must be a torch.Tensor, got {type(x).__name__}")
        if x.layout != torch.strided:
            raise InputTypeError(f"{name}: input has layout {x.layout}; convfuse takes dense "
                                 "(torch.strided) tensors")
        if x.dim() not in self._ndims:
            ranks = " or ".join(f"{n}-d" for n in self._ndims)
            raise ValueError(f"{name}: expected a {ranks} input, got shape {tuple(x.shape)}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise InputTypeError(f"{name}: input dtype {x.dtype} is not supported; convfuse "
                                 "computes in float32, float64, float16 or bfloat16")
        present = [(what, t) for what, t in (
            ("weight", self.weight), ("bias", self.bias), ("running_mean", self.running_mean),
            ("running_var", self.running_var)) if t is not None]
        # torch.nn reads the channel count off the per-channel tensors, not num_features (a
        # layer whose parameters and statistics were swapped for others still runs), and
        # takes any count when there are none
        channels = x.shape[1]
        for what, t in present:
            if tuple(t.shape) != (channels,):
                first, ft = present[0]
                if tuple(ft.shape) == (channels,) or ft.dim() != 1:
                    raise InputShapeError(f"{name}: the {what} has shape {tuple(t.shape)}, the "
                                          f"input has {channels} channels")
                raise InputShapeError(f"{name}: input has {channels} channels, the layer "
                                      f"expects {ft.shape[0]}")  # torch.nn: a RuntimeError
        self._check_scalars(use_batch_stats)
        # the input's dtype throughout, or PyTorch's mixed precision: float16/bfloat16 data
        # with every parameter and statistic in float32 (torch.nn refuses a mix of the two)
        per_channel = x.dtype if x.dtype not in _HALF or not present \
            or present[0][1].dtype != torch.float32 else torch.float32
        for what, t in present:
            if t.dtype == per_channel:
                pass
            elif x.dtype in _HALF and t.dtype in (x.dtype, torch.float32):
                first, ft = present[0]
                raise InputTypeError(
                    f"{name}: the {what} is {t.dtype} but the {first} is {ft.dtype}: with "
                    f"{x.dtype} input, the weight, bias and running statistics are all "
                    f"{x.dtype} or all float32 (as torch.nn)")
            else:
                raise InputTypeError(f"{name}: input dtype {x.dtype} does not match the "
                                     f"{what}'s {t.dtype}")
            if t.device != x.device:
                raise InputDeviceError(f"{name}: input is on {x.device}, the {what} on "
                                       f"{t.device}")
        if use_batch_stats and math.prod(x.shape) == x.shape[1]:
            raise ValueError(f"{name}: expected more than 1 value per channel when training, "
                             f"got input shape {tuple(x.shape)}")
        if residual is None:
            return
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"{name}: residual must be a torch.Tensor or None, got "
                            f"{type(residual).__name__}")
        if residual.layout != torch.strided:
            raise InputTypeError(f"{name}: residual has layout {residual.layout}; convfuse "
                                 "takes dense (torch.strided) tensors")
        if residual.shape != x.shape:
            raise ValueError(f"{name}: residual has shape {tuple(residual.shape)}, the input "
                             f"has shape {tuple(x.shape)}")
        if residual.dtype != x.dtype or residual.device != x.device:
            raise (InputDeviceError if residual.device != x.device else InputTypeError)(
                f"{name}: residual is {residual.dtype} on {residual.device}, the input "
                f"{x.dtype} on {x.device}")

    def _check_scalars(self, use_batch_stats: bool) -> None:
        """eps and momentum as they are now (assigned after construction too, a 0-d tensor
        included), checked before the count moves: a refused call changes nothing."""
        name = type(self).__name__
        eps, momentum = _scalar(self.eps), _scalar(self.momentum)
        if not _is_real(eps) or not math.isfinite(eps):
            raise ValueError(f"{name}: eps must be a finite number, got {self.eps!r}")
        # torch.nn's checks: eps positive when normalising with the batch's statistics,
        # non-negative otherwise (torch 2.11 wants it positive always: the rule of the
        # installed torch is followed)
        if use_batch_stats and not eps > 0:
            raise ValueError(f"{name}: eps must be positive during training, but got "
                             f"{self.eps!r}")
        if not use_batch_stats and not (eps > 0 or (eps == 0 and _ZERO_EPS_IN_EVAL)):
            raise ValueError(f"{name}: eps must be "
                             f"{'non-negative' if _ZERO_EPS_IN_EVAL else 'positive'}, but got "
                             f"{self.eps!r}")
        # the constructor's rule (torch.nn takes any float and computes with it)
        if momentum is not None and not _is_real(momentum):
            raise TypeError(f"{name}: momentum must be a number or None, got "
                            f"{type(self.momentum).__name__} {self.momentum!r}")
        if momentum is not None and not 0.0 <= momentum <= 1.0:
            raise ValueError(f"{name}: momentum must lie in [0, 1] or be None, got "
                             f"{self.momentum!r}")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """act(batchnorm(x) + residual), fused in one convfuse op; torch.nn's rules decide
        between batch and running statistics and whether the running ones are updated."""
        if parametrized(self):
            with once_per_call():  # Note [a parametrized weight, once per call]
                return self._forward(x, residual)
        return self._forward(x, residual)

    def _forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        weight, bias, rm, rv, nbt = self._state()
        if weight is None and bias is not None:
            # a weight set to None after construction (torch.nn takes it): torch's batch norm,
            # as under torch.func, where the fused ops would give the bias no gradient
            self._check(x, residual, self._use_batch_stats())
            return self._torch_batch_norm(x, residual)
        eager = _eager.takes_eager_path(x, weight, bias, residual, rm, rv, nbt)
        if not eager and _eager.under_torch_func():  # Note [torch.func transforms]
            self._check(x, residual, self._use_batch_stats())
            return self._torch_batch_norm(x, residual)
        if not eager and _eager._compiling():
            # traced by dynamo: a read of CALLS would become a guard of the compiled graph,
            # failed (a recompile) whenever any eager call adds a signature
            self._check(x, residual, self._use_batch_stats())
            return self._general(x, residual)
        key = self._call_key(x, residual, weight, bias, rm, rv, nbt, eager)
        try:
            call = CALLS.get(key)
        except TypeError:  # an unhashable hyperparameter: checked every time
            call = None
        if call is None:
            use_batch_stats = self._use_batch_stats()
            self._check(x, residual, use_batch_stats)  # before any state changes
            call = CALLS.remember(key, self._plan(x, residual, use_batch_stats, key))
        if call is GENERAL or not eager:
            return self._general(x, residual)
        if call.count:
            nbt.add_(1)
        # Buffers are passed when they are updated (training and tracking) or read (eval).
        return call(x, weight, bias, residual, (rm, rv, nbt) if call.reads else (None, None, nbt),
                    _host_arrays.of(self))

    def _state(self) -> tuple[Any, Any, Any, Any, Any]:
        """(weight, bias, running_mean, running_var, num_batches_tracked), read from
        nn.Module's dicts where attribute access would return just that (Note [reading a
        layer's state] in _module_state.py), else by attribute access (also under dynamo,
        whose guard on _PLAIN's dict would fail as it fills)."""
        if not _eager._compiling() and type(self) in _PLAIN:
            d = self.__dict__
            try:
                p, b = d["_parameters"], d["_buffers"]
                return (p["weight"], p["bias"], b["running_mean"], b["running_var"],
                        b["num_batches_tracked"])
            except KeyError:  # deleted, or moved out of the dicts
                pass
        return (self.weight, self.bias, self.running_mean, self.running_var,
                self.num_batches_tracked)

    def _use_batch_stats(self) -> bool:
        return self.training or (self.running_mean is None and self.running_var is None)

    def _factor_momentum(self) -> float | None:
        """The momentum handed to the op: torch.nn's, 0 with no count to average over."""
        momentum = _scalar(self.momentum)
        if self.training and self.track_running_stats and momentum is None \
                and self.num_batches_tracked is None:
            return 0.0  # torch.nn: no count, no cumulative average
        return momentum

    def _plan(self, x: torch.Tensor, residual: torch.Tensor | None, use_batch_stats: bool,
              key: Any) -> Any:
        """A checked call's BatchNormCall, or GENERAL where the general path runs it (Note
        [batch-norm call plans] in _bn_plan.py)."""
        if key is None:
            return GENERAL
        reads = not self.training or self.track_running_stats
        call = _bn_plan.plan(x, self.weight, self.bias, residual, use_batch_stats,
                             float(self.eps), self._factor_momentum(), self.activation,
                             self.running_mean if reads else None,
                             self.running_var if reads else None, self.num_batches_tracked)
        if call is None:
            return GENERAL
        call.reads = reads
        call.count = (self.training and self.track_running_stats
                      and self.num_batches_tracked is not None)
        return call

    def _general(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """A checked call through batchnorm_call: the custom ops under a tracer, and
        whatever a plan does not hold (Note [batch-norm call plans] in _bn_plan.py)."""
        use_batch_stats = self._use_batch_stats()
        factor_momentum = self._factor_momentum()
        # before the count moves: a refused call changes nothing
        refuse_a_training_trace(use_batch_stats, x, self.weight, self.bias, residual)
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        stats = not self.training or self.track_running_stats
        rm = self.running_mean if stats else None
        rv = self.running_var if stats else None
        if x.numel() == 0:
            return self._empty_batch(x, residual, rm, rv, use_batch_stats)
        return batchnorm_call(x, self.weight, self.bias, residual, rm, rv,
                              self.num_batches_tracked, use_batch_stats, factor_momentum,
                              float(self.eps), self.activation)

    def _call_key(self, x: Any, residual: Any, weight: Any, bias: Any, rm: Any, rv: Any,
                  nbt: Any, eager: bool) -> Any:
        """The key of a call's checks and BatchNormCall (Note [batch-norm call plans] in
        _bn_plan.py): all they read, strides included, or None where nothing may be
        remembered (a non-tensor argument, which the checks refuse; a trace, whose sizes
        may be symbolic: `eager` already rules it out)."""
        if type(x) is not torch.Tensor or (residual is not None
                                           and type(residual) is not torch.Tensor) \
                or (not eager and not keyable(x, residual)):
            return None
        return (type(self), x.shape, x.stride(), x.dtype, x.device,
                None if residual is None else (residual.shape, residual.stride(),
                                               residual.dtype, residual.device),
                None if weight is None else (weight.shape, weight.stride(), weight.dtype,
                                             weight.device),
                None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
                None if rm is None else (rm.shape, rm.stride(), rm.dtype, rm.device),
                None if rv is None else (rv.shape, rv.stride(), rv.dtype, rv.device),
                nbt is None, self.num_features, _scalar(self.eps), _scalar(self.momentum),
                self.activation, self.training, self.track_running_stats)

    def _torch_batch_norm(self, x: torch.Tensor,
                          residual: torch.Tensor | None) -> torch.Tensor:
        """torch.nn.BatchNorm's forward, then the residual add and the activation, in torch
        ops: what torch.func transforms and forward AD differentiate (Note [torch.func
        transforms] in _eager.py), with torch.nn's numbers and rules, its errors included."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # the cumulative average, as torch.nn computes it
                factor = 1.0 / float(self.num_batches_tracked)
        stats = not self.training or self.track_running_stats
        y = F.batch_norm(x, self.running_mean if stats else None,
                         self.running_var if stats else None, self.weight, self.bias,
                         self._use_batch_stats(), factor, float(self.eps))
        if residual is not None:
            y = y + residual
        return torch_activation(self.activation)(y)

    def _empty_batch(self, x: torch.Tensor, residual: torch.Tensor | None, rm: Any, rv: Any,
                     use_batch_stats: bool) -> torch.Tensor:
        """An empty batch: nothing to compute. torch's own batch norm gives what torch.nn
        gives (the empty output, zero weight and bias gradients; the running statistics
        unchanged while num_batches_tracked counts the batch, as above)."""
        keep = use_batch_stats  # batch statistics: the running ones are neither read nor written
        y = torch.nn.functional.batch_norm(x, None if keep else rm, None if keep else rv,
                                           self.weight, self.bias, use_batch_stats, 0.0,
                                           float(self.eps))
        return y if residual is None else y + residual

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, bias={self.bias is not None}, "
                f"track_running_stats={self.track_running_stats}, "
                f"activation={self.activation!r}")


class BatchNorm1d(_BatchNormNd):
    """torch.nn.BatchNorm1d + fused residual add and activation; input (N, C) or (N, C, L)."""

    _ndims = (2, 3)


class BatchNorm2d(_BatchNormNd):
    """torch.nn.BatchNorm2d + fused residual add and activation; input (N, C, H, W),
    contiguous or channels_last (convfuse's NHWC, no copy)."""

    _ndims = (4,)


class BatchNorm3d(_BatchNormNd):
    """torch.nn.BatchNorm3d + fused residual add and activation; input (N, C, D, H, W)."""

    _ndims = (5,)
