"""The cuDNN engine's wiring, on a faked GPU: CuPy arrays over fake addresses, cupy.empty
and cupy.zeros handing out such arrays, the binding's compute calls and the kernel
launchers recording their arguments. This checks, without a device, that each engine
function passes the plan's descriptors and the arrays' pointers in cuDNN's argument
order; tests/gpu/test_cudnn_ops.py checks the numbers on a real one."""

from __future__ import annotations

import contextlib
import importlib
import threading

import numpy as np
import pytest

import convfuse.ops as ops
from convfuse.ops import _checks
from convfuse.ops.cudnn.device import ExecContext
from convfuse.pool_geometry import PoolGeometry
from tests._ops_dispatch_helpers import GEOMS


class FakeStream:
    def __init__(self, ptr):
        self.ptr = ptr


class FakeEvent:
    """cupy.cuda.Event as Note [cached constants across streams] uses it: records on the
    fake current stream, and `done` is what the test sets."""

    def __init__(self, gpu):
        self.gpu, self.done = gpu, False
        self.ptr = 0xE0 + len(gpu.stream_ops)

    def record(self, stream=None):
        on = stream if stream is not None else self.gpu.stream
        self.gpu.stream_ops.append(("record", self.ptr, on.ptr))


class FakeGpu:
    COMPUTE = ("convolutionBiasActivationForward", "convolutionForward",
               "convolutionBackwardData", "convolutionBackwardFilter",
               "convolutionBackwardBias", "poolingForward", "poolingBackward",
               "activationForward", "addTensor")
    LAUNCHERS = ("activation_forward", "activation_backward", "activation_backward_bias",
                 "bias_act_forward")

    def __init__(self, monkeypatch):
        cp = pytest.importorskip("cupy")
        from convfuse import backend
        from convfuse._binding import cudnn
        from convfuse.ops import elementwise
        from convfuse.plan import algorithms, clear_plan_cache
        from convfuse.plan import conv as plan_conv

        if backend.gpu_available():
            pytest.skip("fakes the device; tests/gpu covers a real one")
        self.cp, self.lib = cp, cudnn()
        self.calls = []
        self.fail = {}  # binding function -> exceptions to raise on its next calls
        self.next_ptr = 1 << 40
        clear_plan_cache()
        monkeypatch.setattr(_checks, "current_device", lambda: 0)
        monkeypatch.setattr(cp.cuda.runtime, "getDevice", lambda: 0)
        monkeypatch.setattr(cp, "empty", lambda shape, dtype=float, order="C":
                            self.array(shape, dtype))
        monkeypatch.setattr(cp, "empty_like", lambda a, dtype=None, **kw:
                            self.array(a.shape, dtype or a.dtype))
        monkeypatch.setattr(cp, "zeros", lambda shape, dtype=float, order="C":
                            self.array(shape, dtype, "zeros"))
        for kind in ("conv", "pooling"):
            mod = importlib.import_module(f"convfuse.ops.cudnn.{kind}")
            monkeypatch.setattr(mod, "get_handle", lambda *a: "H")
        for name in self.COMPUTE:
            monkeypatch.setattr(self.lib, name, lambda *a, _n=name: self.record(_n, a))
        for name in self.LAUNCHERS:
            monkeypatch.setattr(elementwise, name, lambda *a, _n=name: self.calls.append((_n, a)))
        lib = self.lib
        self.perfs = [lib.AlgoPerf(a, 0, 1.0, 0, lib.CUDNN_DETERMINISTIC, m)
                      for a, m in ((6, lib.CUDNN_TENSOR_OP_MATH), (2, lib.CUDNN_DEFAULT_MATH),
                                   (0, lib.CUDNN_DEFAULT_MATH))]
        monkeypatch.setattr(algorithms, "heuristic_perfs", lambda *a: self.perfs)
        monkeypatch.setattr(algorithms, "forced_identity_perf", lambda lib_, h, plan: [
            lib.AlgoPerf(lib.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, 0, 0.0, 0,
                         lib.CUDNN_DETERMINISTIC, plan.conv_desc.getMathType())])
        # Note [workspace sizes are queried]: the size query answers the record's size.
        monkeypatch.setattr(algorithms, "workspace_size", lambda lib_, h, plan, d, algo, desc:
                            next(p.memory for p in self.perfs if p.algo == algo))
        monkeypatch.setattr(plan_conv, "pool_alloc", lambda n: None)
        monkeypatch.setattr(plan_conv, "release_search_memory", lambda: None)
        # Note [cached constants across streams]: events and waits, kept apart from calls
        self.stream, self.stream_ops = FakeStream(0x5000), []
        monkeypatch.setattr(cp.cuda, "get_current_stream", lambda: self.stream)
        monkeypatch.setattr(cp.cuda, "Event", lambda **kw: FakeEvent(self))
        monkeypatch.setattr(cp.cuda.runtime, "streamWaitEvent", lambda s, e, flags=0:
                            self.stream_ops.append(("wait", e, s, flags)))
        from convfuse.ops.cudnn import layout

        monkeypatch.setattr(layout, "to_channels_first", self.to_channels_first)
        monkeypatch.setattr(layout, "to_channels_last", self.to_channels_last)
        self.zeros = []

    def array(self, shape, dtype, kind="empty"):
        from convfuse.dtypes import canonical

        cp = self.cp
        dt = canonical(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = max(int(np.prod(shape)) * dt.itemsize, 1)
        mem = cp.cuda.memory.UnownedMemory(self.next_ptr, nbytes, None, device_id=0)
        self.next_ptr += -(-nbytes // 4096) * 4096 + 4096
        a = cp.ndarray(shape, dt, memptr=cp.cuda.memory.MemoryPointer(mem, 0))
        if kind == "zeros":
            self.zeros.append(a)
        return a

    def to_channels_first(self, a):
        out = self.array((a.shape[0], a.shape[-1], *a.shape[1:-1]), a.dtype)
        self.calls.append(("to_channels_first", (a, out)))
        return out

    def to_channels_last(self, a_cf, out=None):
        if out is None:
            out = self.array((a_cf.shape[0], *a_cf.shape[2:], a_cf.shape[1]), a_cf.dtype)
        self.calls.append(("to_channels_last", (a_cf, out)))
        return out

    def record(self, name, args):
        self.calls.append((name, args))
        errors = self.fail.get(name)
        if errors:
            raise errors.pop(0)

    # ---- the pointer path (Note [the pointer path] in convfuse/ops/cudnn/device.py) ----

    def pointer_context(self, stream=0xA000):
        """An ExecContext standing in for a caller's (torch's): allocations and CuPy
        scopes are recorded in `self.allocs` and `self.scopes`."""
        return FakeContext(self, stream)

    def device_array(self, shape, dtype, ctx, owner="caller"):
        """A DeviceArray over a fresh fake address, as the torch bridge makes one."""
        from convfuse.dtypes import canonical
        from convfuse.ops.cudnn.device import DeviceArray

        dt = canonical(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        ptr = self.next_ptr
        self.next_ptr += -(-max(int(np.prod(shape)) * dt.itemsize, 1) // 4096) * 4096 + 4096
        return DeviceArray(ptr, shape, dt, ctx, owner)

    def forbid_cupy_arrays(self, monkeypatch):
        """No CuPy array may be made on the pointer path, nor any DLPack exchange."""
        def refuse(*a, **k):
            raise AssertionError("the pointer path made a CuPy array or a DLPack exchange")

        for name in ("empty", "empty_like", "from_dlpack", "ascontiguousarray"):
            monkeypatch.setattr(self.cp, name, refuse)
        torch = pytest.importorskip("torch")
        monkeypatch.setattr(torch, "from_dlpack", refuse)

    def real_handles(self, monkeypatch):
        """The engine's own get_handle, over fake cuDNN handles that record setStream."""
        from convfuse.ops.cudnn import handle

        for kind in ("conv", "pooling", "batchnorm", "conv_transpose"):
            mod = importlib.import_module(f"convfuse.ops.cudnn.{kind}")
            monkeypatch.setattr(mod, "get_handle", handle.get_handle)
        monkeypatch.setattr(handle, "require_gpu", lambda what: None)
        monkeypatch.setattr(handle, "cudnn", lambda: type("Lib", (), {"Handle": FakeHandle}))
        monkeypatch.setattr(handle, "_local", threading.local())
        monkeypatch.setattr(handle, "_all_handles", [])
        monkeypatch.setattr(handle, "_free", {})
        return handle._all_handles


class FakeHandle:
    def __init__(self):
        self.streams = []  # every setStream, in order

    def setStream(self, ptr):
        self.streams.append(ptr)


class FakeContext(ExecContext):
    """A caller's ExecContext (torch's, say) on device 0: allocations and CuPy scopes are
    recorded in the fake GPU's `allocs` and `scopes`."""

    __slots__ = ("gpu",)

    def __init__(self, gpu, stream):
        super().__init__(0, stream)
        self.gpu = gpu
        gpu.allocs, gpu.scopes = getattr(gpu, "allocs", []), getattr(gpu, "scopes", [])

    def allocate(self, nbytes):
        ptr = self.gpu.next_ptr
        self.gpu.next_ptr += -(-nbytes // 4096) * 4096 + 4096
        self.gpu.allocs.append(("allocate", nbytes, ptr))
        return type("Block", (), {"ptr": ptr})()

    def empty(self, shape, dtype):
        a = self.gpu.device_array(shape, dtype, self, owner="ctx.empty")
        self.gpu.allocs.append(("empty", tuple(a.shape), a.ptr))
        return a

    @contextlib.contextmanager
    def _scope(self):
        self.gpu.scopes.append("enter")
        yield
        self.gpu.scopes.append("exit")

    def cupy_scope(self):
        return self._scope()


def ptr(a):
    return a.data.ptr


@pytest.fixture
def gpu(monkeypatch):
    return FakeGpu(monkeypatch)


FUSED = "convolutionBiasActivationForward"


@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: g.layout)
def test_engine_fused_relu_with_bias_and_residual(gpu, geom):
    from convfuse.plan import get_plan

    x, w = gpu.array(geom.input_shape, "float32"), gpu.array(geom.weight_shape, "float32")
    b, res = gpu.array(geom.bias_shape, "float32"), gpu.array(geom.output_shape, "float32")
    y, z = ops.conv_bias_act(x, w, b, geom, "relu", res, 0.5)
    assert z is None and y.shape == geom.output_shape and y.dtype == np.float32
    plan = get_plan(geom, "float32", "relu", True)
    cand = plan.choice("fwd", "H", fused=True)
    assert cand.algo == 6  # cuDNN's first-ranked record
    [(name, args)] = gpu.calls
    assert name == FUSED
    assert args == ("H", 1.0, plan.x_desc, ptr(x), plan.w_desc, ptr(w), plan.conv_desc_for(cand),
                    6, 0, 0, 0.5, plan.y_desc, ptr(res), plan.bias_desc, ptr(b), plan.act_desc,
                    plan.y_desc, ptr(y))
    assert args[6].getMathType() == gpu.lib.CUDNN_TENSOR_OP_MATH  # the record's math type


def test_engine_identity_with_bias_is_the_fused_call_on_its_forced_algorithm(gpu):
    from convfuse.plan import get_plan

    geom = GEOMS[0]
    x, w = gpu.array(geom.input_shape, "float16"), gpu.array(geom.weight_shape, "float16")
    b = gpu.array(geom.bias_shape, "float16")
    y1, _ = ops.conv_bias_act(x, w, b, geom)
    y2, _ = ops.conv_bias_act(x, w, b, geom, "linear")
    plan = get_plan(geom, "float16")
    assert gpu.zeros == []  # a bias was given: no zero bias is made
    for (name, a), y in zip(gpu.calls, (y1, y2), strict=True):
        assert name == FUSED
        # Note [IDENTITY needs IMPLICIT_PRECOMP_GEMM]; z = y with alpha2 = 0.
        assert a[7] == gpu.lib.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM
        assert (a[10], a[11], a[12]) == (0.0, plan.y_desc, ptr(y))
        assert (a[13], a[14], a[15]) == (plan.bias_desc, ptr(b), plan.act_desc)
        assert a[15].get()[0] == gpu.lib.CUDNN_ACTIVATION_IDENTITY


def test_engine_identity_with_a_residual_and_no_bias_reads_the_zero_bias(gpu):
    geom = GEOMS[0]
    x, w = gpu.array(geom.input_shape, "float16"), gpu.array(geom.weight_shape, "float16")
    res = gpu.array(geom.output_shape, "float16")
    y, _ = ops.conv_bias_act(x, w, None, geom, "identity", res, 0.5)
    [zero] = gpu.zeros  # one cached zero bias per (device, dtype, K)
    assert zero.shape == (geom.out_channels,) and zero.dtype == np.float16
    [(name, a)] = gpu.calls
    assert name == FUSED and (a[10], a[12], a[14]) == (0.5, ptr(res), ptr(zero))
    assert a[17] == ptr(y)
    assert a[7] == gpu.lib.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM


@pytest.mark.parametrize("act", ["identity", "linear", "silu", "tanh"])
def test_engine_with_nothing_to_fuse_runs_convolution_forward(gpu, act):
    """Note [nothing to fuse]: no bias, no residual, no activation cuDNN applies: one
    convolutionForward with the plan's best-ranked algorithm, no zero bias, no forward path
    recorded; another activation then runs in its kernel."""
    from convfuse.plan import get_plan

    geom = GEOMS[1]
    x, w = gpu.array(geom.input_shape, "float32"), gpu.array(geom.weight_shape, "float32")
    y, z = ops.conv_bias_act(x, w, None, geom, act)
    (name, a), *rest = gpu.calls
    plan = get_plan(geom, "float32")
    assert name == "convolutionForward" and a[7] == 6  # the ranking's first, not forced
    out = ptr(z) if z is not None else ptr(y)
    assert (a[2], a[3], a[4], a[5], a[11], a[12]) == (plan.x_desc, ptr(x), plan.w_desc,
                                                      ptr(w), plan.y_desc, out)
    assert gpu.zeros == [] and plan.forward_path is None
    assert [n for n, _ in rest] == ([] if act in ("identity", "linear")
                                    else ["activation_forward"])


@pytest.mark.parametrize(("act", "in_place"), [("silu", False), ("gelu", False),
                                               ("tanh", True), ("leaky_relu", True)])
def test_engine_other_activations_run_identity_then_one_kernel(gpu, act, in_place):
    geom = GEOMS[1]
    x, w = gpu.array(geom.input_shape, "float32"), gpu.array(geom.weight_shape, "float32")
    b = gpu.array(geom.bias_shape, "float32")
    y, z = ops.conv_bias_act(x, w, b, geom, act)
    (fused, fa), (launch, la) = gpu.calls
    assert (fused, launch) == (FUSED, "activation_forward")
    assert fa[15].get()[0] == gpu.lib.CUDNN_ACTIVATION_IDENTITY
    conv_out = fa[17]
    if in_place:
        assert z is None and ptr(y) == conv_out and la == (y, act, y)
    else:  # silu, gelu keep the pre-activation for backward
        assert ptr(z) == conv_out and ptr(y) != conv_out and la == (z, act, y)


def test_engine_forward_and_gradients(gpu):
    from convfuse.plan import get_plan

    # float32: a float64 channels-last geometry runs channels-first (the test below)
    geom = GEOMS[3]
    x, w = gpu.array(geom.input_shape, "float32"), gpu.array(geom.weight_shape, "float32")
    dz = gpu.array(geom.output_shape, "float32")
    y = ops.conv_forward(x, w, geom)
    dx = ops.conv_backward_data(dz, w, geom)
    dw_out = gpu.array(geom.weight_shape, "float32")
    db_out = gpu.array(geom.bias_shape, "float32")
    dw = ops.conv_backward_filter(x, dz, geom, out=dw_out, beta=1.0)
    db = ops.conv_backward_bias(dz, geom, out=db_out, beta=1.0)
    assert dw is dw_out and db is db_out
    assert dx.shape == geom.input_shape
    p = get_plan(geom, "float32")
    c = {d: p.choice(d, "H") for d in ("fwd", "bwd_data", "bwd_filter")}
    cd = {d: p.conv_desc_for(c[d]) for d in c}
    assert gpu.calls == [
        ("convolutionForward", ("H", 1.0, p.x_desc, ptr(x), p.w_desc, ptr(w), cd["fwd"],
                                c["fwd"].algo, 0, 0, 0.0, p.y_desc, ptr(y))),
        ("convolutionBackwardData", ("H", 1.0, p.w_desc, ptr(w), p.y_desc, ptr(dz),
                                     cd["bwd_data"], c["bwd_data"].algo, 0, 0, 0.0, p.x_desc,
                                     ptr(dx))),
        ("convolutionBackwardFilter", ("H", 1.0, p.x_desc, ptr(x), p.y_desc, ptr(dz),
                                       cd["bwd_filter"], c["bwd_filter"].algo, 0, 0, 1.0,
                                       p.w_desc, ptr(dw))),
        ("convolutionBackwardBias", ("H", 1.0, p.y_desc, ptr(dz), 1.0, p.bias_desc, ptr(db))),
    ]


def test_engine_float64_channels_last_runs_channels_first(gpu):
    """Note [float64 runs channels-first]: every cuDNN call of a float64 channels-last
    convolution gets the channels-first plan's descriptors and channels-first copies; the
    results are copied back into channels-last arrays (beta = 1 outputs copied in first)."""
    from convfuse.ops.cudnn import layout
    from convfuse.plan import get_plan

    geom = GEOMS[3]
    cf = layout.cudnn_geometry(geom, "float64")
    assert layout.cudnn_geometry(geom, "float32") is geom
    assert layout.cudnn_geometry(GEOMS[0], "float64") is GEOMS[0]
    assert (cf.input_shape, cf.weight_shape, cf.channels_last) == (
        geom.input_shape_cf, geom.weight_shape_cf, False)
    assert (cf.stride, cf.padding, cf.dilation, cf.groups) == (
        geom.stride, geom.padding, geom.dilation, geom.groups)
    assert cf.output_shape == geom.output_shape_cf
    x, w = gpu.array(geom.input_shape, "float64"), gpu.array(geom.weight_shape, "float64")
    dz, res = gpu.array(geom.output_shape, "float64"), gpu.array(geom.output_shape, "float64")
    b = gpu.array(geom.bias_shape, "float64")
    p = get_plan(cf, "float64")

    y = ops.conv_forward(x, w, geom)
    (n1, (x0, xc)), (n2, (w0, wc)), (n3, a), (n4, (yc, y0)) = gpu.calls
    assert (n1, n2, n3, n4) == ("to_channels_first", "to_channels_first", "convolutionForward",
                                "to_channels_last")
    assert x0 is x and w0 is w and y0 is y and y.shape == geom.output_shape
    assert (a[2], a[3], a[4], a[5], a[11], a[12]) == (p.x_desc, ptr(xc), p.w_desc, ptr(wc),
                                                      p.y_desc, ptr(yc))

    gpu.calls.clear()
    dx_out = gpu.array(geom.input_shape, "float64")
    dx = ops.conv_backward_data(dz, w, geom, out=dx_out, beta=1.0)
    (n1, (o0, oc)), (n2, (dz0, dzc)), (n3, (w0, wc)), (n4, a), (n5, (oc2, o2)) = gpu.calls
    assert (n1, n2, n3, n4, n5) == ("to_channels_first", "to_channels_first",
                                    "to_channels_first", "convolutionBackwardData",
                                    "to_channels_last")
    assert o0 is dx_out and dz0 is dz and w0 is w and oc2 is oc and o2 is dx_out and dx is dx_out
    assert (a[2], a[3], a[4], a[5], a[10], a[11], a[12]) == (
        p.w_desc, ptr(wc), p.y_desc, ptr(dzc), 1.0, p.x_desc, ptr(oc))

    gpu.calls.clear()
    dw = ops.conv_backward_filter(x, dz, geom)  # beta = 0: out is not read, no copy in
    names = [n for n, _ in gpu.calls]
    assert names == ["to_channels_first", "to_channels_first", "convolutionBackwardFilter",
                     "to_channels_last"]
    a = gpu.calls[2][1]
    assert (a[2], a[4], a[10], a[11]) == (p.x_desc, p.y_desc, 0.0, p.w_desc)
    assert dw.shape == geom.weight_shape

    gpu.calls.clear()
    y, z = ops.conv_bias_act(x, w, b, geom, "gelu", res, 0.5)
    names = [n for n, _ in gpu.calls]
    assert names == ["to_channels_first"] * 3 + [FUSED, "activation_forward",
                                                 "to_channels_last", "to_channels_last"]
    fp = get_plan(cf, "float64", "gelu", True)
    a = gpu.calls[3][1]
    assert (a[2], a[11], a[12], a[13], a[14]) == (fp.x_desc, fp.y_desc, ptr(gpu.calls[0][1][1]),
                                                  fp.bias_desc, ptr(b))
    assert y.shape == z.shape == geom.output_shape


@pytest.mark.parametrize("bias_grad", ["cudnn", "fused"])
def test_engine_activation_backward_bias(gpu, bias_grad):
    from convfuse import config
    from convfuse.plan import get_plan

    geom = GEOMS[2]
    dy, y = gpu.array(geom.output_shape, "float32"), gpu.array(geom.output_shape, "float32")
    db_out = gpu.array((4,), "float32")
    with config.flags(bias_grad=bias_grad):
        dz, db = ops.activation_backward_bias(dy, y, "relu", geom, db_out=db_out, beta=1.0)
        dz0, db0 = ops.activation_backward_bias(dy, y, "relu", geom)
    assert db is db_out and dz.shape == dy.shape and db0.shape == (4,)
    if bias_grad == "fused":
        assert gpu.calls == [("activation_backward_bias", (dy, y, "relu", geom, dz, db, 1.0)),
                             ("activation_backward_bias", (dy, y, "relu", geom, dz0, db0, 0.0))]
    else:
        p = get_plan(geom, "float32")
        assert gpu.calls == [
            ("activation_backward", (dy, y, "relu", dz)),
            ("convolutionBackwardBias", ("H", 1.0, p.y_desc, ptr(dz), 1.0, p.bias_desc, ptr(db))),
            ("activation_backward", (dy, y, "relu", dz0)),
            ("convolutionBackwardBias", ("H", 1.0, p.y_desc, ptr(dz0), 0.0, p.bias_desc,
                                         ptr(db0))),
        ]


def test_engine_activation_ops(gpu):
    z, dy = gpu.array((3, 5), "bfloat16"), gpu.array((3, 5), "bfloat16")
    out = gpu.array((3, 5), "bfloat16")
    y = ops.activation_forward(z, "swish")
    assert ops.activation_forward(z, "elu", out=out) is out
    dz = ops.activation_backward(dy, z, "gelu")
    assert gpu.calls == [("activation_forward", (z, "silu", y)),
                         ("activation_forward", (z, "elu", out)),
                         ("activation_backward", (dy, z, "gelu", dz))]


def test_engine_pooling(gpu):
    from convfuse.plan import get_pool_plan

    pg = PoolGeometry.create((2, 9, 3), 3, 2, 1, "avg", "NWC")
    x = gpu.array(pg.input_shape, "float32")
    y = ops.pool_forward(x, pg)
    dy = gpu.array(pg.output_shape, "float32")
    dx = ops.pool_backward(dy, x, y, pg)
    p = get_pool_plan(pg, "float32")
    assert y.shape == pg.output_shape and dx.shape == pg.input_shape
    assert gpu.calls == [
        ("poolingForward", ("H", p.pool_desc, 1.0, p.x_desc, ptr(x), 0.0, p.y_desc, ptr(y))),
        ("poolingBackward", ("H", p.pool_desc, 1.0, p.y_desc, ptr(y), p.y_desc, ptr(dy),
                             p.x_desc, ptr(x), 0.0, p.x_desc, ptr(dx))),
    ]


def test_engine_fused_call_falls_back_when_refused(gpu):
    from convfuse.errors import CudnnError

    lib = gpu.lib
    geom = GEOMS[0]
    x, w = gpu.array(geom.input_shape, "float32"), gpu.array(geom.weight_shape, "float32")
    refusal = CudnnError(lib.CUDNN_STATUS_NOT_SUPPORTED, "cudnnConvolutionBiasActivationForward")
    gpu.fail[FUSED] = [refusal, refusal]
    ops.conv_bias_act(x, w, None, geom, "relu")
    assert [a[7] for _, a in gpu.calls] == [6, 2, 0]  # down cuDNN's ranking
    ops.conv_bias_act(x, w, None, geom, "relu")
    assert gpu.calls[-1][1][7] == 0  # the plan remembers
    # IDENTITY's algorithm is forced: one refusal sends the plan to the unfused fallback
    # (Note [unfused fallback]; tests/test_fused_fallback.py checks it in detail).
    from convfuse.plan import FusedFallbackWarning

    gpu.fail[FUSED] = [refusal]
    gpu.calls.clear()
    b = gpu.array(geom.bias_shape, "float32")
    with pytest.warns(FusedFallbackWarning, match=r"\(3000\) for every algorithm"):
        ops.conv_bias_act(x, w, b, geom, "identity")
    assert [name for name, _ in gpu.calls] == [FUSED, "convolutionForward", "bias_act_forward"]
    assert gpu.calls[0][1][7] == lib.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM
    # Other errors are never retried.
    gpu.fail[FUSED] = [CudnnError(lib.CUDNN_STATUS_BAD_PARAM, "cudnnX")]
    gpu.calls.clear()
    with pytest.raises(CudnnError, match=r"BAD_PARAM|2000"):
        ops.conv_bias_act(x, w, None, geom, "relu")
    assert len(gpu.calls) == 1


def test_engine_errors_carry_context(gpu):
    from convfuse.errors import CudnnError

    geom = GEOMS[1]
    x, w = gpu.array(geom.input_shape, "float32"), gpu.array(geom.weight_shape, "float32")
    gpu.fail["convolutionForward"] = [CudnnError(2000, "cudnnConvolutionForward",
                                                 "CUDNN_STATUS_BAD_PARAM")]
    with pytest.raises(CudnnError) as info:
        ops.conv_forward(x, w, geom)
    assert str(info.value).startswith("cudnnConvolutionForward failed with CUDNN_STATUS_BAD_PARAM "
                                      f"(2000): conv_forward for {geom.describe()} dtype=float32")
    assert "algo=6 workspace=0" in str(info.value)


def test_cached_zero_bias_is_ordered_before_every_stream_that_reads_it(gpu, monkeypatch):
    """Note [cached constants across streams]: the zero bias is filled once, on the stream
    of its first use, with an event recorded after the fill; a call on any stream waits
    on that event (device-side) until the host has seen it complete, inside a capture as
    an external wait; afterwards no call waits."""
    from convfuse.ops.cudnn import constants, fused
    from convfuse.plan import capture

    monkeypatch.setattr(fused, "_zero_bias", {})
    geom = GEOMS[0]
    x, w = gpu.array(geom.input_shape, "float32"), gpu.array(geom.weight_shape, "float32")
    ops.conv_bias_act(x, w, None, geom, "relu")  # made on stream A
    [zero] = gpu.zeros
    [(kind, event, on)] = gpu.stream_ops[:1]
    assert (kind, on) == ("record", 0x5000)
    assert gpu.stream_ops[1:] == [("wait", event, 0x5000, 0)]
    gpu.stream = FakeStream(0x6000)  # another stream reads it: waits for the fill
    ops.conv_bias_act(x, w, None, geom, "relu")
    assert gpu.stream_ops[-1] == ("wait", event, 0x6000, 0)
    monkeypatch.setattr(capture, "stream_is_capturing", lambda: True)
    gpu.stream = FakeStream(0x7000)  # a capture: the wait is recorded as external
    ops.conv_bias_act(x, w, None, geom, "relu")
    assert gpu.stream_ops[-1] == ("wait", event, 0x7000, constants.EVENT_WAIT_EXTERNAL)
    monkeypatch.setattr(capture, "stream_is_capturing", lambda: False)
    [item] = fused_cache().values()
    item.event.done = True  # the host sees the fill finished: no more waits, anywhere
    n = len(gpu.stream_ops)
    for stream in (0x5000, 0x8000):
        gpu.stream = FakeStream(stream)
        ops.conv_bias_act(x, w, None, geom, "relu")
    assert len(gpu.stream_ops) == n and item.complete
    assert gpu.zeros == [zero]  # one fill in all
    fused_args = [a for name, a in gpu.calls if name == FUSED]
    assert len(fused_args) == 5 and all(a[14] == ptr(zero) for a in fused_args)


def fused_cache():
    from convfuse.ops.cudnn import fused

    return fused._zero_bias
