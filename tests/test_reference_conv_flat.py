"""Stride-1 convolutions on the flat padded input (reference/conv_flat.py Note [flat padded
convolution], Note [by images]): naive loops as the oracle for both forms, blocks small
enough to split tiny problems, any thread count bitwise the same, and the filter gradient
safe from gap outputs' 0 * inf."""

from __future__ import annotations

import numpy as np
import pytest

from convfuse import functional as F
from convfuse.geometry import ConvGeometry
from convfuse.ops.reference import _threads, conv_flat, conv_images
from convfuse.ops.reference import conv as rc

from . import naive

LAYOUTS = {1: ("NCW", "NWC"), 2: ("NCHW", "NHWC"), 3: ("NCDHW", "NDHWC")}

# (x shape channels-first, K, kernel, padding, dilation, groups)
CASES = [
    ((2, 3, 9), 4, 3, 1, 1, 1),
    ((2, 3, 9), 4, 3, 0, 2, 1),
    ((2, 4, 6, 7), 6, 3, 1, 1, 2),
    ((3, 2, 5, 6), 3, (3, 2), (1, 0), (1, 2), 1),
    ((2, 2, 7, 5), 2, 3, 2, 1, 1),  # padding == reach: a "full" convolution
    ((2, 3, 4, 5), 4, 1, 0, 1, 1),  # 1x1
    ((1, 2, 4, 5, 3), 2, (3, 3, 1), (1, 1, 0), 1, 2),
]


@pytest.fixture(params=["flat", "images"])
def form(request, monkeypatch):
    """Both forms of a stride-1 conv: all positions in blocks, or image by image (where the
    layout allows it: channels first). Tiny problems would take the gather instead
    (reference/conv.py Note [choosing the method]): not here."""
    monkeypatch.setattr(rc, "GATHER_ELEMENTS", 0)
    monkeypatch.setattr(conv_images, "IMAGE_MAX_ROWS", 0 if request.param == "flat" else 1 << 30)
    monkeypatch.setattr(conv_images, "IMAGE_MIN_OUT", 1)
    return request.param


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 4 outputs, so tiny problems split into many; and every pass threaded."""
    monkeypatch.setattr(rc, "GATHER_ELEMENTS", 0)
    monkeypatch.setattr(conv_flat, "BLOCK_BYTES", 1)
    monkeypatch.setattr(conv_flat, "MIN_BLOCK", 4)
    monkeypatch.setattr(conv_flat, "BLOCK_ALIGN", 4)
    monkeypatch.setattr(_threads, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(_threads, "MIN_GEMM_FLOPS", 1)
    conv_flat.flat_layout.cache_clear()
    yield
    conv_flat.flat_layout.cache_clear()
    _threads.set_num_threads(None)


def _case(shape, k, kernel, padding, dilation, groups, channels_last, seed=0):
    rank = len(shape) - 2
    kernel = (kernel,) * rank if isinstance(kernel, int) else kernel
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    w = rng.standard_normal((k, shape[1] // groups, *kernel))
    if channels_last:
        x, w = (np.ascontiguousarray(np.moveaxis(a, 1, -1)) for a in (x, w))
    layout = LAYOUTS[rank][channels_last]
    g = ConvGeometry.create(x.shape, w.shape, 1, padding, dilation, groups, layout)
    dy = rng.standard_normal(g.output_shape)
    return x, w, dy, g


def _ours(x, w, dy, g):
    return (rc.conv_forward(x, w, g), rc.conv_backward_data(dy, w, g),
            rc.conv_backward_filter(x, dy, g))


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_flat_path_matches_naive_loops_over_many_blocks_and_threads(small_blocks, form, case,
                                                                    channels_last):
    x, w, dy, g = _case(*case, channels_last)
    layout = conv_flat.flat_layout(g, 8)
    assert layout is not None and len(layout.blocks()) > 3
    assert conv_images.by_images(g) == (form == "images" and not channels_last)
    args = dict(stride=1, padding=g.padding, dilation=g.dilation, groups=g.groups,
                channels_last=channels_last)
    want = (naive.conv_forward(x, w, **args),
            naive.conv_backward_data(dy, w, x.shape, **args),
            naive.conv_backward_filter(x, dy, w.shape, **args))
    results = []
    for n in (1, 3):
        _threads.set_num_threads(n)
        results.append(_ours(x, w, dy, g))
    for one, many, oracle in zip(*results, want, strict=True):
        np.testing.assert_array_equal(one, many)  # the thread count changes no bit
        np.testing.assert_allclose(one, oracle, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("stride", "padding"), [(2, 1), (1, 3)])
def test_strides_and_padding_past_the_reach_take_the_im2col_path(stride, padding):
    g = ConvGeometry.create((2, 3, 8, 8), (4, 3, 3, 3), stride, padding, 1, 1, "NCHW")
    assert conv_flat.flat_layout(g, 4) is None


def test_gap_layout_for_a_same_convolution():
    g = ConvGeometry.create((5, 3, 14, 14), (4, 3, 3, 3), 1, 1, 1, 1, "NCHW")
    layout = conv_flat.flat_layout(g, 4)
    # one shared gap column and row: 15 x 15 positions per 14 x 14 image
    assert layout.pitches == (15, 15) and layout.positions == 5 * 225
    assert layout.lead == 16 and layout.length == 16 + 5 * 225 + 2 * 15 + 2


def test_a_gap_output_reading_inf_does_not_turn_a_finite_weight_gradient_into_nan(form):
    """0 * inf at a gap output: the flat sum has a NaN where the true dw is finite, so the
    exact path is taken (Note [flat padded convolution])."""
    x, w, dy, g = _case((2, 2, 6, 6), 3, 3, 1, 1, 1, False, seed=3)
    x[0, 1, 5, 5] = np.inf  # the last real element: gap outputs read it at offset (0, 0)
    args = dict(stride=1, padding=1)
    want = naive.conv_backward_filter(x, dy, w.shape, **args)
    layout = conv_flat.flat_layout(g, 8)
    flat = conv_flat.flat_input(x, g, layout, np.dtype(np.float64))
    raw = conv_flat.flat_filter_grad(flat, conv_flat.flat_output(dy, g, layout,
                                                                 np.dtype(np.float64), "t"),
                                     g, layout).reshape(w.shape)
    assert np.isnan(raw[:, 1, 0, 0]).all() and np.isfinite(want[:, 1, 0, 0]).all()
    got = rc.conv_backward_filter(x, dy, g)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-12)


def test_the_forward_keeps_its_flat_input_for_the_filter_gradient(monkeypatch, form):
    calls = []
    real = conv_flat.flat_input

    def spy(x_cf, geom, layout, cd, tag=None):
        calls.append(tag)
        return real(x_cf, geom, layout, cd, tag)

    monkeypatch.setattr(conv_flat, "flat_input", spy)
    x, w, _, _ = _case((2, 3, 7, 6), 4, 3, 1, 1, 1, False)
    y, ctx = F.conv_bias_act_forward(x, w, padding=1, activation="relu")
    assert ctx.columns is not None and ctx.columns.kind == "flat" and calls == [None]
    dy = np.random.default_rng(1).standard_normal(y.shape)
    got = F.conv_bias_act_backward(dy, ctx, need_dx=False)
    assert calls == [None]  # the filter gradient built no second copy of x
    plain = F.conv_bias_act_backward(
        dy, ctx.__class__(**{**ctx.__dict__, "columns": None}), need_dx=False)
    assert calls == [None, "conv_x_flat"]
    np.testing.assert_array_equal(got.dweight, plain.dweight)


@pytest.mark.parametrize(("partials", "partial_bytes"), [(3, 1 << 30), (16, 1)])
def test_filter_gradient_sums_blocks_in_fixed_runs(small_blocks, form, monkeypatch, partials,
                                                   partial_bytes):
    """Runs of several blocks per partial (PARTIALS), or one run when the weight-sized
    partials would pass PARTIAL_BYTES: the same gradient, any thread count."""
    monkeypatch.setattr(conv_flat, "PARTIALS", partials)
    monkeypatch.setattr(conv_flat, "PARTIAL_BYTES", partial_bytes)
    x, w, dy, g = _case((8, 4, 6, 7), 6, 3, 1, 1, 2, False)  # 8 one-image blocks by images
    assert len(conv_flat.flat_layout(g, 8).blocks()) > 3 * min(partials, 3)
    want = naive.conv_backward_filter(x, dy, w.shape, stride=1, padding=1, groups=2)
    got = []
    for n in (1, 2):
        _threads.set_num_threads(n)
        got.append(rc.conv_backward_filter(x, dy, g))
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_allclose(got[0], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("x_shape", "w_shape", "layout", "groups", "want"), [
    ((2, 1, 8, 8), (16, 1, 3, 3), "NCHW", 1, True),  # 9 rows, 16 outputs
    ((2, 16, 8, 8), (32, 16, 3, 3), "NCHW", 1, True),  # 144 rows
    ((2, 32, 8, 8), (32, 32, 3, 3), "NCHW", 1, False),  # 288 rows: flat
    ((2, 16, 8, 8), (1, 16, 3, 3), "NCHW", 1, False),  # one output channel
    ((2, 16, 8, 8), (16, 4, 3, 3), "NCHW", 4, False),  # 4 outputs per group
    ((2, 8, 8, 1), (16, 3, 3, 1), "NHWC", 1, False),  # channels last: flat
])
def test_which_convs_go_by_images(x_shape, w_shape, layout, groups, want):
    g = ConvGeometry.create(x_shape, w_shape, 1, 1, 1, groups, layout)
    assert conv_images.by_images(g) is want


@pytest.mark.parametrize("shape", [(2, 3, 5, 6), (2, 3, 7), (1, 2, 3, 4, 5)])
def test_reused_buffers_get_every_gap_zeroed(monkeypatch, shape):
    """F and dz-at-positions come from scratch buffers that hold old data: poisoned here
    with NaN, every gap must read 0 and every real element its value."""
    rank = len(shape) - 2
    monkeypatch.setattr(_threads, "scratch", lambda tag, s, dt: np.full(s, np.nan, dt))
    rng = np.random.default_rng(2)
    x = rng.standard_normal(shape)
    g = ConvGeometry.create(shape, (4, shape[1], *(3,) * rank), 1, 1, 1, 1,
                            LAYOUTS[rank][0])
    layout = conv_flat.flat_layout(g, 8)
    flat = conv_flat.flat_input(x, g, layout, np.dtype(np.float64), tag="poisoned")
    assert not np.isnan(flat).any()
    assert np.count_nonzero(flat) == np.count_nonzero(x)
    inner = (slice(None), slice(None), *(slice(0, s) for s in shape[2:]))
    images = flat[:, layout.lead:layout.lead + layout.positions].reshape(
        shape[1], shape[0], *layout.pitches)
    np.testing.assert_array_equal(images[inner], x.swapaxes(0, 1))
    dz = rng.standard_normal(g.output_shape)
    dzq = conv_flat.flat_output(dz, g, layout, np.dtype(np.float64), "poisoned")
    assert not np.isnan(dzq).any() and np.count_nonzero(dzq) == np.count_nonzero(dz)
