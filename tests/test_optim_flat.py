"""convfuse.optim's flat buffers on the CPU: parameters re-homed into one aligned buffer per
dtype group, views that never overlap, and replaced arrays refused at step."""

from __future__ import annotations

import numpy as np
import pytest

from convfuse.optim import SGD
from convfuse.optim._flat import ALIGN_BYTES
from tests._optim_helpers import make_params


# -- flat buffers ----------------------------------------------------------------------------
def _root(a):
    while a.base is not None:
        a = a.base
    return a


def test_rehoming_preserves_values_and_shares_one_buffer(rng):
    params = make_params(rng, np.float32) + make_params(rng, np.float64, [(3,), (2, 2)])
    for p in params:
        p.grad[...] = rng.standard_normal(p.shape)
    old = [(p.data, p.grad, p.data.copy(), p.grad.copy()) for p in params]
    SGD(params, lr=0.1)
    for p, (od, og, d, g) in zip(params, old):
        assert p.data is not od and p.grad is not og
        np.testing.assert_array_equal(p.data, d)
        np.testing.assert_array_equal(p.grad, g)
        assert p.data.shape == d.shape and p.data.dtype == d.dtype and p.data.flags.c_contiguous
        assert p.data.ctypes.data % ALIGN_BYTES == 0 and p.grad.ctypes.data % ALIGN_BYTES == 0
    f32 = [p for p in params if p.dtype == np.float32]
    f64 = [p for p in params if p.dtype == np.float64]
    for group in (f32, f64):
        data_root, grad_root = _root(group[0].data), _root(group[0].grad)
        assert data_root is not grad_root and data_root.ndim == 1
        for p in group:
            assert _root(p.data) is data_root and _root(p.grad) is grad_root
            if p.size:  # an empty view shares no bytes with anything
                assert np.shares_memory(p.data, data_root)
                assert np.shares_memory(p.grad, grad_root)
    assert _root(f32[0].data) is not _root(f64[0].data)
    # Views never overlap, so one parameter's update cannot leak into its neighbour.
    for a in params:
        for b in params:
            if a is not b:
                assert not np.shares_memory(a.data, b.data)


def test_old_arrays_are_not_modified(rng):
    params = make_params(rng, np.float32, [(4,)])
    original = params[0].data
    kept = original.copy()
    opt = SGD(params, lr=0.1, weight_decay=0.1)
    params[0].grad[...] = 1.0
    opt.step()
    np.testing.assert_array_equal(original, kept)
    assert not np.array_equal(params[0].data, kept)


def test_zero_grad_is_one_fill_and_keeps_the_views(rng):
    params = make_params(rng, np.float64)
    opt = SGD(params, lr=0.1)
    views = [p.grad for p in params]
    for p in params:
        p.grad[...] = 3.0
    opt.zero_grad()
    for p, v in zip(params, views):
        assert p.grad is v
        assert not p.grad.any()
    before = [p.data.copy() for p in params]
    opt.step()  # zero gradient, no decay: nothing moves
    for p, b in zip(params, before):
        np.testing.assert_array_equal(p.data, b)


def test_replaced_grad_is_refused_at_step(rng):
    params = make_params(rng, np.float32, [(3,), (2,)])
    opt = SGD(params, lr=0.1)
    params[1].grad = np.ones(2, np.float32)
    with pytest.raises(RuntimeError, match=r"params\[1\].*\.grad replaced"):
        opt.step()
    params[1].grad = opt._groups[0].slots[1].grad
    opt.step()
    SGD(params, lr=0.1)  # a second optimizer re-homes the same parameters
    with pytest.raises(RuntimeError, match=r"params\[0\].*\.data replaced.*another optimizer"):
        opt.step()
