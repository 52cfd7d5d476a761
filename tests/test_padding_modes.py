"""padding_mode ('zeros', 'reflect', 'replicate', 'circular') and padding='same' with an
even kernel, on convfuse's own Conv1d/2d/3d, convfuse.functional and the pad ops.

Oracles: naive per-element loops for the pad op and its backward (tiny sizes), torch.nn's
Conv*d with the same padding_mode on the CPU in float64 (forward, dx, dw, db), and finite
differences.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import convfuse as cf
import convfuse.ops as ops
from convfuse.functional import conv_bias_act, conv_bias_act_backward, conv_bias_act_forward
from convfuse.geometry import same_padding
from convfuse.pad_geometry import PadGeometry, split_padding
from tests.gradcheck import assert_grad_close

torch = pytest.importorskip("torch")

MODES = ("zeros", "reflect", "replicate", "circular")
LAYERS = {1: cf.Conv1d, 2: cf.Conv2d, 3: cf.Conv3d}
TORCH = {1: "Conv1d", 2: "Conv2d", 3: "Conv3d"}


def to_layout(a: np.ndarray, channels_last: bool) -> np.ndarray:
    return np.ascontiguousarray(np.moveaxis(a, 1, -1)) if channels_last else a


def from_layout(a: np.ndarray, channels_last: bool) -> np.ndarray:
    return np.moveaxis(a, -1, 1) if channels_last else a


# ---- the pad op against naive loops ----------------------------------------------------

def source_index(j: int, lo: int, n: int, mode: str) -> int | None:
    """Which input element padded index j reads along one dim (None: a zero)."""
    i = j - lo
    if 0 <= i < n:
        return i
    if mode == "zeros":
        return None
    if mode == "reflect":
        return -i if i < 0 else 2 * (n - 1) - i
    if mode == "replicate":
        return min(max(i, 0), n - 1)
    return i % n  # circular


def naive_pad(x_cf: np.ndarray, pads, mode: str) -> np.ndarray:
    spatial = x_cf.shape[2:]
    out_sp = [n + lo + hi for n, (lo, hi) in zip(spatial, pads)]
    y = np.zeros((*x_cf.shape[:2], *out_sp))
    for idx in itertools.product(*(range(s) for s in out_sp)):
        src = [source_index(j, lo, n, mode) for j, (lo, _), n in zip(idx, pads, spatial)]
        if None not in src:
            y[(slice(None), slice(None), *idx)] = x_cf[(slice(None), slice(None), *src)]
    return y


def naive_pad_backward(dy_cf: np.ndarray, in_spatial, pads, mode: str) -> np.ndarray:
    dx = np.zeros((*dy_cf.shape[:2], *in_spatial))
    for idx in itertools.product(*(range(s) for s in dy_cf.shape[2:])):
        src = [source_index(j, lo, n, mode) for j, (lo, _), n in zip(idx, pads, in_spatial)]
        if None not in src:
            dx[(slice(None), slice(None), *src)] += dy_cf[(slice(None), slice(None), *idx)]
    return dx


# spatial sizes and pads at each mode's limits: reflect pad = size - 1, circular pad = size,
# replicate (and zeros) pads wider than the input, one-sided pads
PAD_CASES = {
    1: [((5,), [(2, 3)]), ((4,), [(3, 0)]), ((3,), [(0, 2)])],
    2: [((4, 3), [(1, 2), (2, 0)]), ((3, 5), [(2, 2), (0, 4)])],
    3: [((3, 4, 2), [(1, 2), (0, 3), (1, 1)])],
}


def limit_pads(pads, spatial, mode):
    if mode == "reflect":
        return [(min(lo, n - 1), min(hi, n - 1)) for (lo, hi), n in zip(pads, spatial)]
    if mode == "circular":
        return [(min(lo, n), min(hi, n)) for (lo, hi), n in zip(pads, spatial)]
    return pads


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "NHWC"])
@pytest.mark.parametrize("rank,case", [(r, i) for r, cases in PAD_CASES.items()
                                       for i in range(len(cases))])
def test_pad_op_and_backward_match_naive_loops(mode, channels_last, rank, case, rng):
    spatial, pads = PAD_CASES[rank][case]
    pads = limit_pads(pads, spatial, mode)
    x_cf = rng.standard_normal((2, 3, *spatial))
    x = to_layout(x_cf, channels_last)
    x0 = x.copy()
    g = PadGeometry.create(x.shape, pads, mode, "NHWC" if channels_last else "NCHW")
    y = ops.pad_forward(x, g)
    assert y.shape == g.output_shape and y.flags.c_contiguous and y.dtype == x.dtype
    np.testing.assert_array_equal(from_layout(y, channels_last), naive_pad(x_cf, pads, mode))
    dy_cf = rng.standard_normal(from_layout(y, channels_last).shape)
    dy = to_layout(dy_cf, channels_last)
    dy0 = dy.copy()
    dx = ops.pad_backward(dy, g)
    assert dx.shape == x.shape and dx.flags.c_contiguous
    np.testing.assert_allclose(from_layout(dx, channels_last),
                               naive_pad_backward(dy_cf, spatial, pads, mode),
                               rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(dy, dy0)


@pytest.mark.parametrize("mode", MODES)
def test_pad_backward_is_the_adjoint_and_matches_torch(mode, rng):
    x = rng.standard_normal((2, 3, 4, 5))
    g = PadGeometry.create(x.shape, [(2, 1), (3, 0)], mode)
    y = ops.pad_forward(x, g)
    dy = rng.standard_normal(y.shape)
    dx = ops.pad_backward(dy, g)
    assert np.vdot(y, dy) == pytest.approx(np.vdot(x, dx), rel=1e-12)
    tmode = "constant" if mode == "zeros" else mode
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.nn.functional.pad(xt, [3, 0, 2, 1], mode=tmode)  # last dim first
    yt.backward(torch.tensor(dy))
    np.testing.assert_array_equal(y, yt.detach().numpy())
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_pad_backward_sums_narrow_dtypes_in_float32(dtype, rng):
    """replicate folds a wide border into one edge element: the sum runs in float32 and
    rounds once, so it is within one unit in the last place of the exact sum."""
    dt = cf.dtypes.canonical(dtype)
    g = PadGeometry.create((1, 2, 3), [(40, 40)], "replicate")
    dy = rng.standard_normal(g.output_shape).astype(dt)
    dx = ops.pad_backward(dy, g)
    assert dx.dtype == dt
    expect = naive_pad_backward(dy.astype(np.float64), (3,), [(40, 40)], "replicate")
    ulp = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]
    np.testing.assert_allclose(dx.astype(np.float64), expect, rtol=ulp, atol=0)


def test_pad_geometry_refuses_what_torch_refuses():
    with pytest.raises(ValueError, match=r"padding_mode='reflect' needs padding < input size"
                                         r".*padding 3 vs\. size 3 along spatial dim 1"):
        PadGeometry.create((1, 1, 5, 3), [(1, 1), (0, 3)], "reflect")
    with pytest.raises(ValueError, match=r"padding_mode='circular' needs padding <= input size"
                                         r".*padding 4 vs\. size 3"):
        PadGeometry.create((1, 1, 3), [(4, 0)], "circular")
    PadGeometry.create((1, 1, 3), [(3, 3)], "circular")  # wraps once: allowed, as in torch
    PadGeometry.create((1, 1, 3), [(9, 9)], "replicate")
    with pytest.raises(ValueError, match="padding_mode must be one of"):
        PadGeometry.create((1, 1, 3), [(1, 1)], "constant")
    with pytest.raises(ValueError, match="padding must be >= 0"):
        PadGeometry.create((1, 1, 3), [(-1, 1)], "zeros")
    with pytest.raises(ValueError, match="pairs"):
        PadGeometry.create((1, 1, 3, 3), [(1, 1)], "zeros")
    with pytest.raises(TypeError, match="pgeom must be a PadGeometry"):
        ops.pad_forward(np.zeros((1, 1, 3)), [(1, 1)])
    g = PadGeometry.create((1, 1, 3), [(1, 1)], "reflect")
    with pytest.raises(ValueError, match="pad_forward: x has shape"):
        ops.pad_forward(np.zeros((1, 1, 4)), g)
    with pytest.raises(ValueError, match="pad_backward: dy has shape"):
        ops.pad_backward(np.zeros((1, 1, 3)), g)


def test_same_padding_puts_the_odd_element_at_the_end():
    assert same_padding((4, 3, 2), (1, 1, 3)) == ((1, 2), (1, 1), (1, 2))
    assert same_padding((5,), (2,)) == ((4, 4),)
    # zeros: symmetric part to cuDNN, the extra end zero explicit
    assert split_padding("same", "zeros", (4, 3), (1, 1), (1, 1)) == (((0, 1), (0, 0)), (1, 1))
    assert split_padding("same", "reflect", (4, 3), (1, 1), (1, 1)) == (((1, 2), (1, 1)), (0, 0))
    assert split_padding(2, "circular", (3,), (1,), (1,)) == (((2, 2),), (0,))
    assert split_padding((1, 2), "zeros", (3, 3), (1, 1), (2, 2)) == (((0, 0), (0, 0)), (1, 2))
    with pytest.raises(ValueError, match="stride 1"):
        split_padding("same", "reflect", (4,), (1,), (2,))
    with pytest.raises(TypeError, match="padding_mode must be a str"):
        split_padding(1, None, (3,), (1,), (1,))


# ---- layers against torch.nn -----------------------------------------------------------

def torch_twin(layer, rank, mode, **kwargs):
    """torch.nn.Conv*d with the same arguments, holding the layer's parameters."""
    t = getattr(torch.nn, TORCH[rank])(layer.in_channels, layer.out_channels, layer.kernel_size,
                                       padding_mode=mode, dtype=torch.float64, **kwargs)
    with torch.no_grad():
        for name, value in layer.state_dict().items():
            getattr(t, name).copy_(torch.from_numpy(np.ascontiguousarray(value)))
    return t


def check_against_torch(layer, t, x_cf, channels_last, rng):
    x = to_layout(x_cf, channels_last)
    layer.zero_grad()
    t.zero_grad()
    y = layer(x)
    xt = torch.tensor(x_cf, requires_grad=True)
    yt = t(xt)
    np.testing.assert_allclose(from_layout(y, channels_last), yt.detach().numpy(),
                               rtol=1e-12, atol=1e-12)
    dy_cf = rng.standard_normal(tuple(yt.shape))
    dx = layer.backward(to_layout(dy_cf, channels_last))
    yt.backward(torch.tensor(dy_cf))
    np.testing.assert_allclose(from_layout(dx, channels_last), xt.grad.numpy(),
                               rtol=1e-12, atol=1e-12)
    grads = {"weight": layer.weight.grad}
    if layer.bias is not None:
        grads["bias"] = layer.bias.grad
    for name, g in grads.items():
        got = layer._param_to_state(name, g)
        np.testing.assert_allclose(got, getattr(t, name).grad.numpy(), rtol=1e-12, atol=1e-12,
                                   err_msg=name)


LAYER_GRID = [
    # rank, kernel, padding, stride, dilation, groups, spatial
    (1, 3, 2, 1, 1, 1, (7,)),
    (1, 4, "same", 1, 1, 1, (6,)),
    (1, 3, "same", 1, 3, 2, (9,)),
    (2, 3, 1, 2, 1, 2, (6, 5)),
    (2, (2, 3), "same", 1, 1, 1, (5, 6)),
    (2, 3, (2, 0), 1, (1, 2), 1, (5, 7)),
    (2, (4, 2), "same", 1, (1, 3), 1, (6, 5)),
    (3, 2, "same", 1, 1, 1, (3, 4, 5)),
    (3, 3, (1, 2, 0), (1, 2, 1), 1, 1, (4, 4, 3)),
    (2, 3, "valid", 1, 1, 1, (5, 5)),
]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")  # torch's, on speed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "NHWC"])
@pytest.mark.parametrize("rank,kernel,padding,stride,dilation,groups,spatial", LAYER_GRID)
def test_layer_matches_torch_nn(mode, channels_last, rank, kernel, padding, stride, dilation,
                                groups, spatial, rng):
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    layer = LAYERS[rank](4, 6, kernel, **kw, layout="NHWC" if channels_last else "NCHW",
                         dtype="float64", device="cpu", seed=3, padding_mode=mode)
    t = torch_twin(layer, rank, mode, **kw)
    x_cf = rng.standard_normal((2, 4, *spatial))
    check_against_torch(layer, t, x_cf, channels_last, rng)
    # a second shape through the same layer (the per-shape cache)
    check_against_torch(layer, t, rng.standard_normal((1, 4, *(s + 1 for s in spatial))),
                        channels_last, rng)


@pytest.mark.parametrize("mode", MODES)
def test_layer_with_activation_and_residual(mode, rng):
    layer = cf.Conv2d(3, 3, 4, padding="same", bias=True, activation="tanh", dtype="float64",
                      device="cpu", seed=1, padding_mode=mode)
    t = torch_twin(layer, 2, mode, padding="same")
    x = rng.standard_normal((2, 3, 5, 6))
    res = rng.standard_normal((2, 3, 5, 6))
    layer.residual_scale = 0.5
    y = layer(x, residual=res)
    xt, rt = torch.tensor(x, requires_grad=True), torch.tensor(res, requires_grad=True)
    yt = torch.tanh(t(xt) + 0.5 * rt)
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-12, atol=1e-12)
    dy = rng.standard_normal(y.shape)
    dx, dres = layer.backward(dy)
    yt.backward(torch.tensor(dy))
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dres, rt.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(layer.weight.grad, t.weight.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "NHWC"])
def test_layer_gradients_match_finite_differences(mode, channels_last, rng):
    layer = cf.Conv2d(2, 3, (2, 3), padding="same", activation="sigmoid", dtype="float64",
                      device="cpu", seed=2, padding_mode=mode,
                      layout="NHWC" if channels_last else "NCHW")
    x = to_layout(rng.standard_normal((2, 2, 4, 3)), channels_last)
    r = rng.standard_normal(layer(x).shape)

    def loss():
        return float(np.sum(layer(x) * r))

    layer.zero_grad()
    layer(x)
    dx = layer.backward(r)
    assert_grad_close(dx, loss, x)
    assert_grad_close(layer.weight.grad.copy(), loss, layer.weight.data)


@pytest.mark.parametrize("mode", MODES)
def test_functional_takes_padding_mode_and_even_same(mode, rng):
    x = rng.standard_normal((2, 4, 6, 5))
    w = rng.standard_normal((6, 2, 2, 4))
    b = rng.standard_normal(6)
    t = torch_twin(cf.Conv2d(4, 6, (2, 4), groups=2, dtype="float64", device="cpu"), 2, mode,
                   padding="same", groups=2)
    with torch.no_grad():
        t.weight.copy_(torch.tensor(w))
        t.bias.copy_(torch.tensor(b))
    y, ctx = conv_bias_act_forward(x, w, b, padding="same", groups=2, padding_mode=mode)
    xt = torch.tensor(x, requires_grad=True)
    yt = t(xt)
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(conv_bias_act(x, w, b, padding="same", groups=2,
                                                padding_mode=mode), y)
    dy = rng.standard_normal(y.shape)
    grads = conv_bias_act_backward(dy, ctx)
    yt.backward(torch.tensor(dy))
    np.testing.assert_allclose(grads.dx, xt.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grads.dweight, t.weight.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grads.dbias, t.bias.grad.numpy(), rtol=1e-12, atol=1e-12)
    assert conv_bias_act_backward(dy, ctx, need_dx=False).dx is None


def test_zeros_even_same_pads_only_the_extra_end_zero(monkeypatch, rng):
    """cuDNN keeps the symmetric part; the explicit pad op adds one zero at the end."""
    seen = []
    real = ops.pad_forward

    def spy(x, g):
        seen.append(g)
        return real(x, g)

    monkeypatch.setattr(ops, "pad_forward", spy)
    layer = cf.Conv1d(1, 1, 4, padding="same", bias=False, dtype="float64", device="cpu")
    layer.weight.data[...] = 1.0
    x = np.arange(1.0, 7.0).reshape(1, 1, 6)
    y = layer(x)
    # torch: 1 zero before and 2 after; window i covers x[i-1 : i+3]
    np.testing.assert_array_equal(y[0, 0], [6, 10, 14, 18, 15, 11])
    [g] = seen
    assert g.pads == ((0, 1),) and g.mode == "zeros"
    assert layer._geometry(x)[1].padding == (1,)
    # symmetric zeros never pad explicitly
    seen.clear()
    cf.Conv1d(1, 1, 3, padding="same", dtype="float64", device="cpu")(x)
    assert seen == []


# ---- the layer's API: validation, state, repr ------------------------------------------

def test_padding_mode_is_validated_with_the_layer_name():
    with pytest.raises(ValueError, match=r"Conv2d: padding_mode must be one of 'zeros', "
                                         r"'reflect', 'replicate', 'circular', got 'constant'"):
        cf.Conv2d(2, 2, 3, padding_mode="constant")
    with pytest.raises(TypeError, match="Conv1d: padding_mode must be a str"):
        cf.Conv1d(2, 2, 3, padding_mode=None)
    with pytest.raises(ValueError, match="Conv3d: padding='same' needs stride 1"):
        cf.Conv3d(2, 2, 2, stride=2, padding="same", padding_mode="reflect")
    # torch.nn's positional order puts padding_mode where convfuse's activation is
    with pytest.raises(ValueError, match=r"Conv2d: activation 'reflect' is a padding mode; "
                                         r"pass padding_mode='reflect'"):
        cf.Conv2d(2, 2, 3, 1, 1, 1, 1, True, "reflect")


def test_padding_too_wide_for_the_input_raises_before_any_engine(monkeypatch, rng):
    from convfuse.ops.reference import conv as reference_conv

    def forbidden(*args, **kwargs):
        raise AssertionError("the engine ran")

    monkeypatch.setattr(reference_conv, "conv_bias_act", forbidden)
    layer = cf.Conv2d(1, 1, 3, padding=3, padding_mode="reflect", dtype="float64", device="cpu")
    x = rng.standard_normal((1, 1, 3, 8))
    with pytest.raises(ValueError, match=r"^Conv2d: padding_mode='reflect' needs padding < "
                                         r"input size.*padding 3 vs\. size 3 along spatial dim 0"):
        layer(x)
    circ = cf.Conv1d(1, 1, 3, padding=4, padding_mode="circular", dtype="float64",
                     device="cpu")
    with pytest.raises(ValueError, match=r"^Conv1d: padding_mode='circular' needs padding <="):
        circ(rng.standard_normal((1, 1, 3)))
    assert layer._ctx is None and circ._ctx is None


def test_padding_mode_assignment_takes_effect_and_is_atomic(rng):
    layer = cf.Conv2d(2, 2, 3, padding=1, dtype="float64", device="cpu", seed=0)
    x = rng.standard_normal((1, 2, 4, 4))
    y0 = layer(x)
    layer.padding_mode = "circular"
    assert layer.padding_mode == "circular"
    t = torch_twin(layer, 2, "circular", padding=1)
    np.testing.assert_allclose(layer(x), t(torch.tensor(x)).detach().numpy(), rtol=1e-12)
    assert not np.allclose(layer(x), y0)
    with pytest.raises(ValueError, match="Conv2d: padding_mode must be one of"):
        layer.padding_mode = "mirror"
    assert layer.padding_mode == "circular"
    layer.padding_mode = "zeros"
    np.testing.assert_array_equal(layer(x), y0)


def test_state_dict_and_repr_like_torch():
    layer = cf.Conv2d(2, 4, 3, padding=1, padding_mode="reflect", layout="NHWC")
    t = torch.nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect")
    assert list(layer.state_dict()) == list(t.state_dict())
    # torch prints padding_mode=reflect; convfuse quotes its strings (activation='relu')
    assert "padding_mode='reflect'" in repr(layer) and "padding_mode=reflect" in repr(t)
    plain = cf.Conv2d(2, 4, 3)
    assert "padding_mode" not in repr(plain)
    assert "padding_mode" not in repr(torch.nn.Conv2d(2, 4, 3))
    assert plain.padding_mode == "zeros"
    layer.load_state_dict({k: v.numpy() for k, v in t.state_dict().items()})
    np.testing.assert_array_equal(layer.state_dict()["weight"], t.weight.detach().numpy())


@pytest.mark.parametrize("mode", ["reflect", "circular"])
def test_fold_batchnorm_keeps_the_padding_mode(mode, rng):
    """A folded Conv -> BatchNorm keeps its padding: the pad comes before the conv, the
    affine after it, so folding stays exact."""
    from convfuse.nn import fold_batchnorm

    model = cf.Sequential(
        cf.Conv2d(2, 3, 4, padding="same", padding_mode=mode, dtype="float64", device="cpu",
                  seed=0),
        cf.BatchNorm2d(3, activation="relu", dtype="float64", device="cpu"),
    )
    x = rng.standard_normal((2, 2, 5, 6))
    for _ in range(2):  # running statistics that are not the initial ones
        model(x)
    model.eval()
    folded = fold_batchnorm(model)
    [conv] = folded.layers  # the BatchNorm went into the conv
    assert conv.padding_mode == mode and conv.padding == "same"
    np.testing.assert_allclose(folded(x), model(x), rtol=1e-12, atol=1e-12)
