"""SGD with momentum and Nesterov, PyTorch's rule (torch.optim.SGD, dampening = 0).

Per element, in the compute dtype (float64 for float64 parameters, else float32):
    d = g + weight_decay * p
    buf = d                    on the first step, else  buf = momentum * buf + d
    d = d + momentum * buf     with nesterov, else      d = buf        (only if momentum != 0)
    p = p - lr * d
The GPU kernel (kernels/optim.cu, sgd_*) and `_update_cpu` below evaluate the same
expressions in the same order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _cpu
from ._base import FlatOptimizer, real, take_torch_flags
from ._flat import FlatGroup, Params

# torch.optim.SGD's keyword-only flags (take_torch_flags says which values are accepted)
_TORCH_FLAGS = ("maximize", "foreach", "differentiable", "fused")


class SGD(FlatOptimizer):
    """Stochastic gradient descent over flat buffers; one fused launch per dtype per step.

    `SGD(params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
    maximize=False, foreach=None, differentiable=False, fused=None)`: torch.optim.SGD's
    arguments, order and defaults, so calls written for it mean the same here. `dampening`,
    `maximize` and `differentiable` are supported at their defaults only (others are
    refused, naming the argument); `foreach` and `fused` choose torch's implementation and
    any value is accepted (convfuse's step is always one fused launch). State dicts move
    both ways: `state_dict()` saves these flags at their defaults (torch.optim.SGD needs
    `dampening` to step; its arrays are NumPy's, made tensors for torch), and
    torch.optim.SGD's state, which counts no steps, loads as
    stepped (the rule reads only that). The momentum buffer is float32 for float16/bfloat16
    parameters.
    """

    _kernel = "sgd"
    _torch_flags = ("dampening", *_TORCH_FLAGS)
    _torch_counts_steps = False

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        super().__init__(
            params, lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize, foreach=foreach,
            differentiable=differentiable, fused=fused,
        )

    def _validated(self, **hyper: Any) -> dict[str, Any]:
        take_torch_flags(hyper, _TORCH_FLAGS)
        if "dampening" in hyper:  # torch.optim.SGD's, at its default only: not in defaults
            dampening = hyper.pop("dampening")
            if real(dampening, "dampening") != 0.0:
                raise ValueError(f"dampening={dampening!r} is not supported: convfuse's fused "
                                 "update is torch.optim.SGD's with dampening=0 (its default)")
        unknown = set(hyper) - {"momentum", "weight_decay", "nesterov"}
        if unknown:
            raise ValueError(f"unknown SGD hyperparameter(s) {sorted(unknown)}")
        momentum = real(hyper.get("momentum", 0.0), "momentum")
        weight_decay = real(hyper.get("weight_decay", 0.0), "weight_decay")
        nesterov = hyper.get("nesterov", False)
        if not momentum >= 0.0:
            raise ValueError(f"Invalid momentum value: {hyper['momentum']}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {hyper['weight_decay']}")
        if not isinstance(nesterov, (bool, np.bool_)):
            raise TypeError(f"nesterov must be a bool, got {type(nesterov).__name__}")
        if nesterov and momentum <= 0:
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        return {"momentum": momentum, "weight_decay": weight_decay, "nesterov": bool(nesterov)}

    def _state_names_of(self, defaults: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if defaults["momentum"] != 0 else ()

    def _state_args(self, g: FlatGroup) -> tuple[Any, ...]:
        if self._defaults["momentum"] != 0:
            return (g.state["momentum_buffer"],)
        return (np.uint64(0),)  # NULL: the kernel never touches buf when momentum == 0

    def _hyper_args(self) -> tuple[Any, ...]:
        h = self._defaults
        return (np.float64(h["momentum"]), np.float64(h["weight_decay"]), np.int32(h["nesterov"]))

    def _update_cpu(self, g: FlatGroup, t: int, lr: float) -> None:
        # blocked, in place and threaded, in this docstring's order (Note [blocked CPU
        # update] in optim/_cpu.py)
        h = self._defaults
        buf = g.state["momentum_buffer"] if h["momentum"] != 0 else None
        _cpu.sgd(g.data, g.grad, buf, g.compute_dtype, t, lr, h["momentum"],
                 h["weight_decay"], h["nesterov"])
