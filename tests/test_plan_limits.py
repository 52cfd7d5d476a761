"""cuDNN's 32-bit limit on a tensor's elements, against the real libcudnn without a GPU: a
plan whose tensor cuDNN cannot describe is refused with a TensorTooLargeError that names
the tensor, its shape and the limit, before any cuDNN call (no descriptor is made). Before,
such a tensor got cudnnSetTensorNdDescriptor's NOT_SUPPORTED, or, where one sample's stride
did not fit an int, pybind11's "incompatible function arguments"."""

from __future__ import annotations

import gc

import pytest

from convfuse.errors import CudnnError, TensorTooLargeError
from convfuse.geometry import ConvGeometry
from convfuse.plan import get_plan, get_pool_plan
from convfuse.plan.batchnorm import BatchNormGeometry, get_batchnorm_plan
from convfuse.plan.descriptors import MAX_ELEMENTS
from convfuse.pool_geometry import PoolGeometry
from tests import _plan_helpers
from tests._plan_helpers import lib

fresh_cache = _plan_helpers.fresh_cache  # autouse fixture


def test_the_limit_is_cudnns_own():
    """2**31 - 1 elements are described, one more is refused: MAX_ELEMENTS is libcudnn's
    bound, not a guess (2**31 - 1 is prime: only a 1 x ... x n shape reaches it)."""
    n = MAX_ELEMENTS
    lib.TensorDescriptor().setNd(lib.CUDNN_DATA_FLOAT, [1, 1, 1, n], [n, n, n, 1])
    with pytest.raises(CudnnError, match="NOT_SUPPORTED"):
        lib.TensorDescriptor().setNd(lib.CUDNN_DATA_FLOAT, [2, 1, 1, n // 2 + 1],
                                     [n // 2 + 1] * 3 + [1])


@pytest.mark.parametrize("x_shape, w_shape, padding, what, shape, count", [
    ((4, 64, 4096, 4096), (8, 64, 1, 1), 0, "x", "4 x 64 x 4096 x 4096", "4,294,967,296"),
    ((1, 64, 8192, 4096), (8, 64, 1, 1), 0, "x", "1 x 64 x 8192 x 4096", "2,147,483,648"),
    ((1, 1, 46000, 46000), (1, 1, 1, 1), 400, "y", "1 x 1 x 46800 x 46800",
     "2,190,240,000"),
], ids=["batch", "one-sample", "output"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_a_convolution_cudnn_cannot_describe_is_refused_before_any_descriptor(
        x_shape, w_shape, padding, what, shape, count, channels_last):
    x = x_shape if not channels_last else (x_shape[0], *x_shape[2:], x_shape[1])
    w = w_shape if not channels_last else (w_shape[0], *w_shape[2:], w_shape[1])
    geom = ConvGeometry.create(x, w, padding=padding, layout="NHWC" if channels_last else "NCHW")
    gc.collect()  # earlier tests' plans in reference cycles: freed now, not mid-count
    before = lib.liveDescriptorCount()
    with pytest.raises(TensorTooLargeError) as info:
        get_plan(geom, "float16")
    msg = str(info.value)
    assert f"{what} ({shape}, channels first) has {count} elements" in msg
    assert ("even one sample" in msg) == (count != "4,294,967,296")  # else: the ops split it
    assert "2,147,483,647" in msg and geom.describe() in msg
    assert isinstance(info.value, ValueError) and lib.liveDescriptorCount() == before


def test_a_convolution_of_exactly_the_limit_is_planned():
    geom = ConvGeometry.create((1, 1, MAX_ELEMENTS), (1, 1, 1))
    plan = get_plan(geom, "float32")
    assert plan.key.geometry.output_shape == (1, 1, MAX_ELEMENTS)


def test_a_batch_norm_or_pooling_cudnn_cannot_describe_is_refused():
    gc.collect()  # earlier tests' plans in reference cycles: freed now, not mid-count
    before = lib.liveDescriptorCount()
    with pytest.raises(TensorTooLargeError, match=r"x \(8 x 32 x 2048 x 4096, channels "
                                                  r"first\) has 2,147,483,648 elements"):
        get_batchnorm_plan(BatchNormGeometry.create((8, 32, 2048, 4096)), "float32")
    with pytest.raises(TensorTooLargeError, match=r"x \(8 x 32 x 2048 x 4096, channels "
                                                  r"first\) has 2,147,483,648 elements"):
        get_batchnorm_plan(BatchNormGeometry.create((8, 2048, 4096, 32), "NHWC"), "float16")
    with pytest.raises(TensorTooLargeError, match=r"x \(4 x 64 x 4096 x 4096") as info:
        get_pool_plan(PoolGeometry.create((4, 64, 4096, 4096), 2), "float32")
    assert "batch norm and pooling are not split" in str(info.value)  # unlike convolutions
    assert lib.liveDescriptorCount() == before
