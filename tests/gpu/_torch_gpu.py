"""What the convfuse.torch GPU tests share: the test's CUDA setting, NaN poisoning of
PyTorch's caching allocator, and a captured step's replay on a new input."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

import convfuse as cf

torch = pytest.importorskip("torch")


@contextlib.contextmanager
def exact_cuda(reset_dynamo: bool = False) -> Iterator[None]:
    """Skip without a CUDA build of PyTorch; else run with TF32 off in convfuse and in
    PyTorch's cuDNN and matmul (float32 results are compared with float64 references and
    with torch.nn's float32, which must not round to TF32 either), Dynamo's caches reset
    around the test when asked, and every flag restored afterwards."""
    if not torch.cuda.is_available():
        pytest.skip(f"PyTorch {torch.__version__} has no usable CUDA")
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    if reset_dynamo:
        torch._dynamo.reset()
    try:
        with cf.config.flags(allow_tf32=False):
            yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
        if reset_dynamo:
            torch._dynamo.reset()


def poison(nbytes: int = 64 << 20) -> None:
    """Fill, then free, a block of PyTorch's cache with NaN: the next allocations of the
    current stream likely reuse it, so an output read before it is written shows. The
    caching allocator serves requests of at most 1 MiB from a pool of their own (2 MiB
    segments a large block never reaches), so 32 blocks of exactly 1 MiB are poisoned as
    well: freed, each segment's two coalesce into 2 MiB of NaN for the small outputs.
    (A graph capture allocates from a private pool neither reaches.)"""
    block = torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda")
    small = [torch.full((1 << 18,), float("nan"), device="cuda") for _ in range(32)]
    del block, small


def replay_on_new_input(graph, static_x, static_y):
    """Copy a new random input into a captured training step's static input, replay the
    graph, and return (the new input, copies of y and of x's gradient)."""
    new_x = torch.randn_like(static_x)
    with torch.no_grad():
        static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    return new_x, static_y.detach().clone(), static_x.grad.detach().clone()
