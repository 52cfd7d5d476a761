"""convfuse.distributed against torch.distributed's own behaviour on 2 gloo ranks: the average
of float16/bfloat16/float32/float64 gradients is DDP's bit for bit (divide, then sum: no
float16 overflow), ranks holding different models raise ValueError on every rank (no hang,
no gloo abort), a bad `src` or `group` is refused before any collective, and a rank outside
`group` is left alone, as torch's collectives leave it.

The ranks run this file as a script (`python tests/test_distributed_checks.py SCENARIO RANK
STORE OUT`), as in tests/test_distributed.py: they meet through a FileStore in the test's
tmp_path, and each writes what it saw to OUT (a pickle) for the test to compare.
"""

from __future__ import annotations

import datetime
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import convfuse as cf  # noqa: E402
from tests._ranks import run_ranks  # noqa: E402

WORLD = 2
GROUP_TIMEOUT_S = 30  # a rank left waiting in a collective fails instead of hanging
TIMEOUT_S = 180
DTYPES = ("float16", "bfloat16", "float32", "float64")
NP_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
             "float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}
MODEL_MISMATCH = "{fn}: the ranks hold different models: the shapes, dtypes or layouts"


def _grads(dtype: str, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """A (4, 3) weight gradient and a (4,) bias gradient for `rank`, in `dtype`: random
    values, plus (float16) values whose sum overflows while their average does not, and
    subnormals that the division before the sum rounds (to even) where the division after
    it would not."""
    rng = np.random.default_rng(10 * rank + DTYPES.index(dtype))
    w = rng.standard_normal((4, 3)) * 3.0
    b = rng.standard_normal(4)
    if dtype == "float16":
        w[0] = [40000.0, 60000.0, -65504.0]
        w[1] = [2.0 ** -24, 3 * 2.0 ** -24, 2.0 ** -14]
    return w.astype(NP_DTYPES[dtype]), b.astype(NP_DTYPES[dtype])


def _torch_dtype(dtype: str) -> Any:
    return getattr(torch, dtype)


def _as_torch(a: np.ndarray) -> Any:
    if a.dtype == NP_DTYPES["bfloat16"]:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _as_numpy(t: Any) -> np.ndarray:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(NP_DTYPES["bfloat16"]).copy()
    return t.numpy().copy()


def _error(fn: Callable[[], Any]) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # the test compares type and message
        return type(exc).__name__, str(exc)
    return None


# -- the scenarios, run on each rank ------------------------------------------------------
def scenario_average(rank: int) -> dict[str, Any]:
    """Per dtype: the gradients allreduce_gradients averages, and DDP's average of the same
    gradients (a backward whose gradient is exactly them: d/dw sum(w * G) = G)."""
    import torch.distributed as dist

    from convfuse.distributed import allreduce_gradients

    out: dict[str, Any] = {}
    for dtype in DTYPES:
        w, b = _grads(dtype, rank)
        lin = cf.Linear(3, 4, dtype=dtype, seed=0)
        opt = cf.optim.SGD(lin.parameters(), lr=0.0)
        lin.weight.grad[...] = w
        lin.bias.grad[...] = b
        allreduce_gradients(opt)
        out[f"{dtype}/convfuse"] = (lin.weight.grad.copy(), lin.bias.grad.copy())

        ref = torch.nn.Linear(3, 4, dtype=_torch_dtype(dtype))
        ddp = torch.nn.parallel.DistributedDataParallel(ref)
        y = ddp(torch.ones(1, 3, dtype=_torch_dtype(dtype)))
        loss = (y.sum() * 0 + (ref.weight * _as_torch(w)).sum()
                + (ref.bias * _as_torch(b)).sum())
        loss.backward()
        out[f"{dtype}/ddp"] = (_as_numpy(ref.weight.grad), _as_numpy(ref.bias.grad))
        del ddp

        # the order this replaces, sum then divide, for the test to show it differs
        summed = _as_torch(w)
        dist.all_reduce(summed)
        out[f"{dtype}/sum_then_divide"] = _as_numpy(summed / WORLD)
    return out


def _lin(rank: int, fan_in: int, fan_out: int, **kw: Any) -> cf.Linear:
    return cf.Linear(fan_in, fan_out, seed=rank, **kw)


def scenario_mismatch(rank: int) -> dict[str, Any]:
    """Models that differ between the ranks: each call's error on this rank, and whether
    this rank's arrays kept their own values."""
    from convfuse.distributed import broadcast_parameters

    out: dict[str, Any] = {}
    # same element count, transposed shapes: the case a broadcast silently "succeeds" at
    lin = _lin(rank, 3, 4, bias=False) if rank == 0 else _lin(rank, 4, 3, bias=False)
    own = lin.weight.data.copy()
    out["shape"] = _error(lambda: broadcast_parameters(lin))
    out["shape_kept"] = np.array_equal(lin.weight.data, own)
    # another element count: the case gloo aborts the process at
    lin = _lin(rank, 3, 4) if rank == 0 else _lin(rank, 3, 5)
    out["count"] = _error(lambda: broadcast_parameters(lin))
    # same shapes, another dtype
    lin = _lin(rank, 3, 4, dtype="float32" if rank == 0 else "float64")
    out["dtype"] = _error(lambda: broadcast_parameters(lin))
    # one more layer on rank 0
    layers = [_lin(rank, 3, 3) for _ in range(2 if rank == 0 else 1)]
    out["extra_layer"] = _error(lambda: broadcast_parameters(cf.Sequential(*layers)))
    # the parameters match, the buffers do not: both functions refuse
    bn = cf.BatchNorm1d(3 if rank == 0 else 4, dtype="float64", device="cpu")
    model = cf.Sequential(_lin(rank, 3, 3, dtype="float64"), bn)
    out["buffers_via_parameters"] = _error(lambda: broadcast_parameters(model))
    # the same stored shape, (4, 3, 3, 3), in two layouts: a 3x3 conv on 3 channels, NCHW
    # on rank 0, NHWC on rank 1 (a raw broadcast scrambled the weight)
    conv = cf.Conv2d(3, 4, 3, layout="NCHW" if rank == 0 else "NHWC", dtype="float64",
                     seed=rank)
    out["layout"] = _error(lambda: broadcast_parameters(conv))
    # arrays one rank cannot receive into: every rank raises (no hang, no write into
    # read-only memory), before anything is broadcast
    lin = _lin(rank, 2, 2, dtype="float64")
    if rank == 1:
        lin.weight.data = np.broadcast_to(np.float64(2.0), (2, 2))
    out["read_only"] = _error(lambda: broadcast_parameters(lin))

    class Holder(cf.nn.Module):
        def __init__(self) -> None:
            self.register_buffer("ids", np.full(3, rank + 1, np.uint32))

    first = _lin(rank, 2, 2, dtype="float64")
    before = first.weight.data.copy()
    out["uint32"] = _error(lambda: broadcast_parameters(cf.Sequential(first, Holder())))
    out["uint32_kept"] = np.array_equal(first.weight.data, before)
    first.register_buffer("small", np.zeros(2, np.int16))  # gloo cannot carry int16 either
    out["int16"] = _error(lambda: broadcast_parameters(first))
    # and the group is still in step: a matching model is broadcast as before
    lin = _lin(rank, 3, 4, dtype="float64")
    broadcast_parameters(lin)
    out["after_weight"] = lin.weight.data.copy()
    return out


def scenario_arguments(rank: int) -> dict[str, Any]:
    """Bad `src` / `group` / flags: the error and the number of collectives issued (counted
    at torch.distributed's functions). Then the good arguments that look like bad ones."""
    import torch.distributed as dist

    from convfuse.distributed import allreduce_gradients, broadcast_buffers, broadcast_parameters

    calls: list[str] = []
    real = {name: getattr(dist, name) for name in ("all_reduce", "broadcast")}

    def counting(name: str) -> Callable[..., Any]:
        return lambda *a, **k: calls.append(name) or real[name](*a, **k)

    for name in real:
        setattr(dist, name, counting(name))
    solo = dist.new_group([0])  # every rank takes part in making it; rank 1 is left out
    model = cf.Sequential(_lin(rank, 3, 4, dtype="float64"),
                          cf.BatchNorm1d(4, dtype="float64", device="cpu"))
    opt = cf.optim.SGD(model.parameters(), lr=0.1)
    cases: dict[str, Callable[[], Any]] = {
        "src_str": lambda: broadcast_parameters(model, src="0"),
        "src_float": lambda: broadcast_parameters(model, src=0.0),
        "src_bool": lambda: broadcast_parameters(model, src=True),
        "src_world": lambda: broadcast_parameters(model, src=WORLD),
        "src_negative": lambda: broadcast_parameters(model, src=-1),
        "buffers_src_world": lambda: broadcast_buffers(model, src=WORLD),
        "src_off_group": lambda: broadcast_parameters(model, src=1, group=solo),
        "group_str": lambda: broadcast_parameters(model, group="abc"),
        "group_ranks": lambda: broadcast_parameters(model, group=[0, 1]),
        "buffers_group_str": lambda: broadcast_buffers(model, group="abc"),
        "allreduce_group_str": lambda: allreduce_gradients(opt, group="abc"),
        "allreduce_group_int": lambda: allreduce_gradients(opt, group=0),
    }
    out: dict[str, Any] = {}
    try:
        for name, call in cases.items():
            calls.clear()
            out[name] = (_error(call), len(calls))
        # an integer that is not a Python int is a rank all the same (rank 1's weights)
        calls.clear()
        broadcast_parameters(model, src=np.int64(1))
        out["src_numpy_weight"] = model[0].weight.data.copy()
        out["src_numpy_calls"] = list(calls)
        # the per-step buffer broadcast: broadcasts alone, no check (no host sync)
        calls.clear()
        broadcast_buffers(model)
        out["buffers_calls"] = list(calls)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return out


def scenario_off_group(rank: int) -> dict[str, Any]:
    """A group of rank 0 alone, every function called on both ranks: on rank 1 nothing
    changes and nothing is raised, as with torch's own all_reduce (the oracle)."""
    import warnings

    import torch.distributed as dist

    from convfuse.distributed import allreduce_gradients, broadcast_buffers, broadcast_parameters

    solo = dist.new_group([0])
    model = cf.Sequential(_lin(rank, 3, 4, dtype="float64"),
                          cf.BatchNorm1d(4, dtype="float64", device="cpu"))
    model[1].running_mean[...] = rank + 7.0
    opt = cf.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {}
    for average in (True, False):
        for p in model.parameters():
            p.grad[...] = rank + 1.0
        out[f"error_{average}"] = _error(
            lambda a=average: allreduce_gradients(opt, a, group=solo))
        out[f"grads_{average}"] = [p.grad.copy() for p in model.parameters()]
        t = torch.full((3,), rank + 1.0, dtype=torch.float64)
        with warnings.catch_warnings():  # torch warns on the ranks it leaves alone
            warnings.simplefilter("ignore")
            dist.all_reduce(t, group=solo)
        out[f"torch_{average}"] = t.numpy().copy()
    own = model[0].weight.data.copy()
    out["bcast_error"] = _error(lambda: broadcast_parameters(model, group=solo))
    out["buffers_error"] = _error(lambda: broadcast_buffers(model, group=solo))
    out["weight_kept"] = np.array_equal(model[0].weight.data, own)
    out["running_mean"] = model[1].running_mean.copy()
    return out


SCENARIOS = {"average": scenario_average, "mismatch": scenario_mismatch,
             "arguments": scenario_arguments, "off_group": scenario_off_group}


def _worker(scenario: str, rank: int, init_file: str, out: str) -> None:
    import importlib

    import torch.distributed as dist

    # before the group (tests/test_distributed.py's _worker: Note [process-group teardown])
    importlib.import_module("torch.distributed.nn")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        result = SCENARIOS[scenario](rank)
        dist.barrier()  # every rank got here: none is stuck in a collective the other skipped
        with open(out, "wb") as f:
            pickle.dump(result, f)
    finally:
        import gc

        gc.collect()  # DDP's reducer, before the group goes
        dist.destroy_process_group()


def _run_ranks(scenario: str, tmp_path: Path) -> list[dict[str, Any]]:
    init = tmp_path / "store"
    run_ranks(__file__, [[scenario, str(r), str(init), str(tmp_path / f"rank{r}.pkl")]
                         for r in range(WORLD)], TIMEOUT_S)
    results = []
    for r in range(WORLD):
        with open(tmp_path / f"rank{r}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results


def _f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def test_average_divides_then_sums_bitwise_as_ddp(tmp_path):
    ranks = _run_ranks("average", tmp_path)
    for dtype in DTYPES:
        dt = NP_DTYPES[dtype]
        for r in ranks:
            for got, want in zip(r[f"{dtype}/convfuse"], r[f"{dtype}/ddp"], strict=True):
                assert got.dtype == dt
                # bitwise: the same bytes as DDP's gradients (inf and signed zeros included)
                np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8),
                                              err_msg=dtype)
        # and an independent oracle: each rank's gradient halved (exact in float64, then
        # rounded to the dtype), the two halves added in float64 and rounded once
        for i in range(2):
            halves = [_f64(_f64(_grads(dtype, rank)[i]) * 0.5).astype(dt) for rank in
                      range(WORLD)]
            want = (_f64(halves[0]) + _f64(halves[1])).astype(dt)
            np.testing.assert_array_equal(_f64(ranks[0][f"{dtype}/convfuse"][i]), _f64(want),
                                          err_msg=dtype)
            np.testing.assert_array_equal(_f64(ranks[1][f"{dtype}/convfuse"][i]), _f64(want))
    fp16 = ranks[0]["float16/convfuse"][0]
    assert np.isfinite(fp16).all()
    # (40000 + 40000-ish) / 2, where summing first gave inf, as it does here: the case the
    # order decides; the subnormal 2**-24 halves to 0 on each rank (ties to even), as in DDP
    assert not np.isfinite(ranks[0]["float16/sum_then_divide"][0]).all()
    assert fp16[1, 0] == np.float16(0.0)


@pytest.fixture(scope="module")
def mismatch_ranks(tmp_path_factory):
    """One pair of processes for all the mismatch cases (each refused, the group stays in
    step for the next)."""
    return _run_ranks("mismatch", tmp_path_factory.mktemp("mismatch"))


@pytest.mark.parametrize("case", ["shape", "count", "dtype", "extra_layer",
                                  "buffers_via_parameters", "layout"])
def test_ranks_holding_different_models_all_raise(mismatch_ranks, case):
    fn = "broadcast_parameters"  # broadcast_buffers, per step, does not check (no host sync)
    for rank, r in enumerate(mismatch_ranks):
        err = r[case]
        assert err is not None, f"rank {rank}: {case} was broadcast"
        assert err[0] == "ValueError", err
        assert err[1].startswith(MODEL_MISMATCH.format(fn=fn)), err
        assert f"(rank {rank} has" in err[1]


def test_an_array_a_rank_cannot_receive_into_is_refused_on_every_rank(mismatch_ranks):
    """A read-only parameter on rank 1 hung both ranks until the group's timeout (or, for a
    bytes-backed array, was written into); a uint32 buffer failed inside gloo after the
    parameters were broadcast. Now every rank raises first."""
    assert mismatch_ranks[1]["read_only"] == (
        "TypeError", "broadcast_parameters: rank 1: parameter 0 (weight) is a read-only "
        "array (a broadcast or memory-mapped array?); assign a writable copy. Nothing was "
        "broadcast.")
    assert mismatch_ranks[0]["read_only"] == (
        "TypeError", "broadcast_parameters: rank 0: another rank reported an array it "
        "cannot receive into. Nothing was broadcast.")
    for rank, r in enumerate(mismatch_ranks):
        assert r["uint32"] == ("TypeError", f"broadcast_parameters: rank {rank}: buffer "
                               "'1.ids' has dtype uint32, which torch.distributed cannot "
                               "carry; store it as int32, int64 or a float. Nothing was "
                               "broadcast.")
        assert r["uint32_kept"]
        assert r["int16"] is not None and r["int16"][0] == "TypeError" and \
            "buffer 'small' has dtype int16" in r["int16"][1]


def test_a_refused_broadcast_changes_nothing_and_the_group_goes_on(mismatch_ranks):
    assert mismatch_ranks[1]["shape_kept"]  # nothing was broadcast into the other shape
    np.testing.assert_array_equal(mismatch_ranks[1]["after_weight"],
                                  cf.Linear(3, 4, seed=0, dtype="float64").weight.data)
    np.testing.assert_array_equal(mismatch_ranks[0]["after_weight"],
                                  cf.Linear(3, 4, seed=0, dtype="float64").weight.data)


def test_bad_src_and_group_are_refused_before_any_collective(tmp_path):
    ranks = _run_ranks("arguments", tmp_path)
    expect = {
        "src_str": ("TypeError", "broadcast_parameters: src must be an int (a global rank), "
                                 "got str '0'"),
        "src_float": ("TypeError", "broadcast_parameters: src must be an int (a global "
                                   "rank), got float 0.0"),
        "src_bool": ("TypeError", "broadcast_parameters: src must be an int (a global rank), "
                                  "got bool True"),
        "src_world": ("ValueError", "broadcast_parameters: src=2 is not a rank: the default "
                                    "group's ranks are 0 to 1"),
        "src_negative": ("ValueError", "broadcast_parameters: src=-1 is not a rank"),
        "buffers_src_world": ("ValueError", "broadcast_buffers: src=2 is not a rank"),
        "group_str": ("TypeError", "broadcast_parameters: group must be None or a "
                                   "torch.distributed ProcessGroup (from new_group), got str "
                                   "'abc'"),
        "group_ranks": ("TypeError", "broadcast_parameters: group must be None or a "
                                     "torch.distributed ProcessGroup"),
        "buffers_group_str": ("TypeError", "broadcast_buffers: group must be None or a "
                                           "torch.distributed ProcessGroup"),
        "allreduce_group_str": ("TypeError", "allreduce_gradients: group must be None or a "
                                             "torch.distributed ProcessGroup"),
        "allreduce_group_int": ("TypeError", "allreduce_gradients: group must be None or a "
                                             "torch.distributed ProcessGroup (from "
                                             "new_group), got int 0"),
    }
    for rank, r in enumerate(ranks):
        for case, (kind, message) in expect.items():
            err, collectives = r[case]
            assert err is not None and err[0] == kind and err[1].startswith(message), \
                (rank, case, err)
            assert collectives == 0, (rank, case)
    # src=1 is a rank of the world but not of a group of rank 0: refused on rank 0; on
    # rank 1, outside the group, the call does nothing (torch's broadcast would too)
    err, collectives = ranks[0]["src_off_group"]
    assert err == ("ValueError", "broadcast_parameters: src=1 is not a rank of group (its "
                                 "global ranks: [0])") and collectives == 0
    assert ranks[1]["src_off_group"] == (None, 0)
    # a NumPy integer is a rank: rank 1's weights everywhere, after one check
    own1 = cf.Linear(3, 4, seed=1, dtype="float64").weight.data
    for r in ranks:
        np.testing.assert_array_equal(r["src_numpy_weight"], own1)
        assert r["src_numpy_calls"][0] == "all_reduce"  # the models' check, then broadcasts
        assert set(r["src_numpy_calls"][1:]) == {"broadcast"}
        assert r["buffers_calls"] == ["broadcast"] * 2  # BatchNorm's float64 and int64 ones


def test_allreduce_gradients_leaves_a_rank_outside_the_group_alone(tmp_path):
    ranks = _run_ranks("off_group", tmp_path)
    for rank, r in enumerate(ranks):
        for average in (True, False):
            assert r[f"error_{average}"] is None, r[f"error_{average}"]
            # a group of one: its average and its sum are rank 0's own gradients; rank 1,
            # outside it, keeps its own, as torch's all_reduce leaves its tensor
            for g in r[f"grads_{average}"]:
                np.testing.assert_array_equal(g, np.full_like(g, rank + 1.0))
            np.testing.assert_array_equal(r[f"torch_{average}"], np.full(3, rank + 1.0))
        assert r["bcast_error"] is None and r["buffers_error"] is None
        assert r["weight_kept"]
        np.testing.assert_array_equal(r["running_mean"], np.full(4, rank + 7.0))


def test_helpers_without_a_process_group_still_say_so():
    from convfuse.distributed import broadcast_buffers

    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        broadcast_buffers(cf.BatchNorm1d(2, device="cpu"))


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
