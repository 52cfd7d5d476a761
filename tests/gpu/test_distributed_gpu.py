"""convfuse.distributed on a GPU: NCCL on a CuPy flat buffer, eager and captured in a CUDA
graph (world size 1).

NCCL is the one part of the GPU suite that depends on the machine more than on the GPU: a
sandboxed machine may offer only loopback networking or no cuMem, and an NCCL that cannot
start may fail or hang. So these tests sit in a file of their own, last in their
acceptance chunk (their timeout marker sorts them after every other test: tests/conftest.py
cold_compiles_last), NCCL is pointed at loopback without cuMem, and a communicator that
cannot be brought up at all (a first all-reduce, in the fixture) skips them naming why.
Written without a GPU: none of these has run yet.
"""

from __future__ import annotations

import datetime
import gc
import sys

import numpy as np
import pytest

import convfuse as cf

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

# above tests/conftest.py's COLD_COMPILE_S: sorted last, so a hang ends nothing after it
NCCL_TIMEOUT_S = 90


@pytest.fixture
def nccl(tmp_path, monkeypatch):
    """torch.distributed with an NCCL process group of one rank, torn down after the test
    (NCCL's teardown waits for every graph holding the communicator: collected first)."""
    import torch.distributed as dist

    if not torch.cuda.is_available():
        pytest.skip(f"PyTorch {torch.__version__} has no usable CUDA")
    if not dist.is_nccl_available():
        pytest.skip("this PyTorch build has no NCCL")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "0")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        try:  # the communicator is made lazily: at the first collective
            probe = torch.ones(1, device="cuda")
            dist.all_reduce(probe)
            torch.cuda.synchronize()
        except Exception as exc:
            pytest.skip(f"NCCL could not start on this machine: {type(exc).__name__}: {exc}")
        yield dist
    finally:
        # a failed test's traceback (kept by pytest in sys.last_*) holds its frame, and so
        # a CapturedStep whose graph NCCL's teardown would wait for: dropped first
        for name in ("last_exc", "last_traceback", "last_value", "last_type"):
            if hasattr(sys, name):
                setattr(sys, name, None)
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.timeout(NCCL_TIMEOUT_S)
def test_nccl_allreduce_of_a_cupy_flat_buffer_world_one(nccl, monkeypatch):
    import cupy

    from convfuse.distributed import allreduce_gradients, broadcast_parameters

    dist = nccl
    model = cf.Sequential(cf.Conv2d(2, 4, 3, device="cuda", seed=0), cf.Flatten(),
                          cf.Linear(4, 3, device="cuda", seed=1))
    opt = cf.optim.SGD(model.parameters(), lr=0.1)
    for i, p in enumerate(model.parameters()):
        p.grad[...] = i + 0.5
    buffer = opt._groups[0].grad
    expected = buffer.get()
    seen = []
    real = dist.all_reduce

    def spy(t, *args, **kwargs):
        seen.append((t.data_ptr(), t.device.type, kwargs.get("op"),
                     torch.cuda.current_stream().cuda_stream))
        return real(t, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", spy)
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        allreduce_gradients(opt)
        broadcast_parameters(model)
    side.synchronize()
    assert seen == [(buffer.data.ptr, "cuda", dist.ReduceOp.AVG, side.ptr)]
    np.testing.assert_array_equal(buffer.get(), expected)  # the average over one rank


@pytest.mark.timeout(NCCL_TIMEOUT_S)
def test_allreduce_gradients_is_captured_in_a_graph_with_nccl(nccl):
    """Note [streams and capture]: inside convfuse.graph.capture the all-reduce goes to the
    capturing stream; replays equal eager steps (world size 1: the average is the value)."""
    import cupy

    from convfuse.distributed import allreduce_gradients

    def build():
        model = cf.Sequential(cf.Conv2d(1, 4, 3, padding=1, activation="relu",
                                        device="cuda", seed=0),
                              cf.Flatten(), cf.Linear(4 * 8 * 8, 5, device="cuda", seed=1))
        opt = cf.optim.SGD(model.parameters(), lr=0.1)
        loss_fn = cf.CrossEntropyLoss()

        def step(x, y):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            model.backward(loss_fn.backward())
            allreduce_gradients(opt)
            opt.step()
            return loss

        return model, step

    rng = np.random.default_rng(0)
    data = [(cupy.asarray(rng.random((8, 1, 8, 8), dtype=np.float32)),
             cupy.asarray(rng.integers(0, 5, 8).astype(np.int32))) for _ in range(4)]
    eager_model, eager_step = build()
    eager_step(*data[0])  # the capture's warm-up step
    for x, y in data[1:]:
        eager_step(x, y)
    graph_model, graph_step = build()
    captured = cf.graph.capture(graph_step, *data[0])
    for x, y in data[1:]:
        captured(x, y)
    captured.synchronize()
    for a, b in zip(graph_model.parameters(), eager_model.parameters()):
        np.testing.assert_allclose(a.data.get(), b.data.get(), rtol=1e-6, atol=1e-7)
