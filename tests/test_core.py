"""Core helpers: dtypes, activation names, config flags, backend device logic, errors."""

from __future__ import annotations

import pickle

import ml_dtypes
import numpy as np
import pytest

from convfuse import activations, config, dtypes
from convfuse.backend import array_module, device_of, gpu_unavailable_reason, resolve_device
from convfuse.errors import CudnnError, DeviceUnavailableError


def test_dtypes():
    assert dtypes.canonical("float32") == np.float32
    assert dtypes.canonical("BFLOAT16") == np.dtype(ml_dtypes.bfloat16)
    assert dtypes.canonical(np.float16) == np.float16
    assert dtypes.compute_dtype("float16") == np.float32
    assert dtypes.compute_dtype(np.float64) == np.float64
    for bad in ("int8", np.int32, "complex64", "float8"):
        with pytest.raises(ValueError, match="unsupported dtype"):
            dtypes.canonical(bad)


def test_activation_names_and_saves():
    assert activations.normalize(None) == "identity"
    assert activations.normalize("ReLU") == "relu"
    with pytest.raises(ValueError, match="unknown activation 'mish'"):
        activations.normalize("mish")
    assert activations.saves("identity") == "none"
    assert activations.saves("gelu") == "preactivation"
    assert activations.saves("silu") == "preactivation"
    for act in ("relu", "sigmoid", "tanh", "elu", "relu6", "leaky_relu"):
        assert activations.saves(act) == "output"


def test_config_flags_are_scoped_and_validated():
    before = config.get()
    with config.flags(allow_tf32=False, deterministic=True) as inner:
        assert inner.allow_tf32 is False and config.get().deterministic is True
    assert config.get() == before
    with pytest.raises(TypeError, match="unknown flag"):
        config.set_flags(tf32=False)
    with pytest.raises(ValueError, match="bias_grad"):
        config.set_flags(bias_grad="sum")
    assert config.get() == before


def test_backend_without_gpu_says_why():
    if gpu_unavailable_reason() is not None:
        with pytest.raises(DeviceUnavailableError, match="no usable CUDA device or driver"):
            resolve_device("cuda")
        assert resolve_device(None) == "cpu"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")


def test_array_module_and_device_of():
    a = np.zeros(3)
    assert array_module(a, None) is np and device_of(a) == "cpu"
    with pytest.raises(TypeError, match="NumPy or CuPy array"):
        device_of([1, 2])


def test_cudnn_error_message_and_context():
    err = CudnnError(2000, "cudnnSetTensorNdDescriptor", "CUDNN_STATUS_BAD_PARAM")
    assert str(err) == "cudnnSetTensorNdDescriptor failed with CUDNN_STATUS_BAD_PARAM (2000)"
    more = err.with_context("x[1, 2]").with_context("algo 1")
    assert more.status == 2000 and str(more).endswith(": x[1, 2]; algo 1")
    assert isinstance(more, RuntimeError)
    clone = pickle.loads(pickle.dumps(more))
    assert str(clone) == str(more)
