"""BatchNorm1d, BatchNorm2d, BatchNorm3d: batch normalization with a fused residual add and
activation, PyTorch's semantics and state_dict keys.

`y = bn(x, residual=None)` computes act(batchnorm(x) + residual), so a ResNet block's add
and ReLU cost no extra pass (one cuDNN call where cuDNN fuses them, Note [BatchNorm in
cuDNN]). Training normalises with the batch's biased variance and folds the unbiased one
into running_var (when it tracks them); evaluation uses the running statistics, or the
batch's when the layer has none (track_running_stats=False at construction), as PyTorch
decides: by the buffers, not the flag. `bn.backward(dy)` returns dx (and
dresidual when the forward took a residual) and accumulates into weight.grad / bias.grad,
reusing the forward's saved mean and inverse std.

Differences from PyTorch, documented: weight, bias and the running statistics of a float16
or bfloat16 layer are float32 (cuDNN's derived BN descriptor type; PyTorch's AMP keeps them
float32 too).

Note [momentum=None without a host sync]
momentum=None is the cumulative average: factor 1/num_batches_tracked. cuDNN takes the
factor as a host double, and num_batches_tracked lives on the device, so on the GPU the
layer keeps a host mirror of the count. It is read from the device once (one sync) when
stale: at the first training forward, after `.to()`, after load_state_dict, after
another array is assigned to num_batches_tracked and after `momentum` is assigned (replays
of a step captured with a float momentum count on the device only); between those it is
kept in step by the layer itself (so reset the count with reset_running_stats(), not by
writing into the array in place). A CUDA graph would replay the factor of the capture
forever, so a momentum=None layer refuses to run inside graph.capture (CaptureError);
use a float momentum there. On the CPU the count is read directly (no sync to avoid).
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from .. import dtypes, ops
from .._memory import check_bytes
from ..backend import array_module, is_cupy, resolve_device, to_device
from ..errors import ArrayTooLargeError, CaptureError, renamed
from ..grad_mode import is_grad_enabled
from ..ops._checks import as_float
from ..ops.batchnorm import as_factor
from ..plan.batchnorm import LAYOUTS, BatchNormGeometry
from . import _hyper
from ._hyper import dtype_hint
from .module import USER_ERRORS, Layer, contiguous, init_parameter
from .parameter import Parameter


class _BatchNorm(Layer):
    """The shared body of BatchNorm1d/2d/3d; `_ndims` are the accepted input ranks."""

    # A convolution of the same rank names its layouts so (Conv1d(layout="NWC")): they read
    # as the two a batch norm knows, so one layer's `layout` can be handed to the next.
    _rank_layouts: tuple[tuple[str, str], ...] = ()

    _ndims: tuple[int, ...] = ()
    weight: Parameter | None
    bias: Parameter | None
    # Buffers (register_buffer), arrays on the layer's device or None without running stats.
    running_mean: Any
    running_var: Any
    num_batches_tracked: Any

    activation = _hyper.activation_property()

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 activation: str | None = None, layout: str = "NCHW", dtype: Any = "float32",
                 device: str | None = None, *, bias: bool = True) -> None:
        name = type(self).__name__
        if not isinstance(bias, (bool, np.bool_)):
            raise TypeError(f"{name}: bias must be a bool, got {type(bias).__name__} {bias!r}")
        try:
            self.num_features = _hyper.positive_int(num_features, "num_features")
        except (TypeError, ValueError) as exc:
            raise renamed(exc, name) from None
        self.eps = _real(name, "eps", eps, 0.0, None)
        self.momentum = None if momentum is None else _real(name, "momentum", momentum, 0.0, 1.0)
        self.affine, self.track_running_stats = bool(affine), bool(track_running_stats)
        self.activation = activation
        names = {**{n: n for n in LAYOUTS}, **dict(type(self)._rank_layouts)}
        canonical = names.get(layout.upper()) if isinstance(layout, str) else None
        if canonical is None:
            raise ValueError(f"{name}: layout must be one of {sorted(names)}, got {layout!r}")
        self.layout = canonical
        self.dtype = dtypes.canonical(dtype)
        self.device = resolve_device(device)
        pdt = dtypes.compute_dtype(self.dtype)
        self._ctx = None
        self._host_count: int | None = None  # Note [momentum=None without a host sync]
        try:  # each per-channel array, drawn on the host in float64 first (as the convs')
            check_bytes((num_features,), np.float64, "cpu", "weight (made on the host)")
            check_bytes((num_features,), pdt, self.device, "weight")
        except ArrayTooLargeError as exc:
            raise renamed(exc, name) from None
        if self.affine:  # bias=False: a scale without a shift, as torch.nn's (2.13) keyword
            self.weight = init_parameter(np.ones(num_features), pdt, self.device, "weight")
            self.bias = init_parameter(np.zeros(num_features), pdt, self.device, "bias") \
                if bias else None
        else:
            self.weight = None
            self.bias = None
        if self.track_running_stats:
            self.register_buffer("running_mean", to_device(np.zeros(num_features, pdt),
                                                           self.device))
            self.register_buffer("running_var", to_device(np.ones(num_features, pdt),
                                                          self.device))
            self.register_buffer("num_batches_tracked",
                                 to_device(np.zeros((), np.int64), self.device))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            self.running_mean[...] = 0
            self.running_var[...] = 1
            self.num_batches_tracked[...] = 0
            self._host_count = 0

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        for p, value in ((self.weight, 1), (self.bias, 0)):  # each on its own (bias=False)
            if p is not None:
                p.data[...] = value
                p.bump_version()  # a forward saved before it is now stale

    def _geometry(self, x: Any) -> BatchNormGeometry:
        # checked once per signature (Note [layer call cache] in _conv_base.py); layout and
        # num_features are plain attributes, so they are part of the key
        key = (x.shape, self.layout, self.num_features)
        cache = self.__dict__.setdefault("_bn_geoms", {})
        g = cache.get(key)
        if g is None:
            g = self._checked_geometry(x)
            if len(cache) >= 64:
                cache.clear()
            cache[key] = g
        return g

    def _checked_geometry(self, x: Any) -> BatchNormGeometry:
        name = type(self).__name__
        if x.ndim not in self._ndims:
            ranks = " or ".join(f"{n}-d" for n in self._ndims)
            raise ValueError(f"{name} expects a {ranks} input, got shape {tuple(x.shape)}")
        g = BatchNormGeometry.create(x.shape, self.layout, name)
        if g.channels != self.num_features:
            raise ValueError(
                f"{name}: expected {self.num_features} channels on axis {g.channel_axis} "
                f"(layout {self.layout}), got input shape {tuple(x.shape)}")
        return g

    def _factor(self) -> float:
        """exponential_average_factor for this training step (count not yet incremented)."""
        if self.momentum is not None:
            return self.momentum
        nbt = self.num_batches_tracked
        if nbt is None:  # torch.nn: no count, no cumulative average (factor 0.0)
            return 0.0
        if not is_cupy(nbt):
            return as_factor(None, int(nbt) + 1)
        import cupy  # pragma: gpu

        if cupy.cuda.get_current_stream().is_capturing():  # pragma: gpu
            raise CaptureError(
                f"{type(self).__name__}(momentum=None) cannot be captured: its factor "
                "1/num_batches_tracked changes every step and cuDNN takes it from the host "
                "(Note [momentum=None without a host sync]); use a float momentum")
        if self._host_count is None:  # pragma: gpu
            self._host_count = int(nbt.get())  # the one sync, only when stale
        return as_factor(None, self._host_count + 1)  # pragma: gpu

    def _checked_count(self) -> Any:
        """num_batches_tracked, checked before the statistics are written (it is counted
        after): a writable 0-d integer array, or None (torch.nn then counts nothing)."""
        nbt = self.num_batches_tracked
        if nbt is None:
            return None
        kind = getattr(getattr(nbt, "dtype", None), "kind", None)
        if getattr(nbt, "shape", None) != () or kind not in ("i", "u") \
                or not getattr(getattr(nbt, "flags", None), "writeable", True):
            raise TypeError(f"num_batches_tracked must be a writable 0-d integer array or "
                            f"None, got {type(nbt).__name__} {nbt!r}")
        return nbt

    def __call__(self, x: Any, residual: Any = None) -> Any:
        """act(batchnorm(x) + residual); a non-C-contiguous x or residual is copied once."""
        try:
            return self._forward(x, residual)
        except USER_ERRORS as exc:
            raise self._renamed(exc) from None

    def _forward(self, x: Any, residual: Any) -> Any:
        name = type(self).__name__
        self._check_input(x)
        if residual is not None:
            self._check_input(residual, "residual")
        if x.dtype != self.dtype:
            raise ValueError(
                f"{name} has dtype {self.dtype} but its input has dtype {x.dtype}; "
                f"{dtype_hint(self.dtype, x.dtype)}")
        x = contiguous(x)
        if residual is not None:
            residual = contiguous(residual)
        g = self._geometry(x)
        w = self.weight.data if self.weight is not None else None
        b = self.bias.data if self.bias is not None else None
        stats = (self.running_mean, self.running_var)
        if (stats[0] is None) != (stats[1] is None):
            raise ValueError(f"{name}: running_mean and running_var must both be arrays or "
                             "both None")
        # torch.nn's rule: batch statistics in training, or when there are no running ones
        if self.training or stats[0] is None:
            update = self.training and self.track_running_stats and stats[0] is not None
            nbt = self._checked_count() if update else None
            rm, rv = stats if update else (None, None)
            factor = self._factor() if update else 0.0
            y, saved = ops.batchnorm_forward_training(
                x, w, b, rm, rv, self.layout, self.eps, factor, self.activation, residual)
            if nbt is not None:
                nbt += 1  # in place, on the device: capturable
                if self._host_count is not None:
                    self._host_count += 1
        else:
            # under convfuse.no_grad() no backward will follow: no statistics for one
            y, saved = ops.batchnorm_forward_inference(
                x, w, b, self.running_mean, self.running_var, self.layout, self.eps,
                self.activation, residual, is_grad_enabled())
        if isinstance(saved.saved, np.ndarray):
            saved.saved.flags.writeable = False  # an in-place write would corrupt dx
        # what backward differentiates is this call's: eps, layout and activation as they
        # were (an assignment between the two calls takes effect at the next forward)
        self._ctx = (saved, x, residual is not None, g, self.eps, self.layout,
                     self.activation)
        return y

    forward = __call__

    def backward(self, dy: Any) -> Any:
        """dx (and dresidual when the forward took one); accumulates into .grad.
        Atomic and repeatable: see Layer's backward rule."""
        return self._backward_with(dy, self._backward)

    def _backward(self, ctx: Any, dy: Any) -> Any:
        saved, x, has_residual, _, eps, layout, activation = ctx
        dy = self._check_dy(dy, x.shape, x.dtype)
        weight, bias = self.weight, self.bias
        w = None if weight is None else weight.data
        b = None if bias is None else bias.data
        weight_grad = None if weight is None else weight.grad
        bias_grad = None if bias is None else bias.grad
        if (weight is None) != (bias is None):
            # the op takes both parameters (and writes both gradients) or neither: the one
            # set to None after construction is its identity (a weight of ones, a bias of
            # zeros, as the forward computed without it) with a scratch gradient, dropped
            have = w if w is not None else b
            xp = array_module(have)
            if w is None:
                w, weight_grad = xp.ones_like(have), xp.zeros_like(have)
            else:
                b, bias_grad = xp.zeros_like(have), xp.zeros_like(have)
        dx, _, _, dres = ops.batchnorm_backward(
            dy, x, w, b, saved, layout,
            eps, activation, has_residual, need_dx=self.needs_input_grad,
            weight_grad=weight_grad, bias_grad=bias_grad,
            param_beta=1.0 if w is not None else 0.0)
        return (dx, dres) if has_residual else dx

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "num_batches_tracked" and value is not self.__dict__.get(name):
            # another array (not the step's own in-place `+= 1`): the host's mirror of the
            # count is stale, re-read at the next momentum=None step
            self.__dict__["_host_count"] = None
        elif (name == "momentum" and value is None
              and self.__dict__.get("momentum") is not None and "_host_count" in self.__dict__):
            # captured steps replayed with a float momentum count on the device alone (the
            # mirror is kept by eager steps): a switch to None re-reads the count (None
            # assigned again, by a schedule at every step, keeps it: no sync per step)
            self.__dict__["_host_count"] = None
        super().__setattr__(name, value)

    def _buffers_written(self) -> None:
        """Its buffers were overwritten in place (convfuse.distributed.broadcast_buffers):
        the host's mirror of the count is stale."""
        self._host_count = None

    def _move_own(self, target: str) -> None:
        super()._move_own(target)
        self._host_count = None

    def _param_from_state(self, name: str, value: Any) -> Any:
        if name == "num_batches_tracked":
            self._host_count = None  # re-read at the next momentum=None step
        return value

    def extra_repr(self) -> str:
        bias = self.bias is not None or not self.affine  # (torch.nn's repr shows it too)
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, bias={bias}, "
                f"track_running_stats={self.track_running_stats}, "
                f"activation={self.activation!r}, layout={self.layout!r}, dtype={self.dtype}, "
                f"device={self.device!r}")


def _real(layer: str, what: str, value: Any, lo: float, hi: float | None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{layer}: {what} must be a real number, got {type(value).__name__}")
    v = as_float(value)
    if not (v >= lo and (hi is None or v <= hi)) or v != v or v == float("inf"):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo} and finite"
        raise ValueError(f"{layer}: {what} must be {bound}, got {value!r}")
    return v


class BatchNorm1d(_BatchNorm):
    """Over (N, C) or (N, C, L) (NCHW, also "NCW") / (N, L, C) (NHWC, also "NWC")."""

    _ndims = (2, 3)
    _rank_layouts = (("NCW", "NCHW"), ("NWC", "NHWC"))


class BatchNorm2d(_BatchNorm):
    """Over (N, C, H, W) (NCHW) or (N, H, W, C) (NHWC)."""

    _ndims = (4,)


class BatchNorm3d(_BatchNorm):
    """Over (N, C, D, H, W) (NCHW, also "NCDHW") or (N, D, H, W, C) (NHWC, also "NDHWC")."""

    _ndims = (5,)
    _rank_layouts = (("NCDHW", "NCHW"), ("NDHWC", "NHWC"))
