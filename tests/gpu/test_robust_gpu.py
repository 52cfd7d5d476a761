"""Issue #11 on the GPU: the backward rule, version checks, copies, memory limit and
non-contiguous inputs behave as on the CPU (CuPy arrays, cuDNN engine)."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import convfuse as cf
from convfuse.errors import ArrayTooLargeError, DeviceMismatchError, SavedTensorModifiedError

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _deterministic():
    # Bitwise comparisons below need cuDNN algorithms without atomics.
    with cf.config.flags(deterministic=True, allow_tf32=False):
        yield


def _conv():
    return cf.Conv2d(2, 3, 3, padding=1, activation="relu", dtype="float64", device="cuda",
                     seed=0)


def _data(cp):
    rng = np.random.default_rng(0)
    x = cp.asarray(rng.standard_normal((2, 2, 5, 5)))
    dy = cp.asarray(rng.standard_normal((2, 3, 5, 5)))
    return x, dy


def test_bad_gradient_buffers_change_nothing_on_the_gpu_and_a_retry_is_exact():
    import cupy as cp

    x, dy = _data(cp)
    ref = _conv()
    ref(x)
    ref.backward(dy)
    conv = _conv()
    conv(x)
    good = conv.weight.grad
    for bad, exc in [(np.zeros(good.shape), DeviceMismatchError),
                     (cp.zeros((3, 2, 3, 3), cp.float32), ValueError),
                     (conv.weight.data, ValueError), (None, TypeError)]:
        conv.weight.grad = bad
        with pytest.raises(exc, match=r"^Conv2d: weight\.grad"):
            conv.backward(dy)
        assert not conv.bias.grad.any().get()
    conv.weight.grad = good
    conv.backward(dy)
    cp.testing.assert_array_equal(conv.weight.grad, ref.weight.grad)
    cp.testing.assert_array_equal(conv.bias.grad, ref.bias.grad)


def test_optimizer_step_between_forward_and_backward_is_detected_on_the_gpu():
    import cupy as cp

    x, dy = _data(cp)
    conv = _conv()
    opt = cf.optim.SGD(conv.parameters(), lr=0.1, momentum=0.9)
    conv(x)
    opt.step()
    with pytest.raises(SavedTensorModifiedError):
        conv.backward(dy)


def test_a_copied_gpu_pair_trains_exactly_as_the_original():
    import cupy as cp

    x, dy = _data(cp)
    conv = _conv()
    opt = cf.optim.Adam(conv.parameters(), lr=1e-2)
    pairs = [(conv, opt), copy.deepcopy((conv, opt)), pickle.loads(pickle.dumps((conv, opt)))]
    for model, o in pairs:
        for _ in range(2):
            o.zero_grad()
            model(x)
            model.backward(dy)
            o.step()
    for model, _ in pairs[1:]:
        cp.testing.assert_array_equal(model.weight.data, conv.weight.data)


def test_gpu_memory_bomb_fails_before_allocating():
    # 2.7e12 weights (10.8 TB in float32): past any device's memory and any host's, so the
    # check refuses it whichever card and machine run this (10**9 channels, 108 GB, fit an
    # H200's 141 GB and left the refusal to the host's RAM)
    with pytest.raises(ArrayTooLargeError, match="bytes"):
        cf.Conv2d(3, 10**11, 3, device="cuda")


def test_non_contiguous_gpu_input_is_copied_and_left_alone():
    import cupy as cp

    x, _ = _data(cp)
    xt = cp.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    assert not xt.flags.c_contiguous
    conv = _conv()
    cp.testing.assert_array_equal(conv(xt), conv(x))
    assert not xt.flags.c_contiguous
