"""Shared by the optimizer test files (test_optim*.py): parameters, gradient sequences,
and a loop that steps an optimizer through them."""

from __future__ import annotations

from convfuse import Parameter

SHAPES = [(3, 4), (5,), (2, 3, 4), (), (0, 3), (17,), (1, 1, 2, 2)]


def make_params(rng, dtype, shapes=SHAPES):
    return [Parameter(rng.standard_normal(s).astype(dtype)) for s in shapes]


def grad_sequence(rng, shapes, steps):
    return [[rng.standard_normal(s) for s in shapes] for _ in range(steps)]


def run(opt, params, grads, lrs=None):
    """Write each step's gradients in place, set the lr if a schedule is given, step."""
    for k, gs in enumerate(grads):
        if lrs is not None:
            opt.lr = lrs[k]
        for p, g in zip(params, gs):
            p.grad[...] = g
        opt.step()
