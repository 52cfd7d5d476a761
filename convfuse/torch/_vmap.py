"""Batching rules of the fused convolution's custom ops, for torch.func.vmap (per-sample
gradients, model ensembles) without torch's per-sample fallback loop and its warning.

Note [a fused convolution under vmap]
A vmapped call is one convfuse call of a larger convolution:
- a batch of inputs through one weight: the vmapped dimension merges into N, (B, N, C,
  ...) -> (B * N, C, ...), and the output splits back;
- otherwise (a batch of weights, or the backward, whose filter and bias gradients are per
  vmapped element: a per-sample gradient) a grouped convolution of B * groups groups:
  inputs (N, B * C, ...), weights (B * K, C / groups, ...), outputs (N, B * K, ...), each
  vmapped element a block of groups of its own. An unbatched operand is repeated B times.
Each rule calls the custom op itself on plain tensors, so an enclosing transform (vmap of
vmap) applies it again. Outputs an op leaves empty (a placeholder of shape (0,)) carry no
vmapped dimension.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _ops, _transpose_ops


def _front(t: torch.Tensor | None, dim: int | None, size: int) -> torch.Tensor | None:
    """`t` with its vmapped dimension first (repeated `size` times where it has none)."""
    if t is None:
        return None
    if dim is None:
        return t.unsqueeze(0).expand(size, *t.shape)
    return t.movedim(dim, 0)


def _merged(t: torch.Tensor | None, dim: int | None, size: int) -> torch.Tensor | None:
    """(B, N, C, ...) -> (B * N, C, ...): the vmapped dimension merged into the batch."""
    t = _front(t, dim, size)
    return None if t is None else t.reshape(size * t.shape[1], *t.shape[2:])


def _grouped(t: torch.Tensor | None, dim: int | None, size: int) -> torch.Tensor | None:
    """(B, N, C, ...) -> (N, B * C, ...): each vmapped element a block of channels."""
    t = _front(t, dim, size)
    if t is None:
        return None
    t = t.movedim(0, 1)
    return t.reshape(t.shape[0], size * t.shape[2], *t.shape[3:])


def _stacked(t: torch.Tensor | None, dim: int | None, size: int) -> torch.Tensor | None:
    """(B, K, ...) -> (B * K, ...): a weight or bias per vmapped element, one after another."""
    t = _front(t, dim, size)
    return None if t is None else t.reshape(size * t.shape[1], *t.shape[2:])


def _ungrouped(t: torch.Tensor, size: int) -> tuple[torch.Tensor, int | None]:
    """(N, B * K, ...) -> (N, B, K, ...), vmapped at 1; an empty placeholder stays as it is."""
    if t.dim() == 1 and t.numel() == 0:
        return t, None
    return t.reshape(t.shape[0], size, t.shape[1] // size, *t.shape[2:]), 1


def _unstacked(t: torch.Tensor, size: int) -> tuple[torch.Tensor, int | None]:
    """(B * K, ...) -> (B, K, ...), vmapped at 0; an empty placeholder stays as it is."""
    if t.dim() == 1 and t.numel() == 0:
        return t, None
    return t.reshape(size, t.shape[0] // size, *t.shape[1:]), 0


def _unmerged(t: torch.Tensor, size: int) -> tuple[torch.Tensor, int | None]:
    """(B * N, K, ...) -> (B, N, K, ...), vmapped at 0; an empty placeholder stays as it is."""
    if t.dim() == 1 and t.numel() == 0:
        return t, None
    return t.reshape(size, t.shape[0] // size, *t.shape[1:]), 0


def _rules(forward_op: Any, backward_op: Any) -> tuple[Any, Any]:
    """The batching rules of a fused forward op `forward_op(x, weight, bias, residual,
    *hyper, activation) -> (y, z)` and its backward op `backward_op(dy, x, weight, saved,
    *hyper, activation, need_dx, need_dw, need_db, need_dz) -> (dx, dw, db, dz)`, `groups`
    being the last of `hyper` (the convolution's and the transposed convolution's)."""

    def forward(info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, residual: torch.Tensor | None,
                *rest: Any) -> tuple[Any, Any]:
        size = info.batch_size
        dx, dw, db, dr = in_dims[:4]
        *hyper, groups, activation = rest
        if dw is None and db is None:  # one weight: a batch of B * N inputs
            y, z = forward_op(_merged(x, dx, size), weight, bias, _merged(residual, dr, size),
                              *hyper, groups, activation)
            (y, ydim), (z, zdim) = _unmerged(y, size), _unmerged(z, size)
            return (y, z), (ydim, zdim)
        y, z = forward_op(_grouped(x, dx, size), _stacked(weight, dw, size),
                          _stacked(bias, db, size), _grouped(residual, dr, size), *hyper,
                          groups * size, activation)
        (y, ydim), (z, zdim) = _ungrouped(y, size), _ungrouped(z, size)
        return (y, z), (ydim, zdim)

    def backward(info: Any, in_dims: tuple[Any, ...], dy: torch.Tensor, x: torch.Tensor,
                 weight: torch.Tensor, saved: torch.Tensor | None,
                 *rest: Any) -> tuple[Any, Any]:
        size = info.batch_size
        ddy, dx, dw, ds = in_dims[:4]
        *hyper, groups, activation, need_dx, need_dw, need_db, need_dz = rest
        gx, gw, gb, gz = backward_op(
            _grouped(dy, ddy, size), _grouped(x, dx, size), _stacked(weight, dw, size),
            _grouped(saved, ds, size), *hyper, groups * size, activation, need_dx, need_dw,
            need_db, need_dz)
        parts = [_ungrouped(gx, size), _unstacked(gw, size), _unstacked(gb, size),
                 _ungrouped(gz, size)]
        return tuple(t for t, _ in parts), tuple(d for _, d in parts)

    return forward, backward


def register() -> None:
    """The rules, once (convfuse.torch's import)."""
    for forward_op, backward_op in (
            (_ops.conv_bias_act, _ops.conv_bias_act_backward),
            (_transpose_ops.conv_transpose_bias_act,
             _transpose_ops.conv_transpose_bias_act_backward)):
        forward, backward = _rules(forward_op, backward_op)
        torch.library.register_vmap(forward_op, forward)
        torch.library.register_vmap(backward_op, backward)
