"""convfuse._cudnn's handle, object lifetimes and argument checks, on the CPU: no handle
without a GPU, descriptors freed when dropped, wrong list lengths and types refused before
cuDNN sees them, cuDNN's own errors naming the function and carrying cuDNN's message,
read-only perf records."""

from __future__ import annotations

import gc

import pytest

from convfuse.backend import gpu_available
from convfuse.errors import CudnnError
from tests._binding_helpers import conv, filt, lib, tensor


def test_handle_without_gpu_raises_not_initialized():
    if gpu_available():
        pytest.skip("a GPU is present: cudnnCreate succeeds")
    with pytest.raises(CudnnError, match="cudnnCreate") as info:
        lib.Handle()
    assert info.value.status == lib.CUDNN_STATUS_NOT_INITIALIZED == 1001
    assert info.value.status_name == "CUDNN_STATUS_NOT_INITIALIZED"


def test_live_descriptor_count_tracks_lifetimes():
    gc.collect()
    base = lib.liveDescriptorCount()
    kinds = (lib.TensorDescriptor, lib.FilterDescriptor, lib.ConvolutionDescriptor,
             lib.ActivationDescriptor, lib.PoolingDescriptor)
    made = [k() for k in kinds for _ in range(3)]
    assert lib.liveDescriptorCount() == base + 15
    with pytest.raises(ValueError):
        made[0].setNd(lib.CUDNN_DATA_FLOAT, [1, 2, 3], [1])  # a failed set leaks nothing
    del made
    gc.collect()
    assert lib.liveDescriptorCount() == base
    lib.getConvolutionNdForwardOutputDim(conv([0], [1], [1]), tensor([1, 2, 5]), filt([3, 2, 2]))
    gc.collect()
    assert lib.liveDescriptorCount() == base  # temporaries freed


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: lib.TensorDescriptor().setNd(0, [2, 3, 4, 5], [60, 20, 5]), "dims and strides"),
        (lambda: lib.TensorDescriptor().setNd(0, [2, 3], [3, 1]), "3 to 8 entries, got 2"),
        (lambda: lib.TensorDescriptor().setNd(0, [1] * 9, [1] * 9), "3 to 8 entries, got 9"),
        (lambda: lib.TensorDescriptor().setNd(0, [], []), "got 0"),
        (lambda: lib.FilterDescriptor().setNd(0, 0, [4, 3]), "dims must have 3 to 8"),
        (lambda: lib.FilterDescriptor().setNd(0, 0, [1] * 9), "got 9"),
        (lambda: conv([1, 1], [1], [1, 1]), "pads and strides"),
        (lambda: conv([1, 1], [1, 1], [1]), "pads and dilations"),
        (lambda: conv([], [], []), "1 to 6 entries, got 0"),
        (lambda: conv([0] * 7, [1] * 7, [1] * 7), "1 to 6 entries, got 7"),
        (lambda: lib.PoolingDescriptor().setNd(0, 0, [2, 2], [0], [2, 2]), "windowDims and pads"),
        (lambda: lib.PoolingDescriptor().setNd(0, 0, [2], [0], [2, 2]), "windowDims and strides"),
        (lambda: lib.PoolingDescriptor().setNd(0, 0, [], [], []), "got 0"),
        (lambda: lib.PoolingDescriptor().setNd(0, 0, [2] * 7, [0] * 7, [1] * 7), "got 7"),
    ],
)
def test_wrong_list_lengths_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_wrong_argument_types_raise_type_error():
    with pytest.raises(TypeError):
        lib.TensorDescriptor().setNd(0, [2, "3", 4], [12, 4, 1])
    with pytest.raises(TypeError):
        lib.getConvolutionNdForwardOutputDim(None, tensor([1, 2, 3]), filt([1, 2, 3]))
    with pytest.raises(TypeError):
        lib.getPoolingNdForwardOutputDim(lib.PoolingDescriptor(), filt([1, 2, 3]))


def test_cudnn_error_on_bad_values_names_the_function():
    with pytest.raises(CudnnError) as info:
        lib.TensorDescriptor().setNd(lib.CUDNN_DATA_FLOAT, [2, 0, 4, 4], [0, 16, 4, 1])
    assert info.value.function == "cudnnSetTensorNdDescriptor"
    assert info.value.status == lib.CUDNN_STATUS_BAD_PARAM
    assert lib.getErrorString(info.value.status) == info.value.status_name


def test_cudnn_error_carries_cudnns_own_account_of_the_failure():
    """cudnnGetLastErrorString's text, read where the call failed: what the status alone
    does not say (here, which dimension is wrong). It survives with_context and pickling."""
    import pickle

    with pytest.raises(CudnnError) as info:
        lib.TensorDescriptor().setNd(lib.CUDNN_DATA_FLOAT, [2, -3, 4, 4], [48, 16, 4, 1])
    err = info.value
    assert "-3" in err.detail and "\n" not in err.detail
    assert str(err).endswith(f"[cuDNN: {err.detail}]")
    placed = err.with_context("conv_forward for NCHW x (2, -3, 4, 4)")
    assert placed.detail == err.detail and "conv_forward for NCHW" in str(placed)
    assert str(placed).endswith(f"[cuDNN: {err.detail}]")
    again = pickle.loads(pickle.dumps(placed))
    assert (again.detail, str(again)) == (placed.detail, str(placed))
    plain = CudnnError(3000, "cudnnX", "CUDNN_STATUS_NOT_SUPPORTED")
    assert plain.detail == "" and "[cuDNN" not in str(plain)


@pytest.mark.parametrize("status", [4003, 4004])
def test_cudnns_out_of_memory_statuses_are_memory_errors(status):
    """cuDNN's HOST_ and DEVICE_ALLOCATION_FAILED make a CudnnOutOfMemoryError: a MemoryError
    and still a CudnnError, through with_context, pickling and renaming."""
    import pickle

    from convfuse.errors import CudnnOutOfMemoryError, renamed

    err = CudnnError(status, "cudnnX", lib.getErrorString(status), "", "no memory")
    assert type(err) is CudnnOutOfMemoryError and isinstance(err, MemoryError)
    assert isinstance(err, RuntimeError) and err.status == status
    for again in (err.with_context("conv_forward for x"), pickle.loads(pickle.dumps(err)),
                  renamed(err, "Conv2d")):
        assert type(again) is CudnnOutOfMemoryError and again.status == status
    assert "conv_forward for x" in str(err.with_context("conv_forward for x"))
    for other in (4000, 5000, 3000, 2000):  # the other failures are not MemoryErrors
        assert type(CudnnError(other, "cudnnX")) is CudnnError


def test_algo_perf_fields_are_read_only():
    p = lib.AlgoPerf(algo=1, status=0, time=0.25, memory=1 << 33, determinism=1, mathType=3)
    fields = (p.algo, p.status, p.time, p.memory, p.determinism, p.mathType)
    assert fields == (1, 0, 0.25, 1 << 33, 1, 3)
    with pytest.raises(AttributeError):
        p.algo = 2
    assert "memory=8589934592" in repr(p)
