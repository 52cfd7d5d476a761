"""The NumPy views of a layer's own tensors, kept between its CPU calls (Note [a layer's
host arrays]).

Note [a layer's host arrays]
On the CPU a layer hands its parameters (and a batch norm its running statistics) to the
NumPy engine as views, `Tensor.numpy(force=True)`, which cost about a microsecond each: a
batch norm's four are some 5% of torch.nn's whole training step at the sizes where host
time decides it. They rarely change between calls, so a layer keeps the views its last call
made, with the tensors and their addresses, and reuses them while the call's plan is the
same object (so every shape, stride, dtype and device is the key's) and each tensor is the
same object at the same address. Anything else makes them afresh: another plan, a Parameter
reassigned or swapped for the call (torch.func.functional_call), `.data` or `set_` giving
it other memory. A tensor computed by autograd (timm's standardised weights, made at each
call) is never kept: it would be new at the next call anyway, and keeping it would keep its
graph. A view reads the memory when the engine reads it, so in-place updates (an optimizer
step, load_state_dict) need nothing. A view holds the memory it was made of, so a layer
drops its views when it is moved or cast (`nn.Module._apply`: .to, .cuda, .half, ...) and
at worst keeps one stale copy of its own tensors until its next CPU call. A copy or a
pickle of the layer starts with none, and the entry is swapped as one tuple, so a thread
sees the old entry or the new one, never half of each.
"""

from __future__ import annotations

from typing import Any

import torch


class HostArrays:
    """One layer's views (Note [a layer's host arrays])."""

    __slots__ = ("entry",)

    def __init__(self) -> None:
        self.entry: tuple[Any, ...] | None = None

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return HostArrays, ()  # a copy or a pickle starts empty

    def views(self, plan: object, tensors: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
        """`t.numpy(force=True)` of each tensor (None for None), as made for `plan` by the
        last call where every tensor is the same object at the same address."""
        entry = self.entry
        if entry is not None and entry[0] is plan:
            for t, held, ptr in zip(tensors, entry[1], entry[2]):
                if t is not held or (t is not None and t.data_ptr() != ptr):
                    break
            else:
                return entry[3]
        arrays = tuple(None if t is None else t.numpy(force=True) for t in tensors)
        if any(t is not None and t.grad_fn is not None for t in tensors):
            self.entry = None  # computed per call (a standardised weight): nothing to keep,
            return arrays  # and its graph must not outlive the step
        self.entry = (plan, tensors, tuple(0 if t is None else t.data_ptr() for t in tensors),
                      arrays)
        return arrays


def of(module: torch.nn.Module) -> HostArrays:
    """`module`'s HostArrays, made at its first call."""
    d = module.__dict__
    held = d.get("_host_arrays")
    if held is None:
        held = d["_host_arrays"] = HostArrays()
    return held


class HoldsViews(torch.nn.Module):
    """A layer that keeps HostArrays: it drops them when nn.Module._apply moves or casts
    it (.to, .cuda, .half, ...), as the views hold the memory being replaced."""

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        self.__dict__.pop("_host_arrays", None)
        return super()._apply(fn, recurse)
