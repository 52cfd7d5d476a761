"""Adam and AdamW, PyTorch's rules (torch.optim.Adam/AdamW, amsgrad = False).

AdamW is Adam with `decoupled_weight_decay=True`, as in torch.optim (2.x). The flag is a
hyperparameter saved in the state dict's group, and loading follows torch.optim: Adam takes
the checkpoint's flag (so an AdamW checkpoint loaded into Adam decays as AdamW; a checkpoint
without the key, as convfuse's before it was saved, keeps Adam's L2 rule), and AdamW is
always decoupled (torch.optim.AdamW.__setstate__ forces it), whatever it loads.

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

from typing import Any

import numpy as np

from . import _cpu
from ._base import FlatOptimizer, real, take_torch_flags
from ._flat import FlatGroup, Params

_HYPER = ("betas", "eps", "weight_decay", "decoupled_weight_decay")
# torch.optim.Adam's flags beside them (take_torch_flags says which values are accepted)
_TORCH_FLAGS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused")


class Adam(FlatOptimizer):
    """Adam over flat buffers (L2 weight decay added to the gradient, unless
    `decoupled_weight_decay`); one fused launch per dtype group per step.

    `Adam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
    foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
    decoupled_weight_decay=False)`: torch.optim.Adam's arguments, order and defaults.
    `amsgrad`, `maximize` and `differentiable` are supported at their defaults only (others
    are refused, naming the argument); `foreach`, `fused` and `capturable` choose torch's
    implementation and any value is accepted (convfuse's step is always one fused,
    capturable launch). A torch.optim.Adam state dict (its 0-d tensor steps included) loads.
    """

    _kernel = "adam"
    _torch_flags = _TORCH_FLAGS
    _decoupled = False  # the rule when neither the arguments nor a checkpoint name one

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
    ) -> None:
        super().__init__(params, lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=decoupled_weight_decay)

    def _validated(self, **hyper: Any) -> dict[str, Any]:
        take_torch_flags(hyper, _TORCH_FLAGS)
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
        decoupled = hyper.get("decoupled_weight_decay", self._decoupled)
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {hyper['eps']}")
        if not 0.0 <= b1 < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= b2 < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {hyper['weight_decay']}")
        if not isinstance(decoupled, (bool, np.bool_)):
            raise TypeError(f"decoupled_weight_decay must be a bool, got "
                            f"{type(decoupled).__name__} {decoupled!r}")
        # AdamW is decoupled whatever a checkpoint says, as torch.optim.AdamW
        decoupled = bool(decoupled) or self._decoupled
        return {"betas": (b1, b2), "eps": eps, "weight_decay": weight_decay,
                "decoupled_weight_decay": decoupled}

    def _state_names_of(self, defaults: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def _hyper_args(self) -> tuple[Any, ...]:
        (b1, b2), h = self._defaults["betas"], self._defaults
        return (np.float64(b1), np.float64(b2), np.float64(h["eps"]),
                np.float64(h["weight_decay"]), np.int32(h["decoupled_weight_decay"]))

    def _update_cpu(self, g: FlatGroup, t: int, lr: float) -> None:
        # blocked, in place and threaded, in this docstring's order (Note [blocked CPU
        # update] in optim/_cpu.py)
        h = self._defaults
        _cpu.adam(g.data, g.grad, g.state["exp_avg"], g.state["exp_avg_sq"], g.compute_dtype,
                  t, lr, h["betas"], h["eps"], h["weight_decay"], h["decoupled_weight_decay"])


class AdamW(Adam):
    """Adam with decoupled weight decay (p *= 1 - lr * weight_decay before the Adam step).
    `AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
    *, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None)`:
    torch.optim.AdamW's arguments (which have no `decoupled_weight_decay`), as Adam's."""

    _decoupled = True

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True)
