"""Residual blocks: act(body(x) + shortcut(x)) with the add and activation fused.

Note [residual rides on the last layer]: a Conv or BatchNorm layer computes
act(f(x) + residual) in one pass when called with `residual=` (for a conv, the one
cudnnConvolutionBiasActivationForward). A residual block therefore never adds: it hands the
shortcut's output to the body's last layer, whose activation is the block's. Backward gets
(d body, d residual) from that layer; the shortcut's gradient is d residual.
"""

from __future__ import annotations

from typing import Any, TypeGuard

from ..backend import device_of
from ..errors import DeviceMismatchError
from . import _hyper
from .batchnorm import _BatchNorm
from .container import Sequential, runs_once_checked
from .conv import _ConvNd
from .fold import fold_chain, fold_layer
from .module import Layer, forward_keeping_contexts


def fused_tail(layer: Layer, owner: str) -> _ConvNd | _BatchNorm:
    """The layer that will receive `residual=` when `layer` is called with one: `layer`
    itself for a Conv or BatchNorm, the last layer of a (nested) Sequential. TypeError,
    naming `owner`, for anything that cannot take a residual."""
    tail = layer
    while isinstance(tail, Sequential):
        items = tail.layers
        if not items:
            raise ValueError(f"{owner}: the body is an empty Sequential; it must end with a "
                             "Conv or BatchNorm layer, which takes the residual")
        tail = items[-1]
    if not takes_residual(tail):
        raise TypeError(
            f"{owner}: the body must end with a Conv or BatchNorm layer (it takes the "
            f"shortcut as `residual=` and applies the activation in the same pass), but it "
            f"ends with {type(tail).__name__}"
        )
    return tail


def takes_residual(layer: Layer) -> TypeGuard[_ConvNd | _BatchNorm]:
    """Conv and BatchNorm layers add a residual and activate in their own pass."""
    return isinstance(layer, (_ConvNd, _BatchNorm))


def check_contexts(container: Layer) -> None:
    """Before a container's backward writes any gradient, let every layer inside it run the
    checks it can make without writing (`_check_backward`, where the Module API offers it:
    its saved context exists and no parameter changed since the forward), so a backward
    that raises part-way changes no gradient."""
    for name, mod in container.named_modules():
        check = getattr(mod, "_check_backward", None) if name else None
        if check is not None:
            check()


class ResidualBase(Layer):
    """act(body(x) + shortcut(x)), for blocks whose body is a chain of layers.

    Subclasses say which layers form the body (`_body_layers()`: run in order, the last one
    takes `residual=`) and which is the shortcut (`_shortcut()`: a layer or None for the
    identity). The activation lives on that last layer (Note [residual rides on the last
    layer]). `needs_input_grad` reaches the first layer of the body and of the shortcut,
    so a block fed by data computes no input gradient in either branch.
    """

    def _body_layers(self) -> list[Layer]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _shortcut(self) -> Layer | None:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def needs_input_grad(self) -> bool:
        return self.__dict__.get("_needs_input_grad", True)

    @needs_input_grad.setter
    def needs_input_grad(self, value: bool) -> None:
        self.__dict__["_needs_input_grad"] = bool(value)
        self._body_layers()[0].needs_input_grad = bool(value)
        shortcut = self._shortcut()
        if shortcut is not None:
            shortcut.needs_input_grad = bool(value)

    def __call__(self, x: Any) -> Any:
        return forward_keeping_contexts(self, self._forward, x)

    def _forward(self, x: Any) -> Any:
        self._check_block_input(x)
        shortcut = self._shortcut()
        skip = x if shortcut is None else shortcut(x)
        *head, tail = self._body_layers()
        h = x
        for layer in head:
            h = layer(h)
        y = tail(h, residual=skip)
        self._ctx = (tuple(y.shape), y.dtype, device_of(y))
        return y

    forward = __call__

    def _run_units(self) -> list[Layer]:
        shortcut = self._shortcut()
        return [*self._body_layers(), *([] if shortcut is None else [shortcut])]

    def _check_backward(self) -> Any:
        """The block's context and, below it, every layer's (checked before a container
        holding the block writes any gradient)."""
        ctx = self._peek_ctx()
        body = self._body_layers()
        for layer in body[1:]:  # each passes its gradient on to the one before it
            if not layer.needs_input_grad:
                raise ValueError(f"{type(self).__name__}: a body layer after the first "
                                 f"({type(layer).__name__}) has needs_input_grad=False, but "
                                 "the layer before it needs its input gradient; set it True")
        if self.needs_input_grad:  # dx = d body + d shortcut: both branches must give one
            branches: tuple[tuple[str, Layer | None], ...] = (
                ("body", body[0]), ("shortcut", self._shortcut()))
            for what, first in branches:
                if first is not None and not first.needs_input_grad:
                    raise ValueError(
                        f"{type(self).__name__}: the {what}'s first layer "
                        f"({type(first).__name__}) has needs_input_grad=False, but the "
                        "block's input gradient needs it; set the block's needs_input_grad "
                        "(it sets both)")
        check_contexts(self)
        return ctx

    def backward(self, dy: Any) -> Any:
        """dx = d body + d shortcut (None when `needs_input_grad` is False)."""
        with runs_once_checked(self):
            shape, dtype, device = self._check_backward()
            # Checked here, before any layer runs, so a bad dy changes no gradient.
            self._check_block_input(dy, "dy")
            if tuple(dy.shape) != shape or dy.dtype != dtype or device_of(dy) != device:
                raise ValueError(
                    f"{type(self).__name__}: dy has shape {tuple(dy.shape)}, dtype "
                    f"{dy.dtype} on {device_of(dy)!r}, but the forward's output has shape "
                    f"{shape}, dtype {dtype} on {device!r}"
                )
            self._ctx = None  # everything checkable was: consumed, as Layer's rule says
            *head, tail = self._body_layers()
            g, dskip = tail.backward(dy)
            for layer in reversed(head):
                g = layer.backward(g)
            shortcut = self._shortcut()
            if shortcut is not None:
                dskip = shortcut.backward(dskip)
        if not self.needs_input_grad:
            return None
        return g + dskip

    def _fold(self) -> Residual:
        """The evaluation block with each Conv -> BatchNorm of body and shortcut folded
        (convfuse.nn.fold): a Residual whose body ends with the fused conv."""
        parts = fold_chain(self._body_layers())
        body = parts[0] if len(parts) == 1 else Sequential(*parts)
        shortcut = self._shortcut()
        folded = Residual._from_parts(body, None if shortcut is None else fold_layer(shortcut))
        folded.needs_input_grad = self.needs_input_grad
        return folded

    def _check_block_input(self, x: Any, name: str = "input") -> None:
        try:
            where = device_of(x)
        except TypeError:
            raise TypeError(f"{type(self).__name__}: {name} must be a NumPy or CuPy array, "
                            f"got {type(x).__name__}") from None
        device = getattr(self, "device", None)
        if device is not None and where != device:
            raise DeviceMismatchError(
                f"{type(self).__name__} is on {device!r} but its {name} is on {where!r}; "
                f"move one of them (block.to({where!r}) or convert the array)"
            )


class Residual(ResidualBase):
    """`act(body(x) + shortcut(x))`; `shortcut=None` is the identity.

    The body must end with a Conv or BatchNorm layer (directly or as the last layer of a
    Sequential): the add and the activation ride on its `residual=` argument (Note
    [residual rides on the last layer]), so the block costs no elementwise pass. That last
    layer must be built without an activation (the block's `activation` is set on it
    here); a body that ends otherwise is refused with a TypeError. state_dict keys are
    "body.*" and "shortcut.*".
    """

    def __init__(self, body: Layer, shortcut: Layer | None = None,
                 activation: str | None = "relu") -> None:
        if not isinstance(body, Layer):
            raise TypeError(f"Residual: body must be a convfuse layer, got {type(body).__name__}")
        if shortcut is not None and not isinstance(shortcut, Layer):
            raise TypeError(f"Residual: shortcut must be a convfuse layer or None, "
                            f"got {type(shortcut).__name__}")
        try:
            act = _hyper.activation(activation)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"Residual: activation: {exc}") from None
        tail = fused_tail(body, "Residual")
        if tail.activation != "identity":
            raise ValueError(
                f"Residual: the body's last layer ({type(tail).__name__}) already applies "
                f"activation {tail.activation!r} before the add; build it with "
                "activation=None and give the block's activation to Residual(activation=...)"
            )
        scale = getattr(tail, "residual_scale", 1.0)  # a BatchNorm has none
        if scale != 1.0:
            raise ValueError(f"Residual: the body's last layer has residual_scale "
                             f"{scale}; the block adds the shortcut with scale 1")
        devices: set[Any] = {getattr(m, "device", None) for m in (body, shortcut) if m is not None}
        devices.discard(None)
        if len(devices) > 1:
            raise DeviceMismatchError(
                f"Residual: body and shortcut are on different devices: {sorted(devices)}")
        tail.activation = act
        self._assemble(body, shortcut, devices.pop() if devices else None)

    def _assemble(self, body: Layer, shortcut: Layer | None, device: str | None) -> None:
        self.body = body
        self.shortcut = shortcut
        self.device = device  # type: ignore[assignment]
        self._ctx = None

    @property
    def activation(self) -> str:
        """The block's activation: the one its body's last layer applies after the add (Note
        [residual rides on the last layer]), so reading it says what the block computes and
        assigning it (validated, as a Conv's is) takes effect at the next call."""
        return fused_tail(self.body, "Residual").activation

    @activation.setter
    def activation(self, value: Any) -> None:
        try:
            act = _hyper.activation(value)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"Residual: activation: {exc}") from None
        fused_tail(self.body, "Residual").activation = act

    @classmethod
    def _from_parts(cls, body: Layer, shortcut: Layer | None) -> Residual:
        """A block whose body's last layer already carries the block's activation (used by
        folding)."""
        block = cls.__new__(cls)
        fused_tail(body, "Residual")
        device = getattr(body, "device", None)
        block._assemble(body, shortcut, device)
        return block

    def _body_layers(self) -> list[Layer]:
        return [self.body]

    def _shortcut(self) -> Layer | None:
        return self.shortcut

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
