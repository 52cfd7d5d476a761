"""A fake CUDA device for convfuse.torch's eager path, layer to binding (Note [call plans] in
convfuse/torch/_call_plan.py, Note [the torch pointer path] in _arrays.py): on the fake GPU
of tests/test_ops_cudnn_wiring.py, plain tensors report themselves as CUDA tensors of
device 0, torch.empty for CUDA makes CPU tensors (their addresses recorded), and the binding
and the kernel launchers record their calls. A layer call then takes the path it takes on a
GPU (one autograd node, no custom op, no DLPack exchange, cuDNN given the tensors' own
addresses). Used by tests/test_torch_eager_cuda_path.py and by
benchmarks/emulated_cuda_path.py (which times Python's share of that path); `cupy_layers`
does the same for convfuse's own layers on CuPy arrays."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from convfuse.ops import elementwise
from convfuse.ops.cudnn import batchnorm as bn_engine
from convfuse.ops.cudnn import fused
from convfuse.ops.cudnn.device import DeviceArray
from convfuse.plan.batchnorm import clear_batchnorm_plan_cache
from convfuse.torch import _arrays
from tests._engine_calls import forget_signatures
from tests.test_batchnorm_cudnn_wiring import BN_CALLS, SIZES
from tests.test_ops_cudnn_wiring import FakeGpu

WS = 512  # every ranked algorithm's workspace, so each convolution call allocates one


class Launched(NamedTuple):
    """A DeviceArray a kernel launch got, by address only."""

    ptr: int


class Cuda:
    """The fake GPU, and the address of every tensor torch.empty made for device cuda:0
    (addresses only, here and in the recorded launches: a kept reference would make
    autograd copy a gradient it would otherwise take over)."""

    def __init__(self, gpu: FakeGpu, made: list) -> None:
        self.gpu, self.made = gpu, made

    def names(self) -> list[str]:
        return [name for name, _ in self.gpu.calls]

    def call(self, name: str) -> tuple:
        [args] = [a for n, a in self.gpu.calls if n == name]
        return args


def install(monkeypatch: Any, record: bool = True) -> Cuda:
    """The fake CUDA device, through `monkeypatch` (pytest's); `record=False` records
    nothing (for timing loops). Call forget_signatures() and
    clear_batchnorm_plan_cache() again when done."""
    forget_signatures()
    gpu = FakeGpu(monkeypatch)
    lib = gpu.lib
    gpu.perfs = [lib.AlgoPerf(a, 0, 1.0, WS, lib.CUDNN_DETERMINISTIC, lib.CUDNN_DEFAULT_MATH)
                 for a in (6, 2)]
    gpu.real_handles(monkeypatch)
    gpu.forbid_cupy_arrays(monkeypatch)
    monkeypatch.setattr(fused, "_zero_bias", {})
    clear_batchnorm_plan_cache()
    monkeypatch.setattr(bn_engine, "_affine_defaults", {})
    for name in BN_CALLS:
        monkeypatch.setattr(lib, name, lambda *a, _n=name: gpu.record(_n, a))
    for name, size in SIZES.items():
        monkeypatch.setattr(lib, name, lambda *a, _s=size: _s)
    for name in FakeGpu.LAUNCHERS:  # recorded without the arrays, which keep tensors alive
        monkeypatch.setattr(elementwise, name, lambda *a, _n=name: gpu.calls.append(
            (_n, tuple(Launched(v.ptr) if isinstance(v, DeviceArray) else v for v in a))))
    made = []
    real_empty = torch.empty

    def empty(*shape, dtype=None, device=None, **kw):
        t = real_empty(*shape, dtype=dtype, **kw)
        if device is not None and torch.device(device).type == "cuda":
            made.append(t.data_ptr())
        return t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(_arrays, "_current_raw_stream", lambda index: 0xA000 + index)
    monkeypatch.setattr(_arrays, "_current_device", lambda: 0)
    monkeypatch.setattr(_arrays, "CUDA_PATH", "pointer")
    monkeypatch.setattr(_arrays, "_torch_contexts", {})
    # Every plain tensor says it is a CUDA tensor: what the bridge branches on.
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True), raising=False)
    monkeypatch.setattr(torch.Tensor, "is_cpu", property(lambda self: False), raising=False)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0, raising=False)
    if not record:
        for name in (*FakeGpu.COMPUTE, *BN_CALLS):
            monkeypatch.setattr(lib, name, _nothing)
        for name in FakeGpu.LAUNCHERS:
            monkeypatch.setattr(elementwise, name, _nothing)
        monkeypatch.setattr(torch, "empty", lambda *shape, dtype=None, device=None, **kw:
                            real_empty(*shape, dtype=dtype, **kw))
    return Cuda(gpu, made)


def named_calls(calls: list, stable: dict[int, str]) -> list:
    """Recorded calls with `stable`'s addresses named and every other one (fresh outputs,
    workspace, dz; the allocator may reuse any of them) shown as "fresh": what a bound
    call's step must share with the engine's (tests/test_torch_bound_*.py)."""
    out = []
    for name, args in calls:
        shown = []
        for a in args:
            ptr = a.ptr if isinstance(a, Launched) else a
            if type(ptr) is int and ptr > 1 << 20:  # an address, not an algo, mode or size
                shown.append(stable.get(ptr, "fresh"))
            else:
                shown.append(a)
        out.append((name, tuple(shown)))
    return out


def train_step(cuda: Cuda, layer: Any, x: torch.Tensor,
               residual: torch.Tensor | None = None) -> tuple[torch.Tensor, list]:
    """One forward + backward of `layer` with the gradients set to None first (so each one
    is the very tensor cuDNN wrote); (y, the step's recorded calls)."""
    for t in (x, residual, *layer.parameters()):
        if t is not None:
            t.grad = None
    cuda.gpu.calls.clear()
    y = layer(x) if residual is None else layer(x, residual)
    y.backward(torch.ones_like(y))
    return y, list(cuda.gpu.calls)


def cupy_layers(monkeypatch: Any, record: bool = True) -> FakeGpu:
    """convfuse's own layers on CuPy arrays over the fake GPU (convfuse.nn with
    device="cuda"): parameters, gradients and outputs are CuPy arrays over fake device
    memory, and the binding and kernel launchers record their calls (`record=False`: do
    nothing, for timing loops). What a layer's call does on a GPU, minus cuDNN, the kernels
    and CuPy's own allocator. Used by tests/test_layer_device_path.py and by
    benchmarks/emulated_cuda_path.py."""
    import numpy as np

    from convfuse import _memory, backend

    gpu = FakeGpu(monkeypatch)
    gpu.real_handles(monkeypatch)
    cp = gpu.cp
    monkeypatch.setattr(backend, "require_gpu", lambda what="": cp)
    monkeypatch.setattr(backend, "gpu_available", lambda: True)
    monkeypatch.setattr(_memory, "_gpu_total", lambda device: 80 << 30)
    monkeypatch.setattr(cp, "asarray", lambda a, dtype=None: gpu.array(
        np.shape(a), dtype or np.asarray(a).dtype))
    monkeypatch.setattr(cp, "zeros_like", lambda a, dtype=None, **kw: gpu.array(
        a.shape, dtype or a.dtype))
    if not record:
        for name in FakeGpu.COMPUTE:
            monkeypatch.setattr(gpu.lib, name, _nothing)
        for name in FakeGpu.LAUNCHERS:
            monkeypatch.setattr(elementwise, name, _nothing)
    return gpu


def _nothing(*args: Any) -> None:
    return None


