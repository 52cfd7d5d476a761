"""Double backward through convfuse.torch's Conv and BatchNorm (gradient penalties):
gradgradcheck in float64 over activations, residuals, geometries and batch-norm modes;
torch's second derivatives at the activations' kinks; a WGAN-GP style penalty against
torch.nn; which backward path runs; the conv primitives as a transposed convolution."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
nn = torch.nn

import convfuse.torch as ct  # noqa: E402
import convfuse.torch._double as double  # noqa: E402
from convfuse.activations import ACTIVATIONS  # noqa: E402

TORCH_ACT = {
    "identity": lambda z: z, "relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "elu": F.elu, "relu6": F.relu6, "leaky_relu": lambda z: F.leaky_relu(z, 0.01),
    "silu": F.silu, "gelu": F.gelu,
}
CONV = {1: ct.Conv1d, 2: ct.Conv2d, 3: ct.Conv3d}
BN = {1: ct.BatchNorm1d, 2: ct.BatchNorm2d, 3: ct.BatchNorm3d}
F64 = torch.float64


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _rand(*shape, channels_last=False):
    t = torch.randn(*shape, dtype=F64)
    if channels_last:
        t = t.movedim(1, -1).contiguous().movedim(-1, 1)
    return t.requires_grad_()


def _params(layer):
    return {name: p.detach().clone().requires_grad_() for name, p in layer.named_parameters()}


def _gradgradcheck(layer, x, residual=None, fast=True):
    """gradgradcheck of layer(x, residual) in x, the residual and every parameter."""
    params = _params(layer)
    names = list(params)
    extra = () if residual is None else (residual,)

    def fn(x, *rest):
        ps = dict(zip(names, rest[:len(names)]))
        return torch.func.functional_call(layer, ps, (x, *rest[len(names):]))

    inputs = (x, *params.values(), *extra)
    # gradgradcheck differentiates the recorded backward; that it is the right first
    # derivative is checked here: the same gradients as the fused backward's.
    v = torch.randn(fn(*inputs).shape, dtype=F64)
    recorded = torch.autograd.grad(fn(*inputs), inputs, v, create_graph=True)
    fused = torch.autograd.grad(fn(*inputs), inputs, v)
    for a, b in zip(recorded, fused):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    return torch.autograd.gradgradcheck(fn, inputs, fast_mode=fast)


# --- Conv ------------------------------------------------------------------------------

@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_conv_gradgradcheck_every_activation(act, residual):
    layer = ct.Conv2d(2, 3, 2, padding=1, stride=2, activation=act, dtype=F64)
    r = _rand(1, 3, 3, 3) if residual else None
    assert _gradgradcheck(layer, _rand(1, 2, 4, 4), r)


GEOMETRIES = [
    # rank, cin, cout, k, stride, padding, dilation, groups, bias, channels_last, activation
    (1, 4, 4, 3, 2, 1, 1, 2, True, False, "tanh"),
    (1, 2, 3, 2, 1, 0, 2, 1, False, True, "gelu"),
    (2, 2, 4, 3, 2, 1, 1, 2, True, True, "silu"),
    (2, 2, 2, (2, 1), (1, 2), (1, 0), (2, 1), 1, False, False, "elu"),
    (3, 2, 2, 2, 1, 1, 1, 2, True, False, "sigmoid"),
    (3, 1, 2, 2, (1, 2, 1), (0, 1, 1), 1, 1, True, True, "leaky_relu"),
]


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("geo", GEOMETRIES,
                         ids=lambda g: f"{g[0]}d-g{g[7]}-b{int(g[8])}-cl{int(g[9])}-{g[10]}")
def test_conv_gradgradcheck_geometry_grid(geo, residual):
    rank, cin, cout, k, stride, padding, dilation, groups, bias, cl, act = geo
    layer = CONV[rank](cin, cout, k, stride=stride, padding=padding, dilation=dilation,
                       groups=groups, bias=bias, activation=act, dtype=F64)
    x = _rand(2, cin, *([4] * rank), channels_last=cl)
    r = _rand(*layer.output_shape(x.shape), channels_last=cl) if residual else None
    assert _gradgradcheck(layer, x, r)


@pytest.mark.parametrize("act", ["relu", "silu"])
def test_conv_gradgradcheck_full_jacobian(act):
    # The full (not randomly projected) check, on one small case per kind of saved tensor.
    layer = ct.Conv1d(2, 2, 2, padding=1, activation=act, dtype=F64)
    assert _gradgradcheck(layer, _rand(1, 2, 3), _rand(1, 2, 4), fast=False)


# --- BatchNorm -------------------------------------------------------------------------

def _bn(rank, c, act, mode):
    kw = {"affine": mode != "no_affine", "momentum": None if mode == "momentum_none" else 0.1,
          "track_running_stats": mode not in ("no_stats", "eval_no_stats")}
    layer = BN[rank](c, activation=act, dtype=F64, **kw)
    if layer.affine:
        with torch.no_grad():
            layer.weight.uniform_(0.5, 1.5)
            layer.bias.uniform_(-0.5, 0.5)
    if layer.track_running_stats:
        with torch.no_grad():
            layer.running_mean.uniform_(-0.5, 0.5)
            layer.running_var.uniform_(0.5, 1.5)
    if mode.startswith("eval"):
        layer.eval()
    return layer


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_batchnorm_gradgradcheck_every_activation(act, mode):
    layer = _bn(2, 3, act, mode)
    assert _gradgradcheck(layer, _rand(2, 3, 2, 3), _rand(2, 3, 2, 3))


MODES = ["train", "no_stats", "eval", "eval_no_stats", "no_affine", "momentum_none"]


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_batchnorm_gradgradcheck_modes(rank, mode, residual):
    act = ACTIVATIONS[(rank * 7 + MODES.index(mode) * 3 + residual) % len(ACTIVATIONS)]
    layer = _bn(rank, 2, act, mode)
    shape = (3, 2) if rank == 1 and mode == "train" else (2, 2, *([3] * rank))
    cl = rank == 2 and mode == "train"
    x = _rand(*shape, channels_last=cl)
    assert _gradgradcheck(layer, x, _rand(*shape, channels_last=cl) if residual else None)


def test_batchnorm_affine_without_bias_gradgradcheck():
    layer = ct.BatchNorm2d(2, activation="tanh", dtype=F64, bias=False)
    assert _gradgradcheck(layer, _rand(2, 2, 2, 2))


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_batchnorm_gradgradcheck_full_jacobian(mode):
    layer = _bn(1, 2, "gelu", mode)
    assert _gradgradcheck(layer, _rand(3, 2, 2), _rand(3, 2, 2), fast=False)


# --- torch's values where a second derivative is not defined ---------------------------

@pytest.mark.parametrize(("act", "shift"), [("relu", 0.0), ("relu6", 0.0), ("relu6", 6.0),
                                            ("leaky_relu", 0.0), ("elu", 0.0)])
def test_kinks_take_torchs_values(act, shift):
    """Every pre-activation exactly at a kink (0, or relu6's 6), with nonzero weights: the
    input is all ones and the weights small integers, so conv(x, w) = sum(w) exactly and
    the bias moves it to the kink. First and second derivatives there must be torch's
    (elu'' = 0 at 0, where the left limit is 1), not a one-sided limit."""
    ours = ct.Conv2d(2, 3, 2, activation=act, dtype=F64)
    with torch.no_grad():
        ours.weight.copy_(torch.randint(-2, 3, ours.weight.shape, dtype=F64))
        ours.weight[:, 0, 0, 0] = 1.0  # no all-zero filter
        ours.bias.copy_(shift - ours.weight.sum((1, 2, 3)))
    x = torch.ones(2, 2, 4, 4, dtype=F64, requires_grad=True)
    v = torch.randn(2, 3, 3, 3, dtype=F64)
    results = []
    for fn in (ours, lambda t: TORCH_ACT[act](F.conv2d(t, ours.weight, ours.bias))):
        y = fn(x)
        assert bool((y == TORCH_ACT[act](torch.full_like(y, shift))).all())
        gx, = torch.autograd.grad((y * v).sum(), x, create_graph=True)
        penalty = gx.square().sum() + (gx * x).sum()
        results.append([gx, *torch.autograd.grad(penalty, (x, ours.weight, ours.bias),
                                                 allow_unused=True, materialize_grads=True)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


# --- a gradient penalty against torch.nn -----------------------------------------------

def _models(channels_last):
    ours = torch.nn.Sequential(
        ct.Conv2d(2, 4, 3, padding=1, activation="silu", dtype=F64),
        ct.BatchNorm2d(4, activation="leaky_relu", dtype=F64),
        ct.Conv2d(4, 3, 3, stride=2, activation="gelu", dtype=F64),
        ct.BatchNorm2d(3, activation="tanh", dtype=F64),
    )
    theirs = torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1, dtype=F64), torch.nn.SiLU(),
        torch.nn.BatchNorm2d(4, dtype=F64), torch.nn.LeakyReLU(0.01),
        torch.nn.Conv2d(4, 3, 3, stride=2, dtype=F64), torch.nn.GELU(),
        torch.nn.BatchNorm2d(3, dtype=F64), torch.nn.Tanh(),
    )
    with torch.no_grad():
        for m in ours:
            if isinstance(m, ct.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    for o, t in zip(ours, theirs[::2]):
        t.load_state_dict(o.state_dict())
    if channels_last:
        ours.to(memory_format=torch.channels_last)
        theirs.to(memory_format=torch.channels_last)
    return ours, theirs


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_wgan_gp_penalty_matches_torch(train, channels_last):
    ours, theirs = _models(channels_last)
    ours.train(train)
    theirs.train(train)
    x = _rand(3, 2, 6, 6, channels_last=channels_last)
    grads = []
    for model in (ours, theirs):
        out = model(x)
        gx, = torch.autograd.grad(out.sum(), x, create_graph=True)
        penalty = (gx.flatten(1).norm(dim=1) - 1).square().mean()
        loss = out.square().mean() + 10 * penalty
        grads.append([gx.detach(), *torch.autograd.grad(loss, (x, *model.parameters()))])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    for o, t in zip(ours, theirs[::2]):  # the statistics took the same updates
        torch.testing.assert_close(o.state_dict(), t.state_dict(), rtol=1e-12, atol=1e-14)


def test_third_derivative_matches_torch():
    layer = ct.Conv1d(2, 2, 2, activation="tanh", dtype=F64)
    x = _rand(2, 2, 4)

    def third(fn):
        g1, = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
        g2, = torch.autograd.grad(g1.square().sum(), x, create_graph=True)
        return torch.autograd.grad(g2.square().sum(), (x, layer.weight))

    ours = third(layer)
    theirs = third(lambda t: torch.tanh(F.conv1d(t, layer.weight, layer.bias)))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# --- which path runs --------------------------------------------------------------------

def test_first_order_backward_keeps_the_fused_ops(monkeypatch):
    calls = []
    for name in ("conv_backward", "batchnorm_backward"):
        fn = getattr(double, name)
        monkeypatch.setattr(double, name,
                            lambda *a, _fn=fn, _n=name, **k: calls.append(_n) or _fn(*a, **k))
    model = torch.nn.Sequential(ct.Conv2d(2, 3, 3, activation="tanh", dtype=F64),
                                ct.BatchNorm2d(3, activation="sigmoid", dtype=F64))
    x = _rand(2, 2, 5, 5)
    model(x).sum().backward()
    assert calls == []
    gx, = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    assert calls == ["batchnorm_backward", "conv_backward"]
    calls.clear()
    # The second backward is not recorded: the fused ops again, handed the gradient that
    # reached y. (For silu and gelu a gradient reaches z too, and the composed path runs.)
    gx.square().sum().backward()
    assert calls == []


def test_compiled_backward_keeps_the_fused_ops():
    """torch.compile's backward graph holds the fused ops, also for silu and gelu, whose
    pre-activation output is differentiable (Note [two backward paths])."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    seen = []

    def backward_compiler(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes
                    if n.op == "call_function" and "convfuse" in str(n.target))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=lambda gm, ex: make_boxed_func(gm.forward),
                           bw_compiler=backward_compiler)
    model = torch.nn.Sequential(ct.Conv2d(2, 3, 3, activation="silu"),
                                ct.BatchNorm2d(3, activation="gelu"),
                                ct.Conv2d(3, 3, 3, activation="relu"))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    compiled(torch.randn(2, 2, 8, 8, requires_grad=True)).sum().backward()
    assert sorted(seen) == ["convfuse.batchnorm_backward.default",
                            *["convfuse.conv_bias_act_backward.default"] * 2]


# --- the primitives: a transposed convolution, empty inputs -----------------------------

@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_data_grad_is_a_transposed_convolution(channels_last):
    # ConvTranspose2d(3 -> 2, k=3, stride=2, padding=1, output_padding=1, groups=1)
    x = _rand(2, 3, 3, 4, channels_last=channels_last)
    w = _rand(3, 2, 3, 3)
    size = [2, 2, 6, 8]  # (in - 1) * 2 - 2 + 3 + output_padding 1

    def ours(x, w):
        return torch.ops.convfuse.conv_data_grad(x, w, size, [2, 2], [1, 1], [1, 1], 1)

    y = ours(x, w)
    torch.testing.assert_close(
        y, F.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1),
        rtol=1e-12, atol=1e-12)
    assert y._base is None
    assert y.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert torch.autograd.gradcheck(ours, (x, w))
    assert torch.autograd.gradgradcheck(ours, (x, w))


def test_primitives_with_an_empty_batch():
    x = torch.randn(0, 2, 4, 4, dtype=F64)
    w = torch.randn(3, 2, 3, 3, dtype=F64)
    hyper = ([1, 1], [1, 1], [1, 1], 1)
    y = torch.ops.convfuse.conv_forward(x, w, *hyper)
    assert y.shape == (0, 3, 4, 4)
    assert torch.ops.convfuse.conv_data_grad(y, w, [0, 2, 4, 4], *hyper).shape == x.shape
    dw = torch.ops.convfuse.conv_filter_grad(x, y, list(w.shape), *hyper)
    assert torch.equal(dw, torch.zeros_like(w))


def _channels_last(t):
    return t.detach().movedim(1, -1).contiguous().movedim(-1, 1).requires_grad_()


def test_opcheck_the_primitives():
    """torch.library.opcheck: schema, autograd registration, fake implementations (shapes
    and strides, channels-last included) of the four ops; AOT dispatch (torch.compile's
    path) for conv_data_grad, a transposed convolution's forward, and its gradients."""
    x, w = _rand(2, 3, 5, 5), _rand(4, 3, 3, 3)
    dz = _rand(2, 4, 3, 3)
    hyper = ([1, 1], [0, 0], [1, 1], 1)
    ops = torch.ops.convfuse
    quick = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(ops.conv_forward.default, (x, w, *hyper), test_utils=quick)
    torch.library.opcheck(ops.conv_data_grad.default,
                          (_channels_last(dz), w, [2, 3, 5, 5], *hyper))
    torch.library.opcheck(ops.conv_filter_grad.default,
                          (_channels_last(x), _channels_last(dz), [4, 3, 3, 3], *hyper),
                          test_utils=quick)
    torch.library.opcheck(ops.activation_grad.default, (dz, _rand(2, 4, 3, 3), "gelu"),
                          test_utils=quick)


@pytest.mark.parametrize(("act", "module"), [("relu", nn.ReLU), ("relu6", nn.ReLU6),
                                             ("leaky_relu", nn.LeakyReLU)])
def test_a_penalty_reaches_every_parameter_as_torch_nn_does(act, module):
    """A piecewise-linear activation's second derivative is zero; torch.nn's reports it as
    zeros, so a gradient penalty differentiates every parameter (a batch norm's bias gets
    zeros, not "unused"): convfuse's does the same, with torch.nn's numbers."""
    torch.manual_seed(0)
    ours = nn.Sequential(ct.Conv2d(3, 8, 3, padding=1, activation=act, dtype=torch.float64),
                         ct.BatchNorm2d(8, activation=act, dtype=torch.float64))
    theirs = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, dtype=torch.float64), module(),
                           nn.BatchNorm2d(8, dtype=torch.float64), module())
    theirs[0].load_state_dict(ours[0].state_dict())
    theirs[2].load_state_dict(ours[1].state_dict())
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    got = []
    for m in (ours, theirs):
        xi = x.clone().requires_grad_()
        gx, = torch.autograd.grad(m(xi).sum(), xi, create_graph=True)
        got.append(torch.autograd.grad(gx.square().sum(), (xi, *m.parameters())))
    for a, b in zip(*got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    assert torch.count_nonzero(got[0][-1]) == 0  # the batch norm's bias: zeros
