"""Data-parallel training on 2 gloo processes over loopback: DDP around convfuse.torch layers,
and convfuse's own layers with broadcast_parameters / allreduce_gradients. After a few steps
on different data per rank, parameters are identical across ranks and equal to one process
training on the concatenated batch.

The ranks run this file as a script (`python tests/test_distributed.py MODE RANK ...`); they
meet through a FileStore in the test's tmp_path, so no port is chosen, and gloo talks on the
loopback interface only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import convfuse as cf  # noqa: E402
from tests._ranks import run_ranks  # noqa: E402

WORLD = 2
STEPS = 3
PER_RANK = 4
TIMEOUT_S = 240


def _data(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of `step` (all ranks together), float64 images and int labels."""
    rng = np.random.default_rng(100 + step)
    x = rng.standard_normal((WORLD * PER_RANK, 1, 6, 6))
    y = rng.integers(0, 3, WORLD * PER_RANK)
    return x, y


def _shard(a: np.ndarray, rank: int | None) -> np.ndarray:
    return a if rank is None else a[rank * PER_RANK:(rank + 1) * PER_RANK]


# -- convfuse's own layers ----------------------------------------------------------------
def _cf_model(seed: int) -> cf.Sequential:
    return cf.Sequential(
        cf.Conv2d(1, 4, 3, padding=1, activation="relu", dtype="float64", seed=seed),
        cf.Conv2d(4, 4, 3, stride=2, activation="tanh", dtype="float64", seed=seed + 1),
        cf.Flatten(),
        cf.Linear(4 * 2 * 2, 3, dtype="float64", seed=seed + 2),
    )


def train_convfuse(rank: int | None) -> list[np.ndarray]:
    """STEPS Adam steps; rank None: one process on the whole batch. Ranks start from
    different weights (seed = rank) and broadcast_parameters makes them rank 0's."""
    from convfuse.distributed import allreduce_gradients, broadcast_parameters

    model = _cf_model(seed=rank or 0)
    opt = cf.optim.Adam(model.parameters(), lr=0.05)
    if rank is not None:
        broadcast_parameters(model)
    loss_fn = cf.CrossEntropyLoss()
    for step in range(STEPS):
        x, y = _data(step)
        opt.zero_grad()
        loss_fn(model(_shard(x, rank)), _shard(y, rank).astype(np.int64))
        model.backward(loss_fn.backward())
        if rank is not None:
            allreduce_gradients(opt)
        opt.step()
    return [p.data.copy() for p in model.parameters()]


def _mixed_dtype_check(rank: int) -> dict[str, np.ndarray]:
    """bfloat16 + float32 parameters: one all-reduce per dtype, sums exact."""
    import torch.distributed as dist

    from convfuse.distributed import allreduce_gradients

    layers = [cf.Conv2d(2, 3, 3, dtype="bfloat16", seed=0), cf.Linear(3, 2, seed=0)]
    opt = cf.optim.SGD([p for lyr in layers for p in lyr.parameters()], lr=0.1)
    for lyr in layers:
        for p in lyr.parameters():
            p.grad[...] = rank + 1
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: calls.append(t.dtype) or real(t, *a, **k)
    try:
        allreduce_gradients(opt, average=False)
    finally:
        dist.all_reduce = real
    out = {f"grad{i}": np.asarray(p.grad, dtype=np.float64)
           for i, p in enumerate(q for lyr in layers for q in lyr.parameters())}
    out["calls"] = np.array(sorted(str(c) for c in calls))
    # a parameter that is not C-contiguous (a Fortran-ordered weight trains fine) is
    # broadcast in place all the same
    from convfuse.distributed import broadcast_parameters

    lin = cf.Linear(4, 3, seed=rank, dtype="float64")
    lin.weight.data = np.asfortranarray(lin.weight.data)
    broadcast_parameters(lin)
    out["bcast_weight"], out["bcast_bias"] = lin.weight.data, lin.bias.data
    out["bcast_fortran"] = np.array(lin.weight.data.flags.f_contiguous)
    # buffers too, as DDP: each rank's statistics and count (float64 and float32 running
    # statistics, int64 counts: one broadcast per dtype) become rank 0's
    model = cf.Sequential(cf.BatchNorm2d(2, dtype="float64", momentum=None),
                          cf.BatchNorm1d(3, dtype="float32"))
    for i, bn in enumerate(model):
        bn.running_mean[...] = rank + i + 0.5
        bn.running_var[...] = 2 * rank + i + 1
        bn.num_batches_tracked[...] = 5 * rank + i
    model[0].train()(np.zeros((2, 2, 1, 1)) + rank)  # a step: the host's count is mirrored
    model[0]._host_count = 7 * rank
    broadcast_parameters(model)
    for i, bn in enumerate(model):
        for name, buf in bn.named_buffers():
            out[f"buf{i}_{name}"] = buf
    out["host_count_reset"] = np.array(model[0]._host_count is None)
    return out


# -- PyTorch DDP around convfuse.torch layers --------------------------------------------
def _torch_model(seed: int):
    import convfuse.torch as ct

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        ct.Conv2d(1, 4, 3, padding=1, activation="relu", dtype=torch.float64),
        ct.Conv2d(4, 4, 3, stride=2, activation="silu", dtype=torch.float64),
        torch.nn.Flatten(), torch.nn.Linear(4 * 2 * 2, 3, dtype=torch.float64),
    )


def train_torch(rank: int | None) -> list[np.ndarray]:
    model = _torch_model(seed=rank or 0)
    net = model
    if rank is not None:
        net = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's weights
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _data(step)
        opt.zero_grad()
        logits = net(torch.from_numpy(_shard(x, rank)))
        torch.nn.functional.cross_entropy(logits, torch.from_numpy(_shard(y, rank))).backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def _worker(mode: str, rank: int, init_file: str, out: str) -> None:
    import importlib

    import torch.distributed as dist

    # before the group: imported later (DDP does), it keeps the group and its threads alive
    # (examples/train_ddp.py's Note [process-group teardown])
    importlib.import_module("torch.distributed.nn")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        params = train_convfuse(rank) if mode == "convfuse" else train_torch(rank)
        extra = _mixed_dtype_check(rank) if mode == "convfuse" else {}
        np.savez(out, *params, **extra)
    finally:
        dist.destroy_process_group()


def _run_ranks(mode: str, tmp_path: Path) -> list[dict[str, np.ndarray]]:
    init = tmp_path / "store"
    run_ranks(__file__, [[mode, str(r), str(init), str(tmp_path / f"rank{r}.npz")]
                         for r in range(WORLD)], TIMEOUT_S)
    return [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(WORLD)]


def _check_params(ranks: list[dict[str, np.ndarray]], single: list[np.ndarray]) -> None:
    for i, want in enumerate(single):
        a, b = ranks[0][f"arr_{i}"], ranks[1][f"arr_{i}"]
        np.testing.assert_array_equal(a, b)  # identical across ranks
        np.testing.assert_allclose(a, want, rtol=1e-10, atol=1e-12)
    # and training moved them: the comparison is not between untouched initial weights
    start = _cf_model(0).parameters()[0].data if len(single) == 6 else None
    if start is not None:
        assert not np.allclose(single[0], start)


def test_allreduce_gradients_two_ranks_equal_single_process(tmp_path):
    ranks = _run_ranks("convfuse", tmp_path)
    _check_params(ranks, train_convfuse(None))
    for r in ranks:
        assert list(r["calls"]) == ["torch.bfloat16", "torch.float32"]  # one per dtype
        for key in (k for k in r if k.startswith("grad")):
            np.testing.assert_array_equal(r[key], np.full_like(r[key], 3.0))  # 1 + 2
        source = cf.Linear(4, 3, seed=0, dtype="float64")  # rank 0's
        np.testing.assert_array_equal(r["bcast_weight"], source.weight.data)
        np.testing.assert_array_equal(r["bcast_bias"], source.bias.data)
        assert r["bcast_fortran"]  # in place: the same array, still Fortran-ordered
        # rank 0's buffers: its step moved the float64 statistics from 0.5 and 1 (its data
        # is all zeros: mean 0, variance 0; momentum None after 1 step: factor 1/1)
        np.testing.assert_array_equal(r["buf0_running_mean"], [0.0, 0.0])
        np.testing.assert_array_equal(r["buf0_running_var"], [0.0, 0.0])
        assert int(r["buf0_num_batches_tracked"]) == 1
        np.testing.assert_array_equal(r["buf1_running_mean"], np.full(3, 1.5, np.float32))
        np.testing.assert_array_equal(r["buf1_running_var"], np.full(3, 2.0, np.float32))
        assert r["buf1_running_mean"].dtype == np.float32
        assert int(r["buf1_num_batches_tracked"]) == 1
        assert r["host_count_reset"]  # the mirror of the count is re-read


def test_ddp_with_convfuse_layers_two_ranks_equal_single_process(tmp_path):
    ranks = _run_ranks("torch", tmp_path)
    single = train_torch(None)
    _check_params(ranks, single)
    assert not np.allclose(single[0], _torch_model(0)[0].weight.detach().numpy())


def test_helpers_refuse_without_a_process_group_or_a_convfuse_optimizer():
    from convfuse.distributed import allreduce_gradients, broadcast_parameters, flat_gradients

    with pytest.raises(TypeError, match="convfuse optimizer"):
        flat_gradients(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    model = _cf_model(0)
    assert [g.dtype for g in flat_gradients(cf.optim.SGD(model.parameters(), lr=0.1))] == \
        [np.dtype("float64")]
    with pytest.raises(TypeError, match=r"^allreduce_gradients: average must be a bool, got "
                                        r"str 'no'$"):
        allreduce_gradients(cf.optim.SGD(_cf_model(0).parameters(), lr=0.1), average="no")
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            allreduce_gradients(cf.optim.SGD(_cf_model(0).parameters(), lr=0.1))
        with pytest.raises(RuntimeError, match="init_process_group"):
            broadcast_parameters(model)


@pytest.mark.parametrize(("backend_name", "on_gpu", "native"), [
    ("nccl", True, True), ("gloo", False, False), ("gloo", True, False),
    ("cpu:gloo,cuda:nccl", True, True), ("cpu:gloo,cuda:nccl", False, False),
    ("cuda:nccl", False, False), ("cpu:gloo, cuda:nccl", True, True), ("mpi", True, False),
])
def test_only_nccl_averages_natively(backend_name, on_gpu, native):
    """ReduceOp.AVG where NCCL reduces the buffer's device, also under a backend per device
    type; elsewhere a sum and one division."""
    from convfuse.distributed import _averages_natively

    assert _averages_natively(backend_name, on_gpu) is native

def test_a_group_without_a_backend_name_is_asked_for_its_devices_backend(tmp_path):
    """init_process_group() without a backend: get_backend says "undefined", CUDA tensors
    go to NCCL, CPU ones to gloo; the group's own backend for the device decides (asked on
    this PyTorch's real group for the CPU; a stand-in group for CUDA, which this build
    lacks), and anything unexpected means a sum and one division."""
    import torch.distributed as dist

    from convfuse.distributed import _averages_natively

    class ProcessGroupNCCL:
        pass

    class Group:
        def __init__(self, backend):
            self.backend = backend

        def _get_backend(self, device):
            if isinstance(self.backend, Exception):
                raise self.backend
            return self.backend

    assert _averages_natively("undefined", True, Group(ProcessGroupNCCL()))
    assert not _averages_natively("undefined", True, Group(object()))
    assert not _averages_natively("undefined", True, Group(RuntimeError("no cuda backend")))
    assert not _averages_natively("undefined", True, None)
    assert _averages_natively("nccl", True, Group(RuntimeError("not asked")))
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group(init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        assert str(dist.get_backend()) == "undefined"
        group = dist.distributed_c10d._get_default_group()
        assert not _averages_natively("undefined", False, group)  # gloo: no AVG
    finally:
        dist.destroy_process_group()


def test_cupys_null_stream_is_pytorchs_default_stream():
    """The collective runs on PyTorch's stream for CuPy's current one: for CuPy's null
    stream (pointer 0) PyTorch's default stream, not ExternalStream(0), which would be a
    new stream from PyTorch's pool that the null stream never waits for."""
    from types import SimpleNamespace

    from convfuse.distributed import _torch_stream

    made = []
    cuda = SimpleNamespace(
        default_stream=lambda device: made.append(("default", device)) or "default",
        ExternalStream=lambda ptr, device: made.append(("external", ptr, device)) or "ext")
    torch_ns = SimpleNamespace(cuda=cuda)
    assert _torch_stream(torch_ns, 0, 1) == "default"
    assert _torch_stream(torch_ns, 0x7F00, 1) == "ext"
    assert made == [("default", 1), ("external", 0x7F00, 1)]


def test_a_backend_per_device_type_divides_cpu_buffers_then_sums(monkeypatch):
    """Under "cpu:gloo,cuda:nccl" a NumPy gradient buffer is reduced by gloo: each rank's
    gradients multiplied by 1/world size, then SUM (NCCL's AVG is for CUDA buffers only),
    in DDP's order (Note [divide, then sum])."""
    from convfuse.distributed import allreduce_gradients

    dist = torch.distributed
    model = _cf_model(0)
    opt = cf.optim.SGD(model.parameters(), lr=0.1)
    [buf] = [g.grad for g in opt._groups]
    buf[...] = 6.0
    seen = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(dist, "all_reduce",
                        lambda t, op=None, group=None: seen.append((op, t.numpy().copy())))
    allreduce_gradients(opt)
    [(op, handed)] = seen
    assert op == dist.ReduceOp.SUM
    # already divided when the sum sees it, by torch's multiplication by 1/3 (as DDP's)
    want = (torch.full((buf.size,), 6.0, dtype=torch.float64) * (1 / 3)).numpy()
    np.testing.assert_array_equal(handed, want)
    np.testing.assert_array_equal(buf, want)


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])



def test_broadcast_buffers_refuses_what_has_no_buffers_before_anything():
    """A typed error naming what it expects, before any process group is asked for."""
    from convfuse.distributed import broadcast_buffers

    with pytest.raises(TypeError, match=r"broadcast_buffers expects a convfuse layer or model, "
                                        r"got list \(for torch.nn modules use "
                                        r"DistributedDataParallel"):
        broadcast_buffers([cf.Linear(2, 2).weight])
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"expects a convfuse layer or model, got BatchNorm1d"):
        broadcast_buffers(torch.nn.BatchNorm1d(3))  # it has named_buffers, of tensors
