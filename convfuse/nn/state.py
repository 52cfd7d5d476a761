"""state_dict / load_state_dict, keyed and laid out exactly as PyTorch keys the same model.

Keys: own parameters, then own persistent buffers, then each child's under "<child>.",
recursively (torch.nn.Module._save_to_state_dict's order). Values are NumPy copies in
PyTorch's layout: a channels-last conv stores its weight as (K, *kernel, C/groups) but saves
and loads (K, C/groups, *kernel), so PyTorch checkpoints load unchanged.

Loading is all-or-nothing: every key is checked (presence, shape, dtype) and converted
before the first array is written, so a failed load leaves the model as it was. Arrays are
written in place, so an optimizer's flat buffers (convfuse.optim) keep seeing them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .. import dtypes
from ..backend import device_of, is_cupy, to_device
from ..errors import StateDictError

if TYPE_CHECKING:
    from .module import Layer


class IncompatibleKeys(NamedTuple):
    """What `load_state_dict(..., strict=False)` returns, as torch's `_IncompatibleKeys`."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _entries(model: Layer) -> Iterator[tuple[str, Layer, str, Any, bool]]:
    """(key, owning module, attribute, current array, is_parameter) in PyTorch's order: a
    module reachable under two names has its entries under both, as torch.nn's state_dict
    walks its children (named_modules would list it once)."""
    for pre, mod in _walk(model, ""):
        for name, p in mod._own("_param_names"):
            yield pre + name, mod, name, p.data, True
        skip = mod.__dict__.get("_nonpersistent", ())
        for name, b in mod._own("_buffer_names"):
            if name not in skip:
                yield pre + name, mod, name, b, False


def _walk(mod: Layer, pre: str) -> Iterator[tuple[str, Layer]]:
    yield pre, mod
    for name, child in mod.named_children():
        yield from _walk(child, f"{pre}{name}.")


def state_dict(model: Layer) -> OrderedDict[str, np.ndarray]:
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    for key, mod, name, value, _ in _entries(model):
        host = to_device(mod._param_to_state(name, value), "cpu")
        out[key] = np.array(host, copy=True)
    return out


def is_torch_bfloat16(value: Any) -> bool:
    return str(getattr(value, "dtype", "")) == "torch.bfloat16"


def torch_bfloat16_numpy(value: Any) -> np.ndarray:
    """A CPU torch.bfloat16 tensor as a NumPy bfloat16 array, without a copy: NumPy has no
    bfloat16 to take it over DLPack or __array__, so its bytes as int16, read as bfloat16
    (Note [bfloat16 on the CPU] in convfuse/torch/_arrays.py)."""
    import torch

    return value.detach().view(torch.int16).numpy().view(dtypes.bfloat16)


def _as_array(value: Any, key: str) -> Any:
    """NumPy or CuPy view of a user value: arrays, __array__ objects, __dlpack__ objects."""
    if isinstance(value, np.ndarray) or is_cupy(value):
        return value
    if hasattr(value, "__dlpack__") and hasattr(value, "__dlpack_device__"):
        try:
            kind = int(value.__dlpack_device__()[0])
        except Exception:
            kind = 1
        if kind != 1:  # not kDLCPU: a device tensor goes to CuPy without a host copy
            from ..backend import require_gpu

            cp = require_gpu(f"loading {key!r} from a device tensor")
            return cp.from_dlpack(value)  # pragma: gpu
    if is_torch_bfloat16(value):
        return torch_bfloat16_numpy(value)
    if hasattr(value, "__array__") or hasattr(value, "__dlpack__"):
        try:
            return np.asarray(value)
        except Exception:
            try:
                return np.from_dlpack(value)
            except Exception as exc:
                raise StateDictError(
                    f"state_dict[{key!r}]: cannot read a {type(value).__name__} as an array "
                    f"({exc}); convert it to NumPy first"
                ) from None
    raise StateDictError(
        f"state_dict[{key!r}] is a {type(value).__name__}; expected a NumPy or CuPy array, or "
        "an object with __array__ or __dlpack__ (e.g. a torch tensor)"
    )


def _dtype_problem(src: np.dtype, dst: np.dtype) -> str | None:
    """PyTorch's copy_ casts between real numeric types; refuse what would lose meaning."""
    if src.kind in "biuf" or src.name == "bfloat16":
        if dst.kind in "iu" and src.kind == "f":
            return f"a floating array ({src}) cannot load into an integer entry ({dst})"
        if src.kind == "b" and dst.kind != "b":
            return f"a boolean array cannot load into a {dst} entry"
        return None
    return f"dtype {src} is not a real numeric type (the model holds {dst})"


def load_state_dict(model: Layer, sd: Any, strict: bool = True) -> IncompatibleKeys:
    name = type(model).__name__
    if not isinstance(sd, Mapping):
        raise TypeError(f"{name}.load_state_dict expects a mapping of key -> array, "
                        f"got {type(sd).__name__}")
    bad_keys = [k for k in sd if not isinstance(k, str)]
    if bad_keys:
        raise TypeError(f"{name}.load_state_dict: keys must be str, got {bad_keys[:3]!r}")
    entries: dict[str, tuple[Layer, str, Any, bool]] = {}
    names: dict[tuple[int, str], list[str]] = {}  # (module, attribute) -> all its keys
    for key, mod, attr, value, is_param in _entries(model):
        entries.setdefault(key, (mod, attr, value, is_param))
        names.setdefault((id(mod), attr), []).append(key)
    # a checkpoint that names a shared module once (convfuse's before it listed every
    # name, as torch.nn does) still loads: one of its names is enough; and, as torch.nn's
    # BatchNorm loads a state dict without version metadata (any dict of arrays converted
    # from torch's), an absent num_batches_tracked keeps its value
    missing = [k for k, (mod, attr, _, _) in entries.items()
               if not any(n in sd for n in names[(id(mod), attr)])
               and attr != "num_batches_tracked"]
    unexpected = [k for k in sd if k not in entries]
    problems: list[str] = []
    staged: list[tuple[Any, Any, Any]] = []
    for key, (mod, attr, current, is_param) in entries.items():
        if key not in sd:
            continue
        arr = _as_array(sd[key], key)
        want_shape = mod._state_shape(attr, current)
        if tuple(arr.shape) != want_shape:
            problems.append(f"size mismatch for {key}: the checkpoint has shape "
                            f"{tuple(arr.shape)}, the model has {want_shape}")
            continue
        issue = _dtype_problem(np.dtype(arr.dtype), np.dtype(current.dtype))
        if issue:
            problems.append(f"dtype mismatch for {key}: {issue}")
            continue
        if not getattr(getattr(current, "flags", None), "writeable", True):
            # loaded in place (below): found now, not after earlier keys were written
            problems.append(f"{key}: the model's array is read-only (a broadcast or "
                            "memory-mapped array?); assign a writable copy first")
            continue
        local = mod._param_from_state(attr, arr)
        staged.append((current, to_device(local, device_of(current)),
                       getattr(mod, attr) if is_param else None))
    if strict:
        if missing:
            problems.append("missing key(s) in state_dict: " + ", ".join(map(repr, missing)))
        if unexpected:
            problems.append("unexpected key(s) in state_dict: "
                            + ", ".join(map(repr, unexpected)))
    if problems:
        raise StateDictError(f"Error(s) in loading state_dict for {name}:\n  "
                             + "\n  ".join(problems))
    for current, new, param in staged:  # in place: optimizers' flat buffers stay linked
        current[...] = new.astype(current.dtype, copy=False)
        if param is not None:
            param.bump_version()  # a forward saved before the load is now stale
    return IncompatibleKeys(missing, unexpected)
