"""The CUDA-side plumbing of convfuse.torch that can run without a GPU: the CuPy allocator
that hands out PyTorch caching-allocator blocks (torch.empty is redirected to the CPU here,
so only the bookkeeping is exercised: pointers, sizes, and who keeps a block alive)."""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")

from convfuse.torch import _arrays  # noqa: E402


def test_allocator_wraps_a_torch_block_and_keeps_it_alive(monkeypatch):
    made = []
    real_empty = torch.empty

    def fake_empty(n, dtype=None, device=None):
        assert dtype == torch.uint8 and device == torch.device("cuda", 3)
        block = real_empty(n, dtype=dtype)  # host memory standing in for the device block
        made.append(weakref.ref(block))
        return block

    monkeypatch.setattr(torch, "empty", fake_empty)
    alloc = _arrays._torch_allocator(torch.device("cuda", 3))
    ptr = alloc(4096)
    block = made[0]()
    assert ptr.ptr == block.data_ptr() and ptr.mem.size == 4096
    assert ptr.device_id == 3
    del block
    gc.collect()
    assert made[0]() is not None  # the CuPy memory object owns the tensor
    del ptr
    gc.collect()
    assert made[0]() is None  # ...and hands it back to PyTorch's cache when it goes
    empty = alloc(0)
    assert empty.ptr == 0 and len(made) == 1  # nothing taken for zero bytes

