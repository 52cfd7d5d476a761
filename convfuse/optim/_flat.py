"""Flat buffers: every parameter of one dtype re-homed into one data and one grad buffer.

Why: an optimizer step over one contiguous buffer per dtype is one kernel launch (or one
vectorised NumPy pass) instead of one per parameter, zero_grad is one fill, and the
optimizer state sits in flat buffers of the same layout. Layers read `Parameter.data` and
`.grad` afresh at every call (docs/DESIGN.md), so replacing both with views of the flat
buffers is invisible to them.

Each parameter starts on a 256-byte boundary (the base is aligned too): cuDNN wants at least
16 bytes, and 256 keeps every view at the start of a memory transaction. The gaps are zero
in data and grad and stay zero under every update rule here (with eps = 0 Adam turns a
gap into NaN, as it would a real parameter with zero gradient; gaps are never read back).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import dtypes
from ..backend import array_module, device_of, is_cupy
from ..errors import DeviceMismatchError
from ..nn.parameter import Parameter

ALIGN_BYTES = 256


@dataclass
class Slot:
    """Where one parameter lives in its group's flat buffers (offsets in elements)."""

    index: int  # position in the list the optimizer was given
    param: Parameter
    offset: int
    size: int
    shape: tuple[int, ...]
    data: Any = None  # the views handed to the parameter, to notice if it is re-assigned
    grad: Any = None


@dataclass
class FlatGroup:
    """All parameters of one dtype: flat data, grad and optimizer state buffers."""

    dtype: np.dtype
    compute_dtype: np.dtype  # state and arithmetic: float64 for float64, else float32
    device_id: int  # -1 on the CPU
    slots: list[Slot]
    data: Any
    grad: Any
    state: dict[str, Any] = field(default_factory=dict)
    step: int = 0  # steps taken (CPU; on the GPU the count lives in `step_dev`)
    step_dev: Any = None
    ticket_dev: Any = None
    kernel: Any = None
    grid: int = 1
    # state buffers a load_state_dict replaced, kept alive for steps captured before it
    retired: list[dict[str, Any]] = field(default_factory=list)

    @property
    def on_gpu(self) -> bool:
        return self.device_id >= 0

    @property
    def numel(self) -> int:
        return int(self.data.size)


def _device_id(a: Any) -> int:
    """The CUDA device a CuPy array lives on, -1 for a NumPy array."""
    if is_cupy(a):  # pragma: gpu
        return int(a.device.id)
    return -1


def device_context(device_id: int) -> contextlib.AbstractContextManager:
    """Make `device_id` current for allocations and launches (a no-op on the CPU)."""
    if device_id >= 0:  # pragma: gpu
        import cupy

        return cupy.cuda.Device(device_id)
    return contextlib.nullcontext()


def _address(a: Any) -> int:
    if is_cupy(a):  # pragma: gpu
        return int(a.data.ptr)
    return int(a.ctypes.data)


def aligned_zeros(xp: Any, n: int, dtype: np.dtype) -> Any:
    """A zeroed 1-D array of n elements whose first element sits on an ALIGN_BYTES boundary."""
    item = np.dtype(dtype).itemsize
    spare = ALIGN_BYTES // item
    raw = xp.zeros(n + spare, dtype=dtype)
    skip = (-_address(raw) % ALIGN_BYTES) // item
    return raw[skip : skip + n]


def _padded(n: int, dtype: np.dtype) -> int:
    step = ALIGN_BYTES // np.dtype(dtype).itemsize
    return -(-n // step) * step


def _bounds(a: Any) -> tuple[int, int]:
    """[first, last) byte addresses an array's elements span, strides of any sign."""
    start = a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr
    if a.size == 0:
        return start, start
    lo = hi = start
    for n, stride in zip(a.shape, a.strides):
        step = (n - 1) * stride
        lo, hi = (lo + step, hi) if step < 0 else (lo, hi + step)
    return lo, hi + a.itemsize


def _sharing(plist: list[Parameter]) -> tuple[int, int] | None:
    """(j, i), j < i, for two parameters whose arrays share memory, or None: address ranges
    sorted and swept (n log n: optimizers are built, copied and unpickled over thousands of
    parameters), and where ranges meet, NumPy's exact answer (interleaved views of one
    array do not share); device ranges that meet count as shared."""
    spans = sorted((*_bounds(p.data), i) for i, p in enumerate(plist) if p.data.size)
    active: list[tuple[int, int]] = []  # (end, index) of the ranges still open
    for lo, hi, i in spans:
        active = [(end, j) for end, j in active if end > lo]
        for _, j in active:
            a, b = plist[j].data, plist[i].data
            if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray):
                return min(i, j), max(i, j)
            try:
                if np.shares_memory(a, b):  # exact; only where ranges meet
                    return min(i, j), max(i, j)
            except np.exceptions.TooHardError:
                return min(i, j), max(i, j)
        if hi > lo:
            active.append((hi, i))
    return None


# what an optimizer takes: parameters, or named_parameters()' (name, parameter) pairs
Params = Iterable[Parameter] | Iterable[tuple[str, Parameter]]


def _is_named(p: Any) -> bool:
    return isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) \
        and isinstance(p[1], Parameter)


def check_params(params: Params) -> list[Parameter]:
    """The parameters as a list, or a typed error naming what is wrong with them."""
    if isinstance(params, Parameter):
        raise TypeError(
            "params must be an iterable of Parameter, got a single Parameter; wrap it in a list"
        )
    try:
        plist: list[Any] = list(params)
    except TypeError:
        raise TypeError(
            f"params must be an iterable of Parameter, got {type(params).__name__}"
        ) from None
    if not plist:
        raise ValueError("optimizer got an empty parameter list")
    if all(_is_named(p) for p in plist):  # model.named_parameters(), as torch.optim takes
        plist = [p for _, p in plist]
    seen: dict[int, int] = {}
    for i, p in enumerate(plist):
        if isinstance(p, dict):
            raise TypeError(
                f"params[{i}] is a dict: parameter groups (torch.optim's [{{'params': ..., "
                "'lr': ...}, ...]) are not supported; a convfuse optimizer holds one group "
                "(one flat buffer per dtype, one set of hyperparameters): build one optimizer "
                "per group")
        if not isinstance(p, Parameter):
            named = " (named parameters must all be (name, Parameter) pairs)" if _is_named(p) \
                else ""
            raise TypeError(f"params[{i}] is a {type(p).__name__}, expected a convfuse "
                            f"Parameter{named}")
        if id(p) in seen:
            raise ValueError(f"params[{i}] is the same Parameter as params[{seen[id(p)]}]: {p!r}")
        seen[id(p)] = i
        device_of(p.data)  # TypeError unless a NumPy or CuPy array
        try:
            dtypes.canonical(p.data.dtype)
        except ValueError as exc:
            raise ValueError(f"params[{i}]: {exc}") from None
        if p.grad is not None:
            array_module(p.data, p.grad)  # refuses NumPy mixed with CuPy
            if p.grad.shape != p.data.shape or p.grad.dtype != p.data.dtype:
                raise ValueError(
                    f"params[{i}] has grad {p.grad.dtype}{tuple(p.grad.shape)} but data "
                    f"{p.data.dtype}{tuple(p.data.shape)}"
                )
    shared = _sharing(plist)
    if shared is not None:
        j, i = shared
        raise ValueError(
            f"params[{i}] shares memory with params[{j}]: each parameter gets its own slot "
            "in the optimizer's flat buffer, which would untie them; tie weights by sharing "
            "one Parameter object instead")
    where = {(p.device, _device_id(p.data)) for p in plist}
    where |= {(device_of(p.grad), _device_id(p.grad)) for p in plist if p.grad is not None}
    if len(where) > 1:
        names = ", ".join(sorted(f"{d}:{i}" if i >= 0 else d for d, i in where))
        raise DeviceMismatchError(f"optimizer parameters must all be on one device, got {names}")
    return plist


def build_groups(plist: list[Parameter], state_names: tuple[str, ...]) -> list[FlatGroup]:
    """Group checked parameters by dtype and re-home each into its group's flat buffers.

    Values of data and grad are copied in (a None grad becomes zeros); state buffers named
    in `state_names` start at zero in the compute dtype.
    """
    by_dtype: dict[np.dtype, list[tuple[int, Parameter]]] = {}
    for i, p in enumerate(plist):
        by_dtype.setdefault(np.dtype(p.data.dtype), []).append((i, p))
    device_id = _device_id(plist[0].data)
    xp = array_module(plist[0].data)
    groups = []
    with device_context(device_id):
        for dt, members in by_dtype.items():
            slots, offset = [], 0
            for i, p in members:
                size = int(p.data.size)
                slots.append(Slot(i, p, offset, size, tuple(p.data.shape)))
                offset += _padded(size, dt)
            total = max(offset, 1)  # an all-empty group still gets a buffer to point at
            group = FlatGroup(
                dtype=dt,
                compute_dtype=dtypes.compute_dtype(dt),
                device_id=device_id,
                slots=slots,
                data=aligned_zeros(xp, total, dt),
                grad=aligned_zeros(xp, total, dt),
            )
            for name in state_names:
                group.state[name] = aligned_zeros(xp, total, group.compute_dtype)
            for s in slots:
                _rehome(group, s)
            groups.append(group)
    return groups


def _rehome(group: FlatGroup, s: Slot) -> None:
    p, end = s.param, s.offset + s.size
    group.data[s.offset : end] = p.data.reshape(-1)
    if p.grad is not None:
        group.grad[s.offset : end] = p.grad.reshape(-1)
    s.data = group.data[s.offset : end].reshape(s.shape)
    s.grad = group.grad[s.offset : end].reshape(s.shape)
    p.rehome(s.data)  # the same values: a forward saved before may still run backward
    p.grad = s.grad


def check_homes(groups: list[FlatGroup]) -> None:
    """Raise if code replaced a re-homed parameter's arrays: the step would miss them."""
    for g in groups:
        for s in g.slots:
            if s.param.data is not s.data or s.param.grad is not s.grad:
                which = "data" if s.param.data is not s.data else "grad"
                raise RuntimeError(
                    f"params[{s.index}] ({s.param!r}) had its .{which} replaced after this "
                    "optimizer re-homed it into a flat buffer (by an assignment, by moving "
                    "the model with .to()/.cuda()/.cpu(), or by another optimizer built on "
                    "the same parameters); write into it in place "
                    f"(p.{which}[...] = value) so that the optimizer sees the change, or "
                    "build the optimizer after moving the model"
                )


def slots_in_order(groups: list[FlatGroup]) -> Iterator[tuple[FlatGroup, Slot]]:
    """Every (group, slot) pair in the order the parameters were given."""
    pairs = [(g, s) for g in groups for s in g.slots]
    return iter(sorted(pairs, key=lambda gs: gs[1].index))
