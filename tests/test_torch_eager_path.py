"""The two call paths of convfuse.torch's layers (Note [two call paths] in
convfuse/torch/_eager.py) and their per-signature decisions (Note [per-signature decisions]
in convfuse/torch/_signature.py).

In eager mode a layer's call is one autograd.Function running the custom ops' bodies; the
custom ops are what torch.compile, tracing and fake tensors see. The two paths must agree
bit for bit on the CPU (they run the same bodies): forward, backward, double backward,
autocast, no_grad and the running statistics, with the same errors. Which path ran is read
from the profiler's record of operator calls (the custom ops appear as convfuse::*)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import convfuse.ops as cops  # noqa: E402
import convfuse.ops._checks as checks  # noqa: E402
import convfuse.torch as ct  # noqa: E402
import convfuse.torch._eager as eager  # noqa: E402
from convfuse.ops.reference import conv as ref_conv  # noqa: E402

F64 = torch.float64


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _custom_op_calls(fn):
    """The convfuse custom ops `fn()` dispatched, by name, and its autograd Functions."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("convfuse::")]


# Layer makers: (layer, input shape, residual shape or None).
def _conv(act="relu", residual=True, bias=True, cl=False):
    layer = ct.Conv2d(2, 3, 3, padding=1, stride=(1, 2), bias=bias, activation=act)
    return layer, (2, 2, 5, 6), (2, 3, 5, 3) if residual else None, cl


def _transpose(act="relu", residual=True, bias=True, cl=False):
    layer = ct.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1, bias=bias,
                               activation=act)
    return layer, (2, 2, 3, 4), (2, 3, 6, 8) if residual else None, cl


def _bn(act="relu", residual=True, bias=True, cl=False, momentum=0.1):
    layer = ct.BatchNorm2d(2, momentum=momentum, bias=bias, activation=act)
    return layer, (3, 2, 4, 5), (3, 2, 4, 5) if residual else None, cl


def _tensor(shape, dtype, cl):
    t = torch.randn(*shape, dtype=dtype)
    if cl:
        t = t.contiguous(memory_format=torch.channels_last)
    return t.requires_grad_()


def _run(make, path, *, dtype=F64, double=False, autocast=False, no_grad=False, seed=1):
    """Forward and backward (and a gradient penalty's double backward) of a fresh layer
    on fixed data along `path` ("eager" or "custom_op"): every number that comes out."""
    torch.manual_seed(seed)
    layer, xs, rs, cl = make()
    layer = layer.to(dtype)
    x = _tensor(xs, dtype, cl)
    r = None if rs is None else _tensor(rs, dtype, cl)
    forced = None if path == "eager" else (lambda *a: False)
    mp = pytest.MonkeyPatch()
    if forced is not None:
        mp.setattr(eager, "takes_eager_path", forced)
    try:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.no_grad() \
            if no_grad else torch.enable_grad()
        with ctx:
            y = layer(x, residual=r) if r is not None else layer(x)
        out = [y.detach().clone()]
        if not no_grad:
            inputs = [x, *layer.parameters(), *([] if r is None else [r])]
            grads = torch.autograd.grad((y.double() ** 2).sum(), inputs, create_graph=double)
            out += [g.detach().clone() for g in grads]
            if double:
                penalty = sum((g.double() ** 2).sum() for g in grads)
                out += [g.detach().clone() for g in torch.autograd.grad(penalty, inputs)]
        out += [b.detach().clone() for b in layer.buffers()]
    finally:
        mp.undo()
    return out


def _same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and u.shape == v.shape and u.stride() == v.stride()
        assert torch.equal(u, v), (u, v)


MAKERS = {"conv": _conv, "transpose": _transpose, "bn": _bn}


@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("act,residual,bias,cl", [
    ("relu", True, True, False), ("silu", False, False, True), ("identity", True, True, True),
])
def test_paths_agree_bit_for_bit(kind, act, residual, bias, cl):
    def make():
        return MAKERS[kind](act, residual, bias, cl)

    _same(_run(make, "eager"), _run(make, "custom_op"))
    _same(_run(make, "eager", no_grad=True), _run(make, "custom_op", no_grad=True))


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_paths_agree_in_double_backward_and_autocast(kind):
    def make():
        return MAKERS[kind]("silu", True, True, False)

    _same(_run(make, "eager", double=True), _run(make, "custom_op", double=True))
    if kind != "bn":  # batch norm has no autocast rule (Note [autocast])
        _same(_run(make, "eager", dtype=torch.float32, autocast=True),
              _run(make, "custom_op", dtype=torch.float32, autocast=True))
        assert _run(make, "eager", dtype=torch.float32, autocast=True)[0].dtype \
            == torch.bfloat16


def test_batchnorm_paths_agree_on_the_cumulative_average_and_eval():
    def make():
        return _bn("relu", False, True, False, momentum=None)

    for path in ("eager", "custom_op"):
        torch.manual_seed(3)
        outs = []
        for _ in range(2):
            outs.append(_run(make, path, seed=len(outs)))
        if path == "eager":
            first = outs
        else:
            for a, b in zip(first, outs):
                _same(a, b)
    torch.manual_seed(0)
    layer = ct.BatchNorm2d(2, activation="relu").double().eval()
    layer.running_mean.uniform_()
    x = torch.randn(2, 2, 3, 3, dtype=F64, requires_grad=True)
    y = layer(x)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eager, "takes_eager_path", lambda *a: False)
        y2 = layer(x)
    assert torch.equal(y, y2)
    _same(torch.autograd.grad(y.sum(), [x, layer.weight]),
          torch.autograd.grad(y2.sum(), [x, layer.weight]))


@pytest.mark.parametrize("kind,op", [("conv", "convfuse::conv_bias_act"),
                                     ("transpose", "convfuse::conv_transpose_bias_act"),
                                     ("bn", "convfuse::batchnorm_training")])
def test_eager_calls_no_custom_op_and_compile_calls_one(kind, op):
    layer, xs, _, _ = MAKERS[kind]("relu", False)
    x = torch.randn(*xs, requires_grad=True)
    layer(x).sum().backward()
    assert _custom_op_calls(lambda: layer(x).sum().backward()) == []
    y = layer(x)
    assert type(y.grad_fn).__name__ in ("ConvBiasActBackward", "ConvTransposeBiasActBackward",
                                        "BatchNormFunctionBackward")
    with torch.no_grad():
        assert _custom_op_calls(lambda: layer(x)) == []
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        compiled = torch.compile(layer, backend=backend, fullgraph=True)
        compiled(x).sum().backward()  # compiles
        calls = _custom_op_calls(lambda c=compiled: c(x).sum().backward())
        assert calls.count(op) == 1, calls
        assert any(name.endswith("_backward") for name in calls), calls
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning")
def test_tracers_and_transforms_see_the_custom_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = ct.Conv2d(2, 3, 3, padding=1, activation="relu")
    x = torch.randn(2, 2, 4, 4)
    seen = []

    def spy(fn):
        def wrapper(*args):
            seen.append(eager.takes_eager_path(*args))
            return fn(*args)
        return wrapper

    assert eager.takes_eager_path(x, layer.weight, None)
    # the eager path could not run on fake tensors
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        y = layer(mode.from_tensor(x))
    assert y.shape == (2, 3, 4, 4)
    traced = torch.jit.trace(layer, x)
    assert "convfuse::conv_bias_act" in str(traced.graph)
    torch.func.vmap(spy(lambda t: t * 2))(x)
    torch.func.grad(spy(lambda t: (t * 2).sum()))(x)
    with torch.device("cpu"):  # a torch function mode
        spy(lambda t: t)(x)
    assert seen == [False, False, False]
    class Sub(torch.Tensor):
        pass

    assert not eager.takes_eager_path(x.as_subclass(Sub))
    # functional_call swaps parameters for plain tensors: still eager, same numbers
    params = {k: v.detach().clone().requires_grad_() for k, v in layer.named_parameters()}
    y = torch.func.functional_call(layer, params, (x,))
    assert type(y.grad_fn).__name__ == "ConvBiasActBackward"
    assert torch.equal(y, layer(x))


def test_inplace_change_of_a_saved_tensor_raises_on_the_eager_path():
    layer = ct.Conv2d(2, 3, 3, padding=1, activation="relu")  # relu saves y
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    y = layer(x)
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    xw = torch.randn(1, 2, 4, 4)
    w = layer.weight
    y = layer(xw)
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_batchnorm_running_stats_versions_move_as_the_custom_op_moves_them():
    def bumps(path):
        layer = ct.BatchNorm2d(2)
        v0 = layer.running_mean._version
        with pytest.MonkeyPatch.context() as mp:
            if path == "custom_op":
                mp.setattr(eager, "takes_eager_path", lambda *a: False)
            layer(torch.randn(2, 2, 3, 3, requires_grad=True))
        return layer.running_mean._version - v0

    assert bumps("eager") == bumps("custom_op") > 0


def test_only_the_first_call_of_a_signature_validates():
    from convfuse.torch import _ops, conv

    conv.CALLS.clear()  # a signature no earlier test validated
    _ops._PREPARED.clear()
    layer = ct.Conv2d(2, 3, 3, padding=1, activation="relu")
    x = torch.randn(1, 2, 5, 5, requires_grad=True)
    calls = []
    real = checks.validate
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checks, "validate", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
        engine = []
        mp.setattr(ref_conv, "conv_bias_act",
                   lambda *a, f=ref_conv.conv_bias_act: engine.append(1) or f(*a))
        layer(x).sum().backward()
        first = list(calls)
        layer(x).sum().backward()
        assert calls == first and "conv_bias_act" in first  # none the second time
        assert engine == [1, 1]  # the engine function is still looked up at each call
        # an op replaced on convfuse.ops is called through every time
        spied = []
        mp.setattr(cops, "conv_backward_filter",
                   lambda *a, f=cops.conv_backward_filter: spied.append(1) or f(*a))
        layer(x).sum().backward()
        assert spied == [1]


def test_bad_input_gets_the_same_error_after_a_good_call():
    layer = ct.Conv2d(2, 3, 3, padding=1)
    layer(torch.randn(1, 2, 5, 5))
    for _ in range(2):
        with pytest.raises(ct.InputShapeError, match="Conv2d: input has 3 channels"):
            layer(torch.randn(1, 3, 5, 5))
        with pytest.raises(TypeError, match=r"Conv2d: input dtype torch\.float64"):
            layer(torch.randn(1, 2, 5, 5, dtype=F64))
        with pytest.raises(ValueError, match="Conv2d: residual has shape"):
            layer(torch.randn(1, 2, 5, 5), residual=torch.randn(1, 3, 4, 5))
    bn = ct.BatchNorm2d(2)
    bn(torch.randn(2, 2, 3, 3))
    with pytest.raises(TypeError, match=r"residual is torch\.float64"):
        bn(torch.randn(2, 2, 3, 3), residual=torch.randn(2, 2, 3, 3, dtype=F64))


def test_hyperparameters_reassigned_after_construction_are_honoured():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 7, 7, dtype=F64)
    layer = ct.Conv2d(2, 3, 3, padding=1, dtype=F64)
    layer(x)
    layer.stride = (2, 2)
    fresh = ct.Conv2d(2, 3, 3, padding=1, stride=2, dtype=F64)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(layer(x), fresh(x))
    layer.in_channels = 4  # describes the layer only: torch.nn reads the weight's count
    assert torch.equal(layer(x), fresh(x))
    layer.weight = torch.nn.Parameter(layer.weight.detach()[:, :1])  # and this is read
    with pytest.raises(ct.InputShapeError, match="expects 1"):
        layer(x)
    layer.weight = fresh.weight
    layer.stride = [1, 1]  # unhashable: checked every call, still right
    assert layer(x).shape == (1, 3, 7, 7)
    t = ct.ConvTranspose2d(2, 3, 3, stride=2, dtype=F64)
    xt = torch.randn(1, 2, 3, 3, dtype=F64)
    assert t(xt).shape == (1, 3, 7, 7)
    assert t(xt, output_size=(8, 8)).shape == (1, 3, 8, 8)
    t.output_padding = (1, 1)
    assert t(xt).shape == (1, 3, 8, 8)
    bn = ct.BatchNorm2d(2)
    bn(torch.randn(2, 2, 3, 3))
    bn.eps = 0.0
    with pytest.raises(ValueError, match="eps must be positive"):
        bn(torch.randn(2, 2, 3, 3))


def test_batchnorm_statistics_that_overlap_are_refused_after_a_good_call():
    """Overlap depends on addresses, not on the signature: it is checked every call."""
    bn = ct.BatchNorm2d(2)
    x = torch.randn(2, 2, 3, 3)
    bn(x)
    bn(x)  # the signature's second call: the direct engine call
    bn.running_var = bn.running_mean
    before = bn.running_mean.clone()
    with pytest.raises(ValueError, match="overlaps"):
        bn(x)
    assert torch.equal(bn.running_mean, before)

