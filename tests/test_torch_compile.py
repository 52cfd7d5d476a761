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


def _counting_backend(compiles):
    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward
    return backend


def test_eager_calls_elsewhere_do_not_recompile_a_compiled_model():
    """convfuse's call caches (the layers' signature caches, the classes whose state is read
    from nn.Module's dicts) fill with eager calls; a compiled model must not guard on them,
    or every new eager signature anywhere (validation, a last smaller batch) would
    recompile it, and after dynamo's limit run it eagerly for good."""
    class Conv(ct.Conv2d):  # a class no cache has seen yet
        pass

    torch.manual_seed(0)
    model = torch.nn.Sequential(Conv(3, 4, 3, padding=1), ct.BatchNorm2d(4, activation="relu"))
    compiles = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=_counting_backend(compiles), fullgraph=True)
    x = torch.randn(2, 3, 6, 6)
    compiled(x)
    compiled(x)
    for n in (3, 5):  # eager calls of new signatures, of these classes and others
        model(torch.randn(n, 3, 6, 6))
        ct.BatchNorm1d(7)(torch.randn(n, 7))
        ct.Conv1d(2, 2, 3)(torch.randn(n, 2, 8))
    y = compiled(x)
    assert len(compiles) == 1
    torch.testing.assert_close(y, model(x))


def test_a_dynamic_batch_compiles_once():
    """torch._dynamo.mark_dynamic on the batch: the fake implementations keep the size
    symbolic (they used to pin it with int(), which dynamo refuses for a marked dim)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(ct.Conv2d(3, 4, 3, padding=1, activation="relu"),
                                ct.BatchNorm2d(4),
                                ct.Conv2d(4, 4, 3, padding=1).to(memory_format=torch.channels_last))
    compiles = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    counted = torch.compile(model, backend=_counting_backend(compiles), fullgraph=True)
    for n in (4, 6, 9):
        x = torch.randn(n, 3, 6, 6, requires_grad=True)
        torch._dynamo.mark_dynamic(x, 0)
        y = compiled(x)
        y.square().sum().backward()
        g = x.grad.clone()
        x.grad = None
        model(x).square().sum().backward()
        torch.testing.assert_close(y, model(x))
        torch.testing.assert_close(g, x.grad)
        counted(x)
    assert len(compiles) == 1


def test_compiling_a_converted_conv_warns_nothing_torch_nn_does_not():
    """The general path's padding split is lru-cached for eager host time; under dynamo the
    plain function runs, so a compile does not warn about the cache wrapper."""
    import warnings

    torch.manual_seed(0)
    model = ct.convert(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1)))
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.compile(model, backend="eager")(torch.randn(1, 3, 8, 8))
    assert not [w for w in seen if "lru_cache" in str(w.message)]
