"""The rewrite of a Dynamo FX graph: chains of convolution -> [+ residual] -> activation and
batch norm -> [+ residual] -> activation become convfuse's fused ops.

Note [a walk, not declared patterns]
torch.fx's subgraph_rewriter and Inductor's pattern matcher state a pattern as the function
it matches, which reads best (STYLE.md). They cannot say what this rewrite must check:
 - an intermediate with another user (ResNet's stem output, a DenseNet concat input): the
   chain must stop before it, and a declared pattern either refuses the whole match or
   silently drops the other use;
 - in-place forms, whose later readers refer to the mutated tensor, not to the node that
   mutated it (`out.add_(r); relu(out)`) — canonicalised first, below;
 - the fused op runs at the chain's last node, so nothing between its first and last
   node may write the head's inputs (in place, `t[i] = v`, `out=`, through a view or
   its base: forms.written, and forms.may_alias on the recorded storages) or read the
   running statistics the fused op now updates later, nor switch grad mode (a conv under
   no_grad fused into an add after it would give a frozen branch gradients); and the
   chain keeps the head's shape (an add that broadcasts the conv's output, a
   squeeze-excitation context, is torch's);
 - dtypes: under autocast a convolution's output has the autocast dtype and a residual
   add may promote; a chain is fused only where each step keeps the dtype, or where the
   cast is the convolution's own under a known autocast region (the fused op's autocast
   kernel casts the same way, Note [autocast] in _autocast.py);
 - the many spellings (module inlined to F.relu(inplace=True), Tensor.relu_, torch.relu,
   hardtanh(0, 6), `+=` with the residual on either side), each with parameters to check.
A pattern per spelling × optional step would be hundreds of patterns that still need these
checks as filters. So this is one walk over the nodes in order: each convolution and batch
norm starts a chain that grows while its tensor has exactly one user of the next kind.

Conv -> BN: convfuse has no convolution + batch-norm op. The convolution runs alone (with
its bias) and the batch norm starts its own chain, taking the residual and activation.
The fused ops take the graph's own placeholders (parameters and buffers), never copies,
so optimizers and state_dict see the same tensors and the running statistics are updated
in place as torch.nn updates them (a num_batches_tracked increment stays torch's node).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Graph, GraphModule, Node

from .._arrays import SUPPORTED_DTYPES
from .._bn_ops import BatchNormFunction
from .._ops import conv_bias_act  # noqa: F401  (registers torch.ops.convfuse.*)
from .._transpose_ops import conv_transpose_bias_act  # noqa: F401
from . import forms


def batchnorm_act(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                  residual: torch.Tensor | None, running_mean: torch.Tensor | None,
                  running_var: torch.Tensor | None, use_batch_stats: bool, momentum: float,
                  eps: float, activation: str) -> torch.Tensor:
    """act(batchnorm(x) + residual) through convfuse's autograd Function: an FX node cannot
    call `BatchNormFunction.apply` itself (FACTS.md: it fails when the graph runs)."""
    return BatchNormFunction.apply(x, weight, bias, residual, running_mean, running_var,
                                   None, use_batch_stats, momentum, eps, activation)[0]


@dataclass(frozen=True)
class Record:
    """One decision of the rewrite: a chain fused into one convfuse op, or a convolution,
    batch norm or next step of a chain left to the inner backend, and why."""

    fused: bool
    pattern: str  # e.g. "batch_norm+add+relu", "conv2d"
    nodes: tuple[str, ...]  # the FX nodes (replaced when fused)
    reason: str = ""  # why left (or why a fused chain stopped where it did)
    graph: int = 0  # which Dynamo graph (one per graph break)


@dataclass
class _Chain:
    head: forms.Conv | forms.BatchNorm
    nodes: list[Node]
    residual: Node | None = None
    activation: str = "identity"
    stop: str = ""
    steps: list[str] = field(default_factory=list)

    @property
    def tail(self) -> Node:
        return self.nodes[-1]


def fuse(gm: GraphModule, graph_index: int = 0) -> list[Record]:
    """Fuse in place what convfuse computes; return what was fused and what was left."""
    g = gm.graph
    _canonicalize_in_place(g)
    regions = _autocast_regions(g)
    claimed: set[Node] = set()
    # what each node writes, asked once per node: the graph does not change until every
    # chain has grown, and _written_later asks about every later node per candidate
    writes: dict[Node, list[Node] | None] = {}
    chains: list[_Chain] = []
    records: list[Record] = []
    for node in list(g.nodes):
        head = forms.conv(node) or forms.batch_norm(node)
        if head is None:
            continue
        why = head.reason if isinstance(head, forms.Refused) else _refuse_head(head, regions)
        if why:
            records.append(Record(False, _kind(node), (node.name,), why, graph_index))
            continue
        assert not isinstance(head, forms.Refused)
        chain = _grow(head, claimed, regions, writes)
        claimed.update(chain.nodes)
        chains.append(chain)
    done: dict[Node, Node] = {}  # a fused chain's last node -> the node now computing it
    for chain in chains:
        done[chain.tail] = _apply(g, chain, done)
        records.append(Record(True, "+".join([chain.head.kind, *chain.steps]),
                              tuple(n.name for n in chain.nodes), chain.stop, graph_index))
    g.lint()
    gm.recompile()
    return records


def _kind(node: Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _canonicalize_in_place(g: Graph) -> None:
    """After `t.add_(r)` (or `t += r`, `relu_(t)`), readers of `t` read the node that wrote
    it: point them there (the same tensor), so a chain sees the in-place step as its user."""
    for node in list(g.nodes):
        target = forms.mutated(node)
        if target is None or target.op == "placeholder":
            continue
        for user in list(target.users):
            if user is not node and _after(user, node):
                user.replace_input_with(target, node)


def _after(a: Node, b: Node) -> bool:
    n = b.next
    while n.op != "root":
        if n is a:
            return True
        n = n.next
    return False


def _autocast_regions(g: Graph) -> dict[Node, tuple[Any, ...]]:
    """Each node's autocast state: the (device, dtype, enabled) of the innermost region
    (a region's dtype None, `torch.autocast("cuda")`, is the device's autocast dtype)."""
    stack: list[tuple[Any, ...]] = []
    out: dict[Node, tuple[Any, ...]] = {}
    for node in g.nodes:
        if forms.is_autocast_enter(node):
            dev, dtype, enabled = tuple(node.args[:3])
            stack.append((dev, torch.get_autocast_dtype(dev) if dtype is None else dtype,
                          enabled))
        elif forms.is_autocast_exit(node) and stack:
            stack.pop()
        out[node] = stack[-1] if stack else ()
    return out


def _refuse_head(head: forms.Conv | forms.BatchNorm, regions: dict[Node, tuple[Any, ...]],
                 ) -> str:
    """Why convfuse cannot compute this convolution or batch norm ('' if it can)."""
    out, x = forms.value(head.node), forms.value(head.x)
    if out is None or x is None:
        return "no example tensor"
    if out.device.type not in ("cpu", "cuda"):
        return f"device {out.device.type}"
    if out.dtype not in SUPPORTED_DTYPES:
        return f"dtype {out.dtype}"
    if any(isinstance(s, int) and s == 0 for s in x.shape):
        return "an empty input"
    if isinstance(head, forms.BatchNorm):
        if x.dtype != out.dtype:
            return f"changes dtype ({x.dtype} -> {out.dtype})"
        return "" if 2 <= x.dim() <= 5 else f"a {x.dim()}-d input"
    if x.dim() != head.rank + 2:
        return "an unbatched input"
    w = forms.value(head.weight)
    if w is None:
        return "no example weight"
    if x.dtype != out.dtype or w.dtype != out.dtype:
        region = regions.get(head.node, ())
        if not region and torch.is_autocast_enabled(out.device.type):
            # autocast entered outside the compiled function (the usual AMP loop): no region
            # in the graph, but the state dynamo guards on (a change recompiles, and this
            # rewrite runs again under it)
            region = (out.device.type, torch.get_autocast_dtype(out.device.type), True)
        under = len(region) == 3 and region[2] and region[1] == out.dtype \
            and region[0] == out.device.type and out.dtype != torch.float64
        if not under:
            return (f"changes dtype outside an autocast region ({x.dtype} input, {w.dtype} "
                    f"weight -> {out.dtype})")
    return ""


def _sole_user(node: Node) -> tuple[Node | None, str]:
    users = list(node.users)
    if len(users) != 1:
        return None, f"{node.name} has {len(users)} users"
    return users[0], ""


def _written(n: Node, writes: dict[Node, list[Node] | None]) -> list[Node] | None:
    if n not in writes:
        writes[n] = forms.written(n)
    return writes[n]


def _grow(head: forms.Conv | forms.BatchNorm, claimed: set[Node],
          regions: dict[Node, tuple[Any, ...]],
          writes: dict[Node, list[Node] | None]) -> _Chain:
    chain = _Chain(head, [head.node])
    out = forms.value(head.node)
    assert out is not None  # _refuse_head refused a head without one
    dtype = out.dtype
    inputs = {n for n in (head.x, head.weight, head.bias) if n is not None}
    if isinstance(head, forms.BatchNorm):
        inputs |= {n for n in (head.running_mean, head.running_var) if n is not None}
    stats = inputs - {head.x, head.weight, head.bias}

    def step(nxt: Node, extra: Node | None) -> str:
        """Why `nxt` cannot join the chain ('' if it can). The fused op runs at the chain's
        last node and reads the head's inputs there, in the grad mode there: nothing in
        between may write them (by any spelling, through any view) or switch grad mode."""
        if nxt in claimed:
            return f"{nxt.name} belongs to another chain"
        v = forms.value(nxt)
        if v is None or v.dtype != dtype or regions.get(nxt) != regions.get(head.node):
            return f"{nxt.name} changes dtype or autocast region"
        if v.shape != out.shape:  # a residual add that broadcasts the chain's output
            return f"{nxt.name} changes the shape {tuple(out.shape)} to {tuple(v.shape)}"
        if not _same_layout(v, out):
            # torch's add takes its layout from its operands (the first, where they
            # differ); the fused op gives the head's: `x + bn(conv(x))` with a contiguous
            # x and channels_last weights would come back in another memory format
            return f"{nxt.name} changes the memory layout (strides {tuple(out.stride())} " \
                   f"to {tuple(v.stride())})"
        if extra is not None:
            r = forms.value(extra)
            if r is None or r.shape != v.shape or r.dtype != dtype or r.device != v.device:
                return f"the residual {extra.name} differs in shape, dtype or device"
        watched = inputs | ({extra} if extra is not None else set())
        n = head.node.next
        while n is not nxt:
            if forms.changes_grad_mode(n):
                return f"{n.name} switches grad mode in between"
            targets = _written(n, writes)
            if targets is None:
                return f"{n.name} ({_kind(n)}) in between may write an input: unknown what"
            if any(forms.may_alias(t, w) for t in targets for w in watched) \
                    or (stats and _reads(n, stats)):
                return f"{n.name} writes an input or reads the statistics in between"
            n = n.next
        return ""

    cur = head.node
    nxt, why = _sole_user(cur)
    if isinstance(head, forms.Conv) and nxt is not None and forms.batch_norm(nxt) is not None:
        chain.stop = "feeds a batch norm (which takes the residual and activation)"
        return chain
    if nxt in claimed:  # an earlier chain's residual add (ResNet's downsample branch)
        chain.stop = f"the residual of {nxt.name}, fused in another chain"
        return chain
    add = forms.residual_add(nxt, cur) if nxt is not None else None
    if isinstance(add, tuple):
        why = step(nxt, add[0])  # type: ignore[arg-type]
        if not why:
            chain.nodes.append(nxt)  # type: ignore[arg-type]
            chain.residual, cur = add[0], nxt  # type: ignore[assignment]
            chain.steps.append("add")
            nxt, why = _sole_user(cur)
    elif isinstance(add, forms.Refused):
        why = add.reason
    if nxt is not None and not why:
        act = forms.activation(nxt, cur)
        if isinstance(act, str):
            # the residual too: the fused op reads it at the activation, after the add
            why = step(nxt, chain.residual) or _written_later(act, nxt, cur, writes)
            if not why:
                chain.nodes.append(nxt)
                chain.activation = act
                chain.steps.append(act)
        elif isinstance(act, forms.Refused):
            why = act.reason
        elif not chain.steps or chain.steps == ["add"]:
            why = f"{nxt.name} is no activation" if nxt.op != "output" else ""
    chain.stop = why
    return chain


# torch's leaky_relu and hardtanh (relu6) save their input for backward, the fused op its
# output (Note [what backward saves] in activations.py), so writing that output in place
# later (`y = F.leaky_relu(conv(x)); y += skip`), which torch allows, would fail the fused
# op's backward. Their in-place spellings save their output in torch too.
_SAVE_INPUT = ("leaky_relu", "relu6")


def _written_later(act: str, node: Node, cur: Node,
                   writes: dict[Node, list[Node] | None]) -> str:
    """Why activation `node` (applied to `cur`) cannot join the chain for what is done
    with its output after it ('' if it can)."""
    if act not in _SAVE_INPUT or forms.mutated(node) is cur:
        return ""
    n = node.next
    while n.op != "root":
        if n.op == "output":  # the caller, or the graph after a graph break, may write it
            if any(forms.may_alias(o, node) for o in n.all_input_nodes):
                return (f"{node.name} is an output of the graph: torch's {act} saves its "
                        "input, the fused op its output, which may be written in place")
        else:
            targets = _written(n, writes)
            if any(forms.may_alias(t, node) for t in
                   (n.all_input_nodes if targets is None else targets)):
                return (f"{n.name} writes {node.name} in place, which torch's {act} allows "
                        "(it saves its input) and the fused op's backward does not")
        n = n.next
    return ""


def _same_layout(a: Any, b: Any) -> bool:
    """The same memory layout: equal strides wherever a dimension has more than one element
    (a size-one dimension's stride is arbitrary)."""
    return all(n == 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()))


def _reads(n: Node, stats: set[Node]) -> bool:
    """Whether `n` reads the running statistics, through any view (the fused op updates
    them at the chain's last node, not at the batch norm's)."""
    return any(forms.value(i) is not None and any(forms.may_alias(i, s) for s in stats)
               for i in n.all_input_nodes)


def _apply(g: Graph, chain: _Chain, done: dict[Node, Node]) -> Node:
    """Replace the chain by its fused op (inserted at its last node, after every operand);
    operands that were an earlier chain's last node (an input, a weight a convolution
    computed, ...) are read from `done`."""
    head, tail = chain.head, chain.tail

    def new(n: Node | None) -> Node | None:
        return done.get(n, n) if n is not None else None

    residual, weight, bias = new(chain.residual), new(head.weight), new(head.bias)
    with g.inserting_before(tail):
        if isinstance(head, forms.Conv):
            x: Any = new(head.x)
            if any(head.extra_right):  # padding='same' with an odd total: Note [padding
                # convfuse leaves to torch] in conv.py
                x = g.call_function(F.pad, (x, [p for e in reversed(head.extra_right)
                                                for p in (0, e)]))
            if head.transposed:
                op = g.call_function(torch.ops.convfuse.conv_transpose_bias_act.default, (
                    x, weight, bias, residual, head.stride, head.padding,
                    head.output_padding, head.dilation, head.groups, chain.activation))
            else:
                op = g.call_function(torch.ops.convfuse.conv_bias_act.default, (
                    x, weight, bias, residual, head.stride, head.padding,
                    head.dilation, head.groups, chain.activation))
            out = g.call_function(operator.getitem, (op, 0))
        else:
            out = g.call_function(batchnorm_act, (
                new(head.x), weight, bias, residual, new(head.running_mean),
                new(head.running_var), head.training, head.momentum, head.eps, chain.activation))
    out.meta.update(tail.meta)
    tail.replace_all_uses_with(out)
    for node in reversed(chain.nodes):
        g.erase_node(node)
    return out
