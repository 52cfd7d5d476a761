"""Note [a known signature on the device] (convfuse/functional.py): a convfuse.nn layer's
call on CuPy arrays whose signature its call cache knows runs the op's validated entry
without the op's checks, and what a signature does not fix (each array's address and
device) is checked per call. On test_ops_cudnn_wiring's fake GPU, with CuPy layers made
over its fake memory."""

from __future__ import annotations

import numpy as np
import pytest

from convfuse import ops
from convfuse.errors import DeviceMismatchError
from convfuse.ops import _checks
from tests._fake_cuda import cupy_layers

FUSED = "convolutionBiasActivationForward"


@pytest.fixture
def gpu(monkeypatch):
    return cupy_layers(monkeypatch)


def _layer_and_input(gpu):
    import convfuse as cf

    layer = cf.nn.Conv2d(2, 4, 3, padding=1, activation="relu", device="cuda", seed=0)
    return layer, gpu.array((1, 2, 5, 5), np.float32)


def test_a_known_signature_skips_the_ops_checks_not_the_engine(gpu, monkeypatch):
    from convfuse.ops import conv as ops_conv

    checked = []
    real = ops_conv.check_fused_args
    monkeypatch.setattr(ops_conv, "check_fused_args",
                        lambda *a: checked.append(a[0]) or real(*a))
    layer, x = _layer_and_input(gpu)
    layer(x)
    assert checked == ["conv_bias_act"]  # the first call: the op's checks
    gpu.calls.clear()
    layer(x)
    layer(x)
    assert checked == ["conv_bias_act"]  # known: not again
    assert [n for n, _ in gpu.calls].count(FUSED) == 2  # and cuDNN ran each time


def test_a_replaced_op_sees_every_call(gpu, monkeypatch):
    layer, x = _layer_and_input(gpu)
    layer(x)
    seen = []
    real = ops.conv_bias_act
    monkeypatch.setattr(ops, "conv_bias_act", lambda *a, **k: seen.append(1) or real(*a, **k))
    layer(x)
    layer(x)
    assert seen == [1, 1]


def test_what_a_signature_does_not_fix_is_still_checked(gpu, monkeypatch):
    """An address the ops refuse (a weight assigned at an odd offset) and an array on
    another device than the current one get the op's own errors, named by the layer."""
    cp = gpu.cp
    layer, x = _layer_and_input(gpu)
    layer(x)
    good = layer.weight.data
    mem = cp.cuda.memory.UnownedMemory(good.data.ptr, good.nbytes + 16, None, device_id=0)
    layer.weight.data = cp.ndarray(good.shape, good.dtype,
                                   memptr=cp.cuda.memory.MemoryPointer(mem, 4))
    with pytest.raises(ValueError, match=r"Conv2d: w starts at address 0x[0-9a-f]+, which is "
                                         r"not 16-byte aligned"):
        layer(x)
    layer.weight.data = good
    layer(x)
    monkeypatch.setattr(_checks, "current_device", lambda: 1)
    with pytest.raises(DeviceMismatchError, match=r"Conv2d: x lives on CUDA device 0 but the "
                                                  r"current device is 1"):
        layer(x)


def test_the_backward_runs_the_validated_entries_after_its_own_checks(gpu, monkeypatch):
    """The backward's checks (dy and the gradient buffers against the forward's context)
    cover what the ops would check of them; the ops' own checks do not run again, cuDNN
    does; a replaced op sees its calls (and the public ops run then)."""
    from convfuse.ops import conv as ops_conv

    checked = []
    for name in ("check_filter_grad_args", "check_data_grad_args"):
        real = getattr(ops_conv, name)
        monkeypatch.setattr(ops_conv, name,
                            lambda *a, _r=real: checked.append(a[0]) or _r(*a))
    layer, x = _layer_and_input(gpu)
    y = layer(x)
    dy = gpu.array(y.shape, np.float32)
    gpu.calls.clear()
    layer.backward(dy)
    assert checked == []
    names = [n for n, _ in gpu.calls]
    assert names.count("convolutionBackwardFilter") == 1
    assert names.count("convolutionBackwardData") == 1
    seen = []
    real_data = ops.conv_backward_data
    monkeypatch.setattr(ops, "conv_backward_data",
                        lambda *a, **k: seen.append(1) or real_data(*a, **k))
    layer(x)
    layer.backward(dy)
    assert seen == [1] and checked == ["conv_backward_filter", "conv_backward_data"]
