"""`explain(model, *example_inputs)`: what torch.compile(backend="convfuse") fuses in a
model, and what it leaves and why, as records and as a table."""

from __future__ import annotations

from typing import Any

import torch

from .backend import backend
from .rewrite import Record


class Explanation(list[Record]):
    """The rewrite's records, one per fused chain or left node, in graph order;
    `str()` is a table."""

    @property
    def fused(self) -> list[Record]:
        return [r for r in self if r.fused]

    @property
    def left(self) -> list[Record]:
        return [r for r in self if not r.fused]

    def table(self) -> str:
        rows = [("graph", "fused", "pattern", "nodes", "note")]
        rows += [(str(r.graph), "yes" if r.fused else "no", r.pattern, ", ".join(r.nodes),
                  r.reason) for r in self]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4]
                 for row in rows]
        residual = sum(1 for r in self.fused if "+add" in r.pattern)
        lines.append(f"{len(self.fused)} chains fused ({residual} with a residual add), "
                     f"{len(self.left)} left to the inner backend")
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        return self.table()


def explain(model: torch.nn.Module, *example_inputs: Any, **example_kwargs: Any,
            ) -> Explanation:
    """Compile `model` with the convfuse backend (inner "eager") and run it once on the
    example inputs: the records of every graph Dynamo produced.

    Like torch._dynamo.explain, this resets Dynamo's caches first (compiled code of other
    models is recompiled on its next call), and the model's parameters and buffers are
    restored afterwards: the run's update of batch-norm running statistics is undone."""
    import torch._dynamo

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convfuse.torch.explain: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    torch._dynamo.reset()
    records: list[Record] = []
    saved = [(t, t.detach().clone()) for t in (*model.parameters(), *model.buffers())]
    try:
        compiled = torch.compile(model, backend=backend("eager", records=records))
        # in the caller's grad mode, as a compile of it runs: under no_grad Dynamo records
        # no switch for a `with torch.no_grad()` in the forward, and fuses across it
        compiled(*example_inputs, **example_kwargs)
    finally:
        with torch.no_grad():
            for t, copy in saved:
                t.copy_(copy)
        torch._dynamo.reset()
    return Explanation(records)
