"""The CPU update passes of SGD and Adam: cache-blocked, in place, threaded.

Note [blocked CPU update]
Written as whole-buffer NumPy expressions, one Adam step makes about 14 passes over memory
and allocates a temporary per operation (about 136 bytes moved per float32 parameter,
against a floor of 28: read p, g, m, v, write p, m, v). Here the flat buffers are walked in
blocks that fit the L2 cache; within a block every operation of the update runs, in
PyTorch's order, as an in-place ufunc into two per-thread scratch blocks, so each buffer
crosses the memory bus once per step. Blocks are independent, so they are split across the
reference engine's threads (convfuse.ops.reference._threads). Every element sees exactly
the operations, operand order and roundings of the whole-buffer form, so results are
bitwise the same for any block size and thread count.

Python floats meet the arrays as weak scalars (NEP 50): each is rounded to the compute
dtype once and the arithmetic stays in it, as in the GPU kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..ops.reference import _threads

# Bytes of one buffer's block: p, g, m, v blocks plus two scratch blocks stay within a
# 1 MiB L2 with room to spare at 128 KiB.
BLOCK_BYTES = 1 << 17


def _blocked(n: int, itemsize: int, body: Callable[[slice, dict[str, np.ndarray]], None],
             scratch_dtype: np.dtype, n_scratch: int) -> None:
    block = max(1024, BLOCK_BYTES // itemsize)
    n_blocks = -(-n // block)

    def run(lo: int, hi: int) -> None:
        size = min(block, n)
        scratch = {f"s{i}": np.empty(size, scratch_dtype) for i in range(n_scratch)}
        for b in range(lo, hi):
            start = b * block
            body(slice(start, min(n, start + block)), scratch)

    _threads.parallel_for(n_blocks, n, run)


def adam(data: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray, ct: np.dtype,
         t: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
         decoupled: bool) -> None:
    """One Adam/AdamW step over flat buffers, in place (module docstring of optim/adam.py)."""
    b1, b2 = betas
    one = ct.type(1)
    w1 = ct.type(1.0 - b1)
    lerp_small = abs(w1) < 0.5  # PyTorch's lerp picks its form by the weight
    keep = one - w1
    neg_step_size = -(lr / (1.0 - b1**t))
    bc2_sqrt = math.sqrt(1.0 - b2**t)
    decay = 1.0 - lr * weight_decay
    cast_p = data.dtype != ct
    copy_grad = grad.dtype != ct or (weight_decay != 0 and not decoupled)

    def body(sl: slice, s: dict[str, np.ndarray]) -> None:
        n = sl.stop - sl.start
        d, tmp = s["s0"][:n], s["s1"][:n]
        if cast_p:
            p = s["s2"][:n]
            np.copyto(p, data[sl])
        else:
            p = data[sl]
        mb, vb = m[sl], v[sl]
        if copy_grad:  # the gradient is left as the layers wrote it
            np.copyto(d, grad[sl])
        else:
            d = grad[sl]  # read only: in the compute dtype and nothing adds to it
        if decoupled:
            p *= decay
        elif weight_decay != 0:
            np.multiply(weight_decay, p, out=tmp)
            d += tmp
        np.subtract(d, mb, out=tmp)
        if lerp_small:
            tmp *= w1
            mb += tmp
        else:
            tmp *= keep
            np.subtract(d, tmp, out=mb)
        vb *= b2
        np.multiply(1.0 - b2, d, out=tmp)
        tmp *= d
        vb += tmp
        np.sqrt(vb, out=tmp)
        tmp /= bc2_sqrt
        tmp += eps
        np.divide(mb, tmp, out=tmp)
        tmp *= neg_step_size
        p += tmp
        if cast_p:
            data[sl] = p  # float16/bfloat16: rounded to nearest even, once

    _blocked(data.size, ct.itemsize, body, ct, 3 if cast_p else 2)


def sgd(data: np.ndarray, grad: np.ndarray, buf: Any, ct: np.dtype, t: int, lr: float,
        momentum: float, weight_decay: float, nesterov: bool) -> None:
    """One SGD step over flat buffers, in place (module docstring of optim/sgd.py)."""
    cast_p = data.dtype != ct
    neg_lr = -lr

    def body(sl: slice, s: dict[str, np.ndarray]) -> None:
        n = sl.stop - sl.start
        d, tmp = s["s0"][:n], s["s1"][:n]
        if cast_p:
            p = s["s2"][:n]
            np.copyto(p, data[sl])
        else:
            p = data[sl]
        np.copyto(d, grad[sl])
        if weight_decay != 0:
            np.multiply(weight_decay, p, out=tmp)
            d += tmp
        step = d
        if momentum != 0:
            bb = buf[sl]
            if t == 1:
                np.copyto(bb, d)
            else:
                bb *= momentum
                bb += d
            if nesterov:
                np.multiply(momentum, bb, out=tmp)
                d += tmp
            else:
                step = bb
        np.multiply(neg_lr, step, out=tmp)
        p += tmp
        if cast_p:
            data[sl] = p

    _blocked(data.size, ct.itemsize, body, ct, 3 if cast_p else 2)
