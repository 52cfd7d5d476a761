"""The cuDNN engine on raw device memory (Note [the pointer path] in
convfuse/ops/cudnn/device.py), on the fake GPU of tests/test_ops_cudnn_wiring.py: every
binding call gets the DeviceArrays' pointers, a handle bound to the caller's stream (and
re-bound only when the stream changes), workspace and outputs from the caller's
allocator; no CuPy array and no DLPack exchange is made on the way, and what needs CuPy
arithmetic runs through `on_cupy` inside the caller's scope. tests/gpu/
test_torch_pointer_path_gpu.py checks the numbers on a device."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

import convfuse.ops as ops
from convfuse.errors import DeviceMismatchError
from convfuse.ops import elementwise
from convfuse.ops.cudnn import device, fused, handle
from convfuse.ops.cudnn.device import DeviceArray
from convfuse.plan import conv as plan_conv
from tests._ops_dispatch_helpers import GEOMS
from tests.test_ops_cudnn_wiring import FakeGpu

FUSED = "convolutionBiasActivationForward"
WS = 4096  # every ranked record's workspace here, so each call allocates one


@pytest.fixture
def gpu(monkeypatch):
    fake = FakeGpu(monkeypatch)
    lib = fake.lib
    fake.perfs = [lib.AlgoPerf(a, 0, 1.0, WS, lib.CUDNN_DETERMINISTIC, lib.CUDNN_DEFAULT_MATH)
                  for a in (6, 2, 0)]
    fake.handles = fake.real_handles(monkeypatch)
    fake.forbid_cupy_arrays(monkeypatch)
    monkeypatch.setattr(fused, "_zero_bias", {})

    def cupy_pool(nbytes):
        raise AssertionError("an algorithm choice took memory from CuPy's pool")

    monkeypatch.setattr(plan_conv, "pool_alloc", cupy_pool)
    return fake


def arrays(gpu, ctx, dtype, *shapes):
    return [gpu.device_array(s, dtype, ctx) for s in shapes]


def outputs(gpu):
    return {p for kind, _, p in gpu.allocs if kind == "empty"}


def workspaces(gpu):
    return [(n, p) for kind, n, p in gpu.allocs if kind == "allocate"]


@pytest.mark.parametrize("geom", GEOMS[:3], ids=lambda g: g.layout)
def test_convolutions_run_on_the_callers_pointers_stream_and_allocator(gpu, geom):
    from convfuse.plan import get_plan

    ctx = gpu.pointer_context(0xA000)
    x, w, dz, dx_out = arrays(gpu, ctx, "float32", geom.input_shape, geom.weight_shape,
                              geom.output_shape, geom.input_shape)
    y = ops.conv_forward(x, w, geom)
    dx = ops.conv_backward_data(dz, w, geom)
    again = ops.conv_backward_data(dz, w, geom, out=dx_out, beta=1.0)
    dw = ops.conv_backward_filter(x, dz, geom)
    db = ops.conv_backward_bias(dz, geom)
    assert again is dx_out
    for a, shape in ((y, geom.output_shape), (dx, geom.input_shape), (dw, geom.weight_shape),
                     (db, geom.bias_shape)):
        assert type(a) is DeviceArray and a.owner == "ctx.empty" and a.ctx is ctx
        assert tuple(a.shape) == shape and a.dtype == np.float32
    assert outputs(gpu) == {y.ptr, dx.ptr, dw.ptr, db.ptr}
    p = get_plan(geom, "float32")
    [handle] = gpu.handles
    assert handle.streams == [0xA000]  # bound once, for five calls
    # Each direction's algorithm choice probes its workspace once, then each call takes
    # its own; bias needs none. All from the caller's allocator.
    ws = workspaces(gpu)
    assert [n for n, _ in ws] == [WS] * 7
    ws = [ws[1], ws[3], ws[4], ws[6]]  # probe fwd, fwd, probe bwd_data, bwd_data x2, ...
    (fwd, a1), (bd, a2), (bd2, a3), (bf, a4), (bb, a5) = gpu.calls
    assert (fwd, bd, bd2, bf, bb) == ("convolutionForward", "convolutionBackwardData",
                                      "convolutionBackwardData", "convolutionBackwardFilter",
                                      "convolutionBackwardBias")
    assert (a1[0], a1[3], a1[5], a1[8], a1[9], a1[12]) == (handle, x.ptr, w.ptr, ws[0][1], WS,
                                                           y.ptr)
    assert (a2[3], a2[5], a2[8], a2[10], a2[12]) == (w.ptr, dz.ptr, ws[1][1], 0.0, dx.ptr)
    assert (a3[8], a3[10], a3[12]) == (ws[2][1], 1.0, dx_out.ptr)
    assert (a4[3], a4[5], a4[8], a4[12]) == (x.ptr, dz.ptr, ws[3][1], dw.ptr)
    assert (a5[0], a5[2], a5[3], a5[6]) == (handle, p.y_desc, dz.ptr, db.ptr)


def test_handle_is_rebound_only_when_the_stream_changes(gpu):
    geom = GEOMS[1]
    a_ctx, b_ctx = gpu.pointer_context(0xA000), gpu.pointer_context(0xB000)
    for ctx in (a_ctx, a_ctx, b_ctx, b_ctx, a_ctx):
        x, w = arrays(gpu, ctx, "float32", geom.input_shape, geom.weight_shape)
        ops.conv_forward(x, w, geom)
    gpu.stream.ptr = 0xC000  # a CuPy array on CuPy's current stream: its own context
    x, w = gpu.array(geom.input_shape, "float32"), gpu.array(geom.weight_shape, "float32")
    with pytest.raises(AssertionError, match="pointer path made a CuPy array"):
        ops.conv_forward(x, w, geom)  # (cupy.empty is refused here; the bind came first)
    [handle] = gpu.handles  # one handle per (device, thread)
    assert handle.streams == [0xA000, 0xB000, 0xA000, 0xC000]
    assert [a[0] for n, a in gpu.calls] == [handle] * 5


def test_fused_forward_and_activations_on_pointers(gpu):
    from convfuse.ops.cudnn import constants

    geom = GEOMS[0]
    ctx = gpu.pointer_context(0xA000)
    x, w, b, res = arrays(gpu, ctx, "float32", geom.input_shape, geom.weight_shape,
                          geom.bias_shape, geom.output_shape)
    y, z = ops.conv_bias_act(x, w, b, geom, "relu", res, 0.5)
    assert z is None and type(y) is DeviceArray and y.ptr in outputs(gpu)
    [(name, a)] = gpu.calls
    assert name == FUSED
    (_, probe), (_, ws_ptr) = workspaces(gpu)  # the choice's probe, then the call's
    assert probe != ws_ptr
    assert (a[3], a[5], a[8], a[9], a[10], a[12], a[14], a[17]) == (
        x.ptr, w.ptr, ws_ptr, WS, 0.5, res.ptr, b.ptr, y.ptr)
    gpu.calls.clear()
    y2, z2 = ops.conv_bias_act(x, w, None, geom, "gelu", res)  # keeps its pre-activation
    (fused, fa), (launch, la) = gpu.calls
    [zero] = gpu.zeros  # the cached zero bias: CuPy's default pool, filled once
    assert (fused, launch) == (FUSED, "activation_forward")
    assert fa[14] == zero.data.ptr and fa[17] == z2.ptr and la == (z2, "gelu", y2)
    assert type(y2) is type(z2) is DeviceArray and {y2.ptr, z2.ptr} <= outputs(gpu)
    # Note [cached constants across streams]: the wait is on the caller's stream
    assert ("wait", gpu.stream_ops[0][1], 0xA000, 0) in gpu.stream_ops
    assert not any(op[0] == "wait" and op[2] == gpu.stream.ptr for op in gpu.stream_ops)
    assert constants.EVENT_WAIT_EXTERNAL  # (the capture branch: test_ops_cudnn_wiring)
    gpu.calls.clear()
    y3, z3 = ops.conv_bias_act(x, w, None, geom, "gelu")  # Note [nothing to fuse]
    (conv, ca), (launch, la) = gpu.calls
    assert (conv, launch) == ("convolutionForward", "activation_forward")
    assert (ca[3], ca[5], ca[12]) == (x.ptr, w.ptr, z3.ptr) and la == (z3, "gelu", y3)
    gpu.calls.clear()
    dy, saved = arrays(gpu, ctx, "float32", geom.output_shape, geom.output_shape)
    dz, db = ops.activation_backward_bias(dy, saved, "relu", geom)
    assert [n for n, _ in gpu.calls] == ["activation_backward", "convolutionBackwardBias"]
    assert gpu.calls[0][1] == (dy, saved, "relu", dz) and {dz.ptr, db.ptr} <= outputs(gpu)
    out = ops.activation_forward(dy, "tanh")
    assert type(out) is DeviceArray and out.ptr in outputs(gpu)


def test_pooling_on_pointers(gpu):
    from convfuse.pool_geometry import PoolGeometry

    pg = PoolGeometry.create((2, 9, 3), 3, 2, 1, "max", "NWC")
    ctx = gpu.pointer_context(0xA000)
    x, dy = arrays(gpu, ctx, "float16", pg.input_shape, pg.output_shape)
    y = ops.pool_forward(x, pg)
    dx = ops.pool_backward(dy, x, y, pg)
    (_, a1), (_, a2) = gpu.calls
    assert (a1[4], a1[7]) == (x.ptr, y.ptr) and (a2[4], a2[6], a2[8], a2[11]) == (
        y.ptr, dy.ptr, x.ptr, dx.ptr)
    assert outputs(gpu) == {y.ptr, dx.ptr} and gpu.handles[0].streams == [0xA000]


def test_float64_channels_last_falls_back_to_cupy_in_the_callers_scope(monkeypatch, gpu):
    """Note [float64 runs channels-first] copies with CuPy, so the DeviceArrays enter
    `on_cupy`: CuPy views of the same memory inside the caller's scope; CuPy results come
    back as DeviceArrays that own them."""
    geom = GEOMS[3]
    monkeypatch.undo()  # the fake GPU's cupy.empty is needed by the channels-first copies
    gpu = FakeGpu(monkeypatch)
    gpu.handles = gpu.real_handles(monkeypatch)
    ctx = gpu.pointer_context(0xA000)
    x, w = arrays(gpu, ctx, "float64", geom.input_shape, geom.weight_shape)
    y = ops.conv_forward(x, w, geom)
    assert gpu.scopes == ["enter", "exit"]
    (n1, (xv, _)), (n2, (wv, _)), (n3, _), (n4, (_, y_cupy)) = gpu.calls
    assert (n1, n2, n3, n4) == ("to_channels_first", "to_channels_first",
                                "convolutionForward", "to_channels_last")
    assert (xv.data.ptr, xv.shape, xv.dtype) == (x.ptr, x.shape, x.dtype)
    assert (wv.data.ptr, wv.shape) == (w.ptr, w.shape)
    assert type(y) is DeviceArray and y.owner is y_cupy and y.ptr == y_cupy.data.ptr
    assert y.ctx is ctx and tuple(y.shape) == geom.output_shape


@pytest.fixture
def bn_gpu(monkeypatch, gpu):
    from convfuse.ops.cudnn import batchnorm as engine
    from convfuse.plan.batchnorm import clear_batchnorm_plan_cache
    from tests.test_batchnorm_cudnn_wiring import BN_CALLS, SIZES

    clear_batchnorm_plan_cache()
    monkeypatch.setattr(engine, "_affine_defaults", {})
    for name in BN_CALLS:
        monkeypatch.setattr(gpu.lib, name, lambda *a, _n=name: gpu.record(_n, a))
    for name, size in SIZES.items():
        monkeypatch.setattr(gpu.lib, name, lambda *a, _s=size: _s)
    yield gpu
    clear_batchnorm_plan_cache()


def test_batchnorm_training_on_pointers(bn_gpu):
    """The fused training forward and backward (Note [BatchNorm in cuDNN]'s documented
    config): outputs, saved statistics, workspace and reserve space all from the caller's
    context."""
    gpu = bn_gpu
    ctx = gpu.pointer_context(0xA000)
    shape = (2, 3, 3, 8)
    x, res, dy = arrays(gpu, ctx, "float16", shape, shape, shape)
    w, b, rm, rv, gw, gb = arrays(gpu, ctx, "float32", *[(8,)] * 6)
    y, saved = ops.batchnorm_forward_training(x, w, b, rm, rv, "NHWC", 1e-3, 0.25, "relu", res)
    (fwd, a), = gpu.calls
    (_, ws, wptr), (_, rs, rptr) = [al for al in gpu.allocs if al[0] == "allocate"]
    assert fwd == "batchNormalizationForwardTrainingEx" and (ws, rs) == (1024, 4096)
    assert (a[6], a[8], a[10], a[12], a[13], a[15], a[16]) == (x.ptr, res.ptr, y.ptr, w.ptr,
                                                               b.ptr, rm.ptr, rv.ptr)
    assert (a[18], a[19]) == (saved.mean.ptr, saved.invstd.ptr)
    assert a[21:] == (wptr, 1024, rptr, 4096)
    assert {y.ptr, saved.mean.ptr, saved.invstd.ptr} <= outputs(gpu)
    assert a[0] is gpu.handles[0] and gpu.handles[0].streams == [0xA000]
    gpu.calls.clear()
    dx, dw, db, dres = ops.batchnorm_backward(dy, x, w, b, saved, "NHWC", 1e-3, "relu", True,
                                              weight_grad=gw, bias_grad=gb, param_beta=1.0)
    (bwd, a), = gpu.calls
    (_, bws, bptr) = [al for al in gpu.allocs if al[0] == "allocate"][-1]
    assert bwd == "batchNormalizationBackwardEx" and bws == 2048
    assert (a[8], a[10], a[12], a[14], a[16]) == (x.ptr, y.ptr, dy.ptr, dres.ptr, dx.ptr)
    assert a[-4:] == (bptr, 2048, rptr, 4096) and dw is gw and db is gb
    assert {dx.ptr, dres.ptr} <= outputs(gpu) and gpu.scopes == []


def test_batchnorm_plain_backward_copies_the_residual_gradient_on_the_stream(monkeypatch,
                                                                           bn_gpu):
    """identity: dz is dy itself, so the residual's gradient is a copy of it, made with one
    device-to-device memcpyAsync on the caller's stream into the caller's memory."""
    gpu = bn_gpu
    copies = []
    monkeypatch.setattr(gpu.cp.cuda.runtime, "memcpyAsync", lambda *a: copies.append(a))
    ctx = gpu.pointer_context(0xA000)
    shape = (2, 8, 3, 3)
    x, res, dy = arrays(gpu, ctx, "float32", shape, shape, shape)
    w, b, rm, rv = arrays(gpu, ctx, "float32", *[(8,)] * 4)
    _, saved = ops.batchnorm_forward_training(x, w, b, rm, rv, "NCHW", 1e-5, 0.1, None, res)
    assert [n for n, _ in gpu.calls] == ["batchNormalizationForwardTraining", "addTensor"]
    _, dw, db, dres = ops.batchnorm_backward(dy, x, w, b, saved, "NCHW", 1e-5, None, True)
    assert gpu.calls[-1][0] == "batchNormalizationBackward"
    assert gpu.calls[-1][1][9] == dy.ptr  # dz is dy
    assert copies == [(dres.ptr, dy.ptr, dy.nbytes, 3, 0xA000)]  # cudaMemcpyDeviceToDevice
    assert dres.ptr in outputs(gpu) and {dw.ptr, db.ptr} <= outputs(gpu)


def test_batchnorm_inference_takes_cupys_path_on_pointers(monkeypatch, bn_gpu):
    """Inference computes the saved invstd with CuPy arithmetic: on_cupy (Note [the pointer
    path]); the training forward above never does."""
    from convfuse.ops.cudnn import batchnorm as engine

    gpu = bn_gpu
    seen = []
    monkeypatch.setattr(engine, "on_cupy", lambda fn, *a: seen.append((fn, a)) or (a[0],) * 4)
    ctx = gpu.pointer_context(0xA000)
    x = gpu.device_array((2, 8, 3, 3), "float32", ctx)
    w, b, rm, rv = arrays(gpu, ctx, "float32", *[(8,)] * 4)
    ops.batchnorm_forward_inference(x, w, b, rm, rv, "NCHW")
    [(fn, args)] = seen
    assert fn is engine.batchnorm_forward_inference and args[:5] == (x, w, b, rm, rv)
    assert gpu.calls == []


class Saved(NamedTuple):
    a: object
    flag: bool


def test_on_cupy_maps_device_arrays_both_ways(gpu):
    ctx = gpu.pointer_context(0xA000)
    x, out = arrays(gpu, ctx, "bfloat16", (2, 3), (2, 3))
    seen = {}

    def body(a, pair, saved, none):
        seen.update(a=a, pair=pair, saved=saved, none=none)
        fresh = gpu.array((4,), "bfloat16")
        return pair[0], fresh, fresh

    back, fresh, same = device.on_cupy(body, x, (out, 7), Saved(x, True), None)
    assert same is fresh  # one DeviceArray per CuPy array (a BN forward returns y twice)
    cp = gpu.cp
    assert isinstance(seen["a"], cp.ndarray) and seen["a"].data.ptr == x.ptr
    assert seen["a"].dtype == x.dtype and seen["a"].shape == x.shape
    assert isinstance(seen["pair"][0], cp.ndarray) and seen["pair"][1] == 7
    assert isinstance(seen["saved"], Saved) and seen["saved"].flag is True
    assert seen["saved"].a.data.ptr == x.ptr and seen["none"] is None
    assert back is out  # a view handed back is the caller's own array
    assert type(fresh) is DeviceArray and fresh.owner.shape == (4,) and fresh.ctx is ctx
    assert gpu.scopes == ["enter", "exit"]


def test_device_array_is_what_the_checks_and_engine_read(gpu):
    ctx = gpu.pointer_context(0xA000)
    [a] = arrays(gpu, ctx, "float16", (2, 3, 4))
    assert a.data.ptr == a.ptr and a.device.id == 0 and a.flags.c_contiguous
    assert (a.size, a.nbytes, a.ndim, a.strides) == (24, 48, 3, (24, 8, 2))
    assert device.context_of(a) is ctx and device.is_device_array(None, a)
    with pytest.raises(DeviceMismatchError, match="NumPy and CuPy"):
        ops.activation_forward(a, "relu", out=np.zeros((2, 3, 4), np.float16))
    [b] = arrays(gpu, ctx, "float32", (2, 3, 4))
    with pytest.raises(ValueError, match="share a dtype"):
        ops.activation_forward(a, "relu", out=b)
    assert gpu.calls == []  # refused before any engine call


def test_an_outputs_own_arithmetic_runs_on_cupy_in_the_callers_scope(gpu):
    """ops/conv_transpose.py zero-fills or scales an empty batch's gradient `out`."""
    ctx = gpu.pointer_context(0xA000)
    [out] = arrays(gpu, ctx, "float32", (3,))
    seen = []
    cp = gpu.cp
    real_fill, real_imul = cp.ndarray.fill, cp.ndarray.__imul__
    try:
        cp.ndarray.fill = lambda a, v: seen.append(("fill", a.data.ptr, v))
        cp.ndarray.__imul__ = lambda a, v: seen.append(("imul", a.data.ptr, v)) or a
    except TypeError:
        pytest.skip("cupy.ndarray's methods cannot be replaced here")
    try:
        out.fill(0)
        out *= 0.5
    finally:
        cp.ndarray.fill, cp.ndarray.__imul__ = real_fill, real_imul
    assert seen == [("fill", out.ptr, 0), ("imul", out.ptr, 0.5)]
    assert gpu.scopes == ["enter", "exit"] * 2


# ---- kernel launches: Note [kernel arguments are pointers] in ops/elementwise.py ----

class Recorder:
    def __init__(self, name, launches):
        self.name, self.launches = name, launches

    def __call__(self, grid, block, args, stream=None):
        self.launches.append((self.name, grid, block, args, stream))


@pytest.fixture
def launches(monkeypatch):
    pytest.importorskip("cupy")
    got = []
    monkeypatch.setattr(elementwise, "_function", lambda name, dev: Recorder(name, got))
    monkeypatch.setattr(elementwise, "_sm_count", lambda dev: 4)
    return got


def test_kernels_get_pointers_and_the_callers_stream(monkeypatch, launches):
    gpu = FakeGpu(monkeypatch)  # the real launchers, not FakeGpu's stand-ins
    for name in FakeGpu.LAUNCHERS:
        monkeypatch.setattr(elementwise, name, REAL_LAUNCHERS[name])
    ctx = gpu.pointer_context(0xA000)
    z, y = arrays(gpu, ctx, "float32", (2, 5), (2, 5))
    elementwise.activation_forward(z, "relu", y)
    geom = GEOMS[0]
    out, b = arrays(gpu, ctx, "float32", geom.output_shape, geom.bias_shape)
    elementwise.bias_act_forward(out, b, None, 0.5, "identity", geom)
    cz, cy = gpu.array((2, 5), "float32"), gpu.array((2, 5), "float32")
    elementwise.activation_backward(cz, None, "identity", cy)  # CuPy arrays: CuPy's stream
    (n1, g1, b1, a1, s1), (n2, _, _, a2, s2), (n3, _, _, a3, s3) = launches
    assert (n1, a1, s1.ptr) == ("act_forward_f32", (z.ptr, y.ptr, 10, np.int32(1)), 0xA000)
    assert g1 == (1,) and b1 == (elementwise.ELEMENTWISE_BLOCK,)
    n = int(np.prod(geom.output_shape))
    assert (n2, s2.ptr) == ("bias_act_forward_f32", 0xA000)
    assert a2 == (out.ptr, b.ptr, 0, n, geom.out_channels, n // (2 * 6), 0.5, np.int32(0))
    assert (n3, a3, s3.ptr) == ("act_backward_f32",
                                (cz.data.ptr, cz.data.ptr, cy.data.ptr, 10, np.int32(0)),
                                gpu.stream.ptr)
    for *_, args, _stream in launches:  # addresses and 64-bit integers as Python ints
        assert all(type(v) in (int, float, np.int32) for v in args)


def test_bias_kernel_scratch_comes_from_the_callers_allocator(monkeypatch, launches):
    gpu = FakeGpu(monkeypatch)
    for name in FakeGpu.LAUNCHERS:
        monkeypatch.setattr(elementwise, name, REAL_LAUNCHERS[name])
    ctx = gpu.pointer_context(0xA000)
    geom = GEOMS[0]  # short NCHW channels: the rows kernel, partial sums then a finish
    dy, saved, dz, db = arrays(gpu, ctx, "float16", geom.output_shape, geom.output_shape,
                               geom.output_shape, geom.bias_shape)
    elementwise.activation_backward_bias(dy, saved, "relu", geom, dz, db, 1.0)
    plan = elementwise.plan_bias_grad(geom.output_shape, False, 4)
    assert plan.needs_finish
    [(nbytes, scratch)] = workspaces(gpu)
    assert nbytes == plan.partial_size * 4  # float32 partial sums of float16 data
    (n1, g1, _, a1, s1), (n2, _, _, a2, s2) = launches
    assert (n1, n2) == ("act_bias_rows_f16", "act_bias_finish_f16")
    assert a1 == (dy.ptr, saved.ptr, dz.ptr, *plan.int_args, scratch, db.ptr, 1.0,
                  np.int32(1))
    assert a2 == (scratch, plan.parts, plan.channels, plan.group, db.ptr, 1.0)
    assert s1.ptr == s2.ptr == 0xA000 and g1 == plan.grid


REAL_LAUNCHERS = {name: getattr(elementwise, name) for name in FakeGpu.LAUNCHERS}


def test_float64_channels_last_transposed_conv_falls_back_to_cupy(monkeypatch, gpu):
    """The transposed convolution's float64 channels-last route copies with CuPy too, so
    DeviceArrays enter `on_cupy` before the channels-first copies (never the copies
    themselves on raw pointers)."""
    from convfuse.transpose_geometry import ConvTransposeGeometry

    tgeom = ConvTransposeGeometry.create((2, 3, 4, 4), (4, 2, 2, 3), stride=(2, 1),
                                         padding=(0, 1), layout="NHWC")
    monkeypatch.undo()  # the fake GPU's cupy.empty is needed by the channels-first copies
    gpu = FakeGpu(monkeypatch)
    gpu.handles = gpu.real_handles(monkeypatch)
    ctx = gpu.pointer_context(0xA000)
    x, w = arrays(gpu, ctx, "float64", tgeom.input_shape, tgeom.weight_shape)
    y = ops.conv_transpose_forward(x, w, tgeom)
    assert gpu.scopes == ["enter", "exit"]
    names = [n for n, _ in gpu.calls]
    assert names == ["to_channels_first", "to_channels_first", "convolutionBackwardData",
                     "to_channels_last"]
    assert type(y) is DeviceArray and y.ctx is ctx and tuple(y.shape) == tgeom.output_shape


def test_capture_is_asked_of_the_callers_stream(gpu, monkeypatch):
    """Note [no plan work inside a capture] on the pointer path: the stream whose capture
    forbids choosing an algorithm, timing the forward paths or asking batch norm's sizes is
    the caller's (PyTorch's), not CuPy's current one, which is not capturing then."""
    from convfuse import config
    from convfuse.errors import CaptureError
    from convfuse.plan import capture

    asked = []

    def capturing(stream_ptr=None):
        asked.append(stream_ptr)
        return stream_ptr == 0xA000

    geom = GEOMS[1]
    ctx = gpu.pointer_context(0xA000)
    handle._bound_handle(ctx)  # this thread's handle, made before the capture
    monkeypatch.setattr(capture, "stream_is_capturing", capturing)
    x, w, b = arrays(gpu, ctx, "float32", geom.input_shape, geom.weight_shape,
                     geom.bias_shape)
    with pytest.raises(CaptureError, match=r"choosing the fwd algorithm"):
        ops.conv_forward(x, w, geom)
    with config.flags(benchmark=True), pytest.raises(CaptureError, match=r"timing the fused"):
        ops.conv_bias_act(x, w, b, geom, "identity")
    assert set(asked) == {0xA000} and not gpu.calls
    other = gpu.pointer_context(0xB000)  # another stream, not capturing: the choice is made
    x2, w2 = arrays(gpu, other, "float32", geom.input_shape, geom.weight_shape)
    ops.conv_forward(x2, w2, geom)
    assert [n for n, _ in gpu.calls] == ["convolutionForward"]


def test_batchnorm_sizes_are_refused_in_the_callers_capture(bn_gpu, monkeypatch):
    from convfuse.errors import CaptureError
    from convfuse.plan import capture

    ctx = bn_gpu.pointer_context(0xA000)
    handle._bound_handle(ctx)  # this thread's handle, made before the capture
    monkeypatch.setattr(capture, "stream_is_capturing",
                        lambda stream_ptr=None: stream_ptr == 0xA000)
    shape = (2, 3, 3, 8)
    x, res = arrays(bn_gpu, ctx, "float16", shape, shape)
    w, b, rm, rv = arrays(bn_gpu, ctx, "float32", *[(8,)] * 4)
    with pytest.raises(CaptureError, match=r"fused batch-normalization sizes"):
        ops.batchnorm_forward_training(x, w, b, rm, rv, "NHWC", 1e-3, 0.25, "relu", res)


def test_a_thread_that_ends_gives_its_handle_to_the_next_thread(gpu):
    """handle.py's pool: a thread's handle outlives it (no cudnnDestroy, which would
    synchronise the device) and serves the next thread on that device, bound anew to that
    thread's stream; threads running at once still get a handle each."""
    import gc
    import threading

    geom = GEOMS[0]

    def convolve(stream, done=None, wait=None):
        ctx = gpu.pointer_context(stream)
        x, w = arrays(gpu, ctx, "float32", geom.input_shape, geom.weight_shape)
        ops.conv_forward(x, w, geom)
        if done is not None:
            done.set()
            wait.wait()

    for stream in (0xB000, 0xC000, 0xD000):  # one after another
        t = threading.Thread(target=convolve, args=(stream,))
        t.start()
        t.join()
        gc.collect()
    [h] = gpu.handles
    assert h.streams == [0xB000, 0xC000, 0xD000] and handle._free == {0: [h]}
    started, release = threading.Event(), threading.Event()
    first = threading.Thread(target=convolve, args=(0xE000, started, release))
    first.start()
    started.wait()
    convolve(0xF000)  # this thread, while `first` holds the pooled handle
    release.set()
    first.join()
    assert len(gpu.handles) == 2 and h.streams[-1] == 0xE000
    assert gpu.handles[1].streams == [0xF000]


def test_a_threads_first_cudnn_call_inside_a_capture_is_refused_before_cudnn_create(
        gpu, monkeypatch):
    """cudnnCreate allocates device memory, which a capture in global mode refuses (and is
    then invalidated): a thread with no handle and none pooled gets a CaptureError naming
    it, before the binding is called; one pooled from an ended thread serves, no create."""
    import gc
    import threading

    from convfuse.errors import CaptureError
    from convfuse.plan import capture

    geom = GEOMS[0]
    ctx = gpu.pointer_context(0xA000)
    x, w = arrays(gpu, ctx, "float32", geom.input_shape, geom.weight_shape)
    ops.conv_forward(x, w, geom)  # plans and a handle for this thread, outside any capture
    monkeypatch.setattr(capture, "stream_is_capturing", lambda ptr=None: ptr == 0xA000)
    seen = []

    def first_call():
        try:
            ops.conv_forward(x, w, geom)
        except CaptureError as err:
            seen.append(err)

    t = threading.Thread(target=first_call)
    t.start()
    t.join()
    [err] = seen
    assert "a cuDNN handle for this thread" in str(err) and len(gpu.handles) == 1
    monkeypatch.setattr(capture, "stream_is_capturing", lambda ptr=None: False)
    t = threading.Thread(target=lambda: ops.conv_forward(x, w, geom))
    t.start()
    t.join()  # a handle made for it outside the capture, given back when it ends
    gc.collect()
    monkeypatch.setattr(capture, "stream_is_capturing", lambda ptr=None: ptr == 0xA000)
    seen.clear()
    t = threading.Thread(target=first_call)
    t.start()
    t.join()
    assert seen == [] and len(gpu.handles) == 2  # the pooled one served
