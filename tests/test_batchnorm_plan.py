"""BatchNormPlan on the CPU against the real libcudnn: the descriptors it builds (dims and
strides as NumPy lays the array out), the derived BN descriptors, mode and fused-ops
choice (Note [BatchNorm in cuDNN]), and the plan cache."""

from __future__ import annotations

import numpy as np
import pytest

from convfuse._binding import cudnn
from convfuse.plan.batchnorm import (
    BatchNormGeometry,
    batchnorm_plan_cache_info,
    clear_batchnorm_plan_cache,
    fused_documented,
    get_batchnorm_plan,
)

lib = cudnn()


def numpy_strides(dims, channels_last):
    """Element strides, in (N, C, *spatial) order, of a C-contiguous array holding `dims`
    channels-first or channels-last (itemsize 1, so bytes are elements)."""
    if not channels_last:
        return list(np.empty(dims, np.int8).strides)
    stored = np.empty([dims[0], *dims[2:], dims[1]], np.int8)
    return list(np.moveaxis(stored, -1, 1).strides)


@pytest.mark.parametrize(("shape", "layout", "dims"), [
    ((5, 4), "NCHW", [5, 4, 1, 1]),
    ((5, 4), "NHWC", [5, 4, 1, 1]),
    ((2, 4, 9), "NCHW", [2, 4, 1, 9]),
    ((2, 9, 4), "NHWC", [2, 4, 1, 9]),
    ((2, 4, 3, 5), "NCHW", [2, 4, 3, 5]),
    ((2, 3, 5, 4), "NHWC", [2, 4, 3, 5]),
    ((2, 4, 2, 3, 5), "NCHW", [2, 4, 2, 3, 5]),
    ((2, 2, 3, 5, 4), "NHWC", [2, 4, 2, 3, 5]),
])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_plan_descriptors(shape, layout, dims, dtype):
    clear_batchnorm_plan_cache()
    plan = get_batchnorm_plan(BatchNormGeometry.create(shape, layout), dtype)
    code = {"float32": lib.CUDNN_DATA_FLOAT, "float16": lib.CUDNN_DATA_HALF,
            "bfloat16": lib.CUDNN_DATA_BFLOAT16, "float64": lib.CUDNN_DATA_DOUBLE}[dtype]
    got_type, got_dims, got_strides = plan.x_desc.getNd()
    assert (got_type, got_dims) == (code, dims)
    # The lifted array is byte for byte the caller's: (N, L, C) is (N, 1, L, C).
    assert got_strides == numpy_strides(dims, layout == "NHWC" and len(shape) > 2)
    bn_type = lib.CUDNN_DATA_DOUBLE if dtype == "float64" else lib.CUDNN_DATA_FLOAT
    c = dims[1]
    for desc in (plan.bn_desc_training, plan.bn_desc_inference):
        assert desc.getNd()[0] == bn_type and desc.getNd()[1] == [1, c] + [1] * (len(dims) - 2)
    assert plan.fused_ops is None  # identity: nothing for cuDNN to fuse


def test_fused_ops_choice():
    g = BatchNormGeometry.create((2, 3, 3, 8), "NHWC")
    assert fused_documented(g, "float16")
    assert not fused_documented(g, "float32") and not fused_documented(g, "bfloat16")
    assert not fused_documented(BatchNormGeometry.create((2, 8, 3, 3)), "float16")
    assert not fused_documented(BatchNormGeometry.create((2, 3, 3, 6), "NHWC"), "float16")
    # 4-d as cuDNN sees it: (N, L, C) lifts to NHWC; NDHWC is not NHWC
    assert fused_documented(BatchNormGeometry.create((2, 30, 8), "NHWC"), "float16")
    assert not fused_documented(BatchNormGeometry.create((2, 3, 4, 5, 8), "NHWC"), "float16")
    assert get_batchnorm_plan(g, "float16", "relu", True).fused_ops == \
        lib.CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION
    assert get_batchnorm_plan(g, "float16", "relu").fused_ops == \
        lib.CUDNN_BATCHNORM_OPS_BN_ACTIVATION
    assert get_batchnorm_plan(g, "float16", "gelu", True).fused_ops is None
    assert get_batchnorm_plan(g, "float16", "relu").act_desc.get()[0] == lib.CUDNN_ACTIVATION_RELU


def test_plans_are_cached_per_key():
    clear_batchnorm_plan_cache()
    g = BatchNormGeometry.create((2, 4, 3, 3))
    p = get_batchnorm_plan(g, "float32", "relu", False)
    assert get_batchnorm_plan(BatchNormGeometry.create((2, 4, 3, 3)), "float32", "relu") is p
    assert get_batchnorm_plan(g, "float32", "relu", True) is not p
    assert get_batchnorm_plan(g, "float32", None) is get_batchnorm_plan(g, "float32", "identity")
    assert batchnorm_plan_cache_info() == (2, 3, 3)
    with pytest.raises(TypeError, match="BatchNormGeometry"):
        get_batchnorm_plan((2, 4, 3, 3), "float32")
    clear_batchnorm_plan_cache()
    assert batchnorm_plan_cache_info() == (0, 0, 0)
