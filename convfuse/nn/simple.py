"""Identity, ReLU (and any convfuse activation) and Dropout: the small layers users expect
in a Sequential. Where a ReLU follows a Conv or BatchNorm, prefer `activation="relu"` on
that layer: it is fused there and costs nothing; a standalone ReLU is one more pass."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from .. import activations, dtypes, ops
from ..backend import array_module
from ..ops._checks import as_float
from ..plan.capture import refuse_in_capture
from . import _hyper
from .module import USER_ERRORS, Layer, contiguous, renamed


class _Stateless(Layer):
    """A parameter-free layer that follows its input's device unless `.to()` pins one.
    Backward follows Layer's rule (checks first, context kept when it raises)."""

    def __init__(self) -> None:
        self.device: str | None = None  # type: ignore[assignment]
        self._ctx = None


class Identity(_Stateless):
    """Returns its input; accepts and ignores any constructor arguments, as PyTorch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def __call__(self, x: Any) -> Any:
        self._check_input(x)
        self._ctx = x
        return x

    forward = __call__

    def backward(self, dy: Any) -> Any:
        return self._backward_with(dy, self._backward)

    def _backward(self, x: Any, dy: Any) -> Any:
        self._check_dy(dy, x.shape, x.dtype)
        return dy if self.needs_input_grad else None


class Activation(_Stateless):
    """One of convfuse's activations as a layer (`Activation("gelu")`)."""

    def __init__(self, activation: str | None = "relu") -> None:
        super().__init__()
        self.activation = activation

    activation = _hyper.activation_property()

    def __call__(self, x: Any) -> Any:
        """A non-C-contiguous x is copied once (the caller's array is never modified)."""
        act = self.activation
        try:
            self._check_input(x)
            x = contiguous(x)
            y = ops.activation_forward(x, act)
        except USER_ERRORS as exc:
            raise self._renamed(exc) from None
        kind = activations.saves(act)
        if kind == "output" and isinstance(y, np.ndarray):
            y.flags.writeable = False  # saved for backward: an in-place write would corrupt dx
        self._ctx = (y, {"none": None, "output": y, "preactivation": x}[kind], act)
        return y

    forward = __call__

    def backward(self, dy: Any) -> Any:
        return self._backward_with(dy, self._backward)

    def _backward(self, ctx: Any, dy: Any) -> Any:
        y, saved, act = ctx
        dy = self._check_dy(dy, y.shape, y.dtype)
        if not self.needs_input_grad:
            return None
        return ops.activation_backward(dy, saved, act)

    def extra_repr(self) -> str:
        return repr(self.activation)


class ReLU(Activation):
    """max(x, 0); `inplace` is accepted for PyTorch compatibility and ignored (never in place:
    convfuse never modifies its inputs)."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__("relu")

    def extra_repr(self) -> str:
        return ""


_device_rngs: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()


_FLOATS = frozenset(dtypes.SUPPORTED.values())


class Dropout(_Stateless):
    """Zeroes each element with probability p in training mode and scales the rest by
    1/(1-p); the identity in eval mode. PyTorch's `Dropout(p=0.5)`. The mask is drawn on the
    input's device: on the GPU by the layer's own CuPy Generator (`_device_rng`), seeded
    from `seed`, whose state lives on the device and whose draws are CuPy kernels, so a
    training step with dropout can be captured as a CUDA graph (CuPy's global
    `cupy.random` goes through cuRAND's host API, which refuses a stream capture, and would
    ignore `seed`); each replay advances the state and draws a new mask."""

    def __init__(self, p: float = 0.5, inplace: bool = False, seed: int | None = None) -> None:
        super().__init__()
        self.p = p
        try:
            self._rng = np.random.default_rng(_hyper.seed(seed))
        except USER_ERRORS as exc:
            raise renamed(exc, "Dropout") from None

    @property
    def p(self) -> float:
        """The drop probability; assignable (validated)."""
        return self.__dict__["_p"]

    @p.setter
    def p(self, value: Any) -> None:
        if isinstance(value, (bool, np.bool_)) or not isinstance(
                value, (int, float, np.floating, np.integer)):
            raise TypeError(f"Dropout: p must be a number, got {type(value).__name__}")
        if not 0.0 <= as_float(value) <= 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1], got {value}")
        self.__dict__["_p"] = float(value)

    def __call__(self, x: Any) -> Any:
        self._check_input(x)
        if x.dtype not in _FLOATS:  # an integer scale 1/(1-p) would truncate (to 1 at p<0.5)
            raise ValueError(f"Dropout: input has unsupported dtype {x.dtype}; convfuse "
                             f"supports {', '.join(dtypes.SUPPORTED)}")
        if not self.training or self.p == 0.0:
            self._ctx = (None, x)
            return x
        xp = array_module(x)
        if self.p == 1.0:
            scale = xp.zeros(x.shape, dtype=x.dtype)
        elif xp is np:
            keep = self._rng.random(x.shape, dtype=np.float32) >= self.p
            scale = keep.astype(x.dtype) * x.dtype.type(1.0 / (1.0 - self.p))
        else:  # pragma: gpu
            keep = self._device_rng(xp).random(x.shape, dtype=xp.float32) >= self.p
            scale = keep.astype(x.dtype) * x.dtype.type(1.0 / (1.0 - self.p))
        self._ctx = (scale, x)
        return x * scale

    forward = __call__

    def _device_rng(self, cp: Any) -> Any:
        """This layer's Generator on the current device, made at its first training call
        there (the warm-up a capture needs: its state is seeded by a kernel), seeded from
        the layer's NumPy generator. Kept beside the layer, not in it: copies and pickles
        of the layer carry the NumPy generator's state and make their own."""
        per_device = _device_rngs.setdefault(self, {})
        device = int(cp.cuda.runtime.getDevice())
        rng = per_device.get(device)
        if rng is None:
            # seeding inside a capture would be recorded too (every replay would draw the
            # same mask), its state in the capture's pool, freed with it
            refuse_in_capture("Dropout's first training call on this GPU (creating its "
                              "random generator)")
            # CuPy's default pool, as Mean's buffer: the generator outlives any capture
            with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
                rng = per_device[device] = cp.random.default_rng(
                    int(self._rng.integers(0, 2**63 - 1)))
        return rng

    def backward(self, dy: Any) -> Any:
        return self._backward_with(dy, self._backward)

    def _backward(self, ctx: Any, dy: Any) -> Any:
        scale, x = ctx
        self._check_dy(dy, x.shape, x.dtype)
        if not self.needs_input_grad:
            return None
        return dy if scale is None else dy * scale

    def extra_repr(self) -> str:
        return f"p={self.p}"
