"""Batch normalization: its geometry, and the cuDNN plan of one (geometry, dtype, fused ops).

Note [BatchNorm in cuDNN]
- Mode: inference always runs CUDNN_BATCHNORM_SPATIAL. Training (and its backward, which
  must use the forward's mode) runs CUDNN_BATCHNORM_SPATIAL_PERSISTENT for 4-d
  channels-last float/half/bfloat16 data, as PyTorch does for channels_last (cuDNN
  documents its optimized path for float and half at compute capability >= 6.0; the
  reference's caveat on its scaled atomic integers, overflow-prone on extreme ranges, is
  for NCHW, which never runs it here), and SPATIAL otherwise (channels-first, double, and
  5-d NDHWC, which PyTorch's channels_last_3d also runs SPATIAL: its reduction, and so its
  rounding, is PyTorch's).
- Rank: cuDNN documents the BN kernels for 4-d and 5-d tensors, so (N, C) is described as
  (N, C, 1, 1) and (N, C, L) as (N, C, 1, L), like Note [1-D convolutions as 2-D].
- Scale, bias, mean and variance use the descriptor cudnnDeriveBNTensorDescriptor gives:
  1xCx1x1(x1), float for float/half/bfloat16 data, double for double.
- Fused ops: cudnnBatchNormalizationForwardTrainingEx / BackwardEx apply
  CUDNN_BATCHNORM_OPS_BN_ACTIVATION (relu(bn(x))) and ..._BN_ADD_ACTIVATION
  (relu(bn(x) + z)). The cuDNN API reference (cuDNN 8.x, unchanged in 9) supports them
  only for fully packed NHWC tensors of CUDNN_DATA_HALF with C a multiple of 4, in
  SPATIAL_PERSISTENT mode, with a RELU activation descriptor. NHWC read as 4-d: a 5-d
  NDHWC batch (BatchNorm3d) runs the plain calls, where PyTorch, which never asks for the
  fused bnOps at all, would too (no refusal to meet there on the first GPU). A plan whose
  configuration meets those rules tries the fused calls; any other configuration runs the
  plain calls plus convfuse's add/activation kernels without a warning (nothing was
  refused). If cuDNN refuses a fused call it was documented to take (any NOT_SUPPORTED
  status, at the size query or at the call; or a workspace sized at 0 bytes, with which
  an Ex call would run as the non-extended one, without its bnOps), the plan remembers,
  warns once (FusedFallbackWarning) and runs the plain path from then on (Note
  [BatchNorm fallback] in convfuse/ops/cudnn/batchnorm.py).
  An out-of-memory for the fused calls' workspace or reserve space is not for good: the
  plan runs plain for a while and tries again (Note [transient out-of-memory] in
  plan/choice.py, the same back-off as the conv plans), warning once per plan in all.
- Capture (Note [no plan work inside a capture]): the fused sizes are asked on the first
  fused call, which must come before a CUDA graph capture (its warm-up step does it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .. import activations
from .._binding import cudnn
from ..dtypes import canonical
from ..dtypes import name as dtype_name
from ..errors import CudnnError
from . import descriptors as d
from .cache import CacheInfo, PlanCache
from .capture import refuse_in_capture
from .choice import FusedFallbackState
from .conv import FusedFallbackWarning, current_device

LAYOUTS = ("NCHW", "NHWC")


@dataclass(frozen=True)
class BatchNormGeometry:
    """The shape of a batch-normalised array: (N, C, *spatial) channels-first ("NCHW") or
    (N, *spatial, C) channels-last ("NHWC"); 0 to 3 spatial dims. (N, C) is the same in
    both layouts."""

    shape: tuple[int, ...]
    layout: str

    @classmethod
    def create(cls, shape: Any, layout: str = "NCHW",
               where: str = "batchnorm") -> BatchNormGeometry:
        if layout not in LAYOUTS:
            raise ValueError(f"{where}: layout must be 'NCHW' or 'NHWC', got {layout!r}")
        s = tuple(int(v) for v in shape)
        if not 2 <= len(s) <= 5:
            raise ValueError(
                f"{where}: expected a 2-d to 5-d input (N, C, *spatial), got shape {s}")
        if s[0] < 0 or min(s[1:]) < 1:  # an empty batch is allowed: the ops return it
            raise ValueError(f"{where}: every dimension but the batch must be positive, got "
                             f"shape {s}")
        return cls(s, layout)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def channels_last(self) -> bool:
        return self.layout == "NHWC" and self.ndim > 2

    @property
    def channel_axis(self) -> int:
        return self.ndim - 1 if self.channels_last else 1

    @property
    def channels(self) -> int:
        return self.shape[self.channel_axis]

    @property
    def reduce_axes(self) -> tuple[int, ...]:
        return tuple(a for a in range(self.ndim) if a != self.channel_axis)

    @property
    def batch(self) -> int:
        """N: 0 for an empty batch, which the ops answer without an engine call."""
        return self.shape[0]

    @property
    def count(self) -> int:
        """Values per channel: N times the spatial sizes."""
        return math.prod(self.shape) // self.channels

    @property
    def shape_cf(self) -> tuple[int, ...]:
        if self.channels_last:
            return (self.shape[0], self.channels, *self.shape[1:-1])
        return self.shape

    @property
    def lifted_cf(self) -> tuple[int, ...]:
        """Dims as cuDNN sees them (Note [BatchNorm in cuDNN]): always 4-d or 5-d."""
        s = self.shape_cf
        if len(s) == 2:
            return (*s, 1, 1)
        if len(s) == 3:
            return (s[0], s[1], 1, s[2])
        return s

    def describe(self) -> str:
        return f"batchnorm x={list(self.shape)} layout={self.layout}"


def training_mode_name(geom: BatchNormGeometry, dtype: Any) -> str:
    """Note [BatchNorm in cuDNN]: persistent for 4-d channels-last non-double data."""
    if (geom.channels_last and len(geom.lifted_cf) == 4
            and canonical(dtype).name != "float64"):
        return "CUDNN_BATCHNORM_SPATIAL_PERSISTENT"
    return "CUDNN_BATCHNORM_SPATIAL"


def fused_ops_name(activation: str, residual: bool) -> str | None:
    """The bnOps that would apply this activation (and residual) inside cuDNN, or None."""
    if activation != "relu":
        return None
    if residual:
        return "CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION"
    return "CUDNN_BATCHNORM_OPS_BN_ACTIVATION"


def fused_documented(geom: BatchNormGeometry, dtype: Any) -> bool:
    """Whether cuDNN documents the fused bnOps for this configuration (Note [BatchNorm in
    cuDNN]): packed NHWC half data, C % 4 == 0, SPATIAL_PERSISTENT, as cuDNN sees it 4-d
    (NHWC itself, or (N, L, C) lifted; not NDHWC)."""
    return (geom.channels_last and canonical(dtype).name == "float16"
            and geom.channels % 4 == 0 and len(geom.lifted_cf) == 4
            and training_mode_name(geom, dtype) == "CUDNN_BATCHNORM_SPATIAL_PERSISTENT")


@dataclass(frozen=True)
class BatchNormPlanKey:
    device: int
    dtype: str
    geometry: BatchNormGeometry
    activation: str  # normalized name
    residual: bool

    @classmethod
    def create(cls, geom: BatchNormGeometry, dtype: Any, activation: str | None = "identity",
               residual: bool = False, device: int | None = None) -> BatchNormPlanKey:
        if not isinstance(geom, BatchNormGeometry):
            raise TypeError(f"geom must be a BatchNormGeometry, got {type(geom).__name__}")
        return cls(current_device() if device is None else int(device), dtype_name(dtype),
                   geom, activations.normalize(activation), bool(residual))


@dataclass(frozen=True)
class BatchNormSizes:
    """Bytes cuDNN asked for, for the fused Ex calls of one plan."""

    forward_workspace: int
    backward_workspace: int
    reserve: int


class BatchNormPlan(FusedFallbackState):
    """Descriptors for x (also y, z, dy, dx, dz), the derived BN tensors per mode, and the
    RELU activation of the fused calls; the fused ops' sizes once a handle asked for them."""

    def __init__(self, key: BatchNormPlanKey) -> None:
        self.key = key
        self.lib = lib = cudnn()
        geom, dtype = key.geometry, key.dtype
        self.training_mode = getattr(lib, training_mode_name(geom, dtype))
        self.inference_mode = lib.CUDNN_BATCHNORM_SPATIAL
        ops = fused_ops_name(key.activation, key.residual)
        self.fused_ops = getattr(lib, ops) if ops and fused_documented(geom, dtype) else None
        d.check_elements("x", geom.shape_cf, self.describe)
        try:
            self.x_desc = d.tensor_descriptor(lib, dtype, geom.lifted_cf, geom.channels_last)
            self.bn_desc_training = lib.TensorDescriptor()
            lib.deriveBNTensorDescriptor(self.bn_desc_training, self.x_desc, self.training_mode)
            self.bn_desc_inference = lib.TensorDescriptor()
            lib.deriveBNTensorDescriptor(self.bn_desc_inference, self.x_desc, self.inference_mode)
            self.act_desc = d.activation_descriptor(lib, "relu")
        except CudnnError as err:
            raise err.with_context(f"building a plan for {self.describe()}") from None
        self._init_fused_state()
        self._sizes: BatchNormSizes | None = None

    def describe(self) -> str:
        k = self.key
        return (f"{k.geometry.describe()} dtype={k.dtype} activation={k.activation} "
                f"residual={k.residual}")

    @property
    def tries_fused(self) -> bool:
        """Whether fused Ex calls are on for this plan: documented, never refused, and not
        backing off after an out-of-memory (a pure read; `fused_off` counts the back-off)."""
        return (self.fused_ops is not None and self._fused_refusal is None
                and not self._fused_skip)

    def fused_off(self) -> bool:
        """Whether this training forward takes the plain path; counts down a memory
        back-off (Note [transient out-of-memory])."""
        if self.fused_ops is None or self._fused_refusal is not None:
            return True
        return self._backing_off()

    def sizes(self, handle: Any, stream: int | None = None) -> BatchNormSizes:  # pragma: gpu
        """Workspace and reserve-space bytes of the fused calls, asked once (needs a handle;
        a NULL handle gets BAD_PARAM), never first inside a CUDA graph capture of `stream`
        (the call's ExecContext.capture_stream; None: CuPy's current one)."""
        with self._lock:
            if self._sizes is None:
                refuse_in_capture(f"the fused batch-normalization sizes of {self.describe()}",
                                  stream)
                lib, x, bn, act = self.lib, self.x_desc, self.bn_desc_training, self.act_desc
                mode, ops = self.training_mode, self.fused_ops
                z = x if ops == lib.CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION else None
                fwd = lib.getBatchNormalizationForwardTrainingExWorkspaceSize(
                    handle, mode, ops, x, z, x, bn, act)
                bwd = lib.getBatchNormalizationBackwardExWorkspaceSize(
                    handle, mode, ops, x, x, x, z, x, bn, act)
                reserve = lib.getBatchNormalizationTrainingExReserveSpaceSize(
                    handle, mode, ops, act, x)
                self._sizes = BatchNormSizes(int(fwd), int(bwd), int(reserve))
            return self._sizes


_plans = PlanCache(BatchNormPlan)


def get_batchnorm_plan(geom: BatchNormGeometry, dtype: Any, activation: str | None = "identity",
                       residual: bool = False) -> BatchNormPlan:
    """The cached plan (Note [finding a plan per call] in cache.py)."""
    return _plans.find((geom, dtype, activation, residual, current_device()), None,
                       _batchnorm_key)


def touch_batchnorm_plan(plan: BatchNormPlan) -> bool:
    """Whether `plan` is still the cached plan of its key (get_batchnorm_plan would still
    return it), refreshed as a hit when it is (a bound call's check)."""
    return _plans.touch(plan.key, plan)


def _batchnorm_key(_flags: Any, geom: BatchNormGeometry, dtype: Any, activation: str | None,
                   residual: bool, device: int) -> BatchNormPlanKey:
    return BatchNormPlanKey.create(geom, dtype, activation, residual, device)


def batchnorm_plan_cache_info() -> CacheInfo:
    return _plans.info()


def clear_batchnorm_plan_cache() -> None:
    _plans.clear()


__all__ = [
    "BatchNormGeometry", "BatchNormPlan", "BatchNormPlanKey", "BatchNormSizes",
    "FusedFallbackWarning", "batchnorm_plan_cache_info", "clear_batchnorm_plan_cache",
    "fused_documented", "fused_ops_name", "get_batchnorm_plan", "touch_batchnorm_plan",
    "training_mode_name",
]
