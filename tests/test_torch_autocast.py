"""convfuse.torch under torch.autocast("cpu", dtype=torch.bfloat16): the layers run in the
dtype torch.nn's run in and return what torch.nn's return (Note [autocast] in
convfuse/torch/_autocast.py). Values are checked against float64 computations on the
bfloat16-rounded inputs with bounds from bfloat16's unit roundoff, never against torch's
own bfloat16 output bit for bit (its vector lanes decide the last bit)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import convfuse.torch as ct  # noqa: E402
from convfuse.activations import ACTIVATIONS  # noqa: E402

TORCH_ACT = {
    "identity": lambda z: z, "relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "elu": F.elu, "relu6": F.relu6, "leaky_relu": lambda z: F.leaky_relu(z, 0.01),
    "silu": F.silu, "gelu": F.gelu,
}
CONV = {1: (ct.Conv1d, torch.nn.Conv1d, F.conv1d), 2: (ct.Conv2d, torch.nn.Conv2d, F.conv2d),
        3: (ct.Conv3d, torch.nn.Conv3d, F.conv3d)}
BF16 = torch.bfloat16
U = 2.0 ** -8  # bfloat16's unit roundoff (8 significant bits)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _rounded(t):
    return None if t is None else t.detach().to(BF16).double()


def _abs(t):
    return None if t is None else t.abs()


def _bound_check(y, ref, magnitude, extra=0.0):
    """|y - ref| within one bfloat16 rounding of the result plus float32-accumulation and
    intermediate-rounding error, bounded by a few roundoffs of the sum of |terms|."""
    err = (y.double() - ref).abs()
    tol = U * ref.abs() + 4 * U * U * magnitude + extra + 1e-30
    assert bool((err <= tol).all()), float((err - tol).max())


GRID = [  # rank, stride, padding, dilation, groups, channels_last, residual
    (1, 2, 1, 1, 2, False, True),
    (2, 1, 1, 1, 1, True, False),
    (2, 2, 0, 2, 2, False, True),
    (3, 1, 1, 1, 1, True, True),
]


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("geo", GRID, ids=lambda g: f"{g[0]}d-cl{int(g[5])}-res{int(g[6])}")
def test_conv_runs_in_bfloat16_like_torch_nn(geo, act):
    rank, stride, padding, dilation, groups, cl, residual = geo
    ours_cls, torch_cls, conv = CONV[rank]
    kw = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    ours = ours_cls(4, 6, 3, activation=act, **kw)
    theirs = torch_cls(4, 6, 3, **kw)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 4, *([6] * rank))
    if cl:
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    r = torch.randn(ours.output_shape(x.shape)) if residual else None  # float32: cast too
    with torch.autocast("cpu", dtype=BF16):
        y = ours(x, r)
        y_nn = TORCH_ACT[act](theirs(x))
    assert y.dtype == y_nn.dtype == BF16
    z = conv(_rounded(x), _rounded(ours.weight), _rounded(ours.bias), **kw)
    mag = conv(x.abs().double(), ours.weight.abs().double(), ours.bias.abs().double(), **kw)
    if residual:
        z, mag = z + _rounded(r), mag + r.abs()
    ref = TORCH_ACT[act](z)
    _bound_check(y, ref, mag)  # one rounding: the fused activation runs on float32 values
    if not residual:
        # torch.nn rounds the convolution's output to bfloat16 before its activation:
        # one more rounding, of z, passed through act' (|act'| <= 1.13, gelu's maximum).
        _bound_check(y_nn, ref, mag, extra=1.13 * U * z.abs())


def test_model_output_and_gradients_match_torch_nn_dtypes():
    """A Conv-BN-ReLU-Conv model: the batch norm gets bfloat16 data with float32
    parameters (torch has no autocast rule for batch_norm), every output and gradient has
    torch.nn's dtype, and the values agree with torch.nn's to bfloat16 accuracy."""
    # No bias before the batch norm: its gradient would be 0 up to rounding noise.
    ours = torch.nn.Sequential(ct.Conv2d(3, 4, 3, padding=1, bias=False),
                               ct.BatchNorm2d(4, activation="relu"),
                               ct.Conv2d(4, 2, 3, activation="silu"))
    theirs = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1, bias=False),
                                 torch.nn.BatchNorm2d(4),
                                 torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 3), torch.nn.SiLU())
    for o, t in zip(ours, [theirs[0], theirs[1], theirs[3]]):
        t.load_state_dict(o.state_dict())
    x = torch.randn(2, 3, 7, 7)
    outs, grads = [], []
    for model in (ours, theirs):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=BF16):
            mid = model[0](xi)
            y = model(xi)
        assert mid.dtype == BF16
        y.float().square().sum().backward()
        outs.append(y.detach())
        grads.append([xi.grad, *(p.grad for p in model.parameters())])
    assert outs[0].dtype == outs[1].dtype == BF16
    scale = outs[1].double().abs().max()
    torch.testing.assert_close(outs[0].double(), outs[1].double(), rtol=0,
                               atol=float(8 * U * scale))
    for a, b in zip(*grads):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=float(16 * U * b.abs().max()))
    for o, t in zip(ours, [theirs[0], theirs[1], theirs[3]]):  # running statistics
        for key, v in t.state_dict().items():
            assert o.state_dict()[key].dtype == v.dtype


def test_float64_and_disabled_regions_are_left_alone():
    layer = ct.Conv2d(2, 2, 3, dtype=torch.float64)
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64)
    with torch.autocast("cpu", dtype=BF16):
        assert layer(x).dtype == torch.float64  # autocast never casts float64, as torch
        with torch.autocast("cpu", enabled=False):
            assert ct.Conv2d(2, 2, 3)(x.float()).dtype == torch.float32
    layer32 = ct.Conv2d(2, 2, 3)
    with torch.autocast("cpu", dtype=BF16), pytest.raises(TypeError, match="Conv2d"):
        layer32(x)  # float64 input, float32 weight: torch.nn refuses it as well


def test_batchnorm_is_not_cast_like_torch_nn():
    ours, theirs = ct.BatchNorm2d(3), torch.nn.BatchNorm2d(3)
    x = torch.randn(2, 3, 4, 4)
    with torch.autocast("cpu", dtype=BF16):
        assert ours(x).dtype == theirs(x).dtype == torch.float32
        xb = x.to(BF16)
        assert ours(xb).dtype == theirs(xb).dtype == BF16
        with pytest.raises(TypeError, match="BatchNorm2d: residual"):
            ours(xb, x)  # a fused residual must share the data's dtype


def test_double_backward_under_autocast_runs():
    layer = ct.Conv2d(2, 3, 3, activation="gelu")
    x = torch.randn(1, 2, 5, 5, requires_grad=True)
    with torch.autocast("cpu", dtype=BF16):
        y = layer(x)
    gx, = torch.autograd.grad(y.float().sum(), x, create_graph=True)
    gx.square().sum().backward()
    assert layer.weight.grad.dtype == torch.float32
    assert bool(torch.isfinite(layer.weight.grad).all())


def test_compiled_model_under_autocast_matches_eager():
    model = torch.nn.Sequential(ct.Conv2d(3, 4, 3, activation="relu"), ct.BatchNorm2d(4),
                                ct.Conv2d(4, 4, 3, activation="gelu"))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 3, 8, 8)
    with torch.autocast("cpu", dtype=BF16):
        y, y_eager = compiled(x), model(x)
    assert y.dtype == y_eager.dtype == BF16
    torch.testing.assert_close(y, y_eager, rtol=0, atol=0)  # the same engine, same values


@pytest.mark.parametrize("kind", ["conv", "conv_transpose"])
def test_a_gradient_penalty_under_autocast_keeps_the_forwards_precision(kind):
    """A float32 forward, then torch.autograd.grad(create_graph=True) inside autocast (a
    gradient penalty under AMP): torch's convolution backward has no autocast rule, so
    torch.nn's gradient stays float32 math; convfuse's recorded backward must too (its
    convolution ops, also forwards, are cast where autocast is on)."""
    torch.manual_seed(0)
    if kind == "conv":
        ref, ours = torch.nn.Conv2d(3, 4, 3, padding=1), ct.Conv2d(3, 4, 3, padding=1)
    else:
        ref = torch.nn.ConvTranspose2d(3, 4, 3, stride=2)
        ours = ct.ConvTranspose2d(3, 4, 3, stride=2)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    grads = []
    for m in (ref, ours):
        y = m(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        assert g.dtype == torch.float32
        grads.append(g)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)
