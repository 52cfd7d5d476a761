"""Train the digits conv net data-parallel over several processes with torch.distributed.

    torchrun --standalone --nproc_per_node=2 examples/train_ddp.py [--api convfuse|torch]

Each process takes its share of every global batch. Without a GPU the processes run on
convfuse's NumPy reference engine and talk over gloo; with GPUs each process uses the GPU of
its LOCAL_RANK and talks over NCCL; the script is the same. Run without torchrun it trains
as a world of one.

--api convfuse (default): convfuse's own layers and optimizer (examples/train_digits.py's
  model); `convfuse.distributed.broadcast_parameters` starts every rank from rank 0's weights
  and `allreduce_gradients` averages the gradients with one all-reduce per dtype.
--api torch: the same net written with torch.nn, converted with `convfuse.torch.convert`
  (conv + ReLU become fused convfuse layers) and wrapped in DistributedDataParallel.

Note [process-group teardown]
`dist.destroy_process_group()` frees the process group, and so joins gloo's worker
threads, only if nothing else still holds it. Two things did, and a rank then sometimes
died at exit with `terminate called without an active exception` (SIGABRT) after training
had finished: the group's worker threads outlived `main`, and one of them, dropping its
last collective's tensors during interpreter shutdown, needed the GIL, which a thread
cannot take then (CPython ends the thread, and the unwind through C++ destructors calls
std::terminate). Whether it happened depended on thread scheduling. The holders:
- `torch.distributed.nn` evaluates `group=group.WORLD` as default arguments when it is
  first imported, and DistributedDataParallel imports it: imported after
  `init_process_group`, its functions keep the world group alive for good. So this
  script imports it first, while there is no group;
- DistributedDataParallel itself, until it is collected: the trainer is released (and
  reference cycles collected) before the group is destroyed.
On Linux each rank then checks that no gloo thread is left (`gloo threads left: 0`).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn  # before any process group: Note [process-group teardown]

import convfuse as cf
from convfuse.distributed import allreduce_gradients, broadcast_parameters
from convfuse.selfcheck import gpu_unusable_reason

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_digits import build_model, check_batch_size, load_digits, positive, seed_int


def setup(requested: str | None) -> tuple[int, int, str, str | None]:
    """Pick the device, then join the process group (torchrun's environment, or a world of
    one). Returns rank, world size, device and why no GPU is used (None when one is)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    reason = None if requested == "cpu" else gpu_unusable_reason()
    if requested == "cuda" and reason is not None:
        sys.exit(f"--device cuda: {reason}")  # as train_digits.py: before any process group
    use_gpu = requested != "cpu" and reason is None
    if use_gpu:  # pragma: gpu
        import cupy

        cupy.cuda.Device(local).use()
        torch.cuda.set_device(local)
    backend = "nccl" if use_gpu else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        store = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    return rank, world, "cuda" if use_gpu else "cpu", reason


def torch_model(device: str, seed: int) -> torch.nn.Module:
    import convfuse.torch as ct

    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 2 * 2, 10),
    )
    return ct.convert(net).to(device)


class ConvfuseTrainer:
    """convfuse layers + convfuse Adam; gradients averaged by allreduce_gradients."""

    def __init__(self, device: str, lr: float, seed: int, rank: int) -> None:
        self.xp = cf.backend.xp_for(device)
        self.model = build_model(device, seed + rank)  # different on purpose: the broadcast
        self.opt = cf.optim.Adam(self.model.parameters(), lr=lr)
        broadcast_parameters(self.model)  # every rank now holds rank 0's weights
        self.loss_fn = cf.CrossEntropyLoss()
        self.loss_mean, self.correct_mean = cf.metrics.Mean(), cf.metrics.Mean()

    def step(self, xb: np.ndarray, yb: np.ndarray) -> None:
        self.opt.zero_grad()
        loss = self.loss_fn(self.model(self.xp.asarray(xb)), self.xp.asarray(yb))
        self.model.backward(self.loss_fn.backward())
        allreduce_gradients(self.opt)  # one all-reduce per dtype, averaged over the ranks
        self.opt.step()
        self.loss_mean.add(loss)
        self.correct_mean.add(self.loss_fn.correct, count=len(xb))

    def epoch_stats(self) -> tuple[float, float]:
        stats = (self.loss_mean.compute(), self.correct_mean.compute())
        self.loss_mean.reset()
        self.correct_mean.reset()
        return stats

    def predict(self, x: np.ndarray) -> np.ndarray:
        logits = self.model(self.xp.asarray(x))
        return np.asarray(cf.backend.to_device(logits.argmax(axis=1), "cpu"))

    def parameters(self) -> list[np.ndarray]:
        return [np.asarray(cf.backend.to_device(p.data, "cpu")) for p in self.model.parameters()]


class TorchTrainer:
    """torch.nn converted by convfuse.torch.convert, in DistributedDataParallel."""

    def __init__(self, device: str, lr: float, seed: int, rank: int) -> None:
        self.device = device
        self.model = torch_model(device, seed + rank)
        ids = [torch.cuda.current_device()] if device == "cuda" else None
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        self.opt = torch.optim.Adam(self.ddp.parameters(), lr=lr)
        # summed loss, correct predictions, samples: on the device, read once per epoch
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)

    def step(self, xb: np.ndarray, yb: np.ndarray) -> None:
        x = torch.from_numpy(xb).to(self.device)
        y = torch.from_numpy(yb.astype(np.int64)).to(self.device)
        self.opt.zero_grad()
        logits = self.ddp(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        loss.backward()  # DDP averages the gradients across ranks during backward
        self.opt.step()
        with torch.no_grad():
            n = torch.tensor(float(len(xb)), dtype=torch.float64, device=self.device)
            self.sums += torch.stack([loss.double() * n, (logits.argmax(1) == y).sum().double(),
                                      n])

    def epoch_stats(self) -> tuple[float, float]:
        loss, correct, n = self.sums.tolist()
        self.sums.zero_()
        return loss / n, correct / n

    def predict(self, x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.model(torch.from_numpy(x).to(self.device)).argmax(1).cpu().numpy()

    def parameters(self) -> list[np.ndarray]:
        return [p.detach().cpu().numpy() for p in self.model.parameters()]


def across_ranks(values: list[float], device: str) -> list[float]:
    """The mean of each value over the ranks (one all-reduce)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def parameters_identical(params: list[np.ndarray], device: str) -> bool:
    """Whether every rank holds bit-for-bit the same parameters (max and min agree)."""
    flat = np.concatenate([p.astype(np.float64).ravel() for p in params])
    hi = torch.from_numpy(flat.copy()).to(device)
    lo = hi.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return bool(torch.equal(hi, lo))


def gloo_threads() -> int | None:
    """How many of gloo's threads this process runs (Linux names them gloo_*/pt_gloo_*);
    None where /proc cannot tell."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    names = []
    for task in tasks.iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended while we looked
            continue
    return sum(name.startswith(("gloo", "pt_gloo")) for name in names)


def teardown(rank: int) -> None:
    """Destroy the process group so that its threads end now (Note [process-group
    teardown]); the caller has dropped its trainer."""
    gc.collect()  # DistributedDataParallel's reference cycles hold the group
    dist.destroy_process_group()
    left = gloo_threads()
    if left is not None:
        print(f"rank {rank}: process group destroyed, gloo threads left: {left}", flush=True)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=positive(int), default=6)
    parser.add_argument("--batch-size", type=positive(int), default=64,
                        help="global batch, split evenly over the ranks")
    parser.add_argument("--lr", type=positive(float), default=3e-3)
    parser.add_argument("--api", choices=["convfuse", "torch"], default="convfuse")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--seed", type=seed_int, default=0)
    args = parser.parse_args(argv)
    # every option is checked before the process group exists (torchrun's WORLD_SIZE)
    data = load_digits(args.seed)
    check_batch_size(parser, args.batch_size, len(data[0]),
                     world=int(os.environ.get("WORLD_SIZE", 1)))
    rank, world, device, reason = setup(args.device)
    try:
        return train(args, data, rank, world, device, reason)
    finally:
        teardown(rank)  # train's locals (the trainer, DDP) are gone by now


def train(args: argparse.Namespace, data: tuple, rank: int, world: int, device: str,
          reason: str | None) -> float:
    """Train and evaluate; returns the test accuracy."""
    local = args.batch_size // world
    x_train, x_test, y_train, y_test = data
    trainer_cls = ConvfuseTrainer if args.api == "convfuse" else TorchTrainer
    trainer = trainer_cls(device, args.lr, args.seed, rank)
    if rank == 0 and device == "cpu" and args.device is None and reason:
        print(f"notice: {reason}; running on the CPU reference engine (NumPy).", flush=True)
    if rank == 0:
        print(f"convfuse {cf.__version__}, --api {args.api}: {world} rank(s) on {device} "
              f"({dist.get_backend()}), global batch {args.batch_size} = {world} x {local}",
              flush=True)
    rng = np.random.default_rng(args.seed)  # the same permutation on every rank
    batches = len(x_train) // args.batch_size
    start = time.perf_counter()
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(x_train))
        for b in range(batches):
            idx = order[b * args.batch_size:(b + 1) * args.batch_size]
            mine = idx[rank * local:(rank + 1) * local]
            trainer.step(x_train[mine], y_train[mine])
        loss, train_acc = across_ranks(list(trainer.epoch_stats()), device)
        accuracy = float((trainer.predict(x_test) == y_test).mean())
        if rank == 0:
            print(f"epoch {epoch:>2}: loss {loss:.4f}  train acc {train_acc:.4f}  "
                  f"test acc {accuracy:.4f}", flush=True)
    same = parameters_identical(trainer.parameters(), device)
    if rank == 0:
        print(f"trained in {time.perf_counter() - start:.1f} s; parameters identical on "
              f"all ranks: {same}", flush=True)
        print(f"test accuracy: {accuracy:.4f}", flush=True)
    if not same:
        raise SystemExit("ranks diverged: their parameters differ")
    return accuracy


if __name__ == "__main__":
    main()
