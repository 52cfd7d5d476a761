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



# ---- Note [the torch pointer path] ----------------------------------------------------

class FakeCuda(torch.Tensor):
    """A CPU tensor that says it lives on CUDA device 0: what `to_array` branches on."""

    @property
    def is_cuda(self):
        return True

    def get_device(self):
        return 0


@pytest.fixture
def torch_gpu(monkeypatch):
    """torch.empty on the CPU (recorded), PyTorch's raw stream 0xA000 on device 0, and no
    DLPack exchange allowed."""
    made = []
    real_empty = torch.empty

    def fake_empty(*shape, dtype=None, device=None, **kw):
        assert device == torch.device("cuda", 0) and not kw
        t = real_empty(*shape, dtype=dtype)
        made.append(t)
        return t

    def refuse(*a, **k):
        raise AssertionError("the pointer path made a DLPack exchange")

    monkeypatch.setattr(torch, "empty", fake_empty)
    monkeypatch.setattr(torch, "from_dlpack", refuse)
    monkeypatch.setattr(cupy, "from_dlpack", refuse)
    monkeypatch.setattr(_arrays, "_current_raw_stream", lambda index: 0xA000 + index)
    monkeypatch.setattr(_arrays, "_current_device", lambda: 0)
    monkeypatch.setattr(_arrays, "CUDA_PATH", "pointer")
    monkeypatch.setattr(_arrays, "_torch_contexts", {})
    return made


def test_torch_context_allocates_outputs_and_workspace_from_torch(monkeypatch, torch_gpu):
    import numpy as np

    from convfuse.dtypes import bfloat16
    from convfuse.ops.cudnn.device import DeviceArray

    ctx = _arrays.torch_context(0)
    assert _arrays.torch_context(0) is ctx and (ctx.device, ctx.stream_ptr) == (0, 0xA000)
    monkeypatch.setattr(_arrays, "MAX_CONTEXTS", 2)  # streams made and dropped in a loop
    for index in (1, 2, 3):
        assert _arrays.torch_context(index).stream_ptr == 0xA000 + index
        assert len(_arrays._torch_contexts) <= 2
    assert ctx.stream.ptr == 0xA000 and ctx.device_ref.id == 0
    y = ctx.empty((2, 3), np.dtype(np.float32))
    h = ctx.empty((4,), np.float16)  # a scalar type, not a dtype: canonicalised
    bf = ctx.empty((5,), bfloat16)
    assert [type(a) for a in (y, h, bf)] == [DeviceArray] * 3
    assert [t.dtype for t in torch_gpu] == [torch.float32, torch.float16, torch.bfloat16]
    assert [tuple(t.shape) for t in torch_gpu] == [(2, 3), (4,), (5,)]
    assert h.dtype == np.float16 and bf.dtype == bfloat16 and y.ctx is ctx
    for a, t in zip((y, h, bf), torch_gpu, strict=True):
        assert a.ptr == t.data_ptr() and _arrays.to_tensor(a) is t  # no exchange
    ws = ctx.allocate(4096)
    block = torch_gpu[-1]
    assert block.dtype == torch.uint8 and block.numel() == 4096 and ws.ptr == block.data_ptr()

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "empty", oom)
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError):  # the engine's fallbacks catch it
        ctx.allocate(1 << 30)


def test_to_array_on_cuda_is_a_device_array_of_the_tensor(monkeypatch, torch_gpu):
    import numpy as np

    from convfuse.ops.cudnn.device import DeviceArray

    t = torch.zeros(2, 3, 4, dtype=torch.float16).as_subclass(FakeCuda)
    a = _arrays.to_array(t)
    assert type(a) is DeviceArray and a.owner is t and a.ctx is _arrays.torch_context(0)
    assert (a.ptr, tuple(a.shape), a.dtype) == (t.data_ptr(), (2, 3, 4), np.dtype(np.float16))
    assert _arrays.to_tensor(a) is t
    monkeypatch.setattr(_arrays, "_current_raw_stream", lambda index: 0xB000)
    assert _arrays.to_array(t).ctx.stream_ptr == 0xB000  # PyTorch's stream of the call
    with pytest.raises(ValueError, match="C-contiguous"):
        _arrays.to_array(t.transpose(0, 1))
    with pytest.raises(TypeError, match=r"not torch\.int32"):
        _arrays.to_array(torch.zeros(3, dtype=torch.int32).as_subclass(FakeCuda))
    monkeypatch.setattr(_arrays, "CUDA_PATH", "cupy")  # the DLPack path, kept to compare
    monkeypatch.setattr(cupy, "from_dlpack", lambda x: ("from_dlpack", x))
    assert _arrays.to_array(t)[0] == "from_dlpack"


def test_engine_context_is_nothing_to_enter_on_the_pointer_path(monkeypatch, torch_gpu):
    null = _arrays.engine_context(torch.device("cuda", 0))
    assert null is _arrays.engine_context(torch.device("cuda", 0))
    assert null is _arrays.engine_context(torch.device("cpu"))
    with null:
        pass
    other = _arrays.engine_context(torch.device("cuda", 1))  # not current: a device guard
    assert isinstance(other, torch.cuda.device) and other.idx == 1
    monkeypatch.setattr(_arrays, "CUDA_PATH", "cupy")
    assert _arrays.engine_context(torch.device("cuda", 0)) is not null  # CuPy's setup


def test_bridge_and_engine_on_pointers(monkeypatch, torch_gpu):
    """The bridge's arrays through the cuDNN engine (on tests/test_ops_cudnn_wiring.py's
    fake GPU): the binding gets the tensors' addresses, a handle bound to PyTorch's
    stream, workspace that is a uint8 block of PyTorch's cache, and the output is a
    tensor torch.empty made, handed back with no exchange."""
    import convfuse.ops as ops
    from tests._ops_dispatch_helpers import GEOMS
    from tests.test_ops_cudnn_wiring import FakeGpu

    gpu = FakeGpu(monkeypatch)
    lib = gpu.lib
    gpu.perfs = [lib.AlgoPerf(a, 0, 1.0, 512, lib.CUDNN_DETERMINISTIC, lib.CUDNN_DEFAULT_MATH)
                 for a in (6, 2)]
    handles = gpu.real_handles(monkeypatch)
    geom = GEOMS[1]
    x, w, b = (torch.zeros(s).as_subclass(FakeCuda) for s in
               (geom.input_shape, geom.weight_shape, geom.bias_shape))
    with _arrays.engine_context(torch.device("cuda", 0)):
        y, z = ops.conv_bias_act(_arrays.to_array(x), _arrays.to_array(w), _arrays.to_array(b),
                                 geom, "relu")
        yt = _arrays.to_tensor(y)
    [(name, args)] = gpu.calls
    y_t, probe, block = torch_gpu  # the output, the algorithm choice's probe, the workspace
    assert name == "convolutionBiasActivationForward" and z is None and yt is y_t
    assert (args[3], args[5], args[14], args[17]) == (x.data_ptr(), w.data_ptr(), b.data_ptr(),
                                                      y_t.data_ptr())
    assert (args[8], args[9]) == (block.data_ptr(), 512) and block.dtype == torch.uint8
    assert probe.dtype == torch.uint8 and probe.numel() == 512
    assert tuple(y_t.shape) == geom.output_shape and y_t.dtype == torch.float32
    [handle] = handles
    assert args[0] is handle and handle.streams == [0xA000]


def test_adopt_views_the_caching_allocator_block_a_cupy_result_lives_in(monkeypatch, torch_gpu):
    """Note [the torch pointer path]: a CuPy result made in a block of PyTorch's cache comes
    back as a view of that block (so record_stream reaches the allocation), no DLPack."""
    import numpy as np

    from convfuse.dtypes import bfloat16

    ctx = _arrays.torch_context(0)
    block = torch.zeros(256, dtype=torch.uint8)  # what _torch_allocator wraps
    mem = cupy.cuda.UnownedMemory(block.data_ptr(), 256, block, 0)
    for dtype, tdtype, offset in ((np.float32, torch.float32, 0), (np.float16, torch.float16, 64),
                                  (bfloat16, torch.bfloat16, 128)):
        a = cupy.ndarray((2, 3), dtype, memptr=cupy.cuda.MemoryPointer(mem, offset))
        got = ctx.adopt(a)
        t = _arrays.to_tensor(got)
        assert t.dtype == tdtype and tuple(t.shape) == (2, 3) and t.is_contiguous()
        assert t.data_ptr() == a.data.ptr == got.ptr
        assert t.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()
        # no autograd view: a layer's output made so takes in-place ops (y.relu_())
        assert not t._is_view() and t._base is None
        t.fill_(1)  # the same bytes as the block's
        assert block[offset:offset + t.nbytes].ne(0).any()
