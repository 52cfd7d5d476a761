"""ConvPlan: the cuDNN descriptors of one convolution, and its algorithms once chosen.

A plan is built without a GPU (descriptors only); algorithms and workspace sizes are
chosen on first execution, per direction, because that needs a handle and memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import activations
from .._binding import cudnn
from ..backend import gpu_available
from ..config import Flags
from ..config import get as get_flags
from ..dtypes import canonical
from ..dtypes import name as dtype_name
from ..errors import CudnnError
from ..geometry import ConvGeometry, cached_hash
from . import algorithms as algos
from . import descriptors as d
from .capture import refuse_in_capture, stream_is_capturing
from .choice import (
    OOM_RETRY_CAP,
    OOM_RETRY_FIRST,
    Chosen,
    ForwardPath,
    FusedFallbackState,
    next_backoff,
)

# Re-exported: tests and the engine reach them through this module.
__all__ = ["OOM_RETRY_CAP", "OOM_RETRY_FIRST", "BiasGradFallbackWarning", "ConvPlan",
           "ForwardPath", "FusedFallbackWarning", "PlanKey", "current_device", "pool_alloc",
           "refuse_in_capture", "stream_is_capturing"]


class FusedFallbackWarning(RuntimeWarning):
    """cuDNN refused the fused conv + bias + activation call for every algorithm a plan
    may use; the plan runs it unfused from then on, with extra kernel launches
    (Note [unfused fallback] in convfuse/ops/cudnn/fused.py)."""


class BiasGradFallbackWarning(RuntimeWarning):
    """cuDNN refused convolutionBackwardBias for a plan; its bias gradient runs on
    convfuse's bias kernel from then on (conv_backward_bias in ops/cudnn/conv.py)."""


@dataclass(frozen=True)
class PlanKey:
    """Everything a plan's descriptors and algorithm choices depend on."""

    __hash__ = cached_hash  # hashed at each use of a kept plan (PlanCache.touch)

    def __getstate__(self) -> dict[str, Any]:
        # not the cached hash: str hashes are salted per process
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

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
            dtype=dtype_name(dt), geometry=geom, activation=fused, residual=bool(residual),
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


def release_search_memory() -> None:  # pragma: gpu
    """Hand CuPy's default pool its free blocks back after an algorithm search: Find*Ex
    was offered the largest workspace the heuristics asked for (gigabytes for an FFT
    algorithm), and the pool would keep that block cached for no later call (PyTorch
    empties its cache after its own search for the same reason). A caller's allocator
    (the torch bridge's) is the caller's to trim."""
    import cupy

    pool = cupy.get_default_memory_pool()
    if cupy.cuda.get_allocator() == pool.malloc:  # the search's blocks are that pool's
        pool.free_all_blocks()


class ConvPlan(FusedFallbackState):
    """Descriptors for x, w, y (also z), bias, the convolution and the fused activation."""

    def __init__(self, key: PlanKey) -> None:
        self.key = key
        self.lib = lib = cudnn()
        geom, dtype = key.geometry, key.dtype
        for what, dims in (("x", geom.input_shape_cf), ("y", geom.output_shape_cf),
                           ("w", geom.weight_shape_cf)):  # as describe() names them
            d.check_elements(what, dims, self.describe, splittable=True)
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
        self._init_fused_state()
        self._chosen: dict[str, Chosen] = {}
        self._math_descs: dict[int, Any] = {getattr(lib, key.math_type): self.conv_desc}
        self._forward_path: ForwardPath | None = None
        self._bias_grad_refusal: CudnnError | None = None

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
            return self._desc_for_math(cand.math_type)

    def desc_for(self, cand: algos.Candidate) -> Any:
        """conv_desc_for(cand) without the lock, for a candidate whose descriptor exists (a
        descriptor, once made, is never replaced or removed, and a dict read is atomic)."""
        desc = self._math_descs.get(cand.math_type)
        return desc if desc is not None else self.conv_desc_for(cand)

    def _desc_for_math(self, math_type: int) -> Any:
        """conv_desc_for's work; the caller holds the lock."""
        desc = self._math_descs.get(math_type)
        if desc is None:
            desc = d.convolution_descriptor(self.lib, self.key.dtype, self.key.geometry,
                                            math_type)
            self._math_descs[math_type] = desc
        return desc

    def choice(self, direction: str, handle: Any, inputs: tuple[int, int] = (0, 0),
               fused: bool = False, allocate: Callable[[int], Any] | None = None,
               stream: int | None = None) -> algos.Candidate:
        """The algorithm for `direction` ("fwd", "bwd_data", "bwd_filter"), chosen once.

        `fused=True` asks for the forward of convolutionBiasActivationForward; `inputs`
        are the device pointers Find*Ex runs on when config.benchmark is on. A slot
        demoted for lack of memory returns to its best candidate now and then
        (Note [transient out-of-memory]). `allocate` gives the trial and Find*Ex memory
        (default `pool_alloc`, CuPy's current allocator): the caller's, on the pointer path
        (Note [the pointer path] in ops/cudnn/device.py), and `stream` the stream whose
        capture forbids choosing (the call's ExecContext.capture_stream; None: CuPy's
        current one).
        """
        if direction not in algos.DIRECTIONS:
            raise ValueError(f"direction must be one of {algos.DIRECTIONS}, got {direction!r}")
        slot = self._slot(direction, fused)
        with self._lock:
            chosen = self._chosen.get(slot)
            if chosen is None:
                refuse_in_capture(f"choosing the {slot} algorithm for {self.describe()}",
                                  stream)
                chosen = self._choose(direction, slot, handle, inputs,
                                      allocate if allocate is not None else pool_alloc)
                self._chosen[slot] = chosen
                if self.key.benchmark and allocate is None and not chosen.forced:
                    release_search_memory()  # (the forced identity slot searched nothing)
            elif chosen.retry_in:
                chosen.retry_in -= 1
                if not chosen.retry_in:
                    chosen.index = 0  # try the best again; an allocation failure demotes anew
            if chosen.exhausted:
                raise algos.NoAlgorithmError(
                    f"cuDNN refused every {slot} algorithm it ranked for {self.describe()} "
                    "(the first call that found this raised cuDNN's refusal); the plan has "
                    "none left to run")
            return chosen.candidate

    def settled(self, direction: str, fused: bool = False) -> Chosen | None:
        """The slot's Chosen where `choice` would return its candidate without changing
        anything (chosen, not demoted for memory, no retry pending), else None; `holds`
        says at each later call whether that is still so (Note [bound calls] in
        ops/cudnn/bound.py)."""
        chosen = self._chosen.get(self._slot(direction, fused))
        if chosen is None or chosen.exhausted or not chosen.holds(chosen.candidate):
            return None
        return chosen

    def reject(self, direction: str, cand: algos.Candidate, fused: bool = False,
               out_of_memory: bool = False,
               allocate: Callable[[int], Any] | None = None) -> bool:
        """Drop `cand` after cuDNN refused to run it (for good) or its workspace could not be
        allocated (until the next retry, Note [transient out-of-memory]); True if another
        candidate is now chosen."""
        slot = self._slot(direction, fused)
        with self._lock:
            chosen = self._chosen.get(slot)
            if chosen is None or chosen.exhausted or chosen.candidate != cand:
                return chosen is not None  # another thread moved on already
            if chosen.forced:
                return False
            if out_of_memory:
                start = chosen.index + 1
            else:
                ranked = chosen.ranked
                chosen.ranked = ranked[:chosen.index] + ranked[chosen.index + 1:]
                start = chosen.index
            rest = chosen.ranked[start:]
            if not rest:
                return False
            nxt, _ = algos.first_allocatable(
                rest, allocate if allocate is not None else pool_alloc, self._what(slot))
            chosen.index = chosen.ranked.index(nxt, start)
            if chosen.index == 0:
                chosen.retry_in = chosen.backoff = 0
            elif out_of_memory or chosen.index > start:  # skipped for memory: retry later
                chosen.backoff = next_backoff(chosen.backoff)
                chosen.retry_in = chosen.backoff
            return True

    def workspace_allocated(self, direction: str, fused: bool = False) -> None:
        """The chosen algorithm's workspace was allocated: a retry of the best succeeded."""
        slot = self._slot(direction, fused)
        chosen = self._chosen.get(slot)
        if chosen is not None and chosen.backoff and chosen.index == 0:
            with self._lock:
                chosen.backoff = chosen.retry_in = 0

    # ---- the fused call's state: Note [unfused fallback] in ops/cudnn/fused.py ----

    def fused_off(self) -> bool:
        """Whether this call takes the unfused path (counts down a memory back-off)."""
        if self._fused_refusal is not None:
            return True
        if self._forward_path is not None and self._forward_path.path == "unfused":
            return True
        return self._backing_off()

    @property
    def bias_grad_refusal(self) -> CudnnError | None:
        """cuDNN's refusal of convolutionBackwardBias for this plan, or None."""
        return self._bias_grad_refusal

    def refuse_bias_grad(self, err: CudnnError) -> bool:
        """Record the refusal; True for the first record (the caller warns)."""
        with self._lock:
            first = self._bias_grad_refusal is None
            if first:
                self._bias_grad_refusal = err
            return first

    @property
    def forward_path(self) -> ForwardPath | None:
        """Which forward this plan runs and why, once decided (ForwardPath), else None."""
        return self._forward_path

    def set_forward_path(self, path: ForwardPath, replace: bool = False) -> None:
        """Record the path once (a refusal, which ends the fused call, replaces it)."""
        with self._lock:
            if self._forward_path is None or replace:
                self._forward_path = path

    def _slot(self, direction: str, fused: bool) -> str:
        # Note [IDENTITY needs IMPLICIT_PRECOMP_GEMM]: only the identity fused forward
        # differs from the plain forward.
        identity_fused = fused and direction == "fwd" and self.key.activation == "identity"
        return "fwd_identity" if identity_fused else direction

    def _what(self, slot: str) -> str:
        return f"cuDNN {slot} algorithm for {self.describe()}"

    def _choose(self, direction: str, slot: str, handle: Any, inputs: tuple[int, int],
                alloc: Callable[[int], Any]) -> Chosen:
        lib, key = self.lib, self.key
        forced = slot == "fwd_identity"
        try:
            if forced:
                perfs = algos.forced_identity_perf(lib, handle, self)
            elif key.benchmark:
                perfs = algos.benchmark_perfs(lib, handle, self, direction, inputs, alloc,
                                              key.workspace_limit)
            else:
                perfs = algos.heuristic_perfs(lib, handle, self, direction)
        except CudnnError as err:
            raise err.with_context(f"choosing the {slot} algorithm for {self.describe()}") from None
        rules: dict[str, Any] = dict(deterministic=key.deterministic,
                                     workspace_limit=key.workspace_limit,
                                     fma_only=key.math_type == "CUDNN_FMA_MATH")
        cands = algos.usable_candidates(perfs, lib, **{**rules, "workspace_limit": None})
        if not forced:  # the forced record was sized by the query already
            cands = self._queried(direction, slot, handle, cands)
        limit = key.workspace_limit
        fitting = [c for c in cands if limit is None or c.workspace <= limit]
        if not fitting:
            why = algos.describe_empty(perfs, lib, **rules)
            if cands:  # Note [workspace sizes are queried]: the limit saw the queried sizes
                sizes = ", ".join(f"algo {c.algo}: {c.workspace}" for c in cands)
                why = (f"{len(cands)} usable algorithm(s), 0 within workspace_limit={limit} "
                       f"(queried workspace bytes {sizes})")
            raise algos.NoAlgorithmError(f"no {self._what(slot)} fits: {why}")
        cands = fitting
        first, _ = algos.first_allocatable(cands, alloc, self._what(slot))
        index = cands.index(first)
        backoff = OOM_RETRY_FIRST if index else 0  # Note [transient out-of-memory]
        return Chosen(tuple(cands), index, forced, backoff, backoff)

    def _queried(self, direction: str, slot: str, handle: Any,
                 cands: list[algos.Candidate]) -> list[algos.Candidate]:
        """Note [workspace sizes are queried]; called under the plan's lock."""
        def query(cand: algos.Candidate) -> int:
            return algos.workspace_size(self.lib, handle, self, direction, cand.algo,
                                        self._desc_for_math(cand.math_type))

        try:
            return algos.with_queried_workspace(cands, self.lib, query)
        except CudnnError as err:
            raise err.with_context(
                f"sizing the {slot} workspace for {self.describe()}") from None
