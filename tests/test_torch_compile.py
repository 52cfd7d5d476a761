"""torch.compile(fullgraph=True) over convfuse.torch layers on the CPU: each layer is one
opaque custom op, so there is no graph break, and convfuse's engine runs inside."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import convfuse.ops.reference.conv as ref_conv  # noqa: E402
import convfuse.torch as ct  # noqa: E402


@pytest.mark.slow  # inductor compiles C++ (about 30 s here); still in the default run
def test_compile_fullgraph_matches_eager(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        ct.Conv2d(3, 4, 3, padding=1, activation="silu"),
        ct.Conv2d(4, 4, 3, padding=1, activation="relu").to(memory_format=torch.channels_last),
        torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2),
    )
    calls = {"fwd": 0, "bwd_filter": 0}
    fwd, bwd = ref_conv.conv_bias_act, ref_conv.conv_backward_filter

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(ref_conv, "conv_bias_act", count("fwd", fwd))
    monkeypatch.setattr(ref_conv, "conv_backward_filter", count("bwd_filter", bwd))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(2, 3, 6, 6)
    y = compiled(x)
    y.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert calls == {"fwd": 2, "bwd_filter": 2}  # convfuse ran, as one op per layer
    model.zero_grad()
    y_eager = model(x)
    y_eager.square().sum().backward()
    torch.testing.assert_close(y, y_eager)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)
    # A second call reuses the compiled graph (no recompilation for the same shapes).
    compiled(x)
    assert calls["fwd"] == 6  # 2 compiled + 2 eager + 2 compiled again
