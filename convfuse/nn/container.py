"""Flatten, Sequential and ModuleList."""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..backend import array_module
from ..geometry import is_int, parse_layout
from .module import Layer, forward_keeping_contexts


class Flatten(Layer):
    """torch.nn.Flatten: dims start_dim..end_dim (negative counts from the end) become one,
    by default (N, ...) -> (N, prod(...)); a view of a contiguous input, so it costs nothing
    (a non-contiguous input is copied by the reshape, as NumPy does).

    `layout` is the input's, as the layers before it have it. A channels-last input
    (N, *spatial, C) is flattened in PyTorch's (N, C, *spatial) order, as torch.nn.Flatten
    flattens a channels_last tensor: a Linear after it keeps the weights of the same model
    in NCHW or in PyTorch, so checkpoints move between layouts. That costs one copy of the
    input (and of the gradient); in NCHW, and for (N, C) inputs, there is none."""

    # class defaults: a Flatten pickled before the arguments existed has no such attribute
    start_dim = 1
    end_dim = -1
    layout = "NCHW"

    def __init__(self, start_dim: int = 1, end_dim: int = -1, *, layout: str = "NCHW") -> None:
        for name, value in (("start_dim", start_dim), ("end_dim", end_dim)):
            if not is_int(value):
                raise TypeError(f"Flatten: {name} must be an int, got {type(value).__name__} "
                                f"{value!r}")
        if not isinstance(layout, str):
            raise TypeError(f"Flatten: layout must be a str such as 'NCHW' or 'NHWC', got "
                            f"{type(layout).__name__} {layout!r}")
        try:
            channels_last = parse_layout(layout)
        except ValueError as exc:
            raise ValueError(f"Flatten: {exc}") from None
        self.start_dim, self.end_dim = int(start_dim), int(end_dim)
        if channels_last:  # only then an attribute: the class default holds the usual case
            self.layout = layout.upper()
        self.device: str | None = None  # type: ignore[assignment]
        self._ctx = None

    def _flat_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        ndim = max(len(shape), 1)  # torch.nn: a 0-d tensor flattens as a 1-d one
        start, end = self.start_dim, self.end_dim
        for name, value in (("start_dim", start), ("end_dim", end)):
            if not -ndim <= value < ndim:  # torch.nn's IndexError
                raise IndexError(f"Flatten: {name} {value} is out of range for an input of "
                                 f"shape {shape}")
        start, end = start % ndim, end % ndim
        if start > end:
            raise ValueError(f"Flatten: start_dim {self.start_dim} comes after end_dim "
                             f"{self.end_dim} for an input of shape {shape}")
        if not shape:
            return (1,)
        return (*shape[:start], math.prod(shape[start:end + 1]), *shape[end + 1:])

    def __call__(self, x: Any) -> Any:
        self._check_input(x)
        moved = self.layout != "NCHW" and x.ndim >= 3 and parse_layout(self.layout)
        if moved:  # PyTorch's order: (N, C, *spatial), a view that the reshape copies
            x = array_module(x).moveaxis(x, -1, 1)
        if self.start_dim == 1 and self.end_dim == -1 and x.ndim >= 2 and x.shape[0]:
            y = x.reshape(x.shape[0], -1)  # the usual call (-1 cannot size an empty batch)
        else:
            y = x.reshape(self._flat_shape(tuple(x.shape)))
        self._ctx = (tuple(x.shape), tuple(y.shape), x.dtype, moved)
        return y

    def extra_repr(self) -> str:
        tail = f", layout={self.layout!r}" if self.layout != "NCHW" else ""
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}{tail}"

    forward = __call__

    def backward(self, dy: Any) -> Any:
        """dy reshaped to the input's shape; dy must have exactly the output's shape (a dy
        of the same size but another shape is refused). Keeps the context on refusal."""
        return self._backward_with(dy, self._backward)

    def _backward(self, ctx: Any, dy: Any) -> Any:
        in_shape, out_shape, dtype, moved = ctx
        dy = self._check_dy(dy, out_shape, dtype)
        if not self.needs_input_grad:
            return None
        dx = dy.reshape(in_shape)
        if moved:  # back to the input's channels-last order, C-contiguous as the layers want
            xp = array_module(dx)
            dx = xp.ascontiguousarray(xp.moveaxis(dx, 1, -1))
        return dx


class _LayerList(Layer):
    """Children named "0", "1", ... in order, edited as torch.nn's Sequential and ModuleList
    are (del, insert, extend and pop renumber them). Subclasses say what an edit means for
    their layers' flags (`_edit_state`, `_edited`, `_replacing`)."""

    @property
    def layers(self) -> list[Layer]:
        return list(self.children())

    def __len__(self) -> int:
        return len(self.__dict__.get("_module_names", ()))

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.layers)

    # Every way a layer joins or leaves the list (append, extend, add_module, an attribute,
    # the edits below) drops the forward's context: a backward now would run layers the
    # forward did not, or skip one it ran (a silently wrong dx).
    def add_module(self, name: str, module: Layer | None) -> None:
        super().add_module(name, module)
        Layer._ctx.fset(self, None)  # type: ignore[attr-defined]

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_ctx":  # every forward sets it: the short way, as Layer's
            Layer._ctx.fset(self, value)  # type: ignore[attr-defined]
            return
        # a child replaced by anything (None, a Parameter) leaves the list too
        was_child = name in self.__dict__.get("_module_names", ())
        super().__setattr__(name, value)
        if was_child or isinstance(value, Layer):
            Layer._ctx.fset(self, None)  # type: ignore[attr-defined]

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        Layer._ctx.fset(self, None)  # type: ignore[attr-defined]

    def _edit_state(self) -> Any:
        return None

    def _edited(self, layers: list[Layer], state: Any) -> None:
        """After an edit that renumbered the list to `layers`."""

    def _replacing(self, index: int, layer: Layer) -> None:
        """Before `layer` replaces the layer at `index`."""

    def __setitem__(self, i: int, layer: Layer) -> None:
        """Replace the layer at index `i` in its place (torch.nn's)."""
        self._check_new(layer, "__setitem__")
        names = list(self.__dict__.get("_module_names", ()))
        if not is_int(i):
            raise TypeError(f"{type(self).__name__}: index must be an int, got "
                            f"{type(i).__name__} {i!r}")
        if not -len(names) <= i < len(names):
            raise IndexError(f"{type(self).__name__}: index {i!r} is out of range for "
                             f"{len(names)} layers")
        index = int(i) % len(names)
        self._replacing(index, layer)
        setattr(self, names[index], layer)
        self._take_device(layer)

    def append(self, layer: Layer) -> _LayerList:
        raise NotImplementedError

    def __getitem__(self, i: int | slice) -> Any:
        raise NotImplementedError

    def extend(self, layers: Any) -> _LayerList:
        """Append each of `layers` (torch.nn's); all are checked first."""
        try:
            new = list(layers)
        except TypeError:
            raise TypeError(f"{type(self).__name__}.extend: layers must be an iterable of "
                            f"convfuse layers, got {type(layers).__name__}") from None
        for layer in new:
            self._check_new(layer, "extend")
        for layer in new:
            self.append(layer)
        return self

    def insert(self, index: int, layer: Layer) -> _LayerList:
        """Insert `layer` before position `index` (torch.nn's: -len..len, the layers
        renumbered "0", "1", ...)."""
        self._check_new(layer, "insert")
        n = len(self)
        if not is_int(index):
            raise TypeError(f"{type(self).__name__}.insert: index must be an int, got "
                            f"{type(index).__name__} {index!r}")
        if not -n <= index <= n:
            raise IndexError(f"{type(self).__name__}.insert: index {index} is out of range "
                             f"for {n} layers")
        layers = self.layers
        layers.insert(int(index), layer)  # list.insert reads -len..len as torch does
        self._renumber(layers)
        return self

    def pop(self, i: int | slice) -> Any:
        """Remove and return the layer(s) at `i` (torch.nn's)."""
        out = self[i]
        del self[i]
        return out

    def __delitem__(self, i: int | slice) -> None:
        """Remove the layer(s) at `i`; the others are renumbered "0", "1", ..., as torch.nn
        renumbers them."""
        layers = self.layers
        if isinstance(i, slice):
            del layers[i]
        elif is_int(i):
            if not -len(layers) <= i < len(layers):
                raise IndexError(f"{type(self).__name__}: index {i!r} is out of range for "
                                 f"{len(layers)} layers")
            del layers[int(i)]
        else:
            raise TypeError(f"{type(self).__name__}: index must be an int or a slice, got "
                            f"{type(i).__name__} {i!r}")
        self._renumber(layers)

    def _renumber(self, layers: list[Layer]) -> None:
        """Hold exactly `layers`, named "0", "1", ..."""
        state = self._edit_state()
        for name in list(self.__dict__.get("_module_names", ())):
            delattr(self, name)
        for j, layer in enumerate(layers):
            self.add_module(str(j), layer)
            self._take_device(layer)
        self._edited(layers, state)

    def _check_new(self, layer: Any, fn: str) -> None:
        if not isinstance(layer, Layer):
            raise TypeError(f"{type(self).__name__}.{fn}: {type(layer).__name__} is not a "
                            "convfuse layer")
        device = getattr(layer, "device", None)
        if device and self.device and device != self.device:  # the constructor's rule
            raise ValueError(f"{type(self).__name__}.{fn}: the layer is on {device!r}, the "
                             f"other layers on {self.device!r}")

    def _take_device(self, layer: Layer) -> None:
        device = getattr(layer, "device", None)
        if self.device is None and device:
            self.device = device


class Sequential(_LayerList):
    """Layers applied in order; backward runs them in reverse.

    Children are registered as "0", "1", ... so state_dict keys match torch.nn.Sequential;
    like torch.nn.Sequential, it also takes one mapping of names to layers
    (`Sequential({"conv": c, "bn": b})`), and a slice keeps the layers' names.
    `seq(x, residual=r)` hands `r` to the last layer (which must take `residual=`, like
    Conv2d or BatchNorm2d), so `act(body(x) + r)` costs no extra pass; backward then returns
    `(dx, dresidual)`. `needs_input_grad` flows to the first layer: the others always need
    their input gradient, since it is the previous layer's output gradient.

    Backward is all-or-nothing for everything checkable: before the last layer runs, every
    layer's context, parameter versions and gradient buffers are checked
    (`_check_backward`, recursively), and the last layer checks dy before writing. The
    remaining failure, an engine error after some layers ran (a cuDNN error or
    out-of-memory on the GPU), leaves the gradients undefined: zero them and run the
    forward again.
    """

    def __init__(self, *layers: Layer | Mapping[str, Layer]) -> None:
        if len(layers) == 1 and isinstance(layers[0], Mapping):
            named: list[tuple[Any, Any]] = list(layers[0].items())
        else:
            named = [(str(i), layer) for i, layer in enumerate(layers)]
        for name, layer in named:
            if not isinstance(layer, Layer):
                raise TypeError(f"Sequential: item {name} ({type(layer).__name__}) is not a "
                                "layer (a convfuse.nn.Module)")
            if not isinstance(name, str):
                raise TypeError(f"Sequential: layer names must be str, got "
                                f"{type(name).__name__} {name!r}")
            if (not name or "." in name or name.startswith("_") or name == "device"
                    or hasattr(Sequential, name)):
                raise ValueError(f"Sequential: {name!r} cannot name a layer (empty, holding "
                                 "'.', starting with '_', or an attribute of Sequential)")
        devices: set[str] = {lyr.device for _, lyr in named if getattr(lyr, "device", None)}
        if len(devices) > 1:
            raise ValueError(f"Sequential layers are on different devices: {sorted(devices)}")
        for name, layer in named:
            self.add_module(name, layer)
        for _, layer in named[1:]:  # they pass gradients on (a ResNet defaults to False)
            layer.needs_input_grad = True
        self.device = devices.pop() if devices else None  # type: ignore[assignment]
        self._ctx = None

    # the edits' flags: the first layer takes the Sequential's needs_input_grad (as it was
    # before the edit), the others pass gradients on
    def _edit_state(self) -> Any:
        return self.needs_input_grad

    def _edited(self, layers: list[Layer], state: Any) -> None:
        for j, layer in enumerate(layers):
            layer.needs_input_grad = state if j == 0 else True
        self.__dict__["_needs_input_grad"] = state

    def _replacing(self, index: int, layer: Layer) -> None:
        layer.needs_input_grad = self.needs_input_grad if index == 0 else True

    @property
    def needs_input_grad(self) -> bool:
        # the first layer's, which decides it (a slice or a Sequential built around layers
        # that compute no input gradient says so)
        first = next(self.children(), None)
        if first is not None:
            return first.needs_input_grad
        return self.__dict__.get("_needs_input_grad", True)

    @needs_input_grad.setter
    def needs_input_grad(self, value: bool) -> None:
        self.__dict__["_needs_input_grad"] = bool(value)
        layers = self.layers
        if layers:
            layers[0].needs_input_grad = bool(value)

    def append(self, layer: Layer) -> Sequential:
        self._check_new(layer, "append")
        if not len(self) and "_needs_input_grad" in self.__dict__:  # set while it was empty
            layer.needs_input_grad = self.__dict__["_needs_input_grad"]
        elif len(self):  # it passes gradients on to the layers before it
            layer.needs_input_grad = True
        self.add_module(str(len(self)), layer)
        self._take_device(layer)
        return self

    def __call__(self, x: Any, residual: Any = None) -> Any:
        """The layers in order; `residual=` goes to the last. If a layer raises, every
        layer keeps the context of the last forward that returned (Note [a failed forward
        keeps the contexts])."""
        return forward_keeping_contexts(self, self._forward, x, residual)

    def _forward(self, x: Any, residual: Any) -> Any:
        layers = self.layers
        if residual is not None:  # checked before any layer runs
            if not layers:
                raise ValueError("Sequential: an empty Sequential cannot take a residual")
            if not _takes_residual(type(layers[-1])):
                raise TypeError(
                    f"Sequential: residual= goes to the last layer, but "
                    f"{type(layers[-1]).__name__} takes no residual (end the Sequential with "
                    "a Conv or BatchNorm layer)"
                )
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            x = layer(x, residual=residual) if i == last and residual is not None else layer(x)
        self._ctx = (residual is not None,)
        return x

    forward = __call__

    def _check_backward(self) -> Any:
        ctx = self._peek_ctx()
        layers = self.layers
        for i, layer in enumerate(layers):
            if i and not layer.needs_input_grad:  # set False after it was added
                raise ValueError(
                    f"Sequential: layer {i} ({type(layer).__name__}) has "
                    "needs_input_grad=False, but the layers before it need its input "
                    "gradient; set it True")
            layer._check_backward()
        return ctx

    def _run_units(self) -> list[Layer]:
        return self.layers

    def backward(self, dy: Any) -> Any:
        with runs_once_checked(self):
            (had_residual,) = self._check_backward()
            dres = None
            for i, layer in enumerate(reversed(self.layers)):
                out = layer.backward(dy)
                if i == 0 and had_residual:
                    dy, dres = out
                else:
                    dy = out
        self._ctx = None
        return (dy, dres) if had_residual else dy

    def __getitem__(self, i: int | slice) -> Layer:
        if isinstance(i, slice):  # the layers keep their names, as torch.nn's slice does
            named = list(self.named_children())[i]
            flags = [layer.needs_input_grad for _, layer in named]
            part = Sequential(dict(named))
            for (_, layer), flag in zip(named, flags):  # reading a slice changes nothing
                layer.needs_input_grad = flag
            return part
        return self.layers[i]



class ModuleList(_LayerList):
    """torch.nn.ModuleList: layers held as children "0", "1", ..., so that parameters(),
    state_dict() (keys `name.0.weight`, as torch's), to() and train() see them, where a
    plain Python list would hide them; indexed, iterated and edited as torch's. It has no
    forward: the module holding it runs its layers (and their backward, in reverse)."""

    def __init__(self, modules: Iterable[Layer] | None = None) -> None:
        self.device = None  # type: ignore[assignment]
        self._ctx = None
        if modules is not None:
            self.extend(modules)

    def append(self, layer: Layer) -> ModuleList:
        self._check_new(layer, "append")
        self.add_module(str(len(self)), layer)
        self._take_device(layer)
        return self

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return ModuleList(self.layers[i])
        layers = self.layers
        if not is_int(i):
            raise TypeError(f"ModuleList: index must be an int or a slice, got "
                            f"{type(i).__name__} {i!r}")
        if not -len(layers) <= i < len(layers):
            raise IndexError(f"ModuleList: index {i!r} is out of range for {len(layers)} "
                             "layers")
        return layers[int(i)]

    def __iadd__(self, layers: Iterable[Layer]) -> ModuleList:
        return self.extend(layers)  # type: ignore[return-value]

    def __add__(self, other: Iterable[Layer]) -> ModuleList:
        return ModuleList([*self, *other])


_TAKES_RESIDUAL: dict[type[Layer], bool] = {}


def _takes_residual(cls: type[Layer]) -> bool:
    """Whether `cls.__call__` accepts `residual=` (cached per class: signature is slow)."""
    known = _TAKES_RESIDUAL.get(cls)
    if known is None:
        fn = cls.__call__ if cls.__call__ is not Layer.__call__ else cls.forward
        params = inspect.signature(fn).parameters.values()
        known = any(p.name == "residual" for p in params)
        _TAKES_RESIDUAL[cls] = known
    return known



_WALK = threading.local()  # .active: an enclosing container's backward checked its tree


@contextlib.contextmanager
def runs_once_checked(container: Layer) -> Iterator[None]:
    """The body of a container's backward, after check_run_once over its whole tree; the
    backward of a container inside it (run by the body) does not walk its part again."""
    if getattr(_WALK, "active", False):
        yield
        return
    check_run_once(container)
    _WALK.active = True
    try:
        yield
    finally:
        _WALK.active = False


def check_run_once(container: Layer) -> None:
    """A layer keeps one forward's context, so one instance that ran at two positions
    cannot run backward (its second forward replaced the first's context). Checked before
    any backward writes, through nested containers that run each of their layers once
    (`_run_units`: Sequential, Residual); forward alone (inference) is fine."""
    seen: dict[int, tuple[int, ...]] = {}
    stack: list[tuple[Layer, tuple[int, ...]]] = [(container, ())]
    while stack:
        layer, path = stack.pop()
        below = []
        for i, unit in enumerate(layer._run_units() or ()):
            where = (*path, i)
            first = seen.setdefault(id(unit), where)
            if first is not where:
                raise ValueError(
                    f"{type(container).__name__}: item {_dotted(where)} is the same "
                    f"{type(unit).__name__} object as item {_dotted(first)}; a convfuse "
                    "layer keeps the context of one forward, so backward through a layer "
                    "used twice is refused (use a separate instance for each position)")
            below.append((unit, where))
        stack += reversed(below)


def _dotted(path: tuple[int, ...]) -> str:
    return ".".join(map(str, path))
