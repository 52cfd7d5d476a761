"""PyTorch tensors as convfuse arrays and back, on the same memory.

Note [layouts across the bridge]
PyTorch keeps one logical order (N, C, *spatial) and expresses channels-last as strides;
convfuse expresses it as the shape order (N, *spatial, C), C-contiguous. So a tensor whose
`movedim(1, -1)` is contiguous (a `channels_last` / `channels_last_3d` tensor, or its 1-d
analogue) *is* a contiguous NHWC array: `physical(t, True)` is a view, no copy.
The layout an op runs in is the memory format torch.nn would return for the same call
(`conv_channels_last`, `batchnorm_channels_last`): torch's own choice, asked from torch
(its convolution backend selection, which fake tensors use too; `suggest_memory_format`
for batch norm). So channels_last in gives channels_last out, while Conv1d/BatchNorm1d on a
transposed (N, L, C) input, or a float64 Conv3d with channels_last_3d, run channels-first
and return contiguous tensors, as torch.nn's do. An input not already laid out that way is
copied once (as torch.nn's conv does); the weight follows the layout (a view when it has
that memory format already, else one copy of the weight).
Results come back through `logical(a, cl)`: an ordinary tensor (not a view, so in-place
ops on it work under autograd, e.g. ReLU(inplace=True) or `out += identity`) on the same
memory, whose strides are those of `torch.empty(shape, memory_format=...)`.

Note [bfloat16 on the CPU]
CPU tensors of dtype bfloat16 do not cross DLPack (NumPy has no bfloat16), so they cross as
int16 views and are reinterpreted as ml_dtypes.bfloat16 on the NumPy side: same bytes, no
copy. On CUDA, bfloat16 crosses DLPack natively.

Note [CUDA streams and memory]
On CUDA every op runs on PyTorch's current stream of the tensors' device, with memory from
PyTorch's caching allocator: convfuse's cuDNN handle and kernels queue behind PyTorch's
work without a sync, and one pool serves the process instead of two caches competing for
the same GPU memory (memory PyTorch frees is reusable by convfuse's next call and the
other way round). Blocks are taken on PyTorch's current stream, so PyTorch's stream rules
for its own tensors apply, and under torch.cuda.graph they come from the capture's pool.

Note [the torch pointer path]
By default (CONVFUSE_TORCH_CUDA_PATH unset or "pointer") a CUDA tensor crosses as a
DeviceArray (Note [the pointer path] in convfuse/ops/cudnn/device.py): its data_ptr(),
shape and dtype, and a TorchContext for (device, PyTorch's current raw stream), cached per
pair. The engine binds its handle to that stream (only when it changed), launches its
kernels there, and allocates through the context: outputs with torch.empty (C-contiguous
in convfuse's order, so `to_tensor` hands back the very tensor, no exchange) and
workspace as uint8 tensors from the caching allocator (no cudaMalloc, no sync: safe under
torch.cuda.graph). `engine_context` is then a shared no-op (a device guard only when the
tensors' device is not the current one). Per call this costs a few attribute reads per
tensor and one torch.empty per output: no DLPack, no CuPy array, no context-manager
stack. What the engine runs through CuPy on this path (float64 channels-last
convolutions, windowed transposed convolutions, padding, batch-norm inference and
evaluation backward) enters `TorchContext.cupy_scope`, which is the "cupy" path's setup,
and its results cross to PyTorch inside it (`TorchContext.adopt`): as views of the
caching-allocator block they were made in, so that record_stream reaches that block
(DLPack only for memory PyTorch did not allocate).
CONVFUSE_TORCH_CUDA_PATH=cupy selects the previous path, kept to compare on a GPU:
`engine_context` makes the tensor's device current for CuPy, PyTorch's current stream
CuPy's (`cupy.cuda.Stream.from_external`) and `_torch_allocator` CuPy's allocator;
`to_array` is `cupy.from_dlpack` and `to_tensor` `torch.from_dlpack`, exchanges on one
stream, so without a synchronisation.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import ml_dtypes
import numpy as np
import torch
from torch._prims_common import suggest_memory_format

from ..dtypes import canonical
from ..geometry import layout_name
from ..ops._checks import ALIGNMENT
from ..ops.cudnn.device import MAX_CONTEXTS, DeviceArray, ExecContext
from . import _switches

G = TypeVar("G")

#: The tensor dtypes convfuse computes in (its four storage dtypes).
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def is_channels_last(t: torch.Tensor) -> bool:
    """Whether `t` maps to convfuse's channels-last layout with no copy
    (Note [layouts across the bridge]); a plain contiguous tensor is channels-first."""
    if t.is_contiguous():
        return False
    return t.movedim(1, -1).is_contiguous()


def batchnorm_channels_last(x: torch.Tensor) -> bool:
    """Whether torch.nn's batch norm returns a channels-last result for `x`: it allocates
    its output with `x.suggest_memory_format()` (channels-last only for 4-d and 5-d)."""
    return suggest_memory_format(x) != torch.contiguous_format


def conv_channels_last(x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int],
                       padding: Sequence[int], dilation: Sequence[int], groups: int,
                       output_padding: Sequence[int] | None = None) -> bool:
    """Whether torch.nn's convolution (transposed when `output_padding` is given) returns a
    channels-last result for these tensors: the memory format of the backend torch would
    pick (mkldnn, cuDNN, the slow kernels; no channels-last float64 in cuDNN or mkldnn, nor
    in the CPU's slow 3-d transposed path), asked the way torch's fake tensors ask it."""
    rank = weight.dim() - 2
    transposed = output_padding is not None
    backend = torch._C._select_conv_backend(
        x, weight, None, list(stride), list(padding), list(dilation), transposed,
        list(output_padding) if output_padding is not None else [0] * rank, groups, None)
    if rank == 1:  # torch decides 1-d convolutions on the 2-d problem it runs
        x, weight = x.contiguous().unsqueeze(2), weight.unsqueeze(2)
    fmt = torch._C._conv_determine_backend_memory_format(x, weight, backend)
    return fmt in (torch.channels_last, torch.channels_last_3d)


def physical(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """`t` in convfuse's order for the layout, C-contiguous (a view when strides allow)."""
    v = t.movedim(1, -1) if channels_last else t
    v = v if v.is_contiguous() else v.contiguous()
    if v.is_cuda and v.data_ptr() % ALIGNMENT:  # pragma: gpu
        v = v.clone()  # a view at an odd offset: convfuse's GPU ops refuse it, so copy once
    return v


def logical(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """A convfuse-ordered result as a PyTorch (N, C, ...) tensor on the same memory, and
    not a view (Note [layouts across the bridge])."""
    return t.movedim(-1, 1).detach() if channels_last else t


def strided_like(g: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`g` with `ref`'s strides where theirs differ only at size-one dims (the same memory):
    a 1x1 kernel's (K, C, 1, 1) weight is both contiguous and channels_last, and torch.nn
    gives a gradient its parameter's strides, which DDP's bucket views expect (else it
    warns and copies the gradient at every step)."""
    gs, rs = g.stride(), ref.stride()
    if gs == rs or g.shape != ref.shape:
        return g
    for a, b, n in zip(gs, rs, g.shape):
        if a != b and n != 1:
            return g
    return g.as_strided(g.shape, rs, g.storage_offset())


def empty_in_layout(ref: torch.Tensor, shape: Sequence[int],
                    channels_last: bool) -> torch.Tensor:
    """A new (N, C, ...) tensor of `ref`'s dtype and device whose memory is C-contiguous in
    convfuse's order for the layout: what `logical` returns (the fake implementations'
    outputs), and what `physical` maps back with no copy (an `out=` for convfuse)."""
    shape = list(shape)  # not int(): a symbolic size (dynamic shapes) stays symbolic
    if not channels_last:
        return ref.new_empty(shape)
    if len(shape) in (4, 5):
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        return torch.empty(shape, dtype=ref.dtype, device=ref.device, memory_format=fmt)
    phys = [shape[0], *shape[2:], shape[1]]
    strides = [1] * len(phys)
    for i in range(len(phys) - 2, -1, -1):
        n = phys[i + 1]  # torch.sym_max costs ~1 us a call on plain ints
        strides[i] = strides[i + 1] * (max(n, 1) if type(n) is int else torch.sym_max(n, 1))
    logical_strides = [strides[0], strides[-1], *strides[1:-1]]
    return torch.empty_strided(shape, logical_strides, dtype=ref.dtype, device=ref.device)


def geometry(cls: type[G], x_shape: Sequence[int], w_shape: Sequence[int],
             channels_last: bool, *hyper: Sequence[int] | int) -> G:
    """`cls.create(x_shape, w_shape, *hyper, layout)` for convfuse-ordered (physical) shapes,
    with `hyper` the layer's (stride, padding, [output_padding,] dilation, groups): cached,
    as a layer asks for the same geometry at every call."""
    create: Any = cls  # a class is hashable; lru_cache's stub does not know type[G] is
    return _geometry(create, tuple(int(n) for n in x_shape), tuple(int(n) for n in w_shape),
                     bool(channels_last),
                     tuple(int(h) if isinstance(h, int) else tuple(int(v) for v in h)
                           for h in hyper))


@functools.lru_cache(maxsize=1024)
def _geometry(cls: Any, x_shape: tuple[int, ...], w_shape: tuple[int, ...],
              channels_last: bool, hyper: tuple[Any, ...]) -> Any:
    return cls.create(x_shape, w_shape, *hyper, layout_name(channels_last, len(w_shape) - 2))


#: Note [the torch pointer path]: "pointer" (the default) or "cupy". Read at import;
#: tests and benchmarks may set the attribute.
CUDA_PATH = os.environ.get("CONVFUSE_TORCH_CUDA_PATH", "pointer") or "pointer"
if CUDA_PATH not in ("pointer", "cupy"):
    raise ValueError(f"CONVFUSE_TORCH_CUDA_PATH must be 'pointer' or 'cupy', got {CUDA_PATH!r}")

_NULL_CONTEXT = contextlib.nullcontext()
_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
    torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
}
_TORCH_DTYPES: dict[np.dtype, torch.dtype] = {v: k for k, v in _NUMPY_DTYPES.items()}
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def to_array(t: torch.Tensor) -> Any:
    """A contiguous tensor as a NumPy (CPU) array, or on CUDA a DeviceArray (Note [the
    torch pointer path]) or, on the "cupy" path, a CuPy array, on the same memory."""
    if t.is_cuda:  # pragma: gpu
        if CUDA_PATH == "pointer":
            return device_array(t)
        import cupy

        return cupy.from_dlpack(t.detach())
    if t.dtype == torch.bfloat16:  # Note [bfloat16 on the CPU]
        return t.detach().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if not t.requires_grad:
        return t.numpy()
    # numpy() refuses a tensor that requires grad; on a CPU tensor of a real dtype
    # force=True only detaches it, in C++ (cheaper than detach() then numpy()); elsewhere
    # (a meta tensor) detach() keeps numpy()'s own error
    return t.numpy(force=True) if t.is_cpu else t.detach().numpy()


def host_array(t: torch.Tensor, channels_last: bool) -> np.ndarray:
    """A CPU tensor as a C-contiguous NumPy array in convfuse's order for the layout:
    `to_array(physical(t, channels_last))` without the CUDA branches (the eager path's
    CPU calls, Note [call plans] in _call_plan.py)."""
    if channels_last:
        t = t.movedim(1, -1)
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:  # Note [bfloat16 on the CPU]
        return t.detach().view(torch.int16).numpy().view(_BFLOAT16)
    return t.numpy(force=True)


def device_array(t: torch.Tensor) -> DeviceArray:
    """A C-contiguous CUDA tensor as a DeviceArray on PyTorch's current stream of its
    device; the array keeps `t` alive."""
    if not t.is_contiguous():
        raise ValueError(f"convfuse needs a C-contiguous tensor here, got strides {t.stride()} "
                         f"for shape {tuple(t.shape)}")
    dtype = _NUMPY_DTYPES.get(t.dtype)
    if dtype is None:
        raise TypeError(f"convfuse computes in {', '.join(map(str, _NUMPY_DTYPES))}, "
                        f"not {t.dtype}")
    return DeviceArray(t.data_ptr(), tuple(t.shape), dtype, torch_context(t.get_device()), t)


def to_tensor(a: Any) -> torch.Tensor:
    """A NumPy array, CuPy array or DeviceArray as a tensor on the same memory (PyTorch
    keeps it alive): a DeviceArray's own tensor when PyTorch allocated it."""
    if type(a) is DeviceArray:  # pragma: gpu
        owner: torch.Tensor = a.owner  # the bridge's own tensor, or TorchContext.adopt's
        return owner
    if isinstance(a, np.ndarray):
        a = np.ascontiguousarray(a)  # a no-op for the engine's results; the fake ops assume it
        if a.dtype == _BFLOAT16:  # Note [bfloat16 on the CPU]
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    return torch.from_dlpack(a)  # pragma: gpu


def tensor_context(t: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """engine_context(t.device) for a call on `t`, which on CUDA first follows PyTorch's
    cuDNN switches (_switches.py); off CUDA nothing to set."""
    if not t.is_cuda:
        return _NULL_CONTEXT
    _switches.follow()  # the pointer path does not go through the ops' engine choice
    return engine_context(t.device)


def engine_context(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Run convfuse on `device` the way PyTorch would (Note [CUDA streams and memory]): on
    the pointer path nothing to enter unless `device` is not the current one."""
    if device.type != "cuda":
        return _NULL_CONTEXT
    if CUDA_PATH == "cupy":  # pragma: gpu
        return _cupy_engine_context(device)
    index = device.index if device.index is not None else _current_device()  # pragma: gpu
    if _current_device() == index:  # pragma: gpu
        return _NULL_CONTEXT
    return torch.cuda.device(index)  # pragma: gpu


@contextlib.contextmanager
def _cupy_engine_context(device: torch.device) -> Iterator[None]:  # pragma: gpu
    """The "cupy" path's setup (Note [the torch pointer path])."""
    import cupy

    stream = torch.cuda.current_stream(device)
    with (cupy.cuda.Device(device.index), cupy.cuda.Stream.from_external(stream),
          cupy.cuda.using_allocator(_torch_allocator(device))):
        yield


def _current_device() -> int:
    getter = getattr(torch._C, "_cuda_getDevice", None)
    return int(getter()) if getter is not None else int(torch.cuda.current_device())


def _current_raw_stream(index: int) -> int:
    """PyTorch's current stream of device `index` as a cudaStream_t (what inductor's
    generated code asks: torch._C._cuda_getCurrentRawStream)."""
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None:
        return int(getter(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


class _Block:
    """A workspace block: a uint8 tensor of PyTorch's cache and its address."""

    __slots__ = ("ptr", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.ptr = tensor.data_ptr()


class TorchContext(ExecContext):
    """PyTorch's stream `stream_ptr` on device `device`, allocating from PyTorch's caching
    allocator (Note [the torch pointer path])."""

    __slots__ = ("torch_device",)

    def __init__(self, device: int, stream_ptr: int) -> None:
        super().__init__(device, stream_ptr)
        self.torch_device = torch.device("cuda", device)

    def allocate(self, nbytes: int) -> Any:
        """A uint8 block of PyTorch's cache; PyTorch's out-of-memory becomes CuPy's
        OutOfMemoryError, the MemoryError convfuse's fallbacks catch (_torch_allocator)."""
        try:
            block = torch.empty(int(nbytes), dtype=torch.uint8, device=self.torch_device)
        except torch.OutOfMemoryError as err:
            import cupy

            raise cupy.cuda.memory.OutOfMemoryError(int(nbytes), 0, 0) from err
        return _Block(block)

    def empty(self, shape: tuple[int, ...], dtype: Any) -> DeviceArray:
        dt = _TORCH_DTYPES.get(dtype)
        np_dtype = dtype
        if dt is None:
            np_dtype = canonical(dtype)
            dt = _TORCH_DTYPES[np_dtype]
        t = torch.empty(tuple(shape), dtype=dt, device=self.torch_device)
        return DeviceArray(t.data_ptr(), tuple(shape), np_dtype, self, t)

    def cupy_scope(self) -> contextlib.AbstractContextManager[Any]:  # pragma: gpu
        return _cupy_engine_context(self.torch_device)

    def adopt(self, a: Any) -> DeviceArray:
        """A CuPy result as a tensor, inside `cupy_scope`: a view of the caching-allocator
        block it was made in (`_torch_allocator`), so that PyTorch's `record_stream` (which
        autograd calls when a gradient crosses streams) reaches the block, as it does not
        through a DLPack tensor of memory PyTorch did not allocate; DLPack for anything
        else (CuPy's stream is PyTorch's, so the exchange records no event: none on the
        legacy stream under a capture)."""
        dtype = canonical(a.dtype)
        block = getattr(a.data.mem, "_owner", None)
        if (type(block) is torch.Tensor and block.dtype == torch.uint8 and a.size
                and a.flags.c_contiguous):
            start = a.data.ptr - block.data_ptr()
            # detached: the same storage (record_stream still reaches the block), but no
            # view for autograd, which refuses in-place ops on a view a Function returned
            t = block[start:start + a.nbytes].view(_TORCH_DTYPES[dtype]).view(
                tuple(a.shape)).detach()
        else:  # pragma: gpu
            t = torch.from_dlpack(a)
        return DeviceArray(t.data_ptr(), tuple(t.shape), dtype, self, t)


_torch_contexts: dict[tuple[int, int], TorchContext] = {}


def torch_context(index: int) -> TorchContext:
    """The context of PyTorch's current stream on CUDA device `index` (one per pair)."""
    key = (index, _current_raw_stream(index))
    ctx = _torch_contexts.get(key)
    if ctx is None:
        if len(_torch_contexts) >= MAX_CONTEXTS:  # streams made and dropped in a loop
            _torch_contexts.clear()
        ctx = _torch_contexts.setdefault(key, TorchContext(*key))
    return ctx


def _torch_allocator(device: torch.device) -> Any:
    """A CuPy allocator handing out PyTorch caching-allocator blocks on `device`.

    Each block is a uint8 tensor taken on PyTorch's current stream; the CuPy memory object
    owns it, so the block returns to PyTorch's cache when the last CuPy array (or the
    tensor wrapping it through DLPack) goes away.

    PyTorch's out-of-memory (torch.OutOfMemoryError, a RuntimeError) is re-raised as CuPy's
    OutOfMemoryError (a MemoryError), the exception convfuse's documented fallbacks catch:
    a workspace that cannot be allocated moves down the algorithm ranking, a fused call
    falls back (Note [transient out-of-memory]), instead of failing the op.
    """
    import cupy

    def alloc(nbytes: int) -> Any:
        if nbytes == 0:
            return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(0, 0, None, device.index), 0)
        try:
            block = torch.empty(nbytes, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError as err:
            raise cupy.cuda.memory.OutOfMemoryError(nbytes, 0, 0) from err
        mem = cupy.cuda.UnownedMemory(block.data_ptr(), nbytes, block, device.index)
        return cupy.cuda.MemoryPointer(mem, 0)

    return alloc
