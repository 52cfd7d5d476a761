"""torch.compile(fullgraph=True) over Conv + BatchNorm + ReLU on the CPU: the BatchNorm is
one opaque custom op whose running-statistics update (a mutated argument in its schema)
survives functionalization, with no graph break, and convfuse's engine runs inside."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import convfuse.ops.reference.batchnorm as ref_bn  # noqa: E402
import convfuse.torch as ct  # noqa: E402


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        ct.Conv2d(3, 4, 3, padding=1, bias=False),
        ct.BatchNorm2d(4, activation="relu"),
        ct.Conv2d(4, 4, 3, padding=1, bias=False).to(memory_format=torch.channels_last),
        ct.BatchNorm2d(4, momentum=None),
        torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2),
    )


@pytest.mark.slow  # inductor compiles C++ (tens of seconds here); still in the default run
def test_compile_fullgraph_conv_batchnorm_relu_matches_eager(monkeypatch):
    model = _model()
    eager = copy.deepcopy(model)
    calls = {"train": 0, "infer": 0, "bwd": 0}
    real = {"train": ref_bn.batchnorm_forward_training,
            "infer": ref_bn.batchnorm_forward_inference, "bwd": ref_bn.batchnorm_backward}

    def count(name):
        def wrapped(*a, **k):
            calls[name] += 1
            return real[name](*a, **k)
        return wrapped

    monkeypatch.setattr(ref_bn, "batchnorm_forward_training", count("train"))
    monkeypatch.setattr(ref_bn, "batchnorm_forward_inference", count("infer"))
    monkeypatch.setattr(ref_bn, "batchnorm_backward", count("bwd"))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    for _step in range(2):
        x = torch.randn(2, 3, 6, 6)
        y = compiled(x)
        y.square().sum().backward()
        y_eager = eager(x)
        y_eager.square().sum().backward()
        torch.testing.assert_close(y, y_eager)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
        # the running statistics were updated in place, in both, step after step
        for (name, b), c in zip(model.named_buffers(), eager.buffers()):
            torch.testing.assert_close(b, c, msg=name)
    assert int(model[3].num_batches_tracked) == 2
    assert calls == {"train": 8, "infer": 0, "bwd": 8}  # 2 layers x 2 steps x (compiled+eager)
    model.eval()
    eager.eval()
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x))
    assert calls["infer"] == 4
