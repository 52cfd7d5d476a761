"""Pooling plans against the real libcudnn, without a GPU: descriptors, cuDNN's own output
shape, the cache, errors."""

from __future__ import annotations

import itertools

import pytest

from convfuse import config
from convfuse.errors import CudnnError
from convfuse.plan import get_pool_plan, pool_plan_cache_info
from convfuse.pool_geometry import PoolGeometry
from tests import _plan_helpers
from tests._plan_helpers import cudnn_view, lib, make_geom

fresh_cache = _plan_helpers.fresh_cache  # autouse fixture


# ---------------------------------------------------------------- pooling plans

@pytest.mark.parametrize(("rank", "channels_last", "mode"),
                         list(itertools.product((1, 2, 3), (False, True), ("max", "avg"))))
def test_pool_plan(rank, channels_last, mode):
    spatial = (9, 8, 7)[:rank]
    shape = (2, 3, *spatial) if not channels_last else (2, *spatial, 3)
    pg = PoolGeometry.create(shape, (3, 2, 3)[:rank], (2, 1, 2)[:rank], (1, 0, 1)[:rank], mode,
                             "NHWC" if channels_last else "NCHW")
    plan = get_pool_plan(pg, "float16")
    lifted = rank == 1
    got_mode, nan, window, pads, strides = plan.pool_desc.getNd()
    assert got_mode == (lib.CUDNN_POOLING_MAX if mode == "max"
                        else lib.CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING)
    assert nan == lib.CUDNN_PROPAGATE_NAN
    assert window == ([1] if lifted else []) + list(pg.kernel_size)
    assert pads == ([0] if lifted else []) + list(pg.padding)
    assert strides == ([1] if lifted else []) + list(pg.stride)
    for desc, s in ((plan.x_desc, pg.input_shape), (plan.y_desc, pg.output_shape)):
        dt, dims, st = desc.getNd()
        assert dt == lib.CUDNN_DATA_HALF
        assert (dims, st) == cudnn_view(s, channels_last)
    assert lib.getPoolingNdForwardOutputDim(plan.pool_desc, plan.x_desc) == \
        cudnn_view(pg.output_shape, channels_last)[0]
    assert get_pool_plan(pg, "float16") is plan
    assert pool_plan_cache_info() == (1, 1, 1)


def test_deterministic_max_pooling():
    pg = PoolGeometry.create((1, 2, 6, 6), 2)
    with config.flags(deterministic=True):
        plan = get_pool_plan(pg, "float32")
    assert plan.pool_desc.getNd()[0] == lib.CUDNN_POOLING_MAX_DETERMINISTIC
    with pytest.raises(TypeError, match=r"pgeom must be a PoolGeometry"):
        get_pool_plan(make_geom(2, False, 1), "float32")


def test_pool_plan_errors():
    from convfuse.plan.pool import PoolPlan, PoolPlanKey, pooling_mode_name

    with pytest.raises(ValueError, match=r"pooling mode must be 'max' or 'avg', got 'min'"):
        pooling_mode_name("min", False)
    # Bypass PoolGeometry's validation: an empty window reaches cuDNN.
    bad = PoolGeometry((1, 2, 6, 6), (0, 2), (2, 2), (0, 0), "max", False)
    with pytest.raises(CudnnError, match=r"BAD_PARAM.*building a pooling plan for max-pool "
                                         r"x\[1, 2, 6, 6\]") as info:
        get_pool_plan(bad, "float32")
    assert info.value.status == lib.CUDNN_STATUS_BAD_PARAM

    class Skewed(PoolGeometry):
        @property
        def output_spatial(self):
            return tuple(s + 1 for s in super().output_spatial)

    skewed = Skewed((1, 2, 6, 6), (2, 2), (2, 2), (0, 0), "avg", False)
    with pytest.raises(RuntimeError, match=r"internal error: cuDNN computes pooling output dims "
                                           r"\[1, 2, 3, 3\] but convfuse computes \[1, 2, 4, 4\]"):
        PoolPlan(PoolPlanKey.create(skewed, "float32"))
