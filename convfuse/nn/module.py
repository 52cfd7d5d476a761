"""What every convfuse layer shares: PyTorch's Module API over NumPy/CuPy arrays.

Registration follows torch.nn.Module: assigning a `Parameter` or a `Layer` to an attribute
registers it, in definition order; `register_buffer` registers an array (running statistics).
Everything stays an ordinary attribute, so the hot path reads `self.weight` at no extra cost.
`state_dict()` and `load_state_dict()` live in convfuse/nn/state.py.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from .. import dtypes
from ..backend import device_of, resolve_device, to_device
from ..errors import (
    BackwardBeforeForwardError,
    ConvfuseError,
    DeviceMismatchError,
    SavedTensorModifiedError,
    renamed,
)
from ..grad_mode import _state as _grad_state
from ..ops._checks import engine_ready, overlaps
from .parameter import Parameter, check_set_to_none

# The methods that return self give back the caller's own class (typing.Self is 3.11+).
_L = TypeVar("_L", bound="Layer")

#: The errors a layer re-raises under its own name (`Conv2d: ...`), same type, same text.
USER_ERRORS = (TypeError, ValueError, ConvfuseError)

_REGISTRIES = ("_param_names", "_module_names", "_buffer_names")


class Layer:
    """Base of convfuse layers (alias `Module`): `__call__`, `backward`, and torch.nn.Module's
    bookkeeping: `named_parameters`, `named_buffers`, `named_children`, `named_modules`,
    `state_dict`/`load_state_dict`, `train`/`eval`, `to`/`cuda`/`cpu`, `zero_grad`.

    Subclasses keep what backward needs in `self._ctx` between the two calls; backward
    consumes it (like PyTorch freeing the graph), so a second backward needs a new forward.

    The backward rule, one for every layer (`_backward_with` implements it):
    - everything that can be checked is checked before the first gradient is written: the
      context exists, no parameter changed since the forward (`Parameter._version`), every
      parameter's `.grad` is an array of the parameter's shape, dtype and device, writable,
      C-contiguous and not sharing memory with the parameter, and `dy` is right;
    - a backward that raises keeps the forward's context and has changed no gradient, so a
      corrected retry gives exactly the gradients a first try would have;
    - the context is consumed only when backward returns.
    What cannot be made atomic: an engine failure after the first write (a cuDNN error or
    out-of-memory mid-backward on the GPU) leaves the gradients undefined; zero them and
    run the forward again.
    Errors name the layer: op errors are re-raised with the same type as `Conv2d: ...`.

    `needs_input_grad` (default True) says whether backward must compute dx. A layer whose
    input is data, like the first layer of a model, sets it False and backward returns None
    for dx: on the GPU that saves a whole cudnnConvolutionBackwardData per step.
    """

    device: str
    training: bool = True
    needs_input_grad: bool = True

    # -- calls: subclasses define forward (a block with children: then a forward that
    # raises part-way leaves their contexts as they were) or __call__, and backward ------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.__dict__.get("_module_names"):
            return self.forward(*args, **kwargs)
        return forward_keeping_contexts(self, self.forward, *args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no forward")

    def backward(self, dy: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no backward")

    # -- registration ------------------------------------------------------------------------
    def _registry(self, which: str) -> list[str]:
        reg = self.__dict__.get(which)
        if reg is None:
            reg = []
            object.__setattr__(self, which, reg)
        return reg

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_ctx":  # every forward sets it: the short way to the property
            Layer._ctx.fset(self, value)  # type: ignore[attr-defined]
            return
        if name in ("needs_input_grad", "training") and not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{type(self).__name__}: {name} must be a bool, got "
                            f"{type(value).__name__} {value!r}")
        if name in self.__dict__.get("_buffer_names", ()):
            if value is not None:
                _check_array(value, f"{type(self).__name__}: buffer {name!r}")
        elif isinstance(value, Parameter):
            self._register("_param_names", name)
        elif isinstance(value, Layer):
            self._register("_module_names", name)
        elif name in self.__dict__.get("_param_names", ()) and value is not None:
            raise TypeError(
                f"{type(self).__name__}: cannot assign {type(value).__name__} as parameter "
                f"{name!r} (convfuse.nn.Parameter or None expected)"
            )
        elif name in self.__dict__.get("_module_names", ()) and value is not None:
            raise TypeError(
                f"{type(self).__name__}: cannot assign {type(value).__name__} as child "
                f"module {name!r} (a convfuse layer or None expected)"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        self._unregister(name)
        object.__delattr__(self, name)

    def _register(self, which: str, name: str) -> None:
        """`name` in registry `which`: where it stands if it is there already (replacing a
        child or parameter keeps its place, as torch.nn's dicts do: a Sequential's order is
        its forward's), else last, out of any other registry."""
        if name not in self.__dict__.get(which, ()):
            self._unregister(name)
            self._registry(which).append(name)

    def _unregister(self, name: str) -> None:
        for which in _REGISTRIES:
            reg = self.__dict__.get(which)
            if reg is not None and name in reg:
                reg.remove(name)

    def register_buffer(self, name: str, value: Any, persistent: bool = True) -> None:
        """Register an array (or None) that is state but not a parameter: moved by `to()`,
        saved by `state_dict()` when persistent. PyTorch's `register_buffer`."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{type(self).__name__}: buffer name must be an identifier, "
                             f"got {name!r}")
        self._check_free(name, "_buffer_names", "register_buffer")
        if value is not None:
            _check_array(value, f"{type(self).__name__}: buffer {name!r}")
        self._register("_buffer_names", name)
        nonpersistent = self._registry("_nonpersistent")
        if not persistent and name not in nonpersistent:
            nonpersistent.append(name)
        elif persistent and name in nonpersistent:
            nonpersistent.remove(name)
        object.__setattr__(self, name, value)

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        """Register `param` (a convfuse Parameter, or None) as parameter `name`, as
        torch.nn's register_parameter: a str without '.', not empty, not another
        attribute; checked before anything is registered."""
        self._add_checked("register_parameter", "parameter", name, param, Parameter,
                          "a convfuse Parameter (or None)")

    def get_submodule(self, target: str) -> Layer:
        """The descendant at dotted path `target` ('' is self), as torch.nn's; an
        AttributeError names the first part that is not a child."""
        mod: Layer = self
        if target == "":
            return mod
        for part in target.split("."):
            child = mod.__dict__.get(part) if part in mod.__dict__.get("_module_names", ()) \
                else None
            if child is None:
                raise AttributeError(f"{type(mod).__name__} has no child module {part!r} "
                                     f"(in {target!r})")
            mod = child
        return mod

    def add_module(self, name: str, module: Layer | None) -> None:
        """Register `module` (a convfuse layer, or None) as child `name`, as torch.nn's
        add_module: a str without '.', not empty, not another attribute (a parameter,
        buffer or method); checked before anything is registered."""
        self._add_checked("add_module", "module", name, module, Layer, "a convfuse layer")

    def _add_checked(self, fn: str, kind: str, name: Any, value: Any, cls: type,
                     what: str) -> None:
        """`value` registered as the `kind` `name`, every check (torch.nn's) before."""
        label = f"{type(self).__name__}.{fn}"
        _check_name(label, kind, name)
        if value is not None and not isinstance(value, cls):
            raise TypeError(f"{label}: {name!r} is a {type(value).__name__}, not {what}")
        which = "_param_names" if kind == "parameter" else "_module_names"
        self._check_free(name, which, fn)
        self._register(which, name)
        object.__setattr__(self, name, value)

    def _check_free(self, name: str, which: str, fn: str) -> None:
        """KeyError when `name` is an attribute other than one of registry `which` (torch.nn's
        rule: a buffer or child must not silently take over a parameter or a method)."""
        if name in self.__dict__.get(which, ()):
            return
        if name in self.__dict__ or hasattr(type(self), name):
            raise KeyError(f"{type(self).__name__}.{fn}: attribute {name!r} already exists")

    # -- traversal ---------------------------------------------------------------------------
    def named_children(self) -> Iterator[tuple[str, Layer]]:
        for name in list(self.__dict__.get("_module_names", ())):
            child = self.__dict__.get(name)
            if child is not None:
                yield name, child

    def children(self) -> Iterator[Layer]:
        for _, child in self.named_children():
            yield child

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Layer]]:
        """Self first, then every descendant once, depth first, as PyTorch."""
        seen: set[int] = set()

        def walk(mod: Layer, pre: str) -> Iterator[tuple[str, Layer]]:
            if id(mod) in seen:
                return
            seen.add(id(mod))
            yield pre, mod
            for name, child in mod.named_children():
                yield from walk(child, f"{pre}.{name}" if pre else name)

        yield from walk(self, prefix)

    def modules(self) -> Iterator[Layer]:
        for _, mod in self.named_modules():
            yield mod

    def _own(self, which: str) -> Iterator[tuple[str, Any]]:
        for name in self.__dict__.get(which, ()):
            value = self.__dict__.get(name)
            if value is not None:
                yield name, value

    def named_parameters(self, prefix: str = "", recurse: bool = True
                         ) -> Iterator[tuple[str, Parameter]]:
        """(qualified name, Parameter), own first then children's; shared ones once."""
        seen: set[int] = set()
        mods = self.named_modules(prefix) if recurse else iter([(prefix, self)])
        for pre, mod in mods:
            for name, p in mod._own("_param_names"):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{pre}.{name}" if pre else name), p

    def parameters(self, recurse: bool = True) -> list[Parameter]:
        """A list (not a generator, so it can be passed around twice) of the parameters."""
        return [p for _, p in self.named_parameters(recurse=recurse)]

    def named_buffers(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, Any]]:
        mods = self.named_modules(prefix) if recurse else iter([(prefix, self)])
        for pre, mod in mods:
            for name, b in mod._own("_buffer_names"):
                yield (f"{pre}.{name}" if pre else name), b

    def buffers(self, recurse: bool = True) -> list[Any]:
        return [b for _, b in self.named_buffers(recurse=recurse)]

    def apply(self: _L, fn: Callable[[Layer], None]) -> _L:
        """Call fn on every child (recursively), then on self, as PyTorch; returns self."""
        for child in self.children():
            child.apply(fn)
        fn(self)
        return self

    # -- modes and devices -------------------------------------------------------------------
    def train(self: _L, mode: bool = True) -> _L:
        """Set training mode on self, then call each child's `train(mode)`, as torch.nn: a
        child that overrides train (a block keeping its BatchNorm frozen in eval) is
        obeyed. Returns self."""
        if not isinstance(mode, (bool, np.bool_)):
            raise TypeError(f"{type(self).__name__}.train: mode must be a bool, got {mode!r}")
        self.training = bool(mode)
        for child in self.children():
            child.train(mode)
        return self

    def eval(self: _L) -> _L:
        return self.train(False)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Fill every parameter's gradient with zeros (`set_to_none=True` is refused: a
        convfuse gradient is always an array, README "Every parameter has a gradient")."""
        check_set_to_none(type(self).__name__, set_to_none)
        for p in self.parameters():
            p.zero_grad()

    def to(self: _L, device: str) -> _L:
        """Move parameters (with their gradients) and buffers of self and every descendant to
        'cuda' or 'cpu'; returns self. Build optimizers after moving, as in PyTorch."""
        try:
            target = resolve_device(device)
        except USER_ERRORS as exc:
            raise self._renamed(exc) from None
        modules = list(self.modules())
        if _already_on(modules, target):
            # nothing moves: a pending backward stays, as in torch.nn (the layers that
            # follow their input are pinned, as a move pins them)
            for mod in modules:
                if mod.__dict__.get("device") is None:
                    mod.device = target
            return self
        for mod in modules:
            mod._move_own(target)
        return self

    def _own_arrays(self) -> Iterator[Any]:
        for _, p in self._own("_param_names"):
            yield p.data
            yield p.grad
        for _, b in self._own("_buffer_names"):
            yield b

    def _move_own(self, target: str) -> None:
        for _, p in self._own("_param_names"):
            p.data = to_device(p.data, target)
            p.grad = to_device(p.grad, target)
        for name, b in self._own("_buffer_names"):
            object.__setattr__(self, name, to_device(b, target))
        self.device = target
        self._ctx = None
        # what a layer checked per call signature and geometry holds checks made for the
        # old device (the memory cap, the CPU engine's buffers): made again on the new one
        d = self.__dict__
        for cache in ("_calls", "_geoms"):
            if cache in d:
                d[cache] = {}
        d.pop("_geoms_flags", None)

    def cuda(self: _L) -> _L:
        return self.to("cuda")

    def cpu(self: _L) -> _L:
        return self.to("cpu")

    # -- state_dict hooks: a layer whose storage layout differs from PyTorch's overrides these
    def _param_to_state(self, name: str, value: Any) -> Any:
        """The array `state_dict` stores for own parameter/buffer `name` (PyTorch's layout)."""
        return value

    def _param_from_state(self, name: str, value: np.ndarray | Any) -> Any:
        """Inverse of `_param_to_state`: a state_dict array in this layer's own layout."""
        return value

    def _state_shape(self, name: str, value: Any) -> tuple[int, ...]:
        return tuple(self._param_to_state(name, value).shape)

    def state_dict(self) -> OrderedDict[str, np.ndarray]:
        from .state import state_dict

        return state_dict(self)

    def load_state_dict(self, state_dict: Any, strict: bool = True) -> Any:
        from .state import load_state_dict

        return load_state_dict(self, state_dict, strict)

    # -- the forward's context -----------------------------------------------------------
    @property
    def _ctx(self) -> Any:
        return self.__dict__.get("_ctx_value")

    @_ctx.setter
    def _ctx(self, value: Any) -> None:
        # Recording the parameters' versions with every saved context lets every layer,
        # including ones written later, detect a parameter changed between the two calls.
        d = self.__dict__
        if value is not None:
            if not _grad_state.enabled:  # is_grad_enabled(), inlined
                # convfuse.no_grad(): nothing kept (the backward says why there is none)
                d["_ctx_value"] = None
                d["_ctx_no_grad"] = True
                return
            d["_ctx_versions"] = [(n, p, p._version) for n in d.get("_param_names", ())
                                  if (p := d.get(n)) is not None]
        elif d.get("_ctx_no_grad"):  # consumed or dropped: no longer the no_grad forward's
            d["_ctx_no_grad"] = False
        d["_ctx_value"] = value

    def _peek_ctx(self) -> Any:
        """The forward's context, left in place; raises if there is none or a parameter
        changed since it was saved."""
        ctx = self._ctx
        if ctx is None:
            if self.__dict__.get("_ctx_no_grad"):
                raise BackwardBeforeForwardError(
                    f"{type(self).__name__}.backward(): the last forward ran under "
                    "convfuse.no_grad(), which keeps nothing for a backward; run the "
                    "forward outside it")
            raise BackwardBeforeForwardError(
                f"{type(self).__name__}.backward() called without a preceding forward "
                "(each forward supports one backward)"
            )
        d = self.__dict__
        for name, p, version in d.get("_ctx_versions", ()):
            if p._version != version or d.get(name) is not p:
                raise SavedTensorModifiedError(
                    f"{type(self).__name__}.backward: parameter {p.name or p!r} was modified "
                    f"(version {version} at the forward, {p._version} now) or replaced after "
                    "the forward that saved it (by an optimizer step, load_state_dict or an "
                    "assignment to .data), so the gradients would be wrong; run the forward "
                    "again"
                )
        return ctx

    def _take_ctx(self) -> Any:
        """Peek and consume (for layers that cannot fail after this point)."""
        ctx = self._peek_ctx()
        self._ctx = None
        return ctx

    def _run_units(self) -> list[Layer] | None:
        """The layers a container's forward runs once each (Sequential's, a residual
        block's), for the check that none is run twice (container.check_run_once); None
        for a layer, or a module whose forward may run its children any number of times."""
        return None

    def _check_backward(self) -> Any:
        """Everything checkable before a backward writes: the context and the gradient
        buffers of this layer's own parameters. Returns the context (not consumed).

        A hand-written block that keeps no context of its own (its forward only calls its
        children) is checked through its children instead."""
        if self._ctx is None and self.__dict__.get("_module_names"):
            for child in self.children():
                child._check_backward()
            return None
        ctx = self._peek_ctx()
        for name, p in self._own("_param_names"):
            check_grad(type(self).__name__, name, p)
        return ctx

    def _backward_with(self, dy: Any, body: Callable[[Any, Any], Any]) -> Any:
        """The backward rule (class docstring): checks, then `body(ctx, dy)`, which must
        validate dy completely before its first write; the context is consumed only when
        body returns, and its errors carry the layer's name."""
        ctx = self._check_backward()
        try:
            out = body(ctx, dy)
        except USER_ERRORS as exc:
            raise self._renamed(exc) from None
        self._ctx = None
        return out

    def _renamed(self, exc: BaseException) -> BaseException:
        return renamed(exc, type(self).__name__)

    # -- call helpers ------------------------------------------------------------------------
    def _check_input(self, x: Any, name: str = "input") -> None:
        try:
            where = device_of(x)
        except TypeError:
            kind = type(x).__name__
            raise TypeError(
                f"{type(self).__name__}: {name} must be a NumPy or CuPy array, got {kind}"
            ) from None
        if self.device is not None and where != self.device:
            raise DeviceMismatchError(
                f"{type(self).__name__} is on {self.device!r} but its {name} is on {where!r}; "
                f"move one of them (layer.to({where!r}) or convert the array)"
            )

    def _check_dy(self, dy: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        """dy checked against the forward's output (type, device, shape, dtype) and made
        C-contiguous (one copy when it is not)."""
        self._check_input(dy, "dy")
        if tuple(dy.shape) != tuple(shape) or dy.dtype != dtype:
            raise ValueError(
                f"{type(self).__name__}: dy has shape {tuple(dy.shape)} and dtype {dy.dtype}, "
                f"but the forward's output has shape {tuple(shape)} and dtype {dtype}"
            )
        return contiguous(dy)

    def __repr__(self) -> str:
        extra = self.extra_repr()
        kids = list(self.named_children())
        if not kids:
            return f"{type(self).__name__}({extra})"
        lines = [extra] if extra else []
        for name, child in kids:
            body = repr(child).replace("\n", "\n  ")
            lines.append(f"({name}): {body}")
        inner = "\n  ".join(lines)
        return f"{type(self).__name__}(\n  {inner}\n)"

    def extra_repr(self) -> str:
        return ""


Module = Layer


# Note [a failed forward keeps the contexts]
# A layer's forward sets its context only when it returns, so a layer that raises keeps the
# last good forward's. A container's forward runs its children one by one: if child k
# raises, children 0..k-1 already hold this failed call's contexts, and a backward after it
# (meant for the last good forward) would use their inputs with the good call's dy, wrong
# gradients without an error. So the outermost container call saves every context below
# it first (one walk of the module tree per call, nothing per layer) and puts them back
# if anything below raises. A container called inside it, as a child (covered by that
# snapshot) or as another model a forward calls (not covered: it adds its own subtree),
# puts its own subtree back from the snapshot when it raises (or, called a second time in
# the same outer call, from its own snapshot taken then), so a forward that catches the
# error and goes on (a fallback path) still finds the contexts as they were.
_snapshot = threading.local()


def _subtree(root: Layer) -> Iterator[dict[str, Any]]:
    stack = [root]
    while stack:
        d = stack.pop().__dict__
        yield d
        stack.extend(c for n in d.get("_module_names", ()) if (c := d.get(n)) is not None)


def _restore(root: Layer, saved: dict[int, tuple[Any, Any, Any]]) -> None:
    for d in _subtree(root):
        entry = saved.get(id(d))
        if entry is None:
            continue
        value, versions, no_grad = entry
        d["_ctx_value"] = value
        d["_ctx_no_grad"] = no_grad
        if versions is None:
            d.pop("_ctx_versions", None)
        else:
            d["_ctx_versions"] = versions


def _contexts(root: Layer) -> dict[int, tuple[Any, Any, Any]]:
    return {id(d): (d.get("_ctx_value"), d.get("_ctx_versions"), d.get("_ctx_no_grad"))
            for d in _subtree(root)}


def forward_keeping_contexts(root: Layer, forward: Callable[..., Any], *args: Any,
                             **kwargs: Any) -> Any:
    """forward(*args, **kwargs), leaving every context under `root` as it was if it
    raises (Note [a failed forward keeps the contexts])."""
    saved: dict[int, tuple[Any, Any, Any]] | None = getattr(_snapshot, "saved", None)
    if saved is not None and id(root.__dict__) in saved:  # inside a covering call
        entered: set[int] = _snapshot.entered
        table = saved  # its first call in this one: the snapshot is its state
        if id(root) in entered:  # called again: its last good state is its own to save
            table = _contexts(root)
        entered.add(id(root))
        try:
            return forward(*args, **kwargs)
        except BaseException:
            _restore(root, table)
            raise
    mine = _contexts(root)
    outermost = saved is None
    if saved is None:
        table = _snapshot.saved = mine
        _snapshot.entered = {id(root)}
    else:  # a model called inside another's forward: its own subtree joins the snapshot
        table = saved
        mine = {k: v for k, v in mine.items() if k not in table}
        table.update(mine)
    try:
        return forward(*args, **kwargs)
    except BaseException:
        _restore(root, table)
        raise
    finally:
        if outermost:
            _snapshot.saved = _snapshot.entered = None
        else:
            for k in mine:
                table.pop(k, None)


def check_grad(layer: str, name: str, p: Parameter) -> None:
    """Raise unless `p.grad` can take an accumulated gradient in place (before any write)."""
    g = p.grad
    if g is None:
        raise TypeError(f"{layer}: {name}.grad is None; call zero_grad() (which allocates it) "
                        "before backward")
    try:
        where = device_of(g)
    except TypeError:
        raise TypeError(f"{layer}: {name}.grad must be a NumPy or CuPy array, got "
                        f"{type(g).__name__}") from None
    if where != device_of(p.data):
        raise DeviceMismatchError(f"{layer}: {name}.grad is on {where!r} but {name} is on "
                                  f"{device_of(p.data)!r}")
    if tuple(g.shape) != tuple(p.data.shape) or g.dtype != p.data.dtype:
        raise ValueError(f"{layer}: {name}.grad has shape {tuple(g.shape)} and dtype {g.dtype}, "
                         f"but {name} has shape {tuple(p.data.shape)} and dtype {p.data.dtype}")
    if not g.flags.c_contiguous:
        raise ValueError(f"{layer}: {name}.grad is not C-contiguous (backward accumulates into "
                         "it in place); assign a contiguous array")
    if isinstance(g, np.ndarray) and not g.flags.writeable:
        raise ValueError(f"{layer}: {name}.grad is read-only, but backward accumulates into it")
    if overlaps(g, p.data):
        raise ValueError(f"{layer}: {name}.grad shares memory with {name}.data; the gradient "
                         "would overwrite the weight backward reads")


def contiguous(a: Any) -> Any:
    """`a`, or one C-contiguous copy of it when it is not, or is in device memory at an
    address the ops refuse (ops/_checks.engine_ready; the caller's array is untouched)."""
    return engine_ready(a)


def _already_on(modules: list[Layer], target: str) -> bool:
    """Every layer pinned to `target` or following its input, every array of theirs there,
    and at least one array (a model of parameter-free layers alone says nothing about where
    its last forward ran)."""
    seen = False
    for mod in modules:
        if mod.__dict__.get("device") not in (None, target):
            return False
        for a in mod._own_arrays():
            if a is None:
                continue
            try:
                if device_of(a) != target:
                    return False
            except TypeError:  # not an array (a .grad assigned by hand): moved, converted
                return False
            seen = True
    return seen


def _check_name(fn: str, kind: str, name: Any) -> None:
    """torch.nn's rule for a child's or parameter's name: a str, not empty, without '.'
    ("a.b" would collide with child a's entry b in state_dict keys)."""
    if not isinstance(name, str):
        raise TypeError(f"{fn}: name must be a str, got {type(name).__name__} {name!r}")
    if not name or "." in name:
        raise KeyError(f"{fn}: {kind} name {name!r} can't be empty or contain '.'")


def _check_array(value: Any, what: str) -> None:
    try:
        device_of(value)
    except TypeError:
        raise TypeError(f"{what} must be a NumPy or CuPy array or None, "
                        f"got {type(value).__name__}") from None


def init_parameter(values: Any, dtype: Any, device: str, name: str) -> Parameter:
    """A Parameter from host values drawn in float64, cast once, then moved (seed-stable)."""
    return Parameter(to_device(values.astype(dtypes.canonical(dtype)), device), name)
