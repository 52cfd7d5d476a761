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
signature call its engine function directly: convfuse.ops' validation reads only what the
key holds, given what the bridge guarantees about the arrays it hands over: physical()
makes data contiguous (and aligned on CUDA), outputs are fresh tensors (no overlap), and
the caller passes `aligned` for what physical() does not touch. An op replaced on
convfuse.ops (a test's spy) is always called through, so patching either level still
observes every call; engine functions are looked up on their module at each call, as
convfuse.ops does.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from .. import activations, ops

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


def tensor_key(t: torch.Tensor | None) -> Any:
    """What the checks read of a tensor argument (strides included: layout and contiguity
    decisions depend on them)."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device)


class Prepared:
    """One signature's decisions: the layout (channels last or not), the geometry, and the
    convfuse.ops functions that validated it (Note [per-signature decisions])."""

    __slots__ = ("checked", "cl", "direct", "geom")

    def __init__(self, cl: bool, geom: Any, direct: bool = True) -> None:
        self.cl, self.geom = cl, geom
        self.checked: set[str] = set()
        # False where convfuse.ops does more than validate for this geometry (an empty
        # batch of a transposed convolution): always call through it then.
        self.direct = direct and getattr(geom, "batch", 1) != 0


def _act(a: Any) -> str:
    return activations.normalize(a)


# convfuse.ops function -> (engine module kind, engine function, the engine's arguments
# from the op's, with the defaults convfuse.ops fills in): the op minus its validation.
_DIRECT: dict[str, tuple[str, str, Callable[..., tuple[Any, ...]]]] = {
    "conv_bias_act": ("conv", "conv_bias_act",
                      lambda x, w, b, g, activation, residual: (x, w, b, g, _act(activation),
                                                                residual, 1.0)),
    "conv_backward_bias": ("conv", "conv_backward_bias", lambda dz, g, out: (dz, g, out, 0.0)),
    "conv_backward_filter": ("conv", "conv_backward_filter",
                             lambda x, dz, g, out: (x, dz, g, out, 0.0)),
    "conv_backward_data": ("conv", "conv_backward_data",
                           lambda dz, w, g, out: (dz, w, g, out, 0.0)),
    "activation_backward_bias": ("activation", "activation_backward_bias",
                                 lambda dy, s, a, g, db_out: (dy, s, _act(a), g, db_out, 0.0)),
    "activation_backward": ("activation", "activation_backward",
                            lambda dy, s, a: (dy, s, _act(a), None)),
    "conv_transpose_bias_act": ("conv_transpose", "conv_transpose_bias_act",
                                lambda x, w, b, g, activation, residual:
                                (x, w, b, g, _act(activation), residual, 1.0)),
    "conv_transpose_backward_bias": ("conv_transpose", "conv_transpose_activation_backward_bias",
                                     lambda dz, g, out: (dz, None, "identity", g, out, 0.0)),
    "conv_transpose_activation_backward_bias": (
        "conv_transpose", "conv_transpose_activation_backward_bias",
        lambda dy, s, a, g, db_out: (dy, s, _act(a), g, db_out, 0.0)),
    "conv_transpose_backward_filter": ("conv_transpose", "conv_transpose_backward_filter",
                                       lambda x, dz, g, out: (x, dz, g, out, 0.0)),
    "conv_transpose_backward_data": ("conv_transpose", "conv_transpose_backward_data",
                                     lambda dz, w, g, out: (dz, w, g, out, 0.0)),
}
_ORIGINAL = {name: getattr(ops, name) for name in _DIRECT}
_ENGINES: dict[tuple[str, str], ModuleType] = {}


def _engine(device_type: str, kind: str) -> ModuleType:
    mod = _ENGINES.get((device_type, kind))
    if mod is None:  # convfuse.ops._checks.engine's choice: CuPy arrays run cuDNN
        package = "cudnn" if device_type == "cuda" else "reference"
        mod = _ENGINES[device_type, kind] = importlib.import_module(
            f"convfuse.ops.{package}.{kind}")
    return mod


def op(prep: Prepared, device_type: str, name: str, *args: Any, aligned: bool = True) -> Any:
    """convfuse.ops.<name>(*args) (positional, as _DIRECT spells them), validated the first
    time `prep`'s signature calls it and a direct engine call after that."""
    fn = getattr(ops, name)
    if name in prep.checked and aligned and fn is _ORIGINAL[name]:
        kind, engine_name, engine_args = _DIRECT[name]
        return getattr(_engine(device_type, kind), engine_name)(*engine_args(*args))
    out = fn(*args)
    if prep.direct:
        prep.checked.add(name)
    return out
