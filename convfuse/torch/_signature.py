"""Decisions the bridge makes once per call signature, and the engine calls they allow.

Note [per-signature decisions]
Everything a call decides from its tensors' shapes, strides, dtypes and devices and from
the layer's hyperparameters (the argument checks, the output memory format torch would
pick, the geometry, which engine runs) gives the same answer every time the signature
recurs, so it is decided once and looked up after that. A key holds exactly what a
decision reads, hyperparameters included, so reassigning a layer's hyperparameters after
construction makes a new key instead of reusing a stale answer. Nothing is remembered from
a call that failed: bad input misses the cache, takes the checked path and gets the same
typed error before any engine call, every time.

Once a convfuse.ops function has validated a signature (`op`), later calls with that
signature call what the op itself calls after its checks, its convfuse.ops.validated entry
(so the bridge holds no copy of the op's defaults, result wrapping or accumulation):
convfuse.ops' validation reads only what the key holds, given what the bridge guarantees
about the arrays it hands over: physical() makes data contiguous (and aligned on CUDA),
outputs are fresh tensors (no overlap), and the caller passes `aligned` for what physical()
does not touch. An op replaced on convfuse.ops (a test's spy) is always called through, so
patching either level still observes every call; engine functions are looked up on their
module at each call, as convfuse.ops does.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from .. import activations, ops
from ..ops import validated

_MAX_ENTRIES = 4096  # distinct signatures remembered before starting over


class SignatureCache(dict[Any, Any]):
    """A dict of per-signature decisions that forgets everything when it grows too big
    (a program that keeps changing shapes pays the decisions again, never unbounded
    memory)."""

    def remember(self, key: Any, value: Any) -> Any:
        """`value`, stored under `key` unless that is unhashable (see `lookup`)."""
        if key is None:
            return value
        if len(self) >= _MAX_ENTRIES:
            self.clear()
        with contextlib.suppress(TypeError):
            self[key] = value
        return value


def lookup(cache: SignatureCache, key: Any) -> Any:
    """cache[key], or None when absent or when `key` is None or unhashable (a list assigned
    to a hyperparameter after construction: such a call is checked every time)."""
    if key is None:
        return None
    try:
        return cache.get(key)
    except TypeError:
        return None


def keyable(x: Any, residual: Any) -> bool:
    """Whether a layer call's checks may be remembered by signature: plain tensors (the
    checks refuse anything else, every time), outside a trace or compilation (whose sizes
    may be symbolic)."""
    return (type(x) is torch.Tensor
            and (residual is None or type(residual) is torch.Tensor)
            and not torch.compiler.is_compiling()
            and torch._C._get_tracing_state() is None)


def tensor_key(t: torch.Tensor | None) -> Any:
    """What the checks read of a tensor argument (strides included: layout and contiguity
    decisions depend on them)."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device)


class Prepared:
    """One signature's decisions: the layout (channels last or not), the geometry, and the
    convfuse.ops functions that validated it (Note [per-signature decisions])."""

    __slots__ = ("bound", "checked", "cl", "direct", "geom")

    def __init__(self, cl: bool, geom: Any, direct: bool = True) -> None:
        self.cl, self.geom = cl, geom
        self.checked: set[str] = set()
        # (op name, activation) -> its bound call on CUDA, or False where the engine never
        # binds it (Note [bound calls] in convfuse/ops/cudnn/bound.py)
        self.bound: dict[Any, Any] = {}
        # False where convfuse.ops does more than validate for this geometry (an empty
        # batch, which the ops answer without an engine): always call through it then.
        self.direct = direct and getattr(geom, "batch", 1) != 0


def _act(a: Any) -> str:
    return activations.normalize(a)


# convfuse.ops function -> (engine module kind, its convfuse.ops.validated entry called with
# the op's positional arguments as the bridge passes them): the geometry the signature
# decided where the op takes a layout name, and the activation normalized as the op does.
_V = validated
_DIRECT: dict[str, tuple[str, Callable[..., Any]]] = {
    "conv_bias_act": ("conv", lambda e, p, x, w, b, g, a, r:
                      _V.conv_bias_act(e, x, w, b, g, _act(a), r)),
    "conv_backward_bias": ("conv", lambda e, p, dz, g, out:
                           _V.conv_backward_bias(e, dz, g, out)),
    "conv_backward_filter": ("conv", lambda e, p, x, dz, g, out:
                             _V.conv_backward_filter(e, x, dz, g, out)),
    "conv_backward_data": ("conv", lambda e, p, dz, w, g, out:
                           _V.conv_backward_data(e, dz, w, g, out)),
    "activation_backward_bias": ("activation", lambda e, p, dy, s, a, g, db_out:
                                 _V.activation_backward_bias(e, dy, s, _act(a), g, db_out)),
    "activation_backward": ("activation", lambda e, p, dy, s, a:
                            _V.activation_backward(e, dy, s, _act(a))),
    "conv_transpose_bias_act": ("conv_transpose", lambda e, p, x, w, b, g, a, r:
                                _V.conv_transpose_bias_act(e, x, w, b, g, _act(a), r)),
    "conv_transpose_backward_bias": ("conv_transpose", lambda e, p, dz, g, out:
                                     _V.conv_transpose_backward_bias(e, dz, g, out)),
    "conv_transpose_activation_backward_bias": (
        "conv_transpose", lambda e, p, dy, s, a, g, db_out:
        _V.conv_transpose_activation_backward_bias(e, dy, s, _act(a), g, db_out)),
    "conv_transpose_backward_filter": ("conv_transpose", lambda e, p, x, dz, g, out:
                                       _V.conv_transpose_backward_filter(e, x, dz, g, out)),
    "conv_transpose_backward_data": ("conv_transpose", lambda e, p, dz, w, g, out:
                                     _V.conv_transpose_backward_data(e, dz, w, g, out)),
    "batchnorm_forward_training": (
        "batchnorm", lambda e, p, x, w, b, rm, rv, _layout, eps, f, a, r:
        _V.batchnorm_forward_training(e, x, w, b, rm, rv, p.geom, eps, f, _act(a), r)),
    "batchnorm_forward_inference": (
        "batchnorm", lambda e, p, x, w, b, rm, rv, _layout, eps, a, r, stats=True:
        _V.batchnorm_forward_inference(e, x, w, b, rm, rv, p.geom, eps, _act(a), r, stats)),
    "batchnorm_backward": (
        "batchnorm", lambda e, p, dy, x, w, b, saved, _layout, eps, a, res, need_dx, wg, bg,
        beta: _V.batchnorm_backward(e, dy, x, w, b, saved, p.geom, eps, _act(a), res, need_dx,
                                    wg, bg, beta)),
}
_ORIGINAL = {name: getattr(ops, name) for name in _DIRECT}
_ENGINES: dict[tuple[str, str], ModuleType] = {}


def engine(device_type: str, kind: str) -> ModuleType:
    """The engine module of `kind` convfuse.ops runs for arrays of a `device_type` tensor."""
    mod = _ENGINES.get((device_type, kind))
    if mod is None:  # convfuse.ops._checks.engine's choice: CuPy arrays run cuDNN
        package = "cudnn" if device_type == "cuda" else "reference"
        mod = _ENGINES[device_type, kind] = importlib.import_module(
            f"convfuse.ops.{package}.{kind}")
    return mod


def validated_engine(prep: Prepared, device_type: str, name: str) -> ModuleType | None:
    """The engine module convfuse.ops.validated.<name> takes for `prep`'s signature, where
    `op` would call it directly (validated before, not replaced by a spy), else None: the
    caller then goes through `op`."""
    if name in prep.checked and getattr(ops, name) is _ORIGINAL[name]:
        return engine(device_type, _DIRECT[name][0])
    return None


def op(prep: Prepared, device_type: str, name: str, *args: Any, aligned: bool = True) -> Any:
    """convfuse.ops.<name>(*args) (positional, as _DIRECT spells them), validated the first
    time `prep`'s signature calls it and a direct engine call after that."""
    eng = validated_engine(prep, device_type, name) if aligned else None
    if eng is not None:
        return _DIRECT[name][1](eng, prep, *args)
    out = getattr(ops, name)(*args)
    if prep.direct:
        prep.checked.add(name)
    return out
