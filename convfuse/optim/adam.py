"""Adam and AdamW, PyTorch's rules (torch.optim.Adam/AdamW, amsgrad = False).

Per element, in the compute dtype (float64 for float64 parameters, else float32), with the
per-step scalars computed in double from the step number t (1 on the first step):
    AdamW: p = p * (1 - lr * weight_decay)      Adam: d = g + weight_decay * p
    m = lerp(m, d, 1 - beta1)                    (PyTorch's two-sided lerp)
    v = v * beta2 + ((1 - beta2) * d) * d
    p = p - (lr / (1 - beta1**t)) * (m / (sqrt(v) / sqrt(1 - beta2**t) + eps))
The GPU kernel (kernels/optim.cu, adam_*) and `_update_cpu` below evaluate the same
expressions in the same order. The state (exp_avg, exp_avg_sq) is float32 for
float16/bfloat16 parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..nn.parameter import Parameter
from ._base import FlatOptimizer, real
from ._flat import FlatGroup

_HYPER = ("betas", "eps", "weight_decay")


class Adam(FlatOptimizer):
    """Adam over flat buffers (L2 weight decay added to the gradient); one fused launch per
    dtype group per step. `Adam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0.0)`."""

    _kernel = "adam"
    _decoupled = False

    def __init__(
        self,
        params: Iterable[Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def _validated(self, **hyper: Any) -> dict[str, Any]:
        unknown = set(hyper) - set(_HYPER)
        if unknown:
            raise ValueError(f"unknown {type(self).__name__} hyperparameter(s) {sorted(unknown)}")
        betas = hyper.get("betas", (0.9, 0.999))
        if not isinstance(betas, (tuple, list, np.ndarray)):
            raise TypeError(f"betas must be a pair (beta1, beta2), got {type(betas).__name__} "
                            f"{betas!r}")
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        eps = real(hyper.get("eps", 1e-8), "eps")
        b1, b2 = real(betas[0], "betas[0]"), real(betas[1], "betas[1]")
        weight_decay = real(hyper.get("weight_decay", 0.0), "weight_decay")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {hyper['eps']}")
        if not 0.0 <= b1 < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= b2 < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {hyper['weight_decay']}")
        return {"betas": (b1, b2), "eps": eps, "weight_decay": weight_decay}

    def _state_names_of(self, defaults: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def _hyper_args(self) -> tuple[Any, ...]:
        (b1, b2), h = self.defaults["betas"], self.defaults
        return (np.float64(b1), np.float64(b2), np.float64(h["eps"]),
                np.float64(h["weight_decay"]), np.int32(self._decoupled))

    def _update_cpu(self, g: FlatGroup, t: int, lr: float) -> None:
        h = self.defaults
        (b1, b2), eps, wd = h["betas"], h["eps"], h["weight_decay"]
        ct = g.compute_dtype
        one = ct.type(1)
        p = g.data if g.data.dtype == ct else g.data.astype(ct)
        d = g.grad.astype(ct)  # a copy: the gradient is left as the layers wrote it
        if self._decoupled:
            p *= 1.0 - lr * wd
        elif wd != 0:
            d += wd * p
        m, v = g.state["exp_avg"], g.state["exp_avg_sq"]
        w1 = ct.type(1.0 - b1)
        if abs(w1) < 0.5:  # PyTorch's lerp picks its form by the weight
            m += w1 * (d - m)
        else:
            m[...] = d - (d - m) * (one - w1)
        v *= b2
        v += ((1.0 - b2) * d) * d
        neg_step_size = -(lr / (1.0 - b1**t))
        bc2_sqrt = math.sqrt(1.0 - b2**t)
        denom = np.sqrt(v) / bc2_sqrt + eps
        p += neg_step_size * (m / denom)
        if p is not g.data:
            g.data[...] = p  # float16/bfloat16: rounded to nearest even, once


class AdamW(Adam):
    """Adam with decoupled weight decay (p *= 1 - lr * weight_decay before the Adam step).
    `AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)`."""

    _decoupled = True

    def __init__(
        self,
        params: Iterable[Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(params, lr, betas=betas, eps=eps, weight_decay=weight_decay)
