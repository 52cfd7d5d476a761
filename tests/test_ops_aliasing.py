"""Outputs may not share memory with inputs (cuDNN and the reference engine cannot compute
in place), except that an elementwise activation op may write into exactly its input.

Arrays here are views of one buffer, overlapping or just touching. NumPy cases run the
reference engine where the call is accepted, against results computed on separate copies.
CuPy arrays are real `cupy.ndarray` objects over fake device addresses (as in
tests/test_ops_validation.py); validation reads only their metadata, and the engine is
stubbed, so nothing dereferences them.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import convfuse.ops as ops
from convfuse.geometry import ConvGeometry
from convfuse.ops import _checks

GEOM = ConvGeometry.create((2, 4, 5, 5), (6, 2, 3, 3), padding=1, groups=2)
MATCH = r"{op}: {out} overlaps input '{inp}' \(cuDNN cannot compute in place\); pass a separate"


def views(rng, *shapes, offsets=None):
    """Arrays of `shapes` over one float32 buffer, the i-th starting at element
    offsets[i] (default: packed end to end, so neighbours touch but do not overlap)."""
    sizes = [int(np.prod(s)) for s in shapes]
    if offsets is None:
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    buf = rng.standard_normal(max(o + n for o, n in zip(offsets, sizes))).astype(np.float32)
    return buf, [buf[o:o + n].reshape(s) for o, n, s in zip(offsets, sizes, shapes)]


def refused(op, out, inp, buf, call):
    """`call()` raises the overlap error naming `out` and `inp`, and the buffer is unchanged."""
    before = buf.copy()
    with pytest.raises(ValueError, match=MATCH.format(op=op, out=out, inp=inp)):
        call()
    np.testing.assert_array_equal(buf, before)


# ---------------------------------------------------------------- convolution gradients

@pytest.mark.parametrize("victim", ["dz", "w"])
def test_conv_backward_data_out_overlapping_an_input(rng, victim):
    g = GEOM
    # out starts one element before the input ends (dz) or inside it (w).
    n_dz, n_w = int(np.prod(g.output_shape)), int(np.prod(g.weight_shape))
    starts = {"dz": [0, n_dz, n_dz - 1], "w": [0, n_dz, n_dz + 3]}[victim]
    buf, (dz, w, out) = views(rng, g.output_shape, g.weight_shape, g.input_shape,
                              offsets=starts)
    assert n_w > 3
    refused("conv_backward_data", "out", victim, buf,
            lambda: ops.conv_backward_data(dz, w, g, out=out, beta=1.0))


@pytest.mark.parametrize("victim", ["x", "dz"])
def test_conv_backward_filter_out_overlapping_an_input(rng, victim):
    g = GEOM
    n_x = int(np.prod(g.input_shape))
    n_dz = int(np.prod(g.output_shape))
    starts = {"x": [0, n_x, 5], "dz": [0, n_x, n_x + n_dz - 1]}[victim]
    buf, (x, dz, out) = views(rng, g.input_shape, g.output_shape, g.weight_shape,
                              offsets=starts)
    refused("conv_backward_filter", "out", victim, buf,
            lambda: ops.conv_backward_filter(x, dz, g, out=out))


def test_conv_backward_bias_out_inside_dz(rng):
    buf, (dz, out) = views(rng, GEOM.output_shape, GEOM.bias_shape, offsets=[0, 7])
    refused("conv_backward_bias", "out", "dz", buf,
            lambda: ops.conv_backward_bias(dz, GEOM, out=out))


def test_touching_views_of_one_buffer_are_accepted_and_computed_right(rng):
    """Packed end to end, the views share a buffer but no byte: no false positive, and the
    results equal those computed on separate copies (the oracle: inputs were not clobbered
    while outputs were written)."""
    g = GEOM
    _, (x, w, dz, dx, dw, db) = views(rng, g.input_shape, g.weight_shape, g.output_shape,
                                      g.input_shape, g.weight_shape, g.bias_shape)
    xc, wc, dzc = x.copy(), w.copy(), dz.copy()
    init = [dx.copy(), dw.copy(), db.copy()]
    want_dx = ops.conv_backward_data(dzc, wc, g, out=init[0].copy(), beta=1.0)
    want_dw = ops.conv_backward_filter(xc, dzc, g, out=init[1].copy(), beta=1.0)
    want_db = ops.conv_backward_bias(dzc, g, out=init[2].copy(), beta=1.0)
    assert ops.conv_backward_data(dz, w, g, out=dx, beta=1.0) is dx
    assert ops.conv_backward_filter(x, dz, g, out=dw, beta=1.0) is dw
    assert ops.conv_backward_bias(dz, g, out=db, beta=1.0) is db
    np.testing.assert_array_equal(dx, want_dx)
    np.testing.assert_array_equal(dw, want_dw)
    np.testing.assert_array_equal(db, want_db)
    np.testing.assert_array_equal(x, xc)
    np.testing.assert_array_equal(w, wc)
    np.testing.assert_array_equal(dz, dzc)
    # beta=1 really accumulated: dx differs from a fresh (beta=0) result by the old dx.
    fresh = ops.conv_backward_data(dzc, wc, g)
    np.testing.assert_allclose(want_dx - fresh, init[0], rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- activations

def test_activation_forward_in_place_is_allowed(rng):
    z = rng.standard_normal((3, 7)).astype(np.float32)
    z_before = z.copy()
    assert ops.activation_forward(z, "relu", out=z) is z
    np.testing.assert_array_equal(z, np.maximum(z_before, 0))
    # A view covering exactly the same bytes is the same memory too.
    z2 = rng.standard_normal((3, 7)).astype(np.float32)
    want = np.tanh(z2.astype(np.float64))
    out = z2.reshape(3, 7)
    assert out is not z2 and out.base is z2
    ops.activation_forward(z2, "tanh", out=out)
    np.testing.assert_allclose(z2, want, rtol=1e-6)


@pytest.mark.parametrize("shift", [1, -1, 20, 21])
def test_activation_forward_partial_overlap_is_refused(rng, shift):
    buf = rng.standard_normal(70).astype(np.float32)
    z = buf[20:41].reshape(3, 7)
    out = buf[20 + shift:41 + shift].reshape(3, 7)
    if shift == 21:  # touching, not overlapping: accepted
        want = np.maximum(z, 0)
        ops.activation_forward(z, "relu", out=out)
        np.testing.assert_array_equal(out, want)
        return
    refused("activation_forward", "out", "z", buf,
            lambda: ops.activation_forward(z, "relu", out=out))


@pytest.mark.parametrize("into", ["dy", "saved"])
def test_activation_backward_in_place_is_allowed(rng, into):
    dy = rng.standard_normal((4, 5)).astype(np.float32)
    y = np.maximum(rng.standard_normal((4, 5)), 0).astype(np.float32)
    want = np.where(y > 0, dy, 0)  # relu' from the saved output
    out = dy if into == "dy" else y
    assert ops.activation_backward(dy, y, "relu", out=out) is out
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("victim", ["dy", "saved"])
def test_activation_backward_partial_overlap_is_refused(rng, victim):
    offsets = {"dy": [0, 20, 3], "saved": [0, 20, 37]}[victim]
    buf, (dy, saved, out) = views(rng, (4, 5), (4, 5), (4, 5), offsets=offsets)
    refused("activation_backward", "out", victim, buf,
            lambda: ops.activation_backward(dy, saved, "sigmoid", out=out))


@pytest.mark.parametrize("victim", ["dy", "saved"])
def test_activation_backward_bias_db_out_overlapping_an_input(rng, victim):
    g = GEOM
    n = int(np.prod(g.output_shape))
    offsets = {"dy": [0, n, n - 2], "saved": [0, n, n + 10]}[victim]
    buf, (dy, saved, db) = views(rng, g.output_shape, g.output_shape, g.bias_shape,
                                 offsets=offsets)
    refused("activation_backward_bias", "db_out", victim, buf,
            lambda: ops.activation_backward_bias(dy, saved, "relu", g, db_out=db))


def test_activation_backward_bias_db_out_touching_is_accepted(rng):
    g = GEOM
    _, (dy, y, db) = views(rng, g.output_shape, g.output_shape, g.bias_shape)
    y[...] = np.maximum(y, 0)
    dz_want = np.where(y > 0, dy, 0).astype(np.float64)
    db_want = dz_want.sum(axis=(0, 2, 3)) + db.astype(np.float64)
    dz, got = ops.activation_backward_bias(dy, y, "relu", g, db_out=db, beta=1.0)
    assert got is db
    np.testing.assert_allclose(dz, dz_want, rtol=0, atol=0)
    np.testing.assert_allclose(db, db_want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- CuPy arrays (address ranges)

@pytest.fixture
def cupy_engine(monkeypatch):
    """Fake CuPy arrays pass the device check; the engine records calls, never runs."""
    cp = pytest.importorskip("cupy")
    monkeypatch.setattr(_checks, "current_device", lambda: 0)
    calls = []

    def engine(xp, kind):
        assert xp is cp
        return SimpleNamespace(**{
            name: (lambda *a, _n=name: calls.append(_n) or "ran")
            for name in ("conv_backward_data", "conv_backward_filter", "conv_backward_bias",
                         "activation_forward", "activation_backward",
                         "activation_backward_bias")
        })

    monkeypatch.setattr(_checks, "engine", engine)
    return cp, calls


def fake(cp, mem, offset, shape, dtype=np.float32):
    """A cupy.ndarray at byte `offset` of the fake allocation `mem` (never dereferenced)."""
    return cp.ndarray(shape, np.dtype(dtype), memptr=cp.cuda.memory.MemoryPointer(mem, offset))


def fake_memory(cp, nbytes, base=1 << 40):
    return cp.cuda.memory.UnownedMemory(base, nbytes, None, device_id=0)


def test_cupy_overlap_is_found_from_address_ranges(cupy_engine):
    cp, calls = cupy_engine
    g = GEOM
    nb = {k: int(np.prod(s)) * 4 for k, s in (("dz", g.output_shape), ("w", g.weight_shape),
                                              ("x", g.input_shape), ("b", g.bias_shape))}
    mem = fake_memory(cp, 1 << 16)
    dz, w = fake(cp, mem, 0, g.output_shape), fake(cp, mem, nb["dz"], g.weight_shape)
    # out's first 16 bytes are dz's last 16: a range overlap, found without the device.
    out = fake(cp, mem, nb["dz"] - 16, g.input_shape)
    with pytest.raises(ValueError, match=MATCH.format(op="conv_backward_data", out="out",
                                                      inp="dz")):
        ops.conv_backward_data(dz, w, g, out=out)
    # Packed end to end (out starts where w ends): accepted, and the engine ran.
    out = fake(cp, mem, nb["dz"] + nb["w"], g.input_shape)
    assert ops.conv_backward_data(dz, w, g, out=out) == "ran"
    # db_out starting exactly where dy ends is fine; 16 bytes earlier is not.
    dy = fake(cp, mem, 16384, g.output_shape)
    db = fake(cp, mem, 16384 + nb["dz"], g.bias_shape)
    assert ops.activation_backward_bias(dy, dy, "relu", g, db_out=db) == "ran"
    db = fake(cp, mem, 16384 + nb["dz"] - 16, g.bias_shape)
    with pytest.raises(ValueError, match=MATCH.format(op="activation_backward_bias",
                                                      out="db_out", inp="dy")):
        ops.activation_backward_bias(dy, None, "identity", g, db_out=db)
    # Separate allocations at distant addresses never overlap.
    other = fake_memory(cp, nb["x"], base=(1 << 40) + (1 << 20))
    x = fake(cp, other, 0, g.input_shape)
    assert ops.conv_backward_filter(x, dz, g, out=fake(cp, mem, 8192, g.weight_shape)) == "ran"
    with pytest.raises(ValueError, match=MATCH.format(op="conv_backward_bias", out="out",
                                                      inp="dz")):
        ops.conv_backward_bias(dz, g, out=fake(cp, mem, 32, g.bias_shape))
    assert calls == ["conv_backward_data", "activation_backward_bias", "conv_backward_filter"]


def test_cupy_in_place_activation_only_on_the_same_memory(cupy_engine):
    cp, calls = cupy_engine
    mem = fake_memory(cp, 4096)
    z = fake(cp, mem, 0, (4, 8))
    assert ops.activation_forward(z, "gelu", out=z) == "ran"
    assert ops.activation_forward(z, "gelu", out=fake(cp, mem, 0, (4, 8))) == "ran"
    assert ops.activation_backward(z, z, "sigmoid", out=z) == "ran"
    shifted = fake(cp, mem, 16, (4, 8))
    with pytest.raises(ValueError, match=MATCH.format(op="activation_forward", out="out",
                                                      inp="z") + r".*the input itself"):
        ops.activation_forward(z, "gelu", out=shifted)
    dy = fake(cp, mem, 1024, (4, 8))
    with pytest.raises(ValueError, match=MATCH.format(op="activation_backward", out="out",
                                                      inp="saved")):
        ops.activation_backward(dy, z, "sigmoid", out=shifted)
    assert calls == ["activation_forward"] * 2 + ["activation_backward"]


def test_exact_same_memory_is_refused_outside_elementwise_ops(rng):
    """With C == K and 'same' padding dz and dx have one shape, yet the convolution reads
    neighbours of every element, so even out=dz itself is refused."""
    g = ConvGeometry.create((1, 3, 4, 4), (3, 3, 3, 3), padding=1)
    assert g.input_shape == g.output_shape
    dz = rng.standard_normal(g.output_shape).astype(np.float32)
    w = rng.standard_normal(g.weight_shape).astype(np.float32)
    refused("conv_backward_data", "out", "dz", dz,
            lambda: ops.conv_backward_data(dz, w, g, out=dz))


def test_the_byte_range_of_a_strided_view_follows_its_strides():
    """The device arrays' overlap rule compares byte ranges: a view's is its strides' span
    (what np.may_share_memory bounds), not [first byte, first byte + nbytes)."""
    from convfuse.ops._checks import _span

    a = np.zeros((4, 6))
    for view in (a, a[:, ::2], a[::-1], a[:, 1:3], a.T, a[::-1, ::-2], a[:0]):
        lo, hi = _span(view)
        if view.size == 0:
            assert lo == hi
            continue
        start = view.__array_interface__["data"][0]
        # every element's address, from its index and the strides
        offsets = sum(i * s for i, s in zip(np.indices(view.shape), view.strides))
        assert (lo, hi) == (start + offsets.min(), start + offsets.max() + view.itemsize)


def test_a_strided_device_view_overlaps_by_its_span():
    """overlaps_view on device arrays (CuPy's branch, with stand-ins): the caller's strided
    dy against an output, by the bytes each spans."""
    import types

    from convfuse.ops._checks import overlaps_view

    def device(ptr, shape, strides, itemsize=4):
        return types.SimpleNamespace(data=types.SimpleNamespace(ptr=ptr), shape=shape,
                                     strides=strides, itemsize=itemsize,
                                     size=int(np.prod(shape)), nbytes=int(np.prod(shape)) * 4)

    dy = device(1000, (2, 3), (48, 8))  # every other float of a (2, 6) array: [1000, 1068)
    assert overlaps_view(device(1060, (2,), (4,)), dy)  # inside its span, past nbytes
    assert not overlaps_view(device(1068, (2,), (4,)), dy)
    flipped = device(1048, (2, 3), (-48, 8))  # rows reversed: [1000, 1068) again
    assert overlaps_view(device(1000, (1,), (4,)), flipped)
    assert not overlaps_view(device(996, (1,), (4,)), flipped)
