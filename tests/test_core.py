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
    assert activations.saves("elu") == "preactivation"  # exp(z), not y + 1: accuracy
    for act in ("relu", "sigmoid", "tanh", "relu6", "leaky_relu"):
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


def test_config_flags_restores_only_the_flags_it_changed():
    import threading

    before = config.get()
    try:
        with config.flags(allow_tf32=False):
            config.benchmark = not before.benchmark  # assigned inside the block: it stays
            other = threading.Thread(target=config.set_flags,
                                     kwargs={"deterministic": not before.deterministic})
            other.start()
            other.join()  # another thread's change meanwhile: it stays too
        now = config.get()
        assert now.allow_tf32 == before.allow_tf32  # the block's own flag, restored
        assert now.benchmark == (not before.benchmark)
        assert now.deterministic == (not before.deterministic)
    finally:
        config.set_flags(benchmark=before.benchmark, deterministic=before.deterministic)
    assert config.get() == before


def test_config_flags_blocks_overlapping_on_two_threads_restore_the_first_value():
    """A enters, B enters, A exits, B exits (Note [overlapping flags blocks]): between the
    exits B's value holds, and after both the value from before A; each block restored
    what it saw on entry used to leave B's view (A's value) for good."""
    import threading

    before = config.get()
    seen = {}
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a():
        with config.flags(allow_tf32=not before.allow_tf32, max_array_bytes=1 << 20):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b():
        a_in.wait(10)
        with config.flags(allow_tf32=not before.allow_tf32, max_array_bytes=1 << 21):
            b_in.set()
            a_out.wait(10)
            seen["between"] = config.get()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen["between"].allow_tf32 == (not before.allow_tf32)
    assert seen["between"].max_array_bytes == 1 << 21
    assert config.get() == before


def test_dtype_none_is_float32_as_in_torch_nn():
    import convfuse as cf

    assert cf.dtypes.canonical(None) == np.float32  # NumPy reads None as float64
    assert cf.Conv2d(2, 2, 2, dtype=None, device="cpu").weight.data.dtype == np.float32
    assert cf.Linear(2, 2, dtype=None, device="cpu").weight.data.dtype == np.float32
    assert cf.BatchNorm2d(2, dtype=None).weight.data.dtype == np.float32


@pytest.mark.parametrize("device, error", [("gpu", ValueError), ("banana", ValueError),
                                           (None, TypeError), (0, TypeError)])
def test_xp_for_and_to_device_refuse_what_resolve_device_refuses(device, error):
    from convfuse.backend import to_device, xp_for

    with pytest.raises(error):  # they returned NumPy for anything but exactly "cuda"
        xp_for(device)
    with pytest.raises(error):
        to_device(np.zeros(2), device)
    assert xp_for("CPU") is np and type(to_device(np.zeros(2), "CPU")) is np.ndarray


def test_a_batchnorm_too_large_for_the_cap_is_refused_before_allocating():
    import convfuse as cf
    from convfuse.errors import ArrayTooLargeError

    with pytest.raises(ArrayTooLargeError, match=r"^BatchNorm2d: weight .* \(100000000000,\)"):
        cf.BatchNorm2d(10**11)  # 745 GiB of float64 on the host first


def test_backend_without_gpu_says_why():
    if gpu_unavailable_reason() is not None:
        with pytest.raises(DeviceUnavailableError, match="no usable CUDA device or driver"):
            resolve_device("cuda")
        assert resolve_device(None) == "cpu"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")
    # torch's spellings, and nothing that only starts like one (any of these became 'cuda',
    # the index dropped)
    assert resolve_device("cpu:0") == "cpu"
    for bad in ("cudax", "cuda:abc", "cuda:-1", "cuda:", "cpu:1", "cuda:0:1"):
        with pytest.raises(ValueError, match=r"device must be 'cuda', 'cuda:N', 'cpu' or None"):
            resolve_device(bad)


def test_a_cuda_index_other_than_the_current_device_is_refused(monkeypatch):
    """Native arrays live on CuPy's current device: 'cuda:1' built on GPU 0 silently."""
    from types import SimpleNamespace

    from convfuse import backend

    fake = SimpleNamespace(cuda=SimpleNamespace(Device=lambda: SimpleNamespace(id=0)))
    monkeypatch.setattr(backend, "require_gpu", lambda what: fake)
    assert resolve_device("cuda:0") == "cuda" and resolve_device("CUDA") == "cuda"
    with pytest.raises(ValueError, match=r"device='cuda:1': convfuse's layers use CuPy's current "
                                         r"device \(0\); make GPU 1 current"):
        resolve_device("cuda:1")


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
