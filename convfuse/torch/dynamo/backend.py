"""`backend(inner)`: a torch.compile backend that fuses convfuse's chains in the Dynamo graph
and hands the rewritten graph to an inner backend (Inductor by default).

`convfuse` below is the compiler function itself, `(gm, example_inputs) -> callable`: the
`torch_dynamo_backends` entry point names it (pyproject.toml), so
`torch.compile(model, backend="convfuse")` works after `pip install` with no import. It is
not also registered with `register_backend`: Dynamo loads the entry point lazily, and a
second registration of the same name in the module it loads fails ("duplicate name",
FACTS.md, turn 4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule

from .rewrite import Record, fuse

Compiler = Callable[..., Any]  # Dynamo's backend signature: (gm, example_inputs, **kw)


def _inner_compiler(inner: str | Compiler, mode: str | None,
                    options: dict[str, Any] | None) -> Compiler:
    if callable(inner):
        return inner
    if inner == "inductor":
        # torch.compile's own wrapper: it applies `mode` ("reduce-overhead" is CUDA graphs)
        # and `options` exactly as torch.compile(backend="inductor", mode=...) does.
        wrapper: Any = torch._TorchCompileInductorWrapper(mode, options, None)
        return wrapper
    from torch._dynamo.backends.registry import lookup_backend

    fn = lookup_backend(inner)
    kwargs = {k: v for k, v in (("mode", mode), ("options", options)) if v}
    return (lambda gm, example_inputs: fn(gm, example_inputs, **kwargs)) if kwargs else fn


def _check_backend_name(name: str) -> None:
    """A name Dynamo knows, refused at construction rather than at the first compile (which
    would report it from inside torch.compile's first call)."""
    if name == "convfuse":  # the rewrite would hand its graph to itself
        raise ValueError("convfuse.torch.backend: inner must be another backend than "
                         "'convfuse' (e.g. 'inductor', 'aot_eager', 'eager')")
    if name == "inductor":
        return
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.exc import InvalidBackend

    try:
        lookup_backend(name)
    except InvalidBackend:
        raise ValueError(f"convfuse.torch.backend: inner={name!r} is not a torch.compile "
                         "backend; see torch._dynamo.list_backends()") from None


def backend(inner: str | Compiler = "inductor",
            records: list[Record] | None = None) -> Compiler:
    """A torch.compile backend: convfuse's fusions first (rewrite.fuse), then `inner` (a
    backend name — "inductor", "aot_eager", "eager" — or a callable with Dynamo's backend
    signature, which receives the rewritten graph). `records`, when given, collects what
    each compiled graph fused and left (what `explain` reports).

        torch.compile(model, backend=convfuse.torch.backend(inner="aot_eager"))
    """
    if not callable(inner) and not isinstance(inner, str):
        raise TypeError(f"convfuse.torch.backend: inner must be a backend name or a "
                        f"callable, got {type(inner).__name__}")
    if isinstance(inner, str):
        _check_backend_name(inner)
    if records is not None and not isinstance(records, list):  # extended at each compile
        raise TypeError(f"convfuse.torch.backend: records must be a list or None, got "
                        f"{type(records).__name__}")
    count = [0]

    def compile_graph(gm: GraphModule, example_inputs: Sequence[Any], *,
                      mode: str | None = None, options: dict[str, Any] | None = None) -> Any:
        found = fuse(gm, count[0])
        count[0] += 1
        if records is not None:
            records.extend(found)
        return _inner_compiler(inner, mode, options)(gm, example_inputs)

    compile_graph.__name__ = "convfuse"
    return compile_graph


def convfuse(gm: GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
             options: dict[str, Any] | None = None) -> Any:
    """The "convfuse" torch.compile backend (the entry point): backend(inner="inductor")."""
    return _DEFAULT(gm, example_inputs, mode=mode, options=options)


_DEFAULT = backend()
