"""The forms a convolution, a batch norm, a residual add and an activation take in a Dynamo
FX graph (torch 2.13: modules inlined, their parameters and buffers placeholders), read
into plain values. Each reader returns None for a node that is not its kind, and a
`Refused` naming why for one that is its kind but not something convfuse computes."""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.fx import Node
from torch.multiprocessing.reductions import StorageWeakRef

from ...activations import ELU_ALPHA, LEAKY_RELU_SLOPE


@dataclass(frozen=True)
class Refused:
    """A node of a fusable kind that convfuse cannot take, and why."""

    reason: str


def bind(node: Node, names: tuple[str, ...], defaults: dict[str, Any]) -> dict[str, Any]:
    """The node's arguments by parameter name, defaults filled in."""
    out = dict(defaults)
    out.update(zip(names, node.args))
    out.update(node.kwargs)
    return out


def _target(node: Node) -> Any:
    return node.target if node.op == "call_function" else None


# -- convolutions --------------------------------------------------------------------------

_CONVS = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}  # F.convNd is torch.convNd
_CONV_TRANSPOSES = {torch.conv_transpose1d: 1, torch.conv_transpose2d: 2,
                    torch.conv_transpose3d: 3}
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_T_ARGS = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups",
                "dilation")
_CONV_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1,
                  "output_padding": 0}


@dataclass(frozen=True)
class Conv:
    """A convolution node's operands and geometry, as convfuse's ops take them."""

    node: Node
    transposed: bool
    rank: int
    x: Node
    weight: Node
    bias: Node | None
    stride: list[int]
    padding: list[int]
    extra_right: list[int]  # zeros padding='same' adds on the right only (geometry.same_padding)
    output_padding: list[int]
    dilation: list[int]
    groups: int

    @property
    def kind(self) -> str:
        return f"conv_transpose{self.rank}d" if self.transposed else f"conv{self.rank}d"


def _ints(value: Any, rank: int) -> list[int] | None:
    """A stride/padding/dilation argument as `rank` ints, or None if not constant."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * rank
    if isinstance(value, (tuple, list)) and len(value) in (1, rank) \
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [int(v) for v in value] * (rank if len(value) == 1 else 1)
    return None


def conv(node: Node) -> Conv | Refused | None:
    target = _target(node)
    transposed = target in _CONV_TRANSPOSES
    rank = _CONV_TRANSPOSES.get(target) or _CONVS.get(target)
    if rank is None:
        return None
    a = bind(node, _CONV_T_ARGS if transposed else _CONV_ARGS, _CONV_DEFAULTS)
    x, w, b = a["input"], a["weight"], a["bias"]
    if not isinstance(x, Node) or not isinstance(w, Node) or not (b is None
                                                                  or isinstance(b, Node)):
        return Refused("an operand is not a tensor of the graph")
    groups = a["groups"]
    stride, dilation = _ints(a["stride"], rank), _ints(a["dilation"], rank)
    opad = _ints(a["output_padding"], rank)
    if stride is None or dilation is None or opad is None or not isinstance(groups, int):
        return Refused("stride, dilation or groups is not a constant")
    pad, extra = a["padding"], [0] * rank
    if pad in ("same", "valid"):
        wv = value(w)
        if wv is None:
            return Refused("padding='same' with a weight of unknown shape")
        kernel = [int(k) for k in wv.shape[2:]]
        totals = [d * (k - 1) for k, d in zip(kernel, dilation)] if pad == "same" \
            else [0] * rank
        pad, extra = [t // 2 for t in totals], [t - t // 2 for t in totals]
        extra = [e - p for e, p in zip(extra, pad)]
    else:
        pad = _ints(pad, rank)
        if pad is None:
            return Refused("padding is not a constant")
    return Conv(node, transposed, rank, x, w, b, stride, pad, extra, opad, dilation, groups)


# -- batch norm ----------------------------------------------------------------------------

_BN_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum",
            "eps")


@dataclass(frozen=True)
class BatchNorm:
    node: Node
    x: Node
    running_mean: Node | None
    running_var: Node | None
    weight: Node | None
    bias: Node | None
    training: bool
    momentum: float
    eps: float
    kind: str = "batch_norm"


# Under dynamic=True Dynamo lifts a module's float attributes into graph inputs (read back
# with .item()), so a batch norm's momentum and eps reach the backend as nodes.
_FLOAT_INPUTS = (" (momentum=None, or dynamic=True, under which Dynamo passes module floats"
                 " as graph inputs: torch._dynamo.config.specialize_float = True keeps them"
                 " constants)")


def batch_norm(node: Node) -> BatchNorm | Refused | None:
    if _target(node) is not F.batch_norm:
        return None
    a = bind(node, _BN_ARGS, {"weight": None, "bias": None, "training": False,
                              "momentum": 0.1, "eps": 1e-5})
    tensors = [a[k] for k in ("input", "running_mean", "running_var", "weight", "bias")]
    if not isinstance(a["input"], Node) or not all(t is None or isinstance(t, Node)
                                                   for t in tensors):
        return Refused("an operand is not a tensor of the graph")
    if not isinstance(a["training"], bool):
        return Refused("training is not a constant")
    if not isinstance(a["momentum"], (int, float)):
        # momentum=None: torch.nn computes 1 / float(num_batches_tracked) on the host, which
        # breaks Dynamo's graph before the batch norm (torch runs it), or, with
        # capture_scalar_outputs, fails in Dynamo itself (torch 2.13)
        return Refused("momentum is not a constant" + _FLOAT_INPUTS)
    if not isinstance(a["eps"], (int, float)):
        return Refused("eps is not a constant" + _FLOAT_INPUTS)
    if a["weight"] is None and a["bias"] is not None:  # convfuse's backward pairs them
        return Refused("a bias without a weight")
    if not a["training"] and (a["running_mean"] is None or a["running_var"] is None):
        return Refused("eval without running statistics")
    return BatchNorm(node, a["input"], a["running_mean"], a["running_var"], a["weight"],
                     a["bias"], a["training"], float(a["momentum"]), float(a["eps"]))


# -- residual add --------------------------------------------------------------------------

_ADDS = (operator.add, operator.iadd, torch.add)
_IN_PLACE_ADDS = (operator.iadd,)


def residual_add(node: Node, chain: Node) -> tuple[Node, bool] | Refused | None:
    """(the other operand, whether the add writes into `chain`) for `chain + other` in
    either order, as `+`, `+=`, torch.add, Tensor.add or Tensor.add_."""
    if node.op == "call_method" and node.target in ("add", "add_"):
        a = bind(node, ("self", "other", "alpha"), {"alpha": 1})
        in_place = node.target == "add_"
    elif _target(node) in _ADDS:
        a = bind(node, ("self", "other", "alpha"), {"alpha": 1})
        if "input" in a:  # torch.add(input=..., other=...)
            a["self"] = a.pop("input")
        in_place = _target(node) in _IN_PLACE_ADDS
    else:
        return None
    if a.get("out") is not None or a["alpha"] != 1:
        return Refused("an add with alpha or out=")
    this, other = a["self"], a["other"]
    if this is chain and other is chain:
        return Refused("adds the tensor to itself")
    if other is chain:
        if in_place:
            return Refused("adds into the residual in place")
        this, other = other, this
    if this is not chain or not isinstance(other, Node):
        return Refused("the other operand is not a tensor of the graph")
    return other, in_place


# -- activations ---------------------------------------------------------------------------

Check = Callable[[dict[str, Any]], "str | None"]  # the convfuse name, or None


def _const(name: str) -> Check:
    return lambda a: name


def _hardtanh(a: dict[str, Any]) -> str | None:
    return "relu6" if (a.get("min_val"), a.get("max_val")) == (0.0, 6.0) else None


def _gelu(a: dict[str, Any]) -> str | None:
    return "gelu" if a.get("approximate", "none") == "none" else None


def _leaky(a: dict[str, Any]) -> str | None:
    return "leaky_relu" if a.get("negative_slope") == LEAKY_RELU_SLOPE else None


def _elu(a: dict[str, Any]) -> str | None:
    ok = a.get("alpha") == ELU_ALPHA and a.get("scale", 1) == 1 and a.get("input_scale", 1) == 1
    return "elu" if ok else None


_nn: Any = torch._C._nn
_X = ("input",)
# target -> (parameter names, defaults, check); F.relu6 and F.hardtanh are Python functions
# Dynamo keeps as calls, F.gelu/leaky_relu_/elu_ are torch._C._nn's builtins themselves.
_ACTS: dict[Any, tuple[tuple[str, ...], dict[str, Any], Check]] = {
    torch.relu: (_X, {}, _const("relu")), torch.relu_: (_X, {}, _const("relu")),
    F.relu: (("input", "inplace"), {}, _const("relu")),
    F.relu6: (("input", "inplace"), {}, _const("relu6")),
    F.hardtanh: (("input", "min_val", "max_val", "inplace"),
                 {"min_val": -1.0, "max_val": 1.0}, _hardtanh),
    _nn.hardtanh: (("input", "min_val", "max_val"), {"min_val": -1.0, "max_val": 1.0},
                   _hardtanh),
    _nn.hardtanh_: (("input", "min_val", "max_val"), {"min_val": -1.0, "max_val": 1.0},
                    _hardtanh),
    F.silu: (("input", "inplace"), {}, _const("silu")),
    _nn.silu: (_X, {}, _const("silu")), _nn.silu_: (_X, {}, _const("silu")),
    _nn.gelu: (("input", "approximate"), {}, _gelu),
    torch.sigmoid: (_X, {}, _const("sigmoid")), torch.sigmoid_: (_X, {}, _const("sigmoid")),
    F.sigmoid: (_X, {}, _const("sigmoid")),
    torch.tanh: (_X, {}, _const("tanh")), torch.tanh_: (_X, {}, _const("tanh")),
    F.tanh: (_X, {}, _const("tanh")),
    F.leaky_relu: (("input", "negative_slope", "inplace"), {"negative_slope": 0.01}, _leaky),
    _nn.leaky_relu: (("input", "negative_slope"), {"negative_slope": 0.01}, _leaky),
    _nn.leaky_relu_: (("input", "negative_slope"), {"negative_slope": 0.01}, _leaky),
    F.elu: (("input", "alpha", "inplace"), {"alpha": 1.0}, _elu),
    _nn.elu: (("input", "alpha", "scale", "input_scale"), {"alpha": 1.0}, _elu),
    _nn.elu_: (("input", "alpha", "scale", "input_scale"), {"alpha": 1.0}, _elu),
}
_METHOD_ACTS = {"relu": "relu", "relu_": "relu", "sigmoid": "sigmoid", "sigmoid_": "sigmoid",
                "tanh": "tanh", "tanh_": "tanh"}


def activation(node: Node, chain: Node) -> str | Refused | None:
    """The convfuse activation `node` applies to `chain` (its parameters checked: gelu
    approximate='none', leaky_relu slope 0.01, elu alpha 1, hardtanh exactly (0, 6))."""
    if node.op == "call_method" and node.target in _METHOD_ACTS:
        if node.args[:1] != (chain,) or len(node.args) > 1 or node.kwargs:
            return Refused("an activation method with extra arguments")
        return _METHOD_ACTS[str(node.target)]
    target = _target(node)
    if target not in _ACTS:
        return None
    names, defaults, check = _ACTS[target]
    a = bind(node, names, defaults)
    if a.get("input") is not chain:
        return None
    if a.get("out") is not None:  # the fused op would leave `out` unwritten
        return Refused("an activation with out=")
    name = check(a)
    if name is None:
        shown = ", ".join(f"{k}={v!r}" for k, v in a.items() if k not in ("input", "inplace"))
        return Refused(f"{getattr(target, '__name__', target)}({shown}) is no convfuse "
                       "activation")
    return name


# -- in-place operations -------------------------------------------------------------------

# operator's writing forms, as Dynamo records `t += r`, `t[i] = v`; the rest write nothing
_OPERATOR_WRITES = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul, operator.setitem, operator.delitem})
_NO_RESULT = frozenset({operator.setitem, operator.delitem})  # write, but return None
_DUNDER_WRITES = frozenset(f"__{f.__name__}__" for f in _OPERATOR_WRITES)  # Tensor.__iadd__
# aten's batch_norm, native_batch_norm and instance_norm schemas (torch 2.13) do not mark
# the running statistics they update as written
_STATS = ("running_mean", "running_var")


def _nodes(arg: Any) -> list[Node]:
    """The nodes in an argument: a node, or those in a list or tuple (a `_foreach_` list)."""
    found: list[Node] = []

    def keep(n: Node) -> Node:
        found.append(n)
        return n

    torch.fx.node.map_arg(arg, keep)
    return found


def _in_place_name(name: str) -> bool:
    """torch's spelling of an in-place op: a trailing underscore (`add_`, `_foreach_mul_`),
    or an in-place dunder (`__iadd__`, `__setitem__`)."""
    return (name.endswith("_") and not name.endswith("__")) or name in _DUNDER_WRITES


def _tensor_op_name(node: Node) -> str | None:
    """The name of the torch builtin or Tensor method `node` calls, or None for another
    call (their writes follow torch's naming and aten's schema of that name)."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    if node.op != "call_function":
        return None
    if getattr(target, "__objclass__", None) is torch._C.TensorBase:  # torch.Tensor.add_
        return str(getattr(target, "__name__", ""))
    if inspect.isbuiltin(target) and str(getattr(target, "__module__", "")).startswith("torch"):
        return str(getattr(target, "__name__", ""))
    return None


@cache
def _schemas(target: Any) -> tuple[Any, ...]:
    """The aten schemas a call may run: an OpOverload's, every overload of a packet (which
    one runs depends on the arguments), or aten's operator named `target` (none, empty)."""
    if isinstance(target, torch._ops.OpOverload):
        return (target._schema,)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return tuple(getattr(target, o)._schema for o in target.overloads())
    return tuple(torch._C._jit_get_schemas_for_operator(f"aten::{target}"))


def _by_schema(schemas: tuple[Any, ...], node: Node) -> list[Node]:
    """The nodes `node` passes where any of `schemas` writes (`Tensor(a!)`, `Tensor(a!)[]`)."""
    found: list[Node] = []
    for schema in schemas:
        mine: list[Node] = []
        applies = True
        for i, arg in enumerate(schema.arguments):
            info = arg.alias_info
            if not (info is not None and info.is_write) and arg.name not in _STATS:
                continue
            if not arg.kwarg_only and i < len(node.args):
                given = node.args[i]
            else:  # torch's Python bindings call aten's `self` `input`
                given = node.kwargs.get(arg.name, node.kwargs.get("input")
                                        if arg.name == "self" else None)
            if isinstance(arg.type, torch._C.ListType) and isinstance(given, Node) \
                    and isinstance(value(given), torch.Tensor):
                # an overload for a list (TorchScript's in-place list sort, `sort(Tensor[](a!)
                # self)`) is not the one a single tensor runs
                applies = False
                break
            mine += _nodes(given)
        if applies:
            found += mine
    return found


def _by_signature(target: Any, node: Node) -> list[Node] | None:
    """What a torch.nn.functional (or torch.functional) Python function writes: its input
    with inplace=True, the running statistics (batch_norm, instance_norm), the weight
    embedding renormalises in place under max_norm."""
    try:
        bound = inspect.signature(target).bind_partial(*node.args, **node.kwargs).arguments
    except (TypeError, ValueError):
        return None
    found = [n for k in _STATS for n in _nodes(bound.get(k))]
    if bound.get("inplace") is True:
        found += _nodes(next(iter(bound.values())))
    if bound.get("max_norm") is not None:
        found += _nodes(bound.get("weight"))
    return found


def _holds_tensor(node: Node) -> bool:
    """Whether `node` is (or holds) a tensor; one recording no example value may."""
    v = node.meta.get("example_value", node)
    return v is node or any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(v))


def mutated(node: Node) -> Node | None:
    """The tensor node an in-place operation writes into and returns (its first argument),
    or None."""
    if not node.args or not isinstance(node.args[0], Node) or node.target in _NO_RESULT:
        return None
    target, name = node.target, _tensor_op_name(node)
    if name is not None:
        ok = _in_place_name(name) and name not in ("__setitem__", "__delitem__")
    elif node.op != "call_function":
        ok = False
    elif isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        ok = any(s.arguments and s.returns and _returns_first(s) for s in _schemas(target))
    elif target in _OPERATOR_WRITES:
        ok = True
    else:
        i = _inplace_index(target) if inspect.isfunction(target) else None
        ok = i is not None and (node.kwargs.get("inplace") is True
                                or (len(node.args) > i and node.args[i] is True))
    return node.args[0] if ok else None


def _returns_first(schema: Any) -> bool:
    first, result = schema.arguments[0].alias_info, schema.returns[0].alias_info
    return first is not None and first.is_write and result is not None \
        and result.before_set == first.before_set


@cache
def _inplace_index(target: Any) -> int | None:
    """Where a Python function's `inplace` parameter sits, or None."""
    try:
        params = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("inplace") if "inplace" in params else None


def written(node: Node) -> list[Node] | None:
    """The tensor nodes `node` writes into, by any spelling: an in-place method, builtin or
    aten op (its schema's `(a!)` arguments, every tensor of a `_foreach_*_` list), `t[i] = v`,
    `out=`, inplace=True, a batch norm's running statistics; [] for a node that writes none;
    None for a call convfuse cannot tell (a Python function or module Dynamo did not inline,
    a higher-order op): a caller assumes the worst."""
    if node.op not in ("call_function", "call_method", "call_module") \
            or not any(_holds_tensor(n) for n in node.all_input_nodes):
        return []  # a call given no tensor of the graph writes none of them
    target, name = node.target, _tensor_op_name(node)
    out = _nodes(node.kwargs.get("out"))  # out=(values, indices) matches no schema name
    if name is not None:
        first = _nodes(node.args[0]) if node.args and _in_place_name(name) else []
        return out + first + _by_schema(_schemas(name), node)
    if node.op == "call_module":
        return None
    if target in _OPERATOR_WRITES:
        return _nodes(node.args[0])
    if getattr(target, "__module__", None) == "_operator" or target is getattr:
        return []  # (getattr: `.T`, `.mT`, a view, reads only)
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return out + _by_schema(_schemas(target), node)
    if inspect.isfunction(target) and target.__module__ in ("torch.nn.functional",
                                                            "torch.functional"):
        found = _by_signature(target, node)
        return None if found is None else out + found
    return None


def storage_of(node: Node) -> Any:
    """An id of the memory Dynamo's example (fake) tensor for `node` lives in: views share
    their base's (whatever op made them: `.mT`, moveaxis, tensor_split, ...), other tensors
    have their own; None where the node records no tensor."""
    v = value(node)
    if v is None:
        return None
    try:
        return StorageWeakRef(v.untyped_storage()).cdata
    except Exception:  # a tensor without storage (a subclass): unknown
        return None


def may_alias(a: Node, b: Node) -> bool:
    """Whether writing `a` may change `b`: the same recorded storage; where a node records
    none (Dynamo records one for every tensor node), assumed so."""
    sa, sb = storage_of(a), storage_of(b)
    return sa is None or sb is None or bool(sa == sb)


def changes_grad_mode(node: Node) -> bool:
    """torch.no_grad / enable_grad / set_grad_enabled / inference_mode, as Dynamo records
    them: a call that switches autograd on or off for the nodes after it."""
    if node.op != "call_function":
        return False
    name = getattr(node.target, "__name__", "")
    return name in ("_set_grad_enabled", "_enter_inference_mode", "_exit_inference_mode")


def value(node: Any) -> torch.Tensor | None:
    """The example (fake) tensor Dynamo recorded for a node, or None."""
    v = node.meta.get("example_value") if isinstance(node, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def is_autocast_enter(node: Node) -> bool:
    return _target(node) is not None and getattr(node.target, "__name__", "") == "_enter_autocast"


def is_autocast_exit(node: Node) -> bool:
    return _target(node) is not None and getattr(node.target, "__name__", "") == "_exit_autocast"
