"""Running one cuDNN call with a plan's algorithm: its workspace for this call (moving down
the ranking while memory is short, Note [transient out-of-memory] in plan/choice.py), the
walk down the ranking when cuDNN refuses an algorithm, and error context."""

from __future__ import annotations

import warnings
from typing import Any

from ..._binding import cudnn
from ...errors import CudnnError
from ...plan import (
    Candidate,
    ConvPlan,
    NoAlgorithmError,
    WorkspaceFallbackWarning,
    WorkspaceUnavailableError,
)
from ...plan.algorithms import is_refusal
from .device import ExecContext
from .handle import Workspace


def where(plan: ConvPlan, what: str, cand: Candidate | None = None) -> str:
    algo = f" algo={cand.algo} workspace={cand.workspace}" if cand is not None else ""
    return f"{what} for {plan.describe()}{algo}"


def refused(err: CudnnError, lib: Any) -> bool:
    """Whether cuDNN refused a call as not supported (plan.algorithms.is_refusal)."""
    return is_refusal(err, lib)


def algorithm_and_workspace(plan: ConvPlan, direction: str, handle: Any,
                            inputs: tuple[int, int], ctx: ExecContext,
                            fused: bool = False) -> tuple[Candidate, Workspace]:  # pragma: gpu
    """The plan's algorithm for `direction` and its workspace for this call, from `ctx`'s
    allocator.

    The plan chose an algorithm whose workspace could be allocated then; memory may be
    scarcer now. Rather than fail, drop that algorithm for the next ranked one until a
    later retry (Note [transient out-of-memory]); with none left, WorkspaceUnavailableError.
    """
    import cupy

    skipped: list[Candidate] = []
    while True:
        cand = plan.choice(direction, handle, inputs, fused=fused,
                           allocate=ctx.choice_allocator, stream=ctx.capture_stream)
        try:
            ws = Workspace(cand.workspace, ctx)
        except cupy.cuda.memory.OutOfMemoryError as err:
            skipped.append(cand)
            if not plan.reject(direction, cand, fused=fused, out_of_memory=True,
                               allocate=ctx.choice_allocator):
                tried = ", ".join(f"algo {c.algo} ({c.workspace} bytes)" for c in skipped)
                raise WorkspaceUnavailableError(
                    f"{direction} workspace could not be allocated for {tried}, for "
                    f"{plan.describe()}, and no other algorithm is left to try") from err
            continue
        plan.workspace_allocated(direction, fused=fused)
        if skipped:  # one warning per call, naming every algorithm skipped
            tried = ", ".join(f"algo {c.algo} ({c.workspace} bytes)" for c in skipped)
            warnings.warn(
                f"{direction} workspace could not be allocated now for {tried}, for "
                f"{plan.describe()}; using algo {cand.algo} ({cand.workspace} bytes) until "
                "memory allows the faster one again", WorkspaceFallbackWarning, stacklevel=4)
        return cand, ws


def run_ranked(plan: ConvPlan, direction: str, handle: Any, inputs: tuple[int, int],
               ctx: ExecContext, call: Any, what: str,
               about: ConvPlan | None = None) -> None:  # pragma: gpu
    """call(cand, ws) with the plan's algorithm for `direction`, walking down the ranking
    when cuDNN refuses one (NOT_SUPPORTED: it returns before launching anything, so a
    beta = 1 output is untouched), as PyTorch's algorithm search does; the plan keeps the
    one that ran. Other errors, and a refusal of the last one, are raised naming `what`
    and the plan `about` (default: this one)."""
    lib = cudnn()
    tried: list[Candidate] = []
    while True:
        try:
            cand, ws = algorithm_and_workspace(plan, direction, handle, inputs, ctx)
        except NoAlgorithmError as err:  # nothing ranked fits: name the op as well
            raise type(err)(f"{what}: {err}").with_traceback(err.__traceback__) \
                from err.__cause__
        try:
            call(cand, ws)
            return
        except CudnnError as err:
            if not refused(err, lib):
                raise err.with_context(where(about or plan, what, cand)) from None
            tried.append(cand)
            if plan.reject(direction, cand, allocate=ctx.choice_allocator):
                continue
            algos = ", ".join(str(c.algo) for c in tried)
            raise err.with_context(
                f"{where(about or plan, what, cand)}; cuDNN refused every {direction} "
                f"algorithm this call tried (algo {algos}) and none is left") from None


def forward_into(plan: ConvPlan, handle: Any, ctx: ExecContext, x: Any, w: Any, y: Any,
                 what: str, about: ConvPlan | None = None) -> None:  # pragma: gpu
    """convolutionForward of x and w into y (beta = 0) with the plan's forward algorithm."""
    def call(cand: Candidate, ws: Workspace) -> None:
        cudnn().convolutionForward(
            handle, 1.0, plan.x_desc, x.data.ptr, plan.w_desc, w.data.ptr,
            plan.conv_desc_for(cand), cand.algo, ws.ptr, ws.size, 0.0, plan.y_desc, y.data.ptr)

    run_ranked(plan, "fwd", handle, (x.data.ptr, w.data.ptr), ctx, call, what, about)
