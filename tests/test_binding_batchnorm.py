"""convfuse._cudnn's batch-normalization entries against the real libcudnn, on the CPU.

Without a GPU there is no handle, so only cudnnDeriveBNTensorDescriptor and the enums are
exercised here. The workspace and reserve-space size queries were checked with a NULL
handle through ctypes (libcudnn 9.28 answers CUDNN_STATUS_BAD_PARAM to all three), so they
need a real handle and live in tests/gpu/test_batchnorm_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from convfuse.errors import CudnnError
from tests._binding_helpers import lib, packed_strides

DTYPES = {  # data type of x -> (item size, data type cuDNN derives for the BN tensors)
    "CUDNN_DATA_FLOAT": (4, "CUDNN_DATA_FLOAT"),
    "CUDNN_DATA_HALF": (2, "CUDNN_DATA_FLOAT"),
    "CUDNN_DATA_BFLOAT16": (2, "CUDNN_DATA_FLOAT"),
    "CUDNN_DATA_DOUBLE": (8, "CUDNN_DATA_DOUBLE"),
}
SHAPES = {"4d": [2, 6, 3, 5], "5d": [2, 6, 3, 4, 5]}


def _x(dtype: str, dims: list[int], channels_last: bool):
    d = lib.TensorDescriptor()
    d.setNd(getattr(lib, dtype), dims, packed_strides(dims, channels_last, DTYPES[dtype][0]))
    return d


def test_batchnorm_enums_have_cudnn_values():
    # Values from cudnn_ops.h (cuDNN 9): the binding exports them under their C names.
    assert (lib.CUDNN_BATCHNORM_PER_ACTIVATION, lib.CUDNN_BATCHNORM_SPATIAL,
            lib.CUDNN_BATCHNORM_SPATIAL_PERSISTENT) == (0, 1, 2)
    assert (lib.CUDNN_BATCHNORM_OPS_BN, lib.CUDNN_BATCHNORM_OPS_BN_ACTIVATION,
            lib.CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION) == (0, 1, 2)
    assert lib.CUDNN_BN_MIN_EPSILON == 0.0


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "NHWC"])
@pytest.mark.parametrize("mode", ["CUDNN_BATCHNORM_SPATIAL", "CUDNN_BATCHNORM_SPATIAL_PERSISTENT"])
def test_derive_spatial(dtype, shape, channels_last, mode):
    dims = SHAPES[shape]
    x = _x(dtype, dims, channels_last)
    before = x.getNd()
    bn = lib.TensorDescriptor()
    lib.deriveBNTensorDescriptor(bn, x, getattr(lib, mode))
    want = [1, dims[1]] + [1] * (len(dims) - 2)
    derived_type = getattr(lib, DTYPES[dtype][1])
    assert bn.getNd() == (derived_type, want, packed_strides(want, False, 1))
    assert x.getNd() == before  # the input descriptor is only read


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_derive_per_activation_keeps_spatial_dims(dtype):
    dims = [2, 3, 4, 5]
    bn = lib.TensorDescriptor()
    lib.deriveBNTensorDescriptor(bn, _x(dtype, dims, False), lib.CUDNN_BATCHNORM_PER_ACTIVATION)
    want = [1, 3, 4, 5]
    arr = np.empty(want, dtype=np.int8)
    assert bn.getNd() == (getattr(lib, DTYPES[dtype][1]), want, list(arr.strides))


def test_derived_descriptor_can_be_rederived_and_reused():
    bn = lib.TensorDescriptor()
    lib.deriveBNTensorDescriptor(bn, _x("CUDNN_DATA_DOUBLE", [2, 4, 3, 3], False),
                                 lib.CUDNN_BATCHNORM_SPATIAL)
    lib.deriveBNTensorDescriptor(bn, _x("CUDNN_DATA_HALF", [2, 7, 3, 3, 3], True),
                                 lib.CUDNN_BATCHNORM_SPATIAL)
    assert bn.getNd() == (lib.CUDNN_DATA_FLOAT, [1, 7, 1, 1, 1], [7, 1, 1, 1, 1])


def test_derive_from_unset_descriptor_raises_cudnn_error():
    with pytest.raises(CudnnError) as info:
        lib.deriveBNTensorDescriptor(lib.TensorDescriptor(), lib.TensorDescriptor(),
                                     lib.CUDNN_BATCHNORM_SPATIAL)
    assert info.value.function == "cudnnDeriveBNTensorDescriptor"
    assert info.value.status // 1000 == 2  # the BAD_PARAM family


def test_derive_bad_mode_raises_cudnn_error():
    with pytest.raises(CudnnError) as info:
        lib.deriveBNTensorDescriptor(lib.TensorDescriptor(), _x("CUDNN_DATA_FLOAT", [2, 3, 4, 4],
                                                                False), 17)
    assert info.value.function == "cudnnDeriveBNTensorDescriptor"


def test_compute_calls_need_a_handle_object():
    # No handle exists without a GPU; the binding refuses anything else before cuDNN.
    x = _x("CUDNN_DATA_FLOAT", [2, 3, 4, 4], False)
    with pytest.raises(TypeError):
        lib.getBatchNormalizationTrainingExReserveSpaceSize(
            None, lib.CUDNN_BATCHNORM_SPATIAL, lib.CUDNN_BATCHNORM_OPS_BN, None, x)
    with pytest.raises(TypeError):
        lib.batchNormalizationForwardInference(
            0, lib.CUDNN_BATCHNORM_SPATIAL, 1.0, 0.0, x, 0, x, 0, x, 0, 0, 0, 0, 1e-5)


def test_descriptors_are_freed():
    before = lib.liveDescriptorCount()
    for _ in range(5):
        bn = lib.TensorDescriptor()
        lib.deriveBNTensorDescriptor(bn, _x("CUDNN_DATA_FLOAT", [2, 3, 4, 4], True),
                                     lib.CUDNN_BATCHNORM_SPATIAL)
        del bn
    assert lib.liveDescriptorCount() == before
