"""Checks shared by the torch.compile(backend="convfuse") tests: a model compiled with the
convfuse backend against the same model run by torch.nn in float64 on the CPU engine."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from convfuse.torch.dynamo import Record, backend

TORCH_OPS = {torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d,
             torch.conv_transpose2d, torch.conv_transpose3d, F.batch_norm}


def compile_recorded(model, inner="aot_eager", fullgraph=True):
    """(compiled model, records, rewritten graphs)."""
    records: list[Record] = []
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(inner)(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend(capture, records=records),
                             fullgraph=fullgraph)
    return compiled, records, graphs


def torch_ops_left(graphs) -> list[str]:
    return [n.name for g in graphs for n in g.graph.nodes
            if n.op == "call_function" and n.target in TORCH_OPS]


def convfuse_ops(graphs) -> int:
    return sum(1 for g in graphs for n in g.graph.nodes if n.op == "call_function"
               and ("convfuse" in str(n.target) or n.target.__name__ == "batchnorm_act"))


def assert_matches_torch(model, *inputs, steps=1, rtol=1e-7, fullgraph=True, inner="aot_eager"):
    """Run `model` compiled with the convfuse backend and a copy of it by torch.nn, in
    float64: outputs, input and parameter gradients, buffers (running statistics), and
    `steps` SGD steps (parameters compared after each). Returns (records, graphs)."""
    model = model.double()
    for m in model.modules():  # random masks would differ between the two runs
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
    ref = copy.deepcopy(model)
    compiled, records, graphs = compile_recorded(model, inner, fullgraph)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(steps):
        xs = [x.detach().double().requires_grad_() for x in inputs]
        xr = [x.detach().clone().requires_grad_() for x in xs]
        y, yr = compiled(*xs), ref(*xr)
        _close(y, yr, rtol, "output")
        seed = torch.randn_like(yr)
        (y * seed).sum().backward()
        (yr * seed).sum().backward()
        for a, b in zip(xs, xr):
            _close(a.grad, b.grad, rtol, "input gradient")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            _close(p.grad, q.grad, rtol, f"gradient of {name}")
        for (name, b), c in zip(model.named_buffers(), ref.buffers()):
            _close(b, c, rtol, f"buffer {name}")
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            _close(p, q, rtol, f"{name} after the SGD step")
    return records, graphs


def _close(a, b, rtol, what):
    """Relative to the tensor's scale: float64 through differently-ordered sums, and batch
    norms over few values amplify the last bits (convert() shows the same)."""
    assert a is not None and b is not None, what
    assert a.shape == b.shape, what
    a, b = a.detach(), b.detach()
    scale = max(float(b.abs().max()) if b.numel() else 1.0, 1.0)
    err = float((a - b).abs().max()) if b.numel() else 0.0
    assert err <= rtol * scale, f"{what}: max error {err:.3g} at scale {scale:.3g}"
