"""DistributedDataParallel on 2 gloo processes around a converted Conv + BatchNorm + ReLU model.

DDP broadcasts rank 0's parameters and buffers at construction and the buffers (running
statistics, num_batches_tracked) again before every forward; convfuse's BatchNorm keeps
them as ordinary registered buffers updated in place, so it takes part unchanged. Each rank
trains the torch.nn model and its convfuse conversion side by side under DDP: the two agree
(parameters and buffers, every rank), and the parameters are identical across ranks.
Without SyncBatchNorm each rank normalises with its own batch's statistics, as torch.nn
does, so there is no single-process oracle on the concatenated batch here.

The ranks run this file as a script; they meet through a FileStore in tmp_path.
"""

from __future__ import annotations

import copy
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from tests._ranks import run_ranks  # noqa: E402

WORLD, STEPS, PER_RANK, TIMEOUT_S = 2, 3, 4, 240


def _reference(seed: int):
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * 2 * 2, 3),
    ).double()


def _train(net, rank: int) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(WORLD * PER_RANK, 1, 6, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (WORLD * PER_RANK,), generator=g)
        sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[sl]), y[sl]).backward()
        opt.step()


def _worker(rank: int, init_file: str, out: str) -> None:
    import importlib

    import torch.distributed as dist

    import convfuse.torch as ct

    # before the group: imported later (DDP does), it keeps the group and its threads alive
    # (examples/train_ddp.py's Note [process-group teardown])
    importlib.import_module("torch.distributed.nn")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        ref = _reference(seed=rank)  # different per rank: DDP makes them rank 0's
        ours = ct.convert(copy.deepcopy(ref))
        assert isinstance(ours[1], ct.BatchNorm2d) and ours[1].activation == "relu"
        for model in (ref, ours):
            _train(torch.nn.parallel.DistributedDataParallel(model), rank)
        np.savez(out, **{f"{kind}/{k}": v.detach().numpy() for kind, m in
                         (("ref", ref), ("ours", ours)) for k, v in m.state_dict().items()})
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two fresh interpreters importing torch: about 20 s here; in the default run
def test_ddp_with_convfuse_batchnorm_two_ranks(tmp_path):
    run_ranks(__file__, [[str(r), str(tmp_path / "store"), str(tmp_path / f"rank{r}.npz")]
                         for r in range(WORLD)], TIMEOUT_S)
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(WORLD)]
    start = _reference(0).state_dict()
    for r in ranks:
        names = [k[len("ref/"):] for k in r if k.startswith("ref/")]
        assert names == list(start)
        for k in names:
            np.testing.assert_allclose(r[f"ours/{k}"], r[f"ref/{k}"], rtol=1e-10, atol=1e-12,
                                       err_msg=k)
    params = [k for k, _ in _reference(0).named_parameters()]
    for k in params:
        np.testing.assert_array_equal(ranks[0][f"ours/{k}"], ranks[1][f"ours/{k}"])
    assert not np.allclose(ranks[0]["ours/0.weight"], start["0.weight"].numpy())
    assert int(ranks[1]["ours/4.num_batches_tracked"]) == STEPS
    # each rank's last update used its own batch: the running statistics differ by rank
    assert not np.allclose(ranks[0]["ours/1.running_mean"], ranks[1]["ours/1.running_mean"])


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
