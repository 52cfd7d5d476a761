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
Every op runs inside `engine_context(device)`: the tensor's device is current for CuPy,
CuPy's current stream is PyTorch's current stream (`cupy.cuda.Stream.from_external`), so
convfuse's cuDNN handle (re-bound to CuPy's current stream at every call, see
convfuse/ops/cudnn/handle.py) and its CuPy kernels queue behind PyTorch's work without a
sync; and CuPy allocates from PyTorch's caching allocator (`_torch_allocator`). That
allocator therefore backs the outputs handed to PyTorch and the cuDNN workspace: one pool
for the process instead of two caches competing for the same GPU memory, and memory
PyTorch frees is reusable by convfuse's next call and the other way round. The blocks are
taken on PyTorch's current stream, so PyTorch's stream rules for its own tensors apply.
DLPack exchanges inside the context are on one stream, so they add no synchronisation.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import ml_dtypes
import numpy as np
import torch
from torch._prims_common import suggest_memory_format

from ..geometry import layout_name
from ..ops._checks import ALIGNMENT

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
    if v.device.type == "cuda" and v.data_ptr() % ALIGNMENT:  # pragma: gpu
        v = v.clone()  # a view at an odd offset: convfuse's GPU ops refuse it, so copy once
    return v


def logical(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """A convfuse-ordered result as a PyTorch (N, C, ...) tensor on the same memory, and
    not a view (Note [layouts across the bridge])."""
    return t.movedim(-1, 1).detach() if channels_last else t


def empty_in_layout(ref: torch.Tensor, shape: Sequence[int],
                    channels_last: bool) -> torch.Tensor:
    """A new (N, C, ...) tensor of `ref`'s dtype and device whose memory is C-contiguous in
    convfuse's order for the layout: what `logical` returns (the fake implementations'
    outputs), and what `physical` maps back with no copy (an `out=` for convfuse)."""
    shape = [int(n) for n in shape]
    if not channels_last:
        return ref.new_empty(shape)
    if len(shape) in (4, 5):
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        return torch.empty(shape, dtype=ref.dtype, device=ref.device, memory_format=fmt)
    phys = [shape[0], *shape[2:], shape[1]]
    strides = [1] * len(phys)
    for i in range(len(phys) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(phys[i + 1], 1)
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


def to_array(t: torch.Tensor) -> Any:
    """A contiguous tensor as a NumPy (CPU) or CuPy (CUDA) array on the same memory."""
    t = t.detach()
    if t.device.type == "cuda":  # pragma: gpu
        import cupy

        return cupy.from_dlpack(t)
    if t.dtype == torch.bfloat16:  # Note [bfloat16 on the CPU]
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def to_tensor(a: Any) -> torch.Tensor:
    """A NumPy or CuPy array as a tensor on the same memory (PyTorch keeps it alive)."""
    if isinstance(a, np.ndarray):
        a = np.ascontiguousarray(a)  # a no-op for the engine's results; the fake ops assume it
        if a.dtype == np.dtype(ml_dtypes.bfloat16):  # Note [bfloat16 on the CPU]
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    return torch.from_dlpack(a)  # pragma: gpu


@contextlib.contextmanager
def engine_context(device: torch.device) -> Iterator[None]:
    """Run convfuse on `device` the way PyTorch would (Note [CUDA streams and memory])."""
    if device.type != "cuda":
        yield
        return
    import cupy  # pragma: gpu

    stream = torch.cuda.current_stream(device)  # pragma: gpu
    with (cupy.cuda.Device(device.index), cupy.cuda.Stream.from_external(stream),  # pragma: gpu
          cupy.cuda.using_allocator(_torch_allocator(device))):
        yield  # pragma: gpu


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
