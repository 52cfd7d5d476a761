"""The reference engine's transposed convolution against independent oracles: a naive
scatter loop from the definition on tiny sizes, central finite differences, and
torch.nn.functional.conv_transpose*d in float64 (forward, dx, dw, db) over a grid of
stride, padding, output_padding, dilation, groups, layouts and ranks 1-3."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from convfuse import ops
from convfuse.functional_transpose import (
    conv_transpose_bias_act_backward,
    conv_transpose_bias_act_forward,
)
from convfuse.transpose_geometry import ConvTransposeGeometry
from tests.gradcheck import assert_grad_close

torch = pytest.importorskip("torch")


def naive_conv_transpose(x, w, stride, padding, output_padding, dilation, groups):
    """Channels-first, straight from the definition: each input element scatters
    x * w[kernel offset] to output position i * s - p + k * d."""
    n, cin = x.shape[:2]
    rank = x.ndim - 2
    opg = w.shape[1]
    out_sp = [(x.shape[2 + a] - 1) * stride[a] - 2 * padding[a]
              + dilation[a] * (w.shape[2 + a] - 1) + output_padding[a] + 1 for a in range(rank)]
    y = np.zeros((n, opg * groups, *out_sp))
    ipg = cin // groups
    for b, ci in itertools.product(range(n), range(cin)):
        g = ci // ipg
        for pos in itertools.product(*[range(s) for s in x.shape[2:]]):
            for kk in itertools.product(*[range(k) for k in w.shape[2:]]):
                o = [pos[a] * stride[a] - padding[a] + kk[a] * dilation[a] for a in range(rank)]
                if any(not 0 <= o[a] < out_sp[a] for a in range(rank)):
                    continue
                for oc in range(opg):
                    y[(b, g * opg + oc, *o)] += x[(b, ci, *pos)] * w[(ci, oc, *kk)]
    return y


def _cl(a):
    return np.ascontiguousarray(np.moveaxis(a, 1, -1))


def _cf(a):
    return np.moveaxis(a, -1, 1)


TINY = [  # rank, cin, cout, kernel, stride, padding, output_padding, dilation, groups
    (1, 2, 3, 3, 2, 1, 1, 1, 1),
    (1, 4, 2, 2, 3, 0, 2, 1, 2),
    (2, 2, 4, 3, 2, 1, 1, 1, 2),
    (2, 3, 2, (2, 3), (1, 2), (0, 1), (0, 1), (2, 1), 1),
    (2, 2, 2, 3, 1, 0, 1, 2, 1),   # output_padding >= stride (< dilation), padding 0
    (2, 2, 2, 3, 1, 2, 1, 2, 2),   # ... and with padding > output_padding
    (3, 2, 2, 2, 2, 0, 1, 1, 1),
]


def _t(v, rank):
    return v if isinstance(v, tuple) else (v,) * rank


@pytest.mark.parametrize("case", TINY)
@pytest.mark.parametrize("layout", ["cf", "cl"])
def test_forward_matches_naive_loop(case, layout, rng):
    rank, cin, cout, k, s, p, op, d, g = case
    k, s, p, op, d = (_t(v, rank) for v in (k, s, p, op, d))
    x = rng.standard_normal((2, cin, *([3] * rank)))
    w = rng.standard_normal((cin, cout // g, *k))
    want = naive_conv_transpose(x, w, s, p, op, d, g)
    cl = layout == "cl"
    name = {1: ("NCW", "NWC"), 2: ("NCHW", "NHWC"), 3: ("NCDHW", "NDHWC")}[rank][cl]
    xa, wa = (_cl(x), _cl(w)) if cl else (x, w)
    geom = ConvTransposeGeometry.create(xa.shape, wa.shape, s, p, op, d, g, name)
    y = ops.conv_transpose_forward(xa, wa, geom)
    np.testing.assert_allclose(_cf(y) if cl else y, want, rtol=1e-12, atol=1e-12)
    assert geom.output_shape_cf == want.shape


GRID = [  # kwargs for torch.nn.functional.conv_transpose*d, and the input's spatial size
    dict(stride=1, padding=0, output_padding=0, dilation=1, groups=1),
    dict(stride=2, padding=1, output_padding=1, dilation=1, groups=1),
    dict(stride=2, padding=0, output_padding=0, dilation=1, groups=2),
    dict(stride=3, padding=2, output_padding=2, dilation=2, groups=1),
    dict(stride=1, padding=1, output_padding=1, dilation=2, groups=2),  # op >= stride
    dict(stride=2, padding=1, output_padding=0, dilation=3, groups=4),
]


def _torch_reference(x, w, b, kw, act, dy):
    f = {3: torch.nn.functional.conv_transpose1d, 4: torch.nn.functional.conv_transpose2d,
         5: torch.nn.functional.conv_transpose3d}[x.ndim]
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    yt = f(xt, wt, bt, **kw)
    yt = {"identity": lambda t: t, "relu": torch.relu, "tanh": torch.tanh,
          "gelu": torch.nn.functional.gelu}[act](yt)
    if dy is None:
        return yt.detach().numpy(), None
    yt.backward(torch.tensor(dy))
    return yt.detach().numpy(), (xt.grad.numpy(), wt.grad.numpy(), bt.grad.numpy())


def _torch_cases():
    out = [(rank, i, layout, "identity") for rank in (1, 2, 3) for i in range(len(GRID))
           for layout in ("cf", "cl")]
    out += [(rank, i, "cf", act) for rank in (1, 2, 3) for i in range(len(GRID))
            for act in ("relu", "tanh", "gelu")]
    return out + [(2, 1, "cl", act) for act in ("relu", "tanh", "gelu")]


@pytest.mark.parametrize("rank,grid,layout,act", _torch_cases())
def test_matches_torch_float64(rank, grid, layout, act, rng):
    kw = GRID[grid]
    cin, cout = 4, 8
    g = kw["groups"]
    x = rng.standard_normal((2, cin, *([4, 3, 5][:rank])))
    w = rng.standard_normal((cin, cout // g, *([3, 2, 3][:rank])))
    b = rng.standard_normal(cout)
    y_ref, _ = _torch_reference(x, w, b, kw, act, None)
    dy = rng.standard_normal(y_ref.shape)
    y_ref, (dx_ref, dw_ref, db_ref) = _torch_reference(x, w, b, kw, act, dy)
    cl = layout == "cl"
    name = {1: ("NCW", "NWC"), 2: ("NCHW", "NHWC"), 3: ("NCDHW", "NDHWC")}[rank][cl]
    conv = (lambda a: _cl(a)) if cl else (lambda a: a)
    back = _cf if cl else (lambda a: a)
    y, ctx = conv_transpose_bias_act_forward(
        conv(x), conv(w), b, kw["stride"], kw["padding"], kw["output_padding"], g,
        kw["dilation"], act, layout=name)
    np.testing.assert_allclose(back(y), y_ref, rtol=1e-12, atol=1e-12)
    grads = conv_transpose_bias_act_backward(conv(dy), ctx)
    np.testing.assert_allclose(back(grads.dx), dx_ref, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(back(grads.dweight), dw_ref, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(grads.dbias, db_ref, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("act", ["identity", "silu", "elu"])
@pytest.mark.parametrize("windowed", [False, True])
def test_gradients_match_finite_differences(act, windowed, rng):
    s, op, d = (1, 1, 2) if windowed else (2, 1, 1)
    x = rng.standard_normal((2, 4, 3, 4))
    w = rng.standard_normal((4, 3, 3, 2))
    b = rng.standard_normal(6)
    res = None
    kw = dict(stride=s, padding=1, output_padding=op, groups=2, dilation=d, activation=act)
    y, _ = conv_transpose_bias_act_forward(x, w, b, **kw)
    res = rng.standard_normal(y.shape)
    proj = rng.standard_normal(y.shape)

    def loss():
        out, _ = conv_transpose_bias_act_forward(x, w, b, residual=res, residual_scale=0.5,
                                                 **kw)
        return float((out * proj).sum())

    _, ctx = conv_transpose_bias_act_forward(x, w, b, residual=res, residual_scale=0.5, **kw)
    assert ctx.geom.windowed is windowed
    grads = conv_transpose_bias_act_backward(proj, ctx)
    for analytic, arr in ((grads.dx, x), (grads.dweight, w), (grads.dbias, b),
                          (grads.dresidual, res)):
        assert_grad_close(analytic, loss, arr, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float16", 3e-3), ("bfloat16", 3e-2)])
def test_low_precision_dtypes_match_float64(dtype, tol, rng):
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)

    from convfuse.dtypes import canonical

    dt = canonical(dtype)
    x = rng.standard_normal((2, 4, 5, 5)).astype(dt)
    w = (rng.standard_normal((4, 3, 3, 3)) * 0.3).astype(dt)
    b = rng.standard_normal(3).astype(dt)
    y, ctx = conv_transpose_bias_act_forward(x, w, b, 2, 1, 1, activation="relu")
    y64, ctx64 = conv_transpose_bias_act_forward(
        x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), 2, 1, 1,
        activation="relu")
    assert y.dtype == dt
    scale = np.abs(y64).max()
    np.testing.assert_allclose(y.astype(np.float64), y64, atol=tol * scale * 4, rtol=0)
    dy = rng.standard_normal(y.shape).astype(dt)
    g = conv_transpose_bias_act_backward(dy, ctx)
    g64 = conv_transpose_bias_act_backward(dy.astype(np.float64), ctx64)
    for a, ref in ((g.dx, g64.dx), (g.dweight, g64.dweight), (g.dbias, g64.dbias)):
        assert a.dtype == dt
        np.testing.assert_allclose(a.astype(np.float64), ref,
                                   atol=tol * np.abs(ref).max() * 8, rtol=0)


def test_no_pass_without_bias_residual_or_activation(monkeypatch, rng):
    """Identity without bias or residual returns BackwardData's array itself."""
    from convfuse.ops.reference import conv as ref

    seen = {}
    real = ref.conv_backward_data

    def spy(*a, **k):
        seen["y"] = real(*a, **k)
        return seen["y"]

    monkeypatch.setattr(ref, "conv_backward_data", spy)
    x, w = rng.standard_normal((1, 2, 3, 3)), rng.standard_normal((2, 2, 2, 2))
    geom = ConvTransposeGeometry.create(x.shape, w.shape, 2)
    y, z = ops.conv_transpose_bias_act(x, w, None, geom)
    assert y is seen["y"] and z is None


def test_backward_bias_uses_the_activation_bias_op(monkeypatch, rng):
    """db comes from activation_backward_bias (the fused kernel on the GPU), over the
    transposed convolution's output, never from a generic reduction."""
    from convfuse.ops.reference import conv_transpose as ref_t

    calls = []
    real = ref_t.activation_backward_bias
    monkeypatch.setattr(ref_t, "activation_backward_bias",
                        lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    x, w, b = (rng.standard_normal(s) for s in ((2, 2, 3, 3), (2, 3, 2, 2), (3,)))
    for act in ("identity", "relu"):
        y, ctx = conv_transpose_bias_act_forward(x, w, b, 2, activation=act)
        g = conv_transpose_bias_act_backward(np.ones_like(y), ctx)
        dz = np.ones_like(y) if act == "identity" else (y > 0).astype(float)
        np.testing.assert_allclose(g.dbias, dz.sum(axis=(0, 2, 3)), rtol=1e-13)
    assert calls == ["identity", "relu"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("windowed", [False, True])
def test_half_precision_rounds_once_after_the_bias_and_residual(dtype, windowed, rng):
    """The transposed convolution stays in float32 until its bias, residual and activation
    are applied, and is rounded once (as Conv, and torch.nn in bfloat16): the same bits as
    the float32 computation rounded at the end. It was rounded before the bias too: 100 +
    0.375 - 100 came out 0.5 in bfloat16, 0 in float16."""
    from convfuse.dtypes import canonical

    dt = canonical(dtype)
    g = ConvTransposeGeometry.create((1, 2, 1, 1), (2, 1, 1, 1))
    x = np.array([100.0, 0.375]).reshape(1, 2, 1, 1).astype(dt)
    y, _ = ops.conv_transpose_bias_act(x, np.ones((2, 1, 1, 1), dt), np.array([-100.0], dt),
                                       g)
    assert float(y.ravel()[0]) == 0.375
    g = ConvTransposeGeometry.create((2, 4, 5, 5), (4, 3, 3, 3), 2, 1,
                                     output_padding=1 if windowed else 0)
    x, w = rng.standard_normal(g.input_shape) * 8, rng.standard_normal(g.weight_shape)
    b, r = rng.standard_normal(3) * 50, rng.standard_normal(g.output_shape) * 50
    low = [a.astype(dt) for a in (x, w, b, r)]
    got, z = ops.conv_transpose_bias_act(*low[:3], g, activation="silu", residual=low[3])
    want32, z32 = ops.conv_transpose_bias_act(*[a.astype(np.float32) for a in low[:3]], g,
                                              activation="silu",
                                              residual=low[3].astype(np.float32))
    np.testing.assert_array_equal(got, want32.astype(dt))
    np.testing.assert_array_equal(z, z32.astype(dt))
