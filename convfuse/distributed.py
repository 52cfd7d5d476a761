"""Data-parallel training of convfuse's own layers and optimizers on torch.distributed.

    dist.init_process_group("nccl" if convfuse.gpu_available() else "gloo")
    broadcast_parameters(model)              # once: every rank starts from rank 0's weights
                                             # (and buffers: broadcast_buffers)
    for each step: forward, backward, allreduce_gradients(optimizer), optimizer.step()

Tear down with `torch.distributed.destroy_process_group()` once nothing holds the group any
more (a `convfuse.graph.CapturedStep` whose graph holds an NCCL collective included: drop
it, and let it be collected, first; NCCL's teardown waits for every graph that references
the communicator to be destroyed); mixing in DistributedDataParallel, import
`torch.distributed.nn` before `init_process_group` (examples/train_ddp.py, Note
[process-group teardown]: otherwise the group's gloo threads outlive it, and a rank can
abort at exit).

PyTorch is needed only when these functions are called (`import convfuse` never imports
it). Buffers cross to torch.distributed with no copy: NumPy buffers through
`torch.from_numpy` (gloo), CuPy buffers through DLPack (NCCL). bfloat16 NumPy buffers,
which NumPy cannot hand to PyTorch as such, cross as int16 views reinterpreted as
torch.bfloat16 (same bytes); the backend then sums in bfloat16, as DDP does for bfloat16
gradients (gloo supports it, and NCCL).

Note [one collective per flat buffer]
A convfuse optimizer keeps, per dtype, one flat gradient buffer that every parameter's
`.grad` is a view of (convfuse/optim/_flat.py), with zero gaps between the views. So
`allreduce_gradients` issues one all-reduce per dtype for the whole model: the gaps stay
zero under a sum, and no gradient is copied into or out of a bucket.

Note [streams and capture]
On CuPy buffers the collective is issued with PyTorch's current stream set to CuPy's current
stream, so it is ordered after the backward that wrote the gradients and before the step
that reads them, with no host synchronisation (NCCL averages natively, ReduceOp.AVG, so no
extra kernel either; also under a backend per device type such as "cpu:gloo,cuda:nccl",
where the CUDA buffers are NCCL's: `_averages_natively`). Inside `convfuse.graph.capture`,
CuPy's current stream is the capturing stream, so the all-reduce is recorded into the graph
where the backend allows it: PyTorch's NCCL process group supports CUDA-graph capture of
collectives; gloo runs on the host and cannot be captured (nor does the CPU path have
graphs). The GPU path has not run on a GPU yet.

Note [divide, then sum]
Where convfuse averages itself (a backend without ReduceOp.AVG: gloo), each rank multiplies
its gradients by 1/world before the sum, as DistributedDataParallel's reducer does when it
copies a gradient into its bucket (`at::mul_out(bucket_view, grad, 1. / div_factor)`, then
an all-reduce SUM; its steady state under gradient_as_bucket_view=True divides by the world
size instead, the same bits when the world size is a power of two). Summing first would
overflow float16 gradients that the average holds (40000 on 2 ranks: 80000 > 65504, inf),
and the multiplication is torch's own kernel on the tensor, so the result is DDP's bit for
bit in all four dtypes on 2 gloo ranks (tested against DDP; with more ranks gloo's sum runs
over this flat buffer in its own chunks, not DDP's buckets, and float16 may differ by an
ulp). On NCCL, ReduceOp.AVG stays
(no extra kernel): NCCL's own arithmetic, not compared with DDP's on a GPU yet.

Note [matching models]
A broadcast between ranks whose models differ is not detected by the backend: an array of
another shape with as many elements silently receives rank src's values in its own shape,
and one with another element count aborts the process (gloo) or hangs. DDP refuses such
models when it wraps them; broadcast_parameters first runs one all-reduce (MAX) of three
int64s [h, -h, bad], h a hash of this rank's list of (shape, dtype, checkpoint layout), bad 1
when this rank holds an array it cannot receive into (read-only, or a dtype the backend
cannot carry): the result is [h, -h, 0] on every rank exactly when every rank's h is the
same and none is bad, so either every rank raises or none does, and no rank is left
waiting in a broadcast the others skipped. The three are made like the arrays (a NumPy or a
CuPy array, crossing as the arrays do), so they go to the backend that will broadcast
them. In a world of one there is nothing to compare and no collective (a rank's own bad
array is refused all the same). Reading the result back is a host sync on the GPU, so
broadcast_buffers, called before every forward, does not check: as DDP, which checks when
it wraps the model and not at its per-forward buffer broadcast, it relies on
broadcast_parameters having checked parameters and buffers once.

Note [arguments before collectives]
`src` and `group` are checked in Python before any collective (so that a bad one gives a
typed error naming the function and the argument on every rank, not a backend error from
inside a collective that other ranks may already wait in): `src` is a global rank, as
torch.distributed.broadcast's, so an int in [0, world size of the default group) and a
member of `group`; `group` is None, a ProcessGroup, or GroupMember.NON_GROUP_MEMBER, which
new_group returns on the ranks it leaves out, where, as torch's collectives are, every
function here is a no-op.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .backend import array_module, is_cupy
from .nn.module import Layer
from .nn.parameter import Parameter


def _torch() -> Any:
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise ImportError(
            "convfuse.distributed needs PyTorch's torch.distributed: pip install torch "
            "(convfuse's `torch` extra)"
        ) from exc
    if not dist.is_available():
        raise RuntimeError("convfuse.distributed: this PyTorch build has no torch.distributed")
    if not dist.is_initialized():
        raise RuntimeError(
            "convfuse.distributed: no default process group; call "
            "torch.distributed.init_process_group first (torchrun sets the environment)"
        )
    return torch


def _as_tensor(a: Any) -> Any:
    """The buffer as a tensor on the same memory (Note [bfloat16 on the CPU] in
    convfuse/torch/_arrays.py for bfloat16 NumPy buffers)."""
    from .torch._arrays import to_tensor

    return to_tensor(a)


@contextlib.contextmanager
def _on_cupy_stream(torch: Any, a: Any) -> Iterator[None]:
    """PyTorch's current stream = CuPy's current stream, for CuPy buffers
    (Note [streams and capture]); nothing for NumPy buffers."""
    if not is_cupy(a):
        yield
        return
    import cupy  # pragma: gpu

    with cupy.cuda.Device(a.device.id):  # pragma: gpu
        stream = _torch_stream(torch, cupy.cuda.get_current_stream().ptr, a.device.id)
        with torch.cuda.stream(stream):
            yield


def _torch_stream(torch: Any, ptr: int, device: int) -> Any:
    """PyTorch's stream for CuPy's stream `ptr` on `device`. CuPy's null stream (0) is the
    legacy default stream, PyTorch's default stream; ExternalStream(0) would be a new
    stream from PyTorch's pool instead, which the null stream does not wait for: the step
    after the collective could read the gradients before the average is written."""
    if ptr == 0:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(ptr, device=device)


def _parameters(model: Any) -> list[Parameter]:
    params = model.parameters() if hasattr(model, "parameters") else model
    try:
        plist = list(params)
    except TypeError:
        raise TypeError(
            "broadcast_parameters expects a convfuse layer/model (with .parameters()) or an "
            f"iterable of convfuse Parameters, got {type(model).__name__}"
        ) from None
    for i, p in enumerate(plist):
        if not isinstance(p, Parameter):
            raise TypeError(
                f"broadcast_parameters: parameter {i} is a {type(p).__name__}, not a convfuse "
                "Parameter (for torch.nn modules use DistributedDataParallel, which broadcasts)"
            )
    return plist


def _is_member(dist: Any, fn: str, group: Any) -> bool:
    """Whether this rank belongs to `group` (None: the default group); TypeError for anything
    but None, a ProcessGroup or GroupMember.NON_GROUP_MEMBER (Note [arguments before
    collectives]). Pure Python: allreduce_gradients asks it every step."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return True
    left_out = dist.GroupMember.NON_GROUP_MEMBER
    if type(group) is type(left_out) and group == left_out:
        return False
    raise TypeError(f"{fn}: group must be None or a torch.distributed ProcessGroup (from "
                    f"new_group), got {type(group).__name__} {group!r}")


def _checked_src(dist: Any, fn: str, src: Any, group: Any, member: bool) -> int:
    """`src` as an int, a global rank of `group` (Note [arguments before collectives])."""
    if isinstance(src, bool) or not isinstance(src, (int, np.integer)):
        raise TypeError(f"{fn}: src must be an int (a global rank), got "
                        f"{type(src).__name__} {src!r}")
    world = dist.get_world_size()
    if not 0 <= src < world:
        raise ValueError(f"{fn}: src={int(src)} is not a rank: the default group's ranks are "
                         f"0 to {world - 1} (src is a global rank, as in "
                         "torch.distributed.broadcast)")
    if member and group is not None:
        ranks = dist.get_process_group_ranks(group)
        if int(src) not in ranks:
            raise ValueError(f"{fn}: src={int(src)} is not a rank of group (its global ranks: "
                             f"{sorted(ranks)})")
    return int(src)


def _check_bool(fn: str, name: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):  # "no" would count as true
        raise TypeError(f"{fn}: {name} must be a bool, got {type(value).__name__} {value!r}")


def _buffers(model: Any) -> list[tuple[str, Any]]:
    return list(model.named_buffers()) if hasattr(model, "named_buffers") else []


# dtypes NumPy arrays may have that torch.distributed's backends cannot carry (gloo: "Invalid
# scalar type"); checked on every rank before anything is broadcast
_UNCARRIED = frozenset({"int16", "uint16", "uint32", "uint64"})


def _receive_problem(arrays: Sequence[Any], name_of: Callable[[int], str]) -> str | None:
    """Why this rank could not receive a broadcast into one of `arrays`, or None: a
    read-only array (a broadcast into it would write memory NumPy was told not to, or hang
    the collective when the write fails) or a dtype the backend cannot carry. Names are
    made only for the array refused (broadcast_buffers runs before every forward)."""
    for i, a in enumerate(arrays):
        if not getattr(getattr(a, "flags", None), "writeable", True):
            return (f"{name_of(i)} is a read-only array (a broadcast or memory-mapped "
                    "array?); assign a writable copy")
        if a.dtype.name in _UNCARRIED:
            return (f"{name_of(i)} has dtype {a.dtype}, which torch.distributed cannot "
                    "carry; store it as int32, int64 or a float")
    return None


def _check_same_model(torch: Any, fn: str, params: Sequence[Parameter],
                      buffers: Sequence[tuple[str, Any]], group: Any) -> None:
    """ValueError on every rank unless every rank of `group` holds arrays of the same shapes,
    dtypes and checkpoint layouts, in the same order, and TypeError on every rank if any
    rank cannot receive the broadcast: one all-reduce of three int64s (Note [matching
    models])."""
    dist = torch.distributed
    arrays = [p.data for p in params] + [b for _, b in buffers]
    problem = _receive_problem(arrays, lambda i: f"parameter {i} ({params[i].name or 'unnamed'})"
                               if i < len(params) else f"buffer {buffers[i - len(params)][0]!r}")
    if dist.get_world_size(group) <= 1:
        if problem:  # the same verdict as in a larger world
            raise TypeError(f"{fn}: {problem}. Nothing was broadcast.")
        return
    # a channels-last conv's weight is stored (K, kh, kw, C): with C == kh == kw its shape
    # is an NCHW one's, and only the checkpoint layout tells them apart
    kinds: list[list[tuple[Any, ...]]] = [
        [(tuple(p.data.shape), str(p.data.dtype), is_cupy(p.data), p.state_axes)
              for p in params],
             [(tuple(b.shape), str(b.dtype), is_cupy(b)) for _, b in buffers]]
    digest = hashlib.blake2b(repr(kinds).encode(), digest_size=8).digest()
    h = int.from_bytes(digest, "little") >> 1  # -h fits an int64 too
    like = arrays[0] if arrays else np.empty(0)
    with _on_cupy_stream(torch, like):  # the device of the arrays, for CuPy ones
        got = array_module(like).asarray([h, -h, int(problem is not None)], dtype=np.int64)
        dist.all_reduce(_as_tensor(got), op=dist.ReduceOp.MAX, group=group)
        values = [int(v) for v in got.tolist()]
    if values[2]:
        where = problem or "another rank reported an array it cannot receive into"
        raise TypeError(f"{fn}: rank {dist.get_rank()}: {where}. Nothing was broadcast.")
    if values[:2] != [h, -h]:
        shown = ", ".join(f"{k[0]} {k[1]}" for k in (kinds[0] + kinds[1])[:6])
        more = ", ..." if len(arrays) > 6 else ""
        raise ValueError(
            f"{fn}: the ranks hold different models: the shapes, dtypes or layouts of "
            f"their parameters and buffers differ (rank {dist.get_rank()} has {len(params)} "
            f"parameter(s) and {len(buffers)} buffer(s): {shown}{more}); every rank must "
            "build the same model, as DistributedDataParallel requires. Nothing was "
            "broadcast.")


def broadcast_parameters(model: Any, src: int = 0, group: Any = None) -> None:
    """Overwrite every parameter's data, and every buffer (BatchNorm's running statistics
    and num_batches_tracked), on every rank with rank `src`'s, in place, as
    DistributedDataParallel does when it wraps a model.

    `model` is a convfuse layer or Sequential, or an iterable of convfuse Parameters. One
    broadcast per parameter (this runs once, before training); the arrays stay where they
    are, so an optimizer's flat buffers (whose views they may be) see the new values.
    First, every rank checks that all ranks hold parameters and buffers of the same shapes,
    dtypes and layouts (one small all-reduce: Note [matching models]), and raises ValueError
    if not (TypeError if any rank holds an array it cannot receive into). `src` is a global
    rank; on a rank outside `group` this does nothing, as torch's collectives do there.
    """
    params = _parameters(model)
    checked = _checked_call("broadcast_parameters", src, group)
    if checked is None:
        return
    torch, src = checked
    _check_same_model(torch, "broadcast_parameters", params, _buffers(model), group)
    for p in params:
        _broadcast_in_place(torch, p.data, src, group)
    if hasattr(model, "named_buffers"):
        _broadcast_buffers(torch, model, src, group)


def broadcast_buffers(model: Any, src: int = 0, group: Any = None) -> None:
    """Overwrite every buffer of `model` (a convfuse layer or Sequential) on every rank
    with rank `src`'s, in place: one broadcast per buffer dtype.

    Each rank's BatchNorm running statistics follow its own shard of the data, so they
    drift apart during training. DistributedDataParallel (broadcast_buffers=True, its
    default) copies rank 0's before every forward; call this before each step's forward
    to do the same, or once before evaluating or saving a checkpoint. A BatchNorm with
    momentum=None on the GPU then re-reads its count from the device at its next step
    (one sync per layer: Note [momentum=None without a host sync]); a float momentum
    keeps the step free of syncs.

    It does not check that the ranks' models match (that check reads a result on the host:
    Note [matching models]); broadcast_parameters, run once first, does."""
    if not isinstance(model, Layer):  # before anything else, a process group included
        raise TypeError("broadcast_buffers expects a convfuse layer or model, got "
                        f"{type(model).__name__} (for torch.nn modules use "
                        "DistributedDataParallel, which broadcasts buffers)")
    named = list(model.named_buffers())
    problem = _receive_problem([b for _, b in named], lambda i: f"buffer {named[i][0]!r}")
    if problem:  # on every rank alike: each checks its own model, which must match
        raise TypeError(f"broadcast_buffers: {problem}. Nothing was broadcast.")
    checked = _checked_call("broadcast_buffers", src, group)
    if checked is not None:
        torch, src = checked
        _broadcast_buffers(torch, model, src, group, named)


def _checked_call(fn: str, src: Any, group: Any) -> tuple[Any, int] | None:
    """(torch, src as an int) for a broadcast by `fn`, its arguments checked before any
    collective; None on a rank outside `group`, where it does nothing."""
    torch = _torch()
    dist = torch.distributed
    member = _is_member(dist, fn, group)
    src = _checked_src(dist, fn, src, group, member)
    return (torch, src) if member else None


def _broadcast_buffers(torch: Any, model: Any, src: int, group: Any,
                       named: Sequence[tuple[str, Any]] | None = None) -> None:
    by_kind: dict[tuple[Any, bool], list[Any]] = {}
    for _, b in model.named_buffers() if named is None else named:
        by_kind.setdefault((b.dtype, is_cupy(b)), []).append(b)
    for bufs in by_kind.values():
        if len(bufs) == 1:
            _broadcast_in_place(torch, bufs[0], src, group)
            continue
        xp = array_module(bufs[0])
        flat = xp.concatenate([b.ravel() for b in bufs])
        _broadcast_in_place(torch, flat, src, group)
        at = 0
        for b in bufs:
            b[...] = flat[at:at + b.size].reshape(b.shape)
            at += b.size
    for mod in model.modules():
        written = getattr(mod, "_buffers_written", None)
        if written is not None:
            written()


def _broadcast_in_place(torch: Any, a: Any, src: int, group: Any) -> None:
    # an array need not be C-contiguous (a transposed view trains fine): broadcast a
    # contiguous copy and write it back, or the collective's own copy is the only one that
    # receives rank src's values
    buf = a if a.flags.c_contiguous else array_module(a).ascontiguousarray(a)
    with _on_cupy_stream(torch, a):
        torch.distributed.broadcast(_as_tensor(buf), src=src, group=group)
        if buf is not a:
            a[...] = buf


def flat_gradients(optimizer: Any) -> list[Any]:
    """The optimizer's flat gradient buffers, one per dtype (Note [one collective per flat
    buffer]); TypeError for anything but a convfuse optimizer."""
    from .optim._flat import FlatGroup

    groups = getattr(optimizer, "_groups", None)
    if not isinstance(groups, list) or not all(isinstance(g, FlatGroup) for g in groups):
        raise TypeError(
            "allreduce_gradients expects a convfuse optimizer (convfuse.optim.SGD, Adam or "
            f"AdamW), got {type(optimizer).__name__}; for torch.nn modules use "
            "torch.nn.parallel.DistributedDataParallel"
        )
    return [g.grad for g in groups]


def _averages_natively(backend_name: str, on_gpu: bool, group: Any = None) -> bool:
    """Whether the backend that reduces a buffer on the GPU (`on_gpu`) or the CPU is NCCL,
    which averages natively: `backend_name` is torch.distributed.get_backend's answer,
    one backend ("nccl") or one per device type ("cpu:gloo,cuda:nccl"). A group made by
    init_process_group() without a backend answers "undefined" there while CUDA tensors
    go to NCCL: then the group's backend for the device is asked (`group`, a process
    group; a private PyTorch method, so anything unexpected means no: a sum and one
    division are right everywhere)."""
    if ":" in backend_name:
        pairs = dict(p.strip().split(":", 1) for p in backend_name.split(",") if ":" in p)
        return pairs.get("cuda" if on_gpu else "cpu") == "nccl"
    if backend_name == "undefined" and group is not None:
        try:
            import torch

            backend = group._get_backend(torch.device("cuda" if on_gpu else "cpu"))
        except Exception:
            return False
        return type(backend).__name__ == "ProcessGroupNCCL"
    return backend_name == "nccl"


def allreduce_gradients(optimizer: Any, average: bool = True, group: Any = None) -> None:
    """Sum (or, with `average`, average) every gradient of `optimizer`'s parameters over
    the ranks of `group` (default: the default process group), in place.

    One all-reduce per flat gradient buffer, i.e. per dtype (Note [one collective per flat
    buffer]), on the buffer's own memory. No host sync of its own; capturable with NCCL
    (Note [streams and capture]) once the group's communicator exists: NCCL makes it at
    the group's first collective (unless init_process_group got `device_id`), which cannot
    happen inside a capture, so run one first (broadcast_parameters, or the eager warm-up
    step graph.capture runs). Call it between the backward and `optimizer.step()`.
    Averaging without NCCL divides before the sum, as DDP (Note [divide, then sum]). On a
    rank outside `group` it does nothing, as torch's collectives do there.
    """
    _check_bool("allreduce_gradients", "average", average)
    torch = _torch()
    dist = torch.distributed
    member = _is_member(dist, "allreduce_gradients", group)
    buffers = flat_gradients(optimizer)
    if not member:
        return
    world = dist.get_world_size(group)
    backend_name = str(dist.get_backend(group))
    pg = group
    if backend_name == "undefined" and pg is None:  # asked of the group: _averages_natively
        pg = dist.distributed_c10d._get_default_group()
    for buf in buffers:
        native_avg = average and _averages_natively(backend_name, is_cupy(buf), pg)
        op = dist.ReduceOp.AVG if native_avg else dist.ReduceOp.SUM
        with _on_cupy_stream(torch, buf):
            t = _as_tensor(buf)
            if average and not native_avg and world > 1:
                t.mul_(1.0 / world)  # DDP's reducer's own scaling: Note [divide, then sum]
            dist.all_reduce(t, op=op, group=group)
