"""ConvGeometry: shapes against a brute-force count of window positions, and every rejection."""

from __future__ import annotations

import itertools

import pytest

from convfuse.geometry import ConvGeometry, conv_output_size, parse_layout


def count_windows(size: int, k: int, s: int, p: int, d: int) -> int:
    """Independent oracle: slide the dilated window over the padded axis and count fits."""
    span = d * (k - 1) + 1
    return sum(1 for start in range(0, size + 2 * p, s) if start + span <= size + 2 * p)


@pytest.mark.parametrize("size,k,s,p,d", [
    (n, k, s, p, d)
    for n, k, s, p, d in itertools.product((1, 5, 8, 13), (1, 2, 3), (1, 2, 3), (0, 1, 2), (1, 2))
    if d * (k - 1) + 1 <= n + 2 * p
])
def test_output_size_matches_window_count(size, k, s, p, d):
    assert conv_output_size(size, k, s, p, d) == count_windows(size, k, s, p, d)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_shapes_per_layout(rank, layout):
    spatial = (9, 7, 6)[:rank]
    kernel = (3, 2, 1)[:rank]
    cl = layout == "NHWC"
    x = (2, *spatial, 6) if cl else (2, 6, *spatial)
    w = (4, *kernel, 3) if cl else (4, 3, *kernel)
    g = ConvGeometry.create(x, w, stride=2, padding=1, dilation=1, groups=2, layout=layout)
    out_sp = tuple(count_windows(n, k, 2, 1, 1) for n, k in zip(spatial, kernel))
    assert g.output_shape_cf == (2, 4, *out_sp)
    assert g.output_shape == ((2, *out_sp, 4) if cl else (2, 4, *out_sp))
    assert g.in_channels == 6 and g.out_channels == 4 and g.kernel_size == kernel
    assert g.channel_axis == (rank + 1 if cl else 1)
    assert set(g.reduce_axes) | {g.channel_axis} == set(range(rank + 2))
    # flops: 2 * outputs * (C/groups * prod(kernel))
    n_out = 2 * 4
    for v in out_sp:
        n_out *= v
    per = 3
    for v in kernel:
        per *= v
    assert g.flops() == 2 * n_out * per


def test_padding_same_and_valid():
    g = ConvGeometry.create((1, 1, 10), (1, 1, 5), padding="same", dilation=2)
    assert g.padding == (4,) and g.output_shape == (1, 1, 10)
    assert ConvGeometry.create((1, 1, 10), (1, 1, 5), padding="valid").output_shape == (1, 1, 6)
    with pytest.raises(ValueError, match="asymmetric"):
        ConvGeometry.create((1, 1, 10), (1, 1, 4), padding="same")
    with pytest.raises(ValueError, match="stride 1"):
        ConvGeometry.create((1, 1, 10), (1, 1, 3), padding="same", stride=2)


@pytest.mark.parametrize("kwargs,x,w,message", [
    (dict(padding=-1), (1, 3, 8, 8), (4, 3, 3, 3), "padding must be >= 0"),
    (dict(stride=0), (1, 3, 8, 8), (4, 3, 3, 3), "stride must be >= 1"),
    (dict(dilation=0), (1, 3, 8, 8), (4, 3, 3, 3), "dilation must be >= 1"),
    (dict(groups=2), (1, 3, 8, 8), (4, 3, 3, 3), "divisible by groups"),
    (dict(groups=2), (1, 4, 8, 8), (3, 2, 3, 3), r"out_channels \(3\) must be divisible"),
    (dict(), (1, 4, 8, 8), (4, 3, 3, 3), r"input channels must match the weight: 4 vs. 3"),
    (dict(), (1, 3, 2, 2), (4, 3, 3, 3), "kernel larger than the padded input"),
    (dict(dilation=4), (1, 3, 8, 8), (4, 3, 3, 3), "dilated kernel 9"),
    (dict(), (1, 3, 8), (4, 3, 3, 3), "input must have 4 dims"),
    (dict(), (1, 3, 8, 8), (4, 3), "weight must have 3, 4 or 5 dims"),
    (dict(layout="NCW"), (1, 3, 8, 8), (4, 3, 3, 3), "for 1-d convolutions"),
    (dict(layout="NCHWX"), (1, 3, 8, 8), (4, 3, 3, 3), "unknown layout"),
    (dict(stride=(1, 2, 3)), (1, 3, 8, 8), (4, 3, 3, 3), "stride must be an int or 2 ints"),
    (dict(padding=1.5), (1, 3, 8, 8), (4, 3, 3, 3), "padding must be an int"),
    (dict(), (1, 0, 8, 8), (4, 3, 3, 3), "non-positive"),
    (dict(), (1, 3, 8, 0), (4, 3, 3, 3), "non-positive"),
])
def test_rejections_name_the_problem(kwargs, x, w, message):
    with pytest.raises(ValueError, match=message):
        ConvGeometry.create(x, w, **kwargs)


def test_layout_names():
    assert parse_layout("nhwc") is True and parse_layout("NCDHW", 3) is False
    g = ConvGeometry.create((1, 5, 2), (3, 1, 2), layout="NWC")
    assert g.layout == "NWC" and g.input_shape_cf == (1, 2, 5)


def test_geometry_is_hashable_and_equal_by_value():
    a = ConvGeometry.create((1, 3, 8, 8), (4, 3, 3, 3), padding=1)
    b = ConvGeometry.create((1, 3, 8, 8), (4, 3, 3, 3), padding=(1, 1))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
