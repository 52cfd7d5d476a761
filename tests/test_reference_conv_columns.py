"""The forward's im2col columns reused by the filter gradient (reference/conv.py
Note [kept columns]): same gradients, used only for the array they came from, capped."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from convfuse import functional as F
from convfuse.geometry import ConvGeometry
from convfuse.ops.reference import conv as rc


@pytest.fixture(autouse=True)
def _no_gather(monkeypatch):
    """These shapes are tiny: their columns would be one gather, never kept (reference/conv.py
    Note [choosing the method])."""
    monkeypatch.setattr(rc, "GATHER_ELEMENTS", 0)


def _data(rng, shape=(2, 3, 7, 6), wshape=(4, 3, 3, 3)):
    return (rng.standard_normal(shape).astype(np.float32),
            rng.standard_normal(wshape).astype(np.float32))


@pytest.fixture
def count_columns(monkeypatch):
    calls = []
    real = rc._columns

    def spy(x, geom, cd, tag=None):
        calls.append(x)
        return real(x, geom, cd, tag)

    monkeypatch.setattr(rc, "_columns", spy)
    return calls


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_backward_reuses_forward_columns_with_the_same_gradients(count_columns, layout):
    rng = np.random.default_rng(0)
    x, w = _data(rng)
    if layout == "NHWC":
        x, w = np.ascontiguousarray(x.transpose(0, 2, 3, 1)), np.ascontiguousarray(
            w.transpose(0, 2, 3, 1))
    y, ctx = F.conv_bias_act_forward(x, w, padding=1, stride=(2, 1), activation="relu",
                                     layout=layout)
    assert ctx.columns is not None and len(count_columns) == 1
    dy = rng.standard_normal(y.shape).astype(np.float32)
    got = F.conv_bias_act_backward(dy, ctx)
    assert len(count_columns) == 1  # the filter gradient built none
    plain = ctx.__class__(**{**ctx.__dict__, "columns": None})
    want = F.conv_bias_act_backward(dy, plain)
    assert len(count_columns) == 2
    np.testing.assert_array_equal(got.dweight, want.dweight)
    np.testing.assert_array_equal(got.dx, want.dx)


def test_given_columns_are_ignored_for_another_array_or_geometry(count_columns):
    rng = np.random.default_rng(1)
    x, w = _data(rng)
    _, ctx = F.conv_bias_act_forward(x, w, padding=1, stride=(2, 1))  # im2col, not flat
    other = x.copy() + 1
    g = ctx.geom
    dz = rng.standard_normal(g.output_shape).astype(np.float32)
    with rc.given_columns(ctx.columns):
        dw_other = rc.conv_backward_filter(other, dz, g)
        g2 = ConvGeometry.create(x.shape, w.shape, (2, 1), 0, 1, 1, "NCHW")
        dz2 = rng.standard_normal(g2.output_shape).astype(np.float32)
        dw_geom = rc.conv_backward_filter(x, dz2, g2)
    assert len(count_columns) == 3
    np.testing.assert_array_equal(dw_other, rc.conv_backward_filter(other, dz, g))
    np.testing.assert_array_equal(dw_geom, rc.conv_backward_filter(x, dz2, g2))


def test_kept_columns_are_capped_and_released(monkeypatch):
    rng = np.random.default_rng(2)
    x, w = _data(rng)
    gc.collect()
    before = rc.kept_bytes()
    _, ctx = F.conv_bias_act_forward(x, w, padding=1)
    size = ctx.columns.cols.nbytes
    assert rc.kept_bytes() == before + size
    monkeypatch.setattr(rc, "KEEP_COLUMNS_BYTES", rc.kept_bytes() + size - 1)
    _, ctx2 = F.conv_bias_act_forward(x, w, padding=1)
    assert ctx2.columns is None  # over the cap: the backward rebuilds them
    dy = rng.standard_normal(ctx2.geom.output_shape).astype(np.float32)
    np.testing.assert_array_equal(F.conv_bias_act_backward(dy, ctx2).dweight,
                                  F.conv_bias_act_backward(dy, ctx).dweight)
    del ctx
    gc.collect()
    assert rc.kept_bytes() == before


def test_results_never_alias_the_reused_scratch_buffers(monkeypatch):
    """Note [scratch buffers]: transients are reused, results are not (tiny cap so the
    small arrays here go through the scratch path)."""
    from convfuse.ops.reference import _threads

    monkeypatch.setattr(_threads, "SCRATCH_MIN_BYTES", 0)
    rng = np.random.default_rng(4)
    x, w = _data(rng)
    g = ConvGeometry.create(x.shape, w.shape, 1, 1, 1, 1, "NCHW")
    dz = rng.standard_normal(g.output_shape).astype(np.float32)
    y1, dx1 = rc.conv_forward(x, w, g), rc.conv_backward_data(dz, w, g)
    dw1 = rc.conv_backward_filter(x, dz, g)
    keep = [a.copy() for a in (y1, dx1, dw1)]
    y2, dx2 = rc.conv_forward(2 * x, w, g), rc.conv_backward_data(2 * dz, w, g)
    dw2 = rc.conv_backward_filter(2 * x, dz, g)
    for a, b in zip((y1, dx1, dw1), keep, strict=True):
        np.testing.assert_array_equal(a, b)  # a later call did not overwrite them
    np.testing.assert_allclose(y2, 2 * y1, rtol=1e-6)
    np.testing.assert_allclose(dx2, 2 * dx1, rtol=1e-6)
    np.testing.assert_allclose(dw2, 2 * dw1, rtol=1e-6)
