"""ConvPlan: the cuDNN descriptors of one convolution, and its algorithms once chosen.

A plan is built without a GPU (descriptors only); algorithms and workspace sizes are
chosen on first execution, per direction, because that needs a handle and memory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from .. import activations
from .._binding import cudnn
from ..backend import gpu_available
from ..config import Flags
from ..config import get as get_flags
from ..dtypes import canonical
from ..errors import CudnnError
from ..geometry import ConvGeometry
from . import algorithms as algos
from . import descriptors as d


class FusedFallbackWarning(RuntimeWarning):
    """cuDNN refused the fused conv + bias + activation call for every algorithm a plan
    may use; the plan runs it unfused from then on, with extra kernel launches
    (Note [unfused fallback] in convfuse/ops/cudnn/conv.py)."""


@dataclass(frozen=True)
class PlanKey:
    """Everything a plan's descriptors and algorithm choices depend on."""

    device: int  # CUDA device id, -1 when no GPU is usable (descriptor-only plans)
    dtype: str
    geometry: ConvGeometry
    activation: str  # the fused call's mode: "identity" or "relu"
    residual: bool
    math_type: str  # e.g. "CUDNN_FMA_MATH"
    deterministic: bool
    benchmark: bool
    workspace_limit: int | None

    @classmethod
    def create(cls, geom: ConvGeometry, dtype: Any, activation: str | None = "identity",
               residual: bool = False, flags: Flags | None = None,
               device: int | None = None) -> PlanKey:
        """Validate the arguments and read the flags in force (config.get())."""
        if not isinstance(geom, ConvGeometry):
            raise TypeError(f"geom must be a ConvGeometry, got {type(geom).__name__}")
        dt = canonical(dtype)
        act = activations.normalize(activation)
        # Only RELU and IDENTITY run inside the fused call; the rest run IDENTITY there
        # and then their own kernel.
        fused = act if act in activations.FUSED_IN_CUDNN else "identity"
        f = flags if flags is not None else get_flags()
        return cls(
            device=current_device() if device is None else int(device),
            dtype=dt.name, geometry=geom, activation=fused, residual=bool(residual),
            math_type=d.math_type_name(dt, f.allow_tf32), deterministic=f.deterministic,
            benchmark=f.benchmark, workspace_limit=f.workspace_limit,
        )


def current_device() -> int:
    if not gpu_available():
        return -1
    import cupy  # pragma: gpu

    return int(cupy.cuda.runtime.getDevice())  # pragma: gpu


def pool_alloc(nbytes: int) -> Any:  # pragma: gpu
    """Device memory from CuPy's current allocator (its pool), None for zero bytes."""
    if nbytes == 0:
        return None
    import cupy

    return cupy.cuda.alloc(nbytes)


@dataclass
class _Chosen:
    candidate: algos.Candidate
    remaining: tuple[algos.Candidate, ...]
    forced: bool


class ConvPlan:
    """Descriptors for x, w, y (also z), bias, the convolution and the fused activation."""

    def __init__(self, key: PlanKey) -> None:
        self.key = key
        self.lib = lib = cudnn()
        geom, dtype = key.geometry, key.dtype
        try:
            self.x_desc = d.tensor_descriptor(lib, dtype, geom.input_shape_cf, geom.channels_last)
            self.y_desc = d.tensor_descriptor(lib, dtype, geom.output_shape_cf, geom.channels_last)
            self.bias_desc = d.bias_descriptor(lib, dtype, geom)
            self.w_desc = d.filter_descriptor(lib, dtype, geom)
            self.conv_desc = d.convolution_descriptor(lib, dtype, geom,
                                                      getattr(lib, key.math_type))
            self.act_desc = d.activation_descriptor(lib, key.activation)
            got = tuple(lib.getConvolutionNdForwardOutputDim(self.conv_desc, self.x_desc,
                                                             self.w_desc))
        except CudnnError as err:
            raise err.with_context(f"building a plan for {self.describe()}") from None
        want = d.lift(geom.output_shape_cf)
        if got != want:
            raise RuntimeError(
                f"internal error: cuDNN computes output dims {list(got)} but convfuse "
                f"computes {list(want)} for {self.describe()}"
            )
        self._lock = threading.Lock()
        self._chosen: dict[str, _Chosen] = {}
        self._math_descs: dict[int, Any] = {getattr(lib, key.math_type): self.conv_desc}
        self._fused_refusal: CudnnError | None = None

    def describe(self) -> str:
        k = self.key
        return f"{k.geometry.describe()} dtype={k.dtype} activation={k.activation}"

    def nbytes(self, which: str) -> int:
        """Bytes of the x, w or y array of this plan."""
        g = self.key.geometry
        shape = {"x": g.input_shape, "w": g.weight_shape, "y": g.output_shape}[which]
        n = canonical(self.key.dtype).itemsize
        for s in shape:
            n *= s
        return n

    def conv_desc_for(self, cand: algos.Candidate) -> Any:
        """A convolution descriptor carrying the candidate's math type.

        cuDNN decides tensor-core use from the algorithm and the descriptor's math type
        together, so a record's mathType must be set before running it. Each math type
        gets its own descriptor, so the plan's descriptors are never mutated after build
        and threads may share them.
        """
        with self._lock:
            desc = self._math_descs.get(cand.math_type)
            if desc is None:
                desc = d.convolution_descriptor(self.lib, self.key.dtype, self.key.geometry,
                                                cand.math_type)
                self._math_descs[cand.math_type] = desc
            return desc

    def choice(self, direction: str, handle: Any, inputs: tuple[int, int] = (0, 0),
               fused: bool = False) -> algos.Candidate:
        """The algorithm for `direction` ("fwd", "bwd_data", "bwd_filter"), chosen once.

        `fused=True` asks for the forward of convolutionBiasActivationForward; `inputs`
        are the device pointers Find*Ex runs on when config.benchmark is on.
        """
        if direction not in algos.DIRECTIONS:
            raise ValueError(f"direction must be one of {algos.DIRECTIONS}, got {direction!r}")
        slot = self._slot(direction, fused)
        with self._lock:
            chosen = self._chosen.get(slot)
            if chosen is None:
                chosen = self._choose(direction, slot, handle, inputs)
                self._chosen[slot] = chosen
            return chosen.candidate

    def reject(self, direction: str, cand: algos.Candidate,
               fused: bool = False) -> bool:
        """Drop `cand` after cuDNN refused to run it; True if another one is now chosen."""
        slot = self._slot(direction, fused)
        with self._lock:
            chosen = self._chosen.get(slot)
            if chosen is None or chosen.candidate != cand:
                return chosen is not None  # another thread moved on already
            if chosen.forced or not chosen.remaining:
                return False
            nxt, rest = algos.first_allocatable(chosen.remaining, pool_alloc, self._what(slot))
            self._chosen[slot] = _Chosen(nxt, rest, False)
            return True

    @property
    def fused_refusal(self) -> CudnnError | None:
        """The error with which cuDNN refused the fused call for good, or None."""
        return self._fused_refusal

    def refuse_fused(self, err: CudnnError) -> bool:
        """Record that no algorithm runs this plan's fused call; True for the first record,
        so of the threads that hit the refusal together exactly one warns."""
        with self._lock:
            first = self._fused_refusal is None
            if first:
                self._fused_refusal = err
            return first

    def _slot(self, direction: str, fused: bool) -> str:
        # Note [IDENTITY needs IMPLICIT_PRECOMP_GEMM]: only the identity fused forward
        # differs from the plain forward.
        identity_fused = fused and direction == "fwd" and self.key.activation == "identity"
        return "fwd_identity" if identity_fused else direction

    def _what(self, slot: str) -> str:
        return f"cuDNN {slot} algorithm for {self.describe()}"

    def _choose(self, direction: str, slot: str, handle: Any,
                inputs: tuple[int, int]) -> _Chosen:
        lib, key = self.lib, self.key
        forced = slot == "fwd_identity"
        try:
            if forced:
                perfs = algos.forced_identity_perf(lib, handle, self)
            elif key.benchmark:
                perfs = algos.benchmark_perfs(lib, handle, self, direction, inputs, pool_alloc,
                                              key.workspace_limit)
            else:
                perfs = algos.heuristic_perfs(lib, handle, self, direction)
        except CudnnError as err:
            raise err.with_context(f"choosing the {slot} algorithm for {self.describe()}") from None
        rules = dict(deterministic=key.deterministic, workspace_limit=key.workspace_limit,
                     fma_only=key.math_type == "CUDNN_FMA_MATH")
        cands = algos.usable_candidates(perfs, lib, **rules)
        if not cands:
            raise algos.NoAlgorithmError(
                f"no {self._what(slot)} fits: {algos.describe_empty(perfs, lib, **rules)}")
        first, rest = algos.first_allocatable(cands, pool_alloc, self._what(slot))
        return _Chosen(first, rest, forced)

