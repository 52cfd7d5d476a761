"""Note [batch split] in convfuse/ops/cudnn/split.py: a convolution whose x or y has more
elements than cuDNN's 32-bit descriptors index runs as parts of its batch. Checked on the
fake GPU of tests/test_ops_cudnn_wiring.py (arrays over fake addresses, so no memory is
taken): each part's call gets its part plan's descriptors and the pointers of its rows, the
data gradient keeps the caller's beta per part, and the filter gradient blends it in the
first part only. tests/gpu/test_batch_split_gpu.py checks the numbers on a device."""

from __future__ import annotations

import math

import numpy as np
import pytest

import convfuse.ops as ops
from convfuse import config
from convfuse.errors import TensorTooLargeError
from convfuse.geometry import ConvGeometry
from convfuse.ops.cudnn import bound, split
from convfuse.plan import get_plan, get_transpose_plan
from convfuse.plan.descriptors import MAX_ELEMENTS
from convfuse.transpose_geometry import ConvTransposeGeometry
from tests.test_ops_cudnn_wiring import FakeGpu

FUSED = "convolutionBiasActivationForward"


def _shape(channels_last, n, c, *spatial):
    return (n, *spatial, c) if channels_last else (n, c, *spatial)


def big(channels_last=False, n=5):
    """x of n x 8 x 8192 x 8192: 2**29 elements a sample, so 3 samples a part (4 would be
    2**31, one past the limit); 3 x 3 kernel, padding 1, so y has x's shape."""
    layout = "NHWC" if channels_last else "NCHW"
    return ConvGeometry.create(_shape(channels_last, n, 8, 8192, 8192),
                               _shape(channels_last, 8, 8, 3, 3), padding=1, layout=layout)


@pytest.fixture
def gpu(monkeypatch):
    fake = FakeGpu(monkeypatch)
    with config.flags(max_array_bytes=1 << 50):  # fake addresses: nothing is allocated
        yield fake


def part_bytes(geom, rows, dtype="float16"):
    return rows * math.prod(geom.input_shape[1:]) * np.dtype(dtype).itemsize


# -- which parts ----------------------------------------------------------------------


@pytest.mark.parametrize("n, expect", [(4, [(0, 3), (3, 4)]), (5, [(0, 3), (3, 5)]),
                                       (6, [(0, 3), (3, 6)]), (7, [(0, 3), (3, 6), (6, 7)])])
def test_a_batch_splits_into_the_largest_parts_that_fit(n, expect):
    geom = big(n=n)
    parts = split.parts(geom)
    assert [(i, j) for _, i, j in parts] == expect
    for g, i, j in parts:
        assert g.input_shape == (j - i, *geom.input_shape[1:])
        assert g.output_shape == (j - i, *geom.output_shape[1:])
        assert (g.weight_shape, g.stride, g.padding, g.dilation, g.groups, g.layout) == \
            (geom.weight_shape, geom.stride, geom.padding, geom.dilation, geom.groups,
             geom.layout)
        assert math.prod(g.input_shape) <= MAX_ELEMENTS
    # a part of one more sample would not fit: the parts are as large as they can be
    assert 4 * math.prod(geom.input_shape[1:]) > MAX_ELEMENTS
    # equal parts share one geometry (one plan)
    assert len({g for g, _, _ in parts}) == len({j - i for _, i, j in parts})


def test_parts_start_on_16_byte_boundaries():
    """99,980,001 elements a sample (odd): 21 samples would fit a part, 16 keep every
    part's offset a multiple of 16 bytes in x and y for any itemsize."""
    geom = ConvGeometry.create((40, 1, 9999, 9999), (1, 1, 3, 3), padding=1)
    parts = split.parts(geom)
    assert [(i, j) for _, i, j in parts] == [(0, 16), (16, 32), (32, 40)]
    assert all(i * math.prod(geom.input_shape[1:]) % 16 == 0 for _, i, _ in parts)
    # too large a sample for 16 of them in a part: as many as fit, unaligned
    wide = ConvGeometry.create((7, 1, 20001, 20001), (1, 1, 1, 1))
    assert [(i, j) for _, i, j in split.parts(wide)] == [(0, 5), (5, 7)]


def test_the_larger_of_x_and_y_sets_the_part():
    # y has twice x's channels: y's 2**30 elements a sample allow one sample a part
    geom = ConvGeometry.create((3, 8, 8192, 8192), (16, 8, 1, 1))
    assert [(i, j) for _, i, j in split.parts(geom)] == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("geom", [
    ConvGeometry.create((1, 1, MAX_ELEMENTS), (1, 1, 1)),  # exactly the limit: one call
    ConvGeometry.create((2, 1, 2**31), (1, 1, 1)),  # one sample too large: refused
    ConvGeometry.create((4, 2**16, 2**14), (2**15, 2**16, 1)),  # the weight too large
], ids=["at-limit", "one-sample", "weight"])
def test_what_is_not_split(geom):
    assert split.parts(geom) is None


def test_a_transposed_convolution_splits_by_its_forward_convolutions_tensors():
    # its output (G's x) has 8 x 8192 x 8192 = 2**29 elements a sample, its input a quarter
    tgeom = ConvTransposeGeometry.create((5, 8, 4096, 4096), (8, 8, 2, 2), stride=2)
    assert math.prod(tgeom.conv.input_shape[1:]) == 2**29
    parts = split.parts(tgeom)
    assert [(i, j) for _, i, j in parts] == [(0, 3), (3, 5)]
    for t, i, j in parts:
        assert isinstance(t, ConvTransposeGeometry)
        assert t.input_shape == (j - i, 8, 4096, 4096)
        assert t.conv.input_shape == (j - i, 8, 8192, 8192)


# -- the engine's calls, part by part ---------------------------------------------------


def rows_ptr(a, i):
    return a.data.ptr + i * (a.nbytes // a.shape[0])


def dims(desc):
    return tuple(desc.getNd()[1])


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_the_fused_forward_runs_once_per_part_on_its_rows(gpu, channels_last):
    geom = big(channels_last)
    x, w = gpu.array(geom.input_shape, "float16"), gpu.array(geom.weight_shape, "float16")
    b, res = gpu.array(geom.bias_shape, "float16"), gpu.array(geom.output_shape, "float16")
    y, z = ops.conv_bias_act(x, w, b, geom, "relu", res, 0.5)
    assert z is None and y.shape == geom.output_shape
    parts = split.parts(geom)
    assert [n for n, _ in gpu.calls] == [FUSED] * len(parts) == [FUSED, FUSED]
    for (g, i, j), (_, a) in zip(parts, gpu.calls):
        plan = get_plan(g, "float16", "relu", True)
        assert (a[2], a[3]) == (plan.x_desc, rows_ptr(x, i))
        assert (a[4], a[5]) == (plan.w_desc, w.data.ptr)  # the whole weight, every part
        assert (a[10], a[11], a[12]) == (0.5, plan.y_desc, rows_ptr(res, i))
        assert a[14] == b.data.ptr and (a[16], a[17]) == (plan.y_desc, rows_ptr(y, i))
        assert dims(plan.x_desc)[0] == dims(plan.y_desc)[0] == j - i


def test_an_activation_after_the_parts_runs_once_over_the_whole_output(gpu):
    geom = big()
    x, w = gpu.array(geom.input_shape, "float16"), gpu.array(geom.weight_shape, "float16")
    y, z = ops.conv_bias_act(x, w, None, geom, "silu")  # nothing to fuse: convolutionForward
    names = [n for n, _ in gpu.calls]
    assert names == ["convolutionForward", "convolutionForward", "activation_forward"]
    assert gpu.calls[1][1][12] == rows_ptr(z, 3)  # the second part's rows of z
    assert gpu.calls[2][1] == (z, "silu", y) and z.shape == y.shape == geom.output_shape


def test_the_plain_forward_splits_too(gpu):
    geom = big(n=7)
    x, w = gpu.array(geom.input_shape, "float32"), gpu.array(geom.weight_shape, "float32")
    y = ops.conv_forward(x, w, geom)
    calls = [a for n, a in gpu.calls if n == "convolutionForward"]
    assert [a[3] for a in calls] == [rows_ptr(x, i) for i in (0, 3, 6)]
    assert [a[12] for a in calls] == [rows_ptr(y, i) for i in (0, 3, 6)]


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_the_data_gradient_keeps_the_callers_beta_in_every_part(gpu, beta):
    geom = big()
    dz, w = gpu.array(geom.output_shape, "float16"), gpu.array(geom.weight_shape, "float16")
    out = gpu.array(geom.input_shape, "float16")
    dx = ops.conv_backward_data(dz, w, geom, out=out, beta=beta)
    assert dx is out
    calls = [a for n, a in gpu.calls if n == "convolutionBackwardData"]
    for (g, i, _), a in zip(split.parts(geom), calls, strict=True):
        plan = get_plan(g, "float16")
        assert (a[4], a[5]) == (plan.y_desc, rows_ptr(dz, i))
        assert (a[10], a[11], a[12]) == (beta, plan.x_desc, rows_ptr(dx, i))


@pytest.mark.parametrize("given, beta, betas", [(False, 0.0, [0.0, 1.0]),
                                                (True, 0.5, [0.5, 1.0]),
                                                (True, 0.0, [0.0, 1.0])])
def test_the_filter_gradient_blends_beta_in_the_first_part_and_sums_the_rest(
        gpu, given, beta, betas):
    geom = big(True)
    x, dz = gpu.array(geom.input_shape, "float16"), gpu.array(geom.output_shape, "float16")
    out = gpu.array(geom.weight_shape, "float16") if given else None
    dw = ops.conv_backward_filter(x, dz, geom, out=out, beta=beta)
    calls = [a for n, a in gpu.calls if n == "convolutionBackwardFilter"]
    assert [a[10] for a in calls] == betas
    assert {a[12] for a in calls} == {dw.data.ptr} and dw.shape == geom.weight_shape
    assert [(a[3], a[5]) for a in calls] == [(rows_ptr(x, i), rows_ptr(dz, i)) for i in (0, 3)]


def test_the_bias_gradient_of_a_split_batch_is_one_kernel_launch(gpu):
    geom = big()
    dz, db = gpu.array(geom.output_shape, "float16"), gpu.array(geom.bias_shape, "float16")
    assert ops.conv_backward_bias(dz, geom, out=db, beta=0.5) is db
    assert gpu.calls == [("activation_backward_bias",
                          (dz, None, "identity", geom, None, db, 0.5))]


def test_the_pointer_path_splits_on_views_of_the_callers_memory(gpu, monkeypatch):
    from convfuse.ops.cudnn.device import DeviceArray

    gpu.handles = gpu.real_handles(monkeypatch)
    ctx = gpu.pointer_context(0xA000)
    geom = big()
    x, w = (gpu.device_array(s, "float16", ctx) for s in (geom.input_shape, geom.weight_shape))
    y, _ = ops.conv_bias_act(x, w, None, geom, "relu")
    assert type(y) is DeviceArray and y.ctx is ctx and tuple(y.shape) == geom.output_shape
    assert [k for k, *_ in gpu.allocs if k == "empty"] == ["empty"]  # one output, whole
    calls = [a for n, a in gpu.calls if n == FUSED]
    assert [(a[3], a[17]) for a in calls] == [(rows_ptr(x, i), rows_ptr(y, i)) for i in (0, 3)]
    view = split.rows(x, 3, 5)
    assert type(view) is DeviceArray and view.owner is x and view.ctx is ctx
    assert tuple(view.shape) == (2, *geom.input_shape[1:]) and view.ptr == rows_ptr(x, 3)


def test_a_split_geometry_is_never_bound(gpu):
    geom = big()
    tgeom = ConvTransposeGeometry.create((5, 8, 4096, 4096), (8, 8, 2, 2), stride=2)
    from convfuse.ops.cudnn import conv, conv_transpose

    for name in ("conv_bias_act", "conv_backward_data", "conv_backward_filter",
                 "conv_backward_bias"):
        assert bound.bind(conv, name, geom, "float16", None, "relu") is bound.NEVER
    for name in conv_transpose.AS_IMPORTED:
        assert bound.bind_transpose(conv_transpose, name, tgeom, "float16", None) is bound.NEVER


def test_transposed_convolutions_split_each_call(gpu, monkeypatch):
    gpu.handles = gpu.real_handles(monkeypatch)
    tgeom = ConvTransposeGeometry.create((5, 8, 4096, 4096), (8, 8, 2, 2), stride=2)
    x, w = gpu.array(tgeom.input_shape, "float16"), gpu.array(tgeom.weight_shape, "float16")
    dy = gpu.array(tgeom.output_shape, "float16")
    y = ops.conv_transpose_forward(x, w, tgeom)
    dx = ops.conv_transpose_backward_data(dy, w, tgeom)
    dw = ops.conv_transpose_backward_filter(x, dy, tgeom)
    parts = split.parts(tgeom)
    by = {n: [a for m, a in gpu.calls if m == n] for n in
          ("convolutionBackwardData", "convolutionForward", "convolutionBackwardFilter")}
    for (t, i, _), fwd, data, filt in zip(parts, *by.values(), strict=True):
        plan = get_transpose_plan(t, "float16")
        # forward: G's data gradient, dy = the user's x rows, written into y's rows
        assert (fwd[4], fwd[5], fwd[11], fwd[12]) == (plan.y_desc, rows_ptr(x, i),
                                                      plan.x_desc, rows_ptr(y, i))
        # data gradient: G's forward of dy's rows into dx's rows
        assert (data[2], data[3], data[12]) == (plan.x_desc, rows_ptr(dy, i), rows_ptr(dx, i))
        # filter gradient: into the one dw, beta 0 then 1
        assert (filt[3], filt[5], filt[12]) == (rows_ptr(dy, i), rows_ptr(x, i), dw.data.ptr)
        assert filt[10] == (0.0 if i == 0 else 1.0)


# -- what is still refused --------------------------------------------------------------


def test_one_sample_too_large_is_refused_before_any_call_and_says_why(gpu):
    geom = ConvGeometry.create((2, 1, 2**31), (1, 1, 1))
    x, w = gpu.array(geom.input_shape, "float16"), gpu.array(geom.weight_shape, "float16")
    with pytest.raises(TensorTooLargeError, match="even one sample has 2,147,483,648"):
        ops.conv_forward(x, w, geom)
    assert gpu.calls == []


def test_a_weight_too_large_is_refused_and_says_it_is_not_split():
    geom = ConvGeometry.create((1, 2**16, 4), (2**15, 2**16, 1))
    with pytest.raises(TensorTooLargeError, match="a weight is not split"):
        get_plan(geom, "float16")
