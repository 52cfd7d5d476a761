"""Convolution, pooling and batch-normalization plans: cuDNN descriptors, algorithm choice
and workspace, cached by a hashable key (DESIGN.md "Plans"). Each kind has its own cache
(and its own *_cache_info); `clear_plan_cache` empties all three.

`get_plan(geom, dtype, activation, residual)` reads the flags in force
(`convfuse.config.get()`) into its key, so changing a flag such as allow_tf32 gives a new
plan rather than mutating a cached one.
"""

from __future__ import annotations

from typing import Any

from ..config import get as get_flags
from .algorithms import (
    Candidate,
    NoAlgorithmError,
    WorkspaceFallbackWarning,
    WorkspaceUnavailableError,
)
from .batchnorm import batchnorm_plan_cache_info, clear_batchnorm_plan_cache
from .cache import CacheInfo, PlanCache
from .conv import (
    BiasGradFallbackWarning,
    ConvPlan,
    ForwardPath,
    FusedFallbackWarning,
    PlanKey,
    current_device,
)
from .conv_transpose import transpose_plan_key
from .pool import PoolPlan, PoolPlanKey

_conv_plans = PlanCache(ConvPlan)
_pool_plans = PlanCache(PoolPlan)


def get_plan(geom: Any, dtype: Any, activation: str | None = "identity",
             residual: bool = False) -> ConvPlan:
    """The cached plan for this convolution under the current flags (Note [finding a
    plan per call] in cache.py)."""
    return _conv_plans.find((geom, dtype, activation, residual, current_device()),
                            get_flags(), _conv_key)


def touch_conv_plan(plan: ConvPlan) -> bool:
    """Whether `plan` is still the cached plan of its key (get_plan would still return it
    under the flags it was built with), refreshed as a hit when it is."""
    return _conv_plans.touch(plan.key, plan)


def conv_plan_cached(plan: ConvPlan) -> bool:
    """Whether `plan` is still the cached plan of its key, asked without using it."""
    return _conv_plans.holds(plan.key, plan)


def get_transpose_plan(tgeom: Any, dtype: Any) -> ConvPlan:
    """The cached plan of a transposed convolution: its forward convolution's plan, with
    the roles of x and y swapped (plan/conv_transpose.py)."""
    return _conv_plans.find((tgeom, dtype, current_device()), get_flags(), _transpose_key)


def get_pool_plan(pgeom: Any, dtype: Any) -> PoolPlan:
    return _pool_plans.find((pgeom, dtype, current_device()), get_flags(), _pool_key)


def _conv_key(flags: Any, geom: Any, dtype: Any, activation: str | None, residual: bool,
              device: int) -> PlanKey:
    return PlanKey.create(geom, dtype, activation, residual, flags, device)


def _transpose_key(flags: Any, tgeom: Any, dtype: Any, device: int) -> PlanKey:
    return transpose_plan_key(tgeom, dtype, flags, device)


def _pool_key(flags: Any, pgeom: Any, dtype: Any, device: int) -> PoolPlanKey:
    return PoolPlanKey.create(pgeom, dtype, flags, device)


def forward_paths() -> list[tuple[str, ForwardPath]]:
    """(plan description, ForwardPath) of every cached conv plan whose fused forward has
    run: which path it takes (fused or unfused) and why (heuristics, timed, refused)."""
    out = []
    for plan in _conv_plans.values():
        path = plan.forward_path
        if path is not None:
            out.append((f"{plan.describe()} residual={plan.key.residual}", path))
    return out


def plan_cache_info() -> CacheInfo:
    """(hits, misses, size) of the convolution plan cache only; pool_plan_cache_info and
    batchnorm_plan_cache_info report the other two (clear_plan_cache resets all three)."""
    return _conv_plans.info()


def pool_plan_cache_info() -> CacheInfo:
    return _pool_plans.info()


def clear_plan_cache() -> None:
    """Empty the convolution, pooling and batch-normalization plan caches and reset their
    counts. Plans remember cuDNN's refusals and memory back-offs, so this also lets the
    fused calls be tried again."""
    _conv_plans.clear()
    _pool_plans.clear()
    clear_batchnorm_plan_cache()


__all__ = [
    "BiasGradFallbackWarning",
    "CacheInfo",
    "Candidate",
    "ConvPlan",
    "ForwardPath",
    "FusedFallbackWarning",
    "NoAlgorithmError",
    "PlanKey",
    "PoolPlan",
    "PoolPlanKey",
    "WorkspaceFallbackWarning",
    "WorkspaceUnavailableError",
    "batchnorm_plan_cache_info",
    "clear_plan_cache",
    "conv_plan_cached",
    "forward_paths",
    "get_plan",
    "get_pool_plan",
    "get_transpose_plan",
    "plan_cache_info",
    "pool_plan_cache_info",
    "touch_conv_plan",
]
