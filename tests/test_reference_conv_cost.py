"""The reference engine picks how it builds a convolution's columns by cost (reference/conv.py
Note [choosing the method]): one gather for tiny problems, the flat padded form where its
wasted positions are few, else im2col of the live taps only. Large dilation and padding
against tiny maps (taps that read only padding, strides, groups, 1-d to 3-d, both layouts)
against naive loops (tests/naive.py) and torch in float64; every form gives the same answer;
the non-finite rule of skipped taps is im2col's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from convfuse import functional as cff
from convfuse.geometry import ConvGeometry
from convfuse.ops.reference import _threads, conv_flat
from convfuse.ops.reference import conv as rc

from . import naive

LAYOUTS = {1: ("NCW", "NWC"), 2: ("NCHW", "NHWC"), 3: ("NCDHW", "NDHWC")}
TORCH_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}

# (x shape channels-first, K, kernel, stride, padding, dilation, groups): padding at or past
# the input, dilations 3-5, so whole taps read only padding
CASES = [
    ((1, 2, 4, 4), 3, 3, 1, 4, 4, 1),  # the ASPP shape in small: only the centre tap lives
    ((2, 2, 3, 4), 2, 3, 1, (3, 5), (3, 5), 2),  # groups, per-axis padding
    ((1, 3, 3, 5), 2, (3, 2), 2, (5, 4), (5, 4), 1),  # a stride: col2im data gradient
    ((2, 2, 3), 4, 5, 1, 6, 3, 2),  # 1-d, five taps, two live
    ((1, 2, 3, 3, 2), 2, 3, (1, 2, 1), (3, 3, 3), (3, 3, 3), 1),  # 3-d, strided
    ((1, 1, 1, 1), 2, 1, 2, 1, 1, 1),  # stride 2 against padding 1: no tap reads the input
]


def _case(shape, k, kernel, stride, padding, dilation, groups, channels_last, seed=0):
    rank = len(shape) - 2
    kernel = (kernel,) * rank if isinstance(kernel, int) else kernel
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    w = rng.standard_normal((k, shape[1] // groups, *kernel))
    layout = LAYOUTS[rank][channels_last]
    args = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    if channels_last:
        x, w = np.ascontiguousarray(np.moveaxis(x, 1, -1)), np.ascontiguousarray(
            np.moveaxis(w, 1, -1))
    g = ConvGeometry.create(x.shape, w.shape, stride, padding, dilation, groups, layout)
    dy = rng.standard_normal(g.output_shape)
    return x, w, dy, g, args


def _all(x, w, dy, g):
    return (rc.conv_forward(x, w, g), rc.conv_backward_data(dy, w, g),
            rc.conv_backward_filter(x, dy, g))


def _naive(x, w, dy, args, channels_last):
    return (naive.conv_forward(x, w, **args, channels_last=channels_last),
            naive.conv_backward_data(dy, w, x.shape, **args, channels_last=channels_last),
            naive.conv_backward_filter(x, dy, w.shape, **args, channels_last=channels_last))


@pytest.fixture(params=["gather", "columns"])
def method(request, monkeypatch):
    """Tiny problems gather; with the gather off the same ones take per-tap im2col."""
    if request.param == "columns":
        monkeypatch.setattr(rc, "GATHER_ELEMENTS", 0)
    return request.param


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_large_dilation_and_padding_match_naive_loops(method, case, channels_last):
    x, w, dy, g, args = _case(*case, channels_last)
    assert len(rc._live_taps(g)) < np.prod(g.kernel_size)  # some tap reads only padding
    for got, want in zip(_all(x, w, dy, g), _naive(x, w, dy, args, channels_last), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_large_dilation_and_padding_match_torch_in_float64(case):
    x, w, dy, g, args = _case(*case, False, seed=1)
    rank = len(x.shape) - 2
    tx = torch.from_numpy(x).requires_grad_(True)
    tw = torch.from_numpy(w).requires_grad_(True)
    ty = TORCH_CONV[rank](tx, tw, None, **args)
    ty.backward(torch.from_numpy(dy))
    got = _all(x, w, dy, g)
    for a, b in zip(got, (ty, tx.grad, tw.grad), strict=True):
        np.testing.assert_allclose(a, b.detach().numpy(), rtol=1e-12, atol=1e-12)


def test_which_taps_live():
    # 4x4 map, padding and dilation 4: offsets read -4.., 0.., 4..: only the centre reads input
    g = ConvGeometry.create((1, 1, 4, 4), (1, 1, 3, 3), 1, 4, 4)
    assert rc._live_taps(g) == (4,)
    assert rc._dead_taps(g) == (0, 1, 2, 3, 5, 6, 7, 8)
    # an ordinary 3x3 'same' convolution: every tap reads input
    g = ConvGeometry.create((1, 1, 4, 4), (1, 1, 3, 3), 1, 1, 1)
    assert rc._live_taps(g) == tuple(range(9)) and rc._dead_taps(g) == ()


def test_the_flat_form_is_taken_only_where_its_waste_is_small(monkeypatch):
    monkeypatch.setattr(rc, "GATHER_ELEMENTS", 0)
    # the ASPP layer: 1,600 positions a map for 16 outputs, one live tap of nine
    aspp = ConvGeometry.create((1, 960, 4, 4), (256, 960, 3, 3), 1, 36, 36)
    assert conv_flat.flat_layout(aspp, 4) is not None  # the flat form would apply ...
    assert rc.flat_choice(aspp, 4) is None  # ... but its cost is not taken
    same = ConvGeometry.create((8, 16, 14, 14), (16, 16, 3, 3), 1, 1, 1)
    assert rc.flat_choice(same, 4) is not None  # 256 positions for 196 outputs: flat
    tiny = ConvGeometry.create((1, 1, 4, 4), (1, 1, 3, 3), 1, 1, 1)
    monkeypatch.setattr(rc, "GATHER_ELEMENTS", 1 << 14)
    assert rc.flat_choice(tiny, 4) is None  # tiny: one gather


def test_every_form_agrees_on_a_same_convolution(monkeypatch):
    """Gather, per-tap im2col and the flat form give the same values (to float64 rounding)
    on one geometry where all three apply."""
    x, w, dy, g, args = _case((2, 3, 6, 5), 4, 3, 1, 1, 1, 1, False)
    want = _naive(x, w, dy, args, False)
    for gather, waste in ((1 << 14, 2.0), (0, 0.0), (0, 100.0)):
        monkeypatch.setattr(rc, "GATHER_ELEMENTS", gather)
        monkeypatch.setattr(rc, "FLAT_WASTE", waste)
        rc._flat_by_cost.cache_clear()
        for got, ref in zip(_all(x, w, dy, g), want, strict=True):
            np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
    rc._flat_by_cost.cache_clear()


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_weight_at_a_skipped_tap_poisons_its_channel_as_im2col_does(method, bad):
    """inf * 0 = NaN: the skipped taps' products are put back as the full columns give
    them; other channels stay finite and exact."""
    x, w, dy, g, args = _case((1, 2, 4, 4), 3, 3, 1, 4, 4, 1, False)
    w[1, 0, 0, 0] = bad  # a dead tap (a corner) of output channel 1
    y = rc.conv_forward(x, w, g)
    assert np.isnan(y[:, 1]).all()
    w_ok = w.copy()
    w_ok[1, 0, 0, 0] = 0.0
    want = naive.conv_forward(x, w_ok, **args)
    np.testing.assert_allclose(y[:, [0, 2]], want[:, [0, 2]], rtol=1e-12, atol=1e-12)
    # the data gradient's skipped taps scatter into cropped padding only: still finite
    assert np.isfinite(rc.conv_backward_data(dy, w, g)).all()


def test_a_non_finite_dz_poisons_the_skipped_taps_filter_gradient(method):
    x, w, dy, g, args = _case((1, 2, 4, 4), 3, 3, 1, 4, 4, 1, False)
    dy[0, 2, 1, 1] = np.inf
    dw = rc.conv_backward_filter(x, dy, g)
    dead = [t for t in range(9) if t != 4]
    assert np.isnan(dw[2].reshape(2, 9)[:, dead]).all()
    assert (dw[:2].reshape(2, 2, 9)[..., dead] == 0).all()
    ok = dy.copy()
    ok[0, 2, 1, 1] = 0.0
    want = naive.conv_backward_filter(x, ok, w.shape, **args)
    np.testing.assert_allclose(dw[:2], want[:2], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("channels_last", [False, True])
def test_skipped_taps_are_bitwise_the_same_for_any_thread_count(monkeypatch, channels_last):
    monkeypatch.setattr(rc, "GATHER_ELEMENTS", 0)
    monkeypatch.setattr(_threads, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(_threads, "MIN_GEMM_FLOPS", 1)
    x, w, dy, g, _ = _case((5, 4, 5, 4), 6, 3, 1, 5, 4, 2, channels_last)
    try:
        _threads.set_num_threads(1)
        one = _all(x, w, dy, g)
        _threads.set_num_threads(3)
        many = _all(x, w, dy, g)
    finally:
        _threads.set_num_threads(None)
    for a, b in zip(one, many, strict=True):
        np.testing.assert_array_equal(a, b)


def test_fused_layer_through_skipped_taps_matches_torch_float64():
    """conv_bias_act + backward (bias, relu, residual) on the ASPP geometry in small,
    against torch in float64."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 4, 4))
    w = rng.standard_normal((3, 4, 3, 3))
    b = rng.standard_normal(3)
    r = rng.standard_normal((2, 3, 4, 4))
    y, ctx = cff.conv_bias_act_forward(x, w, b, padding=4, dilation=4, activation="relu",
                                       residual=r)
    dy = rng.standard_normal(y.shape)
    grads = cff.conv_bias_act_backward(dy, ctx)
    tx, tw, tb = (torch.from_numpy(a).requires_grad_(True) for a in (x, w, b))
    ty = torch.relu(F.conv2d(tx, tw, tb, padding=4, dilation=4) + torch.from_numpy(r))
    ty.backward(torch.from_numpy(dy))
    for got, want in ((y, ty), (grads.dx, tx.grad), (grads.dweight, tw.grad),
                      (grads.dbias, tb.grad)):
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-12, atol=1e-12)
