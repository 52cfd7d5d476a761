"""convfuse.torch.BatchNorm1d/2d/3d on the CPU: gradients (gradcheck, float64), equivalence
with torch.nn.BatchNorm*d + the activation (outputs, gradients, running statistics over
several steps), state-dict interchange, layouts and dtypes, which convfuse ops ran, and
input errors."""

from __future__ import annotations

import copy
import inspect
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import convfuse.ops.reference.batchnorm as ref_bn  # noqa: E402
import convfuse.torch as ct  # noqa: E402

TORCH_ACT = {"identity": lambda z: z, "relu": F.relu, "silu": F.silu, "tanh": torch.tanh,
             "gelu": F.gelu}
LAYERS = {1: (ct.BatchNorm1d, torch.nn.BatchNorm1d), 2: (ct.BatchNorm2d, torch.nn.BatchNorm2d),
          3: (ct.BatchNorm3d, torch.nn.BatchNorm3d)}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


_TORCH_BN_HAS_BIAS = "bias" in inspect.signature(torch.nn.BatchNorm2d).parameters


def _pair(rank, c, act=None, dtype=torch.float64, **kw):
    """A convfuse BatchNorm and torch.nn's, with the same (non-trivial) parameters."""
    ours = LAYERS[rank][0](c, activation=act, dtype=dtype, **kw)
    bias = kw.pop("bias", True)
    if bias or _TORCH_BN_HAS_BIAS:
        theirs = LAYERS[rank][1](c, dtype=dtype, **kw, **({} if bias else {"bias": False}))
    else:  # torch 2.11's BatchNorm has no `bias` keyword: the same module, bias removed
        theirs = LAYERS[rank][1](c, dtype=dtype, **kw)
        theirs.register_parameter("bias", None)
    if ours.weight is not None:
        with torch.no_grad():
            ours.weight.uniform_(0.5, 1.5)
            if ours.bias is not None:
                ours.bias.uniform_(-0.5, 0.5)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _input(shape, dtype=torch.float64, channels_last=False):
    x = torch.randn(*shape, dtype=dtype) * 2 + 0.5
    if channels_last:
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)  # channels-last strides, any rank
    return x.requires_grad_()


SHAPES = {1: [(4, 3), (3, 3, 5)], 2: [(2, 3, 4, 3)], 3: [(2, 2, 3, 2, 3)]}
GRID = [(rank, shape, cl) for rank, shapes in SHAPES.items() for shape in shapes
        for cl in ((False, True) if len(shape) > 2 else (False,))]


ACTS = [("identity", False), ("relu", True), ("silu", False), ("tanh", True)]
# every activation/residual pair on 2-d, two of them (in turn) on the other shapes
GRAD_GRID = [(*g, *a) for i, g in enumerate(GRID)
             for a in (ACTS if g[0] == 2 else ACTS[i % 2::2])]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("rank,shape,cl,act,residual", GRAD_GRID,
                         ids=[f"{len(s)}d-cl{int(c)}-{a}-res{int(r)}"
                              for _, s, c, a, r in GRAD_GRID])
def test_gradcheck(rank, shape, cl, act, residual, training):
    bn, _ = _pair(rank, shape[1], act)
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    bn.train(training)
    x = _input(shape, channels_last=cl)
    args = [x]
    if residual:
        args.append(_input(shape, channels_last=cl))
    w = bn.weight.detach().clone().requires_grad_()
    b = bn.bias.detach().clone().requires_grad_()

    def f(w, b, *a):
        return torch.func.functional_call(bn, {"weight": w, "bias": b}, a)

    assert torch.autograd.gradcheck(f, (w, b, *args))


@pytest.mark.parametrize("rank,shape,cl", GRID,
                         ids=[f"{len(s)}d-cl{int(c)}" for _, s, c in GRID])
@pytest.mark.parametrize("act", ["identity", "relu", "gelu"])
def test_equivalence_over_steps_with_running_statistics(rank, shape, cl, act):
    ours, theirs = _pair(rank, shape[1], act)
    for step in range(4):
        train = step < 3
        ours.train(train)
        theirs.train(train)
        x = _input(shape, channels_last=cl)
        res = _input(shape, channels_last=cl)
        y = ours(x, res)
        y_ref = TORCH_ACT[act](theirs(x) + res)
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        dy = torch.randn_like(y)
        got = torch.autograd.grad(y, [x, res, ours.weight, ours.bias], dy)
        want = torch.autograd.grad(y_ref, [x, res, theirs.weight, theirs.bias], dy)
        for g, wt in zip(got, want):
            torch.testing.assert_close(g, wt, rtol=1e-10, atol=1e-10)
        for name, buf in theirs.named_buffers():
            torch.testing.assert_close(getattr(ours, name), buf, rtol=1e-13, atol=1e-13,
                                       msg=name)
        # torch.nn's memory format: channels-last in, channels-last out for 4-d and 5-d;
        # contiguous for a transposed (N, L, C) input of BatchNorm1d; never a view
        assert y._base is None and y.stride() == y_ref.stride()
        if cl and len(shape) > 3:
            assert y.movedim(1, -1).is_contiguous()
    assert int(ours.num_batches_tracked) == 3
    assert not torch.allclose(ours.running_var, torch.ones_like(ours.running_var))


@pytest.mark.parametrize("kw", [{"momentum": None}, {"track_running_stats": False},
                                {"affine": False}, {"bias": False}, {"momentum": 0.0},
                                {"eps": 0.3, "momentum": 1.0}],
                         ids=["cma", "no-stats", "no-affine", "no-bias", "m0", "m1"])
def test_pytorch_options_train_and_eval(kw):
    ours, theirs = _pair(2, 3, "relu", **kw)
    for train in (True, True, True, False, True):
        ours.train(train)
        theirs.train(train)
        x = _input((3, 3, 2, 2))
        y, y_ref = ours(x), F.relu(theirs(x))
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        params = [p for p in ours.parameters()]
        ref_params = [p for p in theirs.parameters()]
        dy = torch.randn_like(y)
        got = torch.autograd.grad(y, [x, *params], dy)
        want = torch.autograd.grad(y_ref, [x, *ref_params], dy)
        for g, wt in zip(got, want):
            torch.testing.assert_close(g, wt, rtol=1e-10, atol=1e-10)
        assert set(dict(ours.named_buffers())) == set(dict(theirs.named_buffers()))
        for name, buf in theirs.named_buffers():
            torch.testing.assert_close(getattr(ours, name), buf, rtol=1e-13, atol=1e-13)


def test_state_dict_interchange_and_initialisation():
    ours = ct.BatchNorm2d(5)
    theirs = torch.nn.BatchNorm2d(5)
    sd_ours, sd_theirs = ours.state_dict(), theirs.state_dict()
    assert list(sd_ours) == list(sd_theirs)
    for k in sd_ours:
        assert sd_ours[k].dtype == sd_theirs[k].dtype and sd_ours[k].shape == sd_theirs[k].shape
        torch.testing.assert_close(sd_ours[k], sd_theirs[k])
    assert sd_ours._metadata[""]["version"] == sd_theirs._metadata[""]["version"] == 2
    theirs.train()
    for _ in range(2):
        theirs(torch.randn(4, 5, 3, 3))
    ours.load_state_dict(theirs.state_dict())
    assert int(ours.num_batches_tracked) == 2
    torch.testing.assert_close(ours.running_mean, theirs.running_mean)
    back = torch.nn.BatchNorm2d(5)
    back.load_state_dict(ours.state_dict())
    torch.testing.assert_close(back.running_var, theirs.running_var)
    # a version-1 state dict (no num_batches_tracked) loads as torch.nn's does
    old = theirs.state_dict()
    del old["num_batches_tracked"]
    old._metadata[""]["version"] = 1
    ours.load_state_dict(old)
    assert int(ours.num_batches_tracked) == 2  # kept, as torch.nn keeps it
    assert "activation='relu'" in repr(ct.BatchNorm1d(2, activation="relu"))


def test_only_the_gradients_autograd_asks_for(monkeypatch):
    calls = []
    real = ref_bn.batchnorm_backward

    def spy(*a):
        calls.append({"residual": a[9], "need_dx": a[10]})
        return real(*a)

    monkeypatch.setattr(ref_bn, "batchnorm_backward", spy)
    bn = ct.BatchNorm2d(3, activation="relu")
    x = torch.randn(2, 3, 4, 4)  # the first layer: no dx
    bn(x, torch.randn(2, 3, 4, 4)).sum().backward()
    assert calls == [{"residual": False, "need_dx": False}]
    assert bn.weight.grad is not None and bn.bias.grad is not None
    calls.clear()
    r = torch.randn(2, 3, 4, 4, requires_grad=True)
    bn(x, r).sum().backward()
    assert calls == [{"residual": True, "need_dx": False}] and r.grad is not None
    # identity: the residual's gradient is dy itself, handed out without the op
    calls.clear()
    ident = ct.BatchNorm2d(3).requires_grad_(False)  # frozen: only the residual needs one
    dy = torch.randn(2, 3, 4, 4)
    dres = torch.autograd.grad(ident(x, r), [r], dy)[0]
    assert calls == [] and torch.equal(dres, dy)


def test_channels_last_is_zero_copy_and_runs_convfuse(monkeypatch):
    seen = []
    real = ref_bn.batchnorm_forward_training

    def spy(x, *a):
        seen.append((x.__array_interface__["data"][0], a[4].layout, x.shape))
        return real(x, *a)

    monkeypatch.setattr(ref_bn, "batchnorm_forward_training", spy)
    x = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    y = ct.BatchNorm2d(3)(x)
    assert seen == [(x.data_ptr(), "NHWC", (2, 4, 5, 3))]
    assert y.is_contiguous(memory_format=torch.channels_last)


def test_float16_bfloat16_and_mixed_parameters_on_the_cpu():
    for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float16, 3e-3)):
        for pdtype in (dtype, torch.float32):  # torch.nn's own, and AMP-style float32
            ours = ct.BatchNorm2d(4, activation="relu", dtype=pdtype)
            ref = torch.nn.BatchNorm2d(4, dtype=torch.float64)
            x = torch.randn(3, 4, 5, 5).to(dtype).requires_grad_()
            y = ours(x)
            assert y.dtype == dtype
            x64 = x.detach().double().requires_grad_()
            y64 = F.relu(ref(x64))
            torch.testing.assert_close(y.double(), y64, rtol=tol, atol=tol)
            assert ours.running_mean.dtype == pdtype
            torch.testing.assert_close(ours.running_mean.double(), ref.running_mean,
                                       rtol=tol, atol=tol)
            dy = torch.randn_like(y64)
            y.backward(dy.to(dtype))
            y64.backward(dy)
            assert ours.weight.grad.dtype == pdtype
            torch.testing.assert_close(x.grad.double(), x64.grad, rtol=5 * tol, atol=5 * tol)
            torch.testing.assert_close(ours.weight.grad.double(), ref.weight.grad,
                                       rtol=5 * tol, atol=20 * tol)


def test_errors_name_the_layer_and_leave_no_state_behind():
    bn = ct.BatchNorm2d(3)
    with pytest.raises(ValueError, match=r"BatchNorm2d: expected a 4-d input"):
        bn(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match=r"BatchNorm2d: input has 2 channels"):
        bn(torch.randn(2, 2, 4, 4))
    with pytest.raises(TypeError, match=r"BatchNorm2d: input dtype torch.float64"):
        bn(torch.randn(2, 3, 4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"BatchNorm2d: residual has shape"):
        bn(torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 3))
    with pytest.raises(TypeError, match=r"BatchNorm2d: residual must be"):
        bn(torch.randn(2, 3, 4, 4), np.zeros((2, 3, 4, 4)))
    with pytest.raises(ValueError, match=r"more than 1 value per channel"):
        ct.BatchNorm1d(3)(torch.randn(1, 3))
    with pytest.raises(TypeError, match=r"BatchNorm2d: input must be a torch.Tensor"):
        bn(np.zeros((2, 3, 4, 4)))
    assert int(bn.num_batches_tracked) == 0
    torch.testing.assert_close(bn.running_var, torch.ones(3))
    with pytest.raises(ValueError, match=r"BatchNorm3d: num_features"):
        ct.BatchNorm3d(0)
    with pytest.raises(ValueError, match=r"BatchNorm1d: .*activation"):
        ct.BatchNorm1d(2, activation="swish2")
    with pytest.raises(TypeError, match=r"BatchNorm2d: dtype torch.int32"):
        ct.BatchNorm2d(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"momentum"):
        ct.BatchNorm2d(2, momentum=1.5)
    # one value per channel is fine in evaluation, as in torch.nn
    bn.eval()
    assert bn(torch.randn(1, 3, 1, 1)).shape == (1, 3, 1, 1)


@pytest.mark.parametrize("dtype,cl,act", [(torch.float64, False, "relu"),
                                          (torch.float64, True, "silu"),
                                          (torch.bfloat16, True, "identity")])
def test_opcheck_schema_fake_and_mutation(dtype, cl, act):
    """torch.library.opcheck: the declared schema (running statistics mutated, nothing
    else; no output aliasing an input), the fake implementations against the real ops,
    and AOT dispatch. The bfloat16 case takes the cast-and-copy-back path."""
    x = _input((3, 4, 5, 5), dtype, cl).detach()
    w, b = torch.rand(4, dtype=dtype) + 0.5, torch.randn(4, dtype=dtype)
    rm, rv = torch.zeros(4, dtype=dtype), torch.ones(4, dtype=dtype)
    r = torch.randn_like(x)
    nbt = torch.tensor(1)
    torch.library.opcheck(torch.ops.convfuse.batchnorm_training,
                          (x, w, b, rm, rv, r, nbt, None, 1e-5, act))
    torch.library.opcheck(torch.ops.convfuse.batchnorm_inference,
                          (x, w, b, rm, rv, None, 1e-5, act))
    y, mean, invstd, z = torch.ops.convfuse.batchnorm_training(
        x, w, b, None, None, None, None, 0.1, 1e-5, act)
    saved = {"relu": y, "silu": z, "identity": None}[act]
    torch.library.opcheck(torch.ops.convfuse.batchnorm_backward,
                          (torch.randn_like(x), x, w, b, saved, mean, invstd, True, 1e-5, act,
                           True, act != "identity"))


def test_no_grad_forward_still_updates_statistics_and_backward_twice():
    ours, theirs = _pair(2, 3, "relu")
    with torch.no_grad():
        ours(_input((4, 3, 2, 2)))
    assert int(ours.num_batches_tracked) == 1
    assert not torch.equal(ours.running_mean, theirs.running_mean)
    x = _input((4, 3, 2, 2))
    y = ours(x)
    g1 = torch.autograd.grad(y.sum(), x, retain_graph=True)[0]
    g2 = torch.autograd.grad(y.sum(), x)[0]
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)


def test_double_backward_matches_torch():
    # Once refused (once_differentiable); the full grid is in test_torch_double_backward.py.
    ours, theirs = _pair(2, 3, "relu")
    x = _input((2, 3, 4, 4))
    grads = []
    for layer, fn in ((ours, ours), (theirs, lambda t: F.relu(theirs(t)))):
        g, = torch.autograd.grad(fn(x).square().sum(), x, create_graph=True)
        grads.append(torch.autograd.grad(g.square().sum(), (x, layer.weight)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_strided_running_statistics_are_written_back_in_place():
    ours, theirs = _pair(2, 3)
    store = torch.zeros(6, dtype=torch.float64)
    ours.running_mean = store[::2]  # a strided view: updated through a copy, then written back
    x = _input((4, 3, 2, 2))
    ours(x)
    theirs(x)
    torch.testing.assert_close(store[::2], theirs.running_mean, rtol=1e-14, atol=1e-14)
    assert torch.equal(store[1::2], torch.zeros(3, dtype=torch.float64))


def test_evaluation_without_autograd_asks_no_statistics(monkeypatch):
    """Note [inference without statistics]: an eval call nothing differentiates asks the
    engine for y alone; one autograd records asks for the statistics its backward reads,
    and both give torch.nn's numbers."""
    from convfuse.ops import validated

    asked = []
    real = validated.batchnorm_forward_inference
    monkeypatch.setattr(validated, "batchnorm_forward_inference",
                        lambda *a: asked.append(a[10]) or real(*a))
    ref = torch.nn.BatchNorm2d(3).double().eval()
    with torch.no_grad():
        ref.running_mean.uniform_(-1, 1)
        ref.running_var.uniform_(0.5, 2)
    bn = ct.convert(copy.deepcopy(ref))
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        for _ in range(2):  # checked, then the validated entry
            torch.testing.assert_close(bn(x), ref(x), rtol=0, atol=1e-12)
    assert asked == [False, False]
    y = bn(x)
    y.square().sum().backward()
    gx = x.grad.clone()
    x.grad = None
    ref(x).square().sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-12, atol=1e-12)
    assert asked == [False, False, True]


def test_jit_trace_records_one_update_saves_and_differentiates():
    """torch.jit.trace of a converted model with a batch norm: replaying a training trace
    (taken under no_grad) updates the running statistics once per call, as torch.nn (the
    Python Function's node and the ops inside it were both replayed: twice); an eval-mode
    trace differentiates as torch.nn's and jit.save/load round-trips it (the Function
    could not be saved); a training trace with gradients is refused, naming what to do."""
    import io

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1), torch.nn.BatchNorm2d(3),
                                torch.nn.ReLU()).double()
    ours = ct.convert(copy.deepcopy(plain))
    x0, x = torch.randn(4, 3, 5, 5, dtype=torch.float64), torch.randn(4, 3, 5, 5,
                                                                     dtype=torch.float64)

    def trace(model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer's notes on Python control flow
            return torch.jit.trace(model, (x0,), check_trace=False)
    with pytest.raises(NotImplementedError, match="training mode with gradients"):
        trace(ours)
    with torch.no_grad():
        traced = trace(ours)
        plain(x0)  # the trace ran one real forward
        torch.testing.assert_close(traced(x), plain(x), rtol=1e-12, atol=1e-12)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(ours[1], name), getattr(plain[1], name),
                                   rtol=1e-12, atol=1e-12)
    ours.eval()
    plain.eval()
    frozen = trace(ours)
    buf = io.BytesIO()
    torch.jit.save(frozen, buf)
    buf.seek(0)
    for model in (frozen, torch.jit.load(buf)):
        xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        model(xg).square().sum().backward()
        plain.zero_grad()
        plain(xr).square().sum().backward()
        torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-12, atol=1e-12)
        got = dict(ours.named_parameters()) if model is frozen else \
            dict(model.named_parameters())
        for name, p in plain.named_parameters():
            torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-12, atol=1e-12)
        ours.zero_grad()
