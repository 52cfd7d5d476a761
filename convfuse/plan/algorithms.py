"""Choosing a cuDNN algorithm and its workspace for one direction of a convolution.

Ranking and the workspace fallback are pure Python over cuDNN's perf records, so the CPU
suite tests them with stand-in records; only the queries themselves need a handle.

Note [IDENTITY needs IMPLICIT_PRECOMP_GEMM]
cudnnConvolutionBiasActivationForward with CUDNN_ACTIVATION_IDENTITY is implemented only
for CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM (cuDNN's documentation of the call;
FACTS: other algorithms return NOT_SUPPORTED, or have been seen to apply ReLU anyway).
So the fused forward of an identity plan never asks the heuristics: it takes that
algorithm and only sizes its workspace. The plain forward (convolutionForward) of the
same plan still ranks every algorithm, which is why plans keep the two apart.

Note [workspace sizes are queried]
A ranking record's `memory` is what cuDNN estimated while ranking, with the descriptor the
query was given (the plan's math type), but the call runs with the record's own math type
(ConvPlan.conv_desc_for), and records from Get*_v7 are estimates. So a plan asks
cudnnGetConvolution*WorkspaceSize for each usable record's algorithm with the descriptor
that will run it, and allocates, offers and checks against workspace_limit that size, as
PyTorch sizes the workspace of the algorithm it runs. A record whose size query cuDNN
refuses (NOT_SUPPORTED) cannot run and is dropped like a failed record.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

from ..errors import ConvfuseError, CudnnError

DIRECTIONS = ("fwd", "bwd_data", "bwd_filter")


class NoAlgorithmError(ConvfuseError, RuntimeError):
    """No cuDNN algorithm satisfies the flags (deterministic, workspace_limit) and memory."""


class WorkspaceUnavailableError(NoAlgorithmError, MemoryError):
    """Every usable algorithm's workspace failed to allocate: a shortage of memory now,
    which may pass (Note [transient out-of-memory] in plan/choice.py), unlike the flags.
    A MemoryError too, as the allocator's own error is."""


class WorkspaceFallbackWarning(RuntimeWarning):
    """A faster algorithm was skipped because its workspace could not be allocated."""


@dataclass(frozen=True)
class Candidate:
    """One usable algorithm: cuDNN's enum value, workspace bytes and the math type cuDNN
    reported for it (the convolution descriptor must carry that math type when run)."""

    algo: int
    workspace: int
    math_type: int
    deterministic: bool


def usable_candidates(perfs: Iterable[Any], lib: ModuleType, *, deterministic: bool,
                      workspace_limit: int | None, fma_only: bool) -> list[Candidate]:
    """Filter cuDNN's ranked perf records, keeping its order (fastest first).

    Dropped: records whose status is not success (cuDNN lists algorithms it cannot run),
    non-deterministic ones when determinism is asked for, workspaces above the limit,
    anything but FMA math when TF32 is off, and ALLOW_CONVERSION math, which would round
    float32 data down to half precision.
    """
    out = []
    for p in perfs:
        if p.status != lib.CUDNN_STATUS_SUCCESS:
            continue
        is_det = p.determinism == lib.CUDNN_DETERMINISTIC
        if deterministic and not is_det:
            continue
        if workspace_limit is not None and p.memory > workspace_limit:
            continue
        if p.mathType == lib.CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION:
            continue
        if fma_only and p.mathType != lib.CUDNN_FMA_MATH:
            continue
        out.append(Candidate(int(p.algo), int(p.memory), int(p.mathType), is_det))
    return out


def is_refusal(err: CudnnError, lib: ModuleType) -> bool:
    """Whether cuDNN refused a call as not supported. cuDNN 9's statuses are categories
    with specific codes (CUDNN_STATUS_NOT_SUPPORTED = 3000, ..._SHAPE = 3002,
    ..._LAYOUT = 3004, ...); cudnn_graph.h's CUDNN_STATUS_CATEGORY(s) is s / 1000 * 1000,
    so every 3xxx code is a refusal, not just 3000."""
    return err.status // 1000 * 1000 == lib.CUDNN_STATUS_NOT_SUPPORTED


def with_queried_workspace(candidates: Sequence[Candidate], lib: ModuleType,
                           query: Callable[[Candidate], int]) -> list[Candidate]:
    """Note [workspace sizes are queried]: each candidate with the size `query` reports
    for its algorithm and math type, in the same order; refused queries drop the candidate,
    other errors propagate."""
    out = []
    for cand in candidates:
        try:
            size = int(query(cand))
        except CudnnError as err:
            if is_refusal(err, lib):
                continue
            raise
        out.append(replace(cand, workspace=size))
    return out


def workspace_size(lib: ModuleType, handle: Any, plan: Any, direction: str, algo: int,
                   conv_desc: Any) -> int:  # pragma: gpu
    """cudnnGetConvolution*WorkspaceSize of `algo` for `direction`, with `conv_desc` (the
    descriptor carrying the math type the call will run with)."""
    if direction == "fwd":
        return int(lib.getConvolutionForwardWorkspaceSize(
            handle, plan.x_desc, plan.w_desc, conv_desc, plan.y_desc, algo))
    if direction == "bwd_data":
        return int(lib.getConvolutionBackwardDataWorkspaceSize(
            handle, plan.w_desc, plan.y_desc, conv_desc, plan.x_desc, algo))
    return int(lib.getConvolutionBackwardFilterWorkspaceSize(
        handle, plan.x_desc, plan.y_desc, conv_desc, plan.w_desc, algo))


def first_allocatable(candidates: Sequence[Candidate], allocate: Callable[[int], Any],
                      what: str) -> tuple[Candidate, tuple[Candidate, ...]]:
    """The first candidate whose workspace the pool can give, and the ones ranked after it.

    A MemoryError (CuPy's OutOfMemoryError is one) moves on to the next candidate; one
    warning says which were skipped. The trial buffer is dropped at once: it returns to
    CuPy's pool, and each call takes its workspace from there again.
    """
    skipped: list[Candidate] = []
    for i, cand in enumerate(candidates):
        try:
            buf = allocate(cand.workspace)
        except MemoryError:
            skipped.append(cand)
            continue
        del buf
        if skipped:
            tried = ", ".join(f"algo {c.algo} ({c.workspace} bytes)" for c in skipped)
            warnings.warn(
                f"{what}: workspace could not be allocated for {tried}; using algo "
                f"{cand.algo} ({cand.workspace} bytes) instead",
                WorkspaceFallbackWarning, stacklevel=4,
            )
        return cand, tuple(candidates[i + 1:])
    if skipped:
        sizes = ", ".join(str(c.workspace) for c in skipped)
        raise WorkspaceUnavailableError(
            f"{what}: out of memory for every algorithm's workspace ({sizes} bytes)")
    raise NoAlgorithmError(f"{what}: no algorithm to try")


def describe_empty(perfs: Sequence[Any], lib: ModuleType, *, deterministic: bool,
                   workspace_limit: int | None, fma_only: bool) -> str:
    """Why `usable_candidates` came back empty, for the NoAlgorithmError message."""
    ok = [p for p in perfs if p.status == lib.CUDNN_STATUS_SUCCESS]
    parts = [f"cuDNN reported {len(perfs)} algorithm(s), {len(ok)} runnable"]
    if deterministic:
        parts.append(f"{sum(p.determinism == lib.CUDNN_DETERMINISTIC for p in ok)} deterministic")
    if workspace_limit is not None:
        parts.append(f"{sum(p.memory <= workspace_limit for p in ok)} within "
                     f"workspace_limit={workspace_limit}")
    if fma_only:
        parts.append(f"{sum(p.mathType == lib.CUDNN_FMA_MATH for p in ok)} with FMA math "
                     "(allow_tf32=False)")
    failed = Counter(int(p.status) for p in perfs if p.status != lib.CUDNN_STATUS_SUCCESS)
    if not failed:
        return ", ".join(parts)
    # a device failure (5xxx) reads differently from a refusal (3xxx): name each status
    return ", ".join(parts) + "; not runnable: " + ", ".join(
        f"{_status_name(lib, s)} ({s}) x{n}" for s, n in sorted(failed.items()))


def _status_name(lib: ModuleType, status: int) -> str:
    try:
        return str(lib.getErrorString(status))
    except Exception:  # a stand-in binding without it: the number alone
        return "status"


def forced_identity_perf(lib: ModuleType, handle: Any, plan: Any) -> list[Any]:  # pragma: gpu
    """A perf record for the one algorithm the IDENTITY fused call accepts
    (Note [IDENTITY needs IMPLICIT_PRECOMP_GEMM]); forward algorithms are deterministic."""
    algo = lib.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM
    size = lib.getConvolutionForwardWorkspaceSize(
        handle, plan.x_desc, plan.w_desc, plan.conv_desc, plan.y_desc, algo)
    return [_Perf(algo, lib.CUDNN_STATUS_SUCCESS, 0.0, size, lib.CUDNN_DETERMINISTIC,
                  plan.conv_desc.getMathType())]


@dataclass(frozen=True)
class _Perf:
    """Same fields as the binding's AlgoPerf, for records convfuse makes itself."""

    algo: int
    status: int
    time: float
    memory: int
    determinism: int
    mathType: int  # cuDNN's field name


def heuristic_perfs(lib: ModuleType, handle: Any, plan: Any,
                    direction: str) -> list[Any]:  # pragma: gpu
    """cuDNN's Get*_v7 ranking: no kernels run, fastest expected first."""
    if direction == "fwd":
        n = lib.getConvolutionForwardAlgorithmMaxCount(handle)
        return lib.getConvolutionForwardAlgorithm_v7(
            handle, plan.x_desc, plan.w_desc, plan.conv_desc, plan.y_desc, n)
    if direction == "bwd_data":
        n = lib.getConvolutionBackwardDataAlgorithmMaxCount(handle)
        return lib.getConvolutionBackwardDataAlgorithm_v7(
            handle, plan.w_desc, plan.y_desc, plan.conv_desc, plan.x_desc, n)
    n = lib.getConvolutionBackwardFilterAlgorithmMaxCount(handle)
    return lib.getConvolutionBackwardFilterAlgorithm_v7(
        handle, plan.x_desc, plan.y_desc, plan.conv_desc, plan.w_desc, n)


def benchmark_perfs(lib: ModuleType, handle: Any, plan: Any, direction: str,
                    inputs: tuple[int, int], allocate: Callable[[int], Any],
                    workspace_limit: int | None) -> list[Any]:  # pragma: gpu
    """cuDNN's Find*Ex: runs every algorithm on the call's inputs, fastest first.

    The output goes to a scratch buffer, never the caller's `out`, which may hold values
    a beta=1 call accumulates into. The workspace offered is the largest the heuristics
    ask for (within the limit) that the pool can give; algorithms wanting more are
    reported by cuDNN as failed and filtered out like any other failure.
    """
    a_ptr, b_ptr = inputs
    sizes = sorted({p.memory for p in heuristic_perfs(lib, handle, plan, direction)
                    if p.status == lib.CUDNN_STATUS_SUCCESS
                    and (workspace_limit is None or p.memory <= workspace_limit)}, reverse=True)
    ws, ws_size = None, 0
    for size in sizes:
        try:
            ws, ws_size = allocate(size), size
            break
        except MemoryError:
            continue
    ws_ptr = ws.ptr if ws is not None else 0
    if direction == "fwd":
        out = allocate(plan.nbytes("y"))
        n = lib.getConvolutionForwardAlgorithmMaxCount(handle)
        return lib.findConvolutionForwardAlgorithmEx(
            handle, plan.x_desc, a_ptr, plan.w_desc, b_ptr, plan.conv_desc, plan.y_desc,
            out.ptr, n, ws_ptr, ws_size)
    if direction == "bwd_data":
        out = allocate(plan.nbytes("x"))
        n = lib.getConvolutionBackwardDataAlgorithmMaxCount(handle)
        return lib.findConvolutionBackwardDataAlgorithmEx(
            handle, plan.w_desc, a_ptr, plan.y_desc, b_ptr, plan.conv_desc, plan.x_desc,
            out.ptr, n, ws_ptr, ws_size)
    out = allocate(plan.nbytes("w"))
    n = lib.getConvolutionBackwardFilterAlgorithmMaxCount(handle)
    return lib.findConvolutionBackwardFilterAlgorithmEx(
        handle, plan.x_desc, a_ptr, plan.y_desc, b_ptr, plan.conv_desc, plan.w_desc,
        out.ptr, n, ws_ptr, ws_size)
