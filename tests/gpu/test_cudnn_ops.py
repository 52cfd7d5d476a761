"""The cuDNN engine against the NumPy reference in float64, on a real GPU.

Every output is poisoned with NaN before the call (engine allocations through a patched
cupy.empty/empty_like, `out=` arrays directly) and must come back finite. Inputs are
rounded to the tested dtype first, and the reference runs in float64 on those rounded
values, so the only error measured is the engine's. Tolerances are normwise:
max|got - ref| <= rtol * max|ref|.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

import convfuse.ops as ops
from convfuse import activations, config
from convfuse._binding import cudnn
from convfuse.dtypes import SUPPORTED
from convfuse.errors import CudnnError
from convfuse.geometry import ConvGeometry
from convfuse.plan import (
    Candidate,
    FusedFallbackWarning,
    WorkspaceFallbackWarning,
    clear_plan_cache,
    get_plan,
)
from convfuse.plan import conv as plan_conv
from convfuse.pool_geometry import PoolGeometry

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from fusion_strict import conv_fusion_documented

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

RTOL = {"float64": 1e-10, "float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}
DTYPES = tuple(RTOL)
NAN_BITS = {"float64": (np.uint64, 0x7FF8000000000000), "float32": (np.uint32, 0x7FC00000),
            "float16": (np.uint16, 0x7E00), "bfloat16": (np.uint16, 0x7FC0)}
_real_empty = cp.empty


@pytest.fixture(autouse=True)
def full_precision_fresh_plans():
    """float32 compares at 1e-5, so TF32 is off unless a test turns it on."""
    clear_plan_cache()
    with config.flags(allow_tf32=False):
        yield
    clear_plan_cache()


def poisoned(shape, dtype):
    a = _real_empty(shape, dtype=dtype)
    utype, bits = NAN_BITS[np.dtype(dtype).name]
    a.view(utype).fill(bits)
    return a


@contextlib.contextmanager
def poison_outputs(monkeypatch):
    """Every array the engine allocates starts as NaN, so unwritten elements show."""
    with monkeypatch.context() as m:
        m.setattr(cp, "empty", lambda shape, dtype=float, order="C": poisoned(shape, dtype))
        m.setattr(cp, "empty_like", lambda a, dtype=None, **kw: poisoned(a.shape, dtype or a.dtype))
        yield


def host(a):
    return cp.asnumpy(a).astype(np.float64)


def assert_close(got, ref, dtype, what="", rtol=None):
    g = host(got)
    assert g.shape == ref.shape, what
    assert np.isfinite(g).all(), f"{what}: {np.count_nonzero(~np.isfinite(g))} elements unwritten"
    tol = (rtol or RTOL[np.dtype(dtype).name]) * max(float(np.abs(ref).max()), 1e-30)
    err = float(np.abs(g - ref).max())
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


class Data:
    """One array in three forms: rounded host (dtype), float64 reference input, device."""

    def __init__(self, rng, shape, dtype, values=None):
        raw = rng.standard_normal(shape) if values is None else values
        self.lo = raw.astype(SUPPORTED[dtype])
        self.ref = self.lo.astype(np.float64)
        self.dev = cp.asarray(self.lo)

    def unchanged(self):
        np.testing.assert_array_equal(host(self.dev), self.ref)


def conv_geoms():
    out = []
    for rank, channels_last, groups in itertools.product((1, 2, 3), (False, True), (1, 2)):
        spatial = {1: (11,), 2: (7, 6), 3: (5, 4, 5)}[rank]
        kernel = {1: (3,), 2: (3, 2), 3: (3, 2, 3)}[rank]
        stride = {1: 2, 2: (2, 1), 3: 1}[rank]
        padding = {1: 1, 2: (1, 0), 3: (1, 0, 1)}[rank]
        # dilated in 1-D only (cuDNN sees (1, 2) there): 2-D, groups 1 stays where cuDNN
        # documents the fused call (DOCUMENTED, below)
        dilation = {1: 2, 2: 1, 3: 1}[rank]
        c, k = 4, 6
        x, w = (2, c, *spatial), (k, c // groups, *kernel)
        if channels_last:
            x, w = (x[0], *x[2:], x[1]), (w[0], *w[2:], w[1])
        out.append(ConvGeometry.create(x, w, stride, padding, dilation, groups,
                                       "NHWC" if channels_last else "NCHW"))
    return out


GEOMS = conv_geoms()
#: 2-D, groups 1, channels first and last: where cuDNN documents the fused call
#: (tests/gpu/test_fused_path_gpu.py), so a test of which calls run may not meet a refusal.
#: GEOMS[3] (1-D, channels-last, grouped) is outside it: cuDNN may refuse the fused call
#: there and run the unfused fallback, which is right but not what those tests count.
# The geometries cuDNN documents the fused call for, in float32 (scripts/fusion_strict.py
# cites the documentation): the tests below demand the fused call on these only.
DOCUMENTED = [g for g in GEOMS if g.rank == 2 and conv_fusion_documented(
    g.layout, g.groups, g.dilation, g.in_channels, g.out_channels, "float32", "relu")]
# the tests below index it and parametrize over it: an empty list would be IndexErrors and
# silently empty families (collected on the CPU too, so a geometry change shows here)
assert [(g.layout, g.groups) for g in DOCUMENTED] == [("NCHW", 1), ("NHWC", 1)]


def gid(g):
    return f"{g.layout}-g{g.groups}"


# ---------------------------------------------------------------- convolution

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geom", GEOMS, ids=gid)
@pytest.mark.parametrize("activation", ["identity", "relu", "silu", "tanh"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_bias_act(monkeypatch, rng, geom, dtype, activation, with_bias):
    x, w = Data(rng, geom.input_shape, dtype), Data(rng, geom.weight_shape, dtype)
    b = Data(rng, geom.bias_shape, dtype) if with_bias else None
    # both paths of alpha2 (z = y at 0, and a residual), and bias with a residual together
    with_res = not with_bias or activation in ("relu", "tanh")
    res = Data(rng, geom.output_shape, dtype) if with_res else None
    with poison_outputs(monkeypatch):
        y, z = ops.conv_bias_act(x.dev, w.dev, b and b.dev, geom, activation,
                                 res and res.dev, 0.5)
    y_ref, z_ref = ops.conv_bias_act(x.ref, w.ref, b and b.ref, geom, activation,
                                     res and res.ref, 0.5)
    assert_close(y, y_ref, dtype, "y")
    if activation == "identity":  # FACTS: a wrong algorithm has been seen to apply ReLU
        assert (host(y) < 0).any()
    if activations.saves(activation) == "preactivation":
        assert_close(z, z_ref, dtype, "z")
    else:
        assert z is None
    for a in (x, w, b, res):
        if a is not None:
            a.unchanged()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geom", GEOMS, ids=gid)
def test_conv_forward_and_gradients(monkeypatch, rng, geom, dtype):
    x, w = Data(rng, geom.input_shape, dtype), Data(rng, geom.weight_shape, dtype)
    dz = Data(rng, geom.output_shape, dtype)
    with poison_outputs(monkeypatch):
        y = ops.conv_forward(x.dev, w.dev, geom)
        dx = ops.conv_backward_data(dz.dev, w.dev, geom)
        dw = ops.conv_backward_filter(x.dev, dz.dev, geom)
        db = ops.conv_backward_bias(dz.dev, geom)
    assert_close(y, ops.conv_forward(x.ref, w.ref, geom), dtype, "y")
    dx_ref = ops.conv_backward_data(dz.ref, w.ref, geom)
    dw_ref = ops.conv_backward_filter(x.ref, dz.ref, geom)
    db_ref = ops.conv_backward_bias(dz.ref, geom)
    assert_close(dx, dx_ref, dtype, "dx")
    assert_close(dw, dw_ref, dtype, "dw")
    assert_close(db, db_ref, dtype, "db")

    # out= with beta=0 writes every element; beta=1 accumulates.
    for beta in (0.0, 1.0):
        outs = [poisoned(s, x.dev.dtype) if beta == 0 else Data(rng, s, dtype)
                for s in (geom.input_shape, geom.weight_shape, geom.bias_shape)]
        arrs = [o if beta == 0 else o.dev for o in outs]
        start = [0.0 if beta == 0 else o.ref for o in outs]
        got = [ops.conv_backward_data(dz.dev, w.dev, geom, out=arrs[0], beta=beta),
               ops.conv_backward_filter(x.dev, dz.dev, geom, out=arrs[1], beta=beta),
               ops.conv_backward_bias(dz.dev, geom, out=arrs[2], beta=beta)]
        for g, a, s, r, name in zip(got, arrs, start, (dx_ref, dw_ref, db_ref), "xwb",
                                    strict=True):
            assert g is a
            assert_close(g, s + r, dtype, f"d{name} beta={beta}")
    for a in (x, w, dz):
        a.unchanged()


@pytest.mark.parametrize("geom", DOCUMENTED, ids=gid)
@pytest.mark.parametrize("activation", ["identity", "relu"])
def test_fused_activations_make_exactly_one_cudnn_call(monkeypatch, rng, activation, geom):
    lib = cudnn()
    x, w = Data(rng, geom.input_shape, "float32"), Data(rng, geom.weight_shape, "float32")
    b = Data(rng, geom.bias_shape, "float32")
    ops.conv_bias_act(x.dev, w.dev, b.dev, geom, activation)  # plans and algorithms chosen
    calls = []
    compute = ["convolutionBiasActivationForward", "convolutionForward", "activationForward",
               "addTensor", "convolutionBackwardBias", "convolutionBackwardData",
               "convolutionBackwardFilter", "poolingForward"]
    for name in compute:
        real = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    from convfuse.ops import elementwise

    for name in ("activation_forward", "activation_backward", "activation_backward_bias"):
        monkeypatch.setattr(elementwise, name, lambda *a, _n=name: calls.append(_n))
    y, _ = ops.conv_bias_act(x.dev, w.dev, b.dev, geom, activation)
    assert calls == ["convolutionBiasActivationForward"]
    y_ref, _ = ops.conv_bias_act(x.ref, w.ref, b.ref, geom, activation)
    assert_close(y, y_ref, "float32")


@pytest.mark.parametrize("with_bias", [True, False])
def test_other_activations_add_exactly_one_kernel(monkeypatch, rng, with_bias):
    """With a bias: the fused call (IDENTITY) then the activation's kernel; without one,
    nothing to fuse (Note [nothing to fuse]): convolutionForward then the kernel. The
    geometry is one cuDNN documents the fused call for (a refusal would add the fallback's
    convolutionForward to the calls)."""
    geom = DOCUMENTED[0]
    lib = cudnn()
    x, w = Data(rng, geom.input_shape, "float32"), Data(rng, geom.weight_shape, "float32")
    b = Data(rng, geom.bias_shape, "float32") if with_bias else None
    from convfuse.ops import elementwise

    for act in ("silu", "gelu", "elu", "sigmoid", "leaky_relu", "relu6"):
        calls = []
        with monkeypatch.context() as m:
            for name, tag in (("convolutionBiasActivationForward", "fused"),
                              ("convolutionForward", "plain")):
                real = getattr(lib, name)
                # recorded once the call returns: a ranked algorithm cuDNN refuses (the
                # engine then tries the next) is no call of the path
                m.setattr(lib, name,
                          lambda *a, _r=real, _c=calls, _t=tag: (_r(*a), _c.append(_t))[0])
            real_act = elementwise.activation_forward
            m.setattr(elementwise, "activation_forward",
                      lambda *a, _r=real_act, _c=calls: _c.append("act") or _r(*a))
            y, z = ops.conv_bias_act(x.dev, w.dev, b and b.dev, geom, act)
        assert calls == ["fused" if with_bias else "plain", "act"], act
        y_ref, z_ref = ops.conv_bias_act(x.ref, w.ref, b and b.ref, geom, act)
        assert_close(y, y_ref, "float32", act)
        if z_ref is not None:
            assert_close(z, z_ref, "float32", act)


def test_backward_never_uses_a_cupy_reduction(monkeypatch, rng):
    geom = GEOMS[5]
    dz = Data(rng, geom.output_shape, "float32")
    y = Data(rng, geom.output_shape, "float32")

    def forbidden(*a, **k):
        raise AssertionError("a CuPy reduction ran in backward")

    for bias_grad in ("cudnn", "fused"):
        with config.flags(bias_grad=bias_grad), monkeypatch.context() as m:
            m.setattr(cp, "sum", forbidden)
            m.setattr(cp.ndarray, "sum", forbidden)
            m.setattr(cp, "mean", forbidden)
            db1 = ops.conv_backward_bias(dz.dev, geom)
            dzz, db2 = ops.activation_backward_bias(dz.dev, y.dev, "tanh", geom)
        assert_close(db1, ops.conv_backward_bias(dz.ref, geom), "float32")
        dz_ref, db_ref = ops.activation_backward_bias(dz.ref, y.ref, "tanh", geom)
        assert_close(dzz, dz_ref, "float32", bias_grad)
        assert_close(db2, db_ref, "float32", bias_grad)


# ---------------------------------------------------------------- activation ops

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", activations.ACTIVATIONS)
@pytest.mark.parametrize("bias_grad", ["cudnn", "fused"])
def test_activation_ops(monkeypatch, rng, dtype, activation, bias_grad):
    geom = GEOMS[7]
    z = Data(rng, geom.output_shape, dtype)
    dy = Data(rng, geom.output_shape, dtype)
    y_ref = ops.activation_forward(z.ref, activation)
    with poison_outputs(monkeypatch):
        y = ops.activation_forward(z.dev, activation)
    assert_close(y, y_ref, dtype, "forward")
    out = poisoned(geom.output_shape, z.dev.dtype)
    assert ops.activation_forward(z.dev, activation, out=out) is out
    assert_close(out, y_ref, dtype, "forward out=")

    need = activations.saves(activation)
    saved = None if need == "none" else (z if need == "preactivation" else
                                         Data(rng, None, dtype, values=host(y)))
    dz_ref = ops.activation_backward(dy.ref, saved and saved.ref, activation)
    with poison_outputs(monkeypatch):
        dz = ops.activation_backward(dy.dev, saved and saved.dev, activation)
    assert_close(dz, dz_ref, dtype, "backward")

    start = Data(rng, geom.bias_shape, dtype)
    with config.flags(bias_grad=bias_grad), poison_outputs(monkeypatch):
        dz2, db = ops.activation_backward_bias(dy.dev, saved and saved.dev, activation, geom)
        dz3, db3 = ops.activation_backward_bias(dy.dev, saved and saved.dev, activation, geom,
                                                db_out=start.dev, beta=1.0)
    dz_ref2, db_ref = ops.activation_backward_bias(dy.ref, saved and saved.ref, activation, geom)
    assert_close(dz2, dz_ref2, dtype, "backward_bias dz")
    assert_close(db, db_ref, dtype, "backward_bias db")
    assert db3 is start.dev
    assert_close(dz3, dz_ref2, dtype, "backward_bias dz (beta=1)")
    assert_close(db3, start.ref + db_ref, dtype, "backward_bias db beta=1")
    for a in (z, dy):
        a.unchanged()


# ---------------------------------------------------------------- pooling

def pool_geoms():
    out = []
    for rank, channels_last, mode in itertools.product((1, 2, 3), (False, True), ("max", "avg")):
        spatial = {1: (9,), 2: (6, 7), 3: (4, 5, 4)}[rank]
        shape = (2, 3, *spatial) if not channels_last else (2, *spatial, 3)
        kernel = {1: 3, 2: (3, 2), 3: 2}[rank]
        stride = {1: 2, 2: (2, 1), 3: 2}[rank]
        padding = {1: 1, 2: (1, 0), 3: 1}[rank]
        out.append(PoolGeometry.create(shape, kernel, stride, padding, mode,
                                       "NHWC" if channels_last else "NCHW"))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pg", pool_geoms(), ids=lambda p: f"{p.layout}-{p.mode}")
def test_pooling(monkeypatch, rng, pg, dtype):
    n = int(np.prod(pg.input_shape))
    # Distinct values exact in every dtype (|v| * 64 <= 256): max pooling has no ties, so
    # which tied element gets the gradient never matters.
    assert n <= 512
    values = (rng.permutation(n) - n // 2).reshape(pg.input_shape) / 64.0
    x = Data(rng, None, dtype, values=values)
    dy = Data(rng, pg.output_shape, dtype)
    with poison_outputs(monkeypatch):
        y = ops.pool_forward(x.dev, pg)
    y_ref = ops.pool_forward(x.ref, pg)
    assert_close(y, y_ref, dtype, "pool y")
    with poison_outputs(monkeypatch):
        dx = ops.pool_backward(dy.dev, x.dev, y, pg)
    assert_close(dx, ops.pool_backward(dy.ref, x.ref, y_ref, pg), dtype, "pool dx")
    for a in (x, dy):
        a.unchanged()


# ---------------------------------------------------------------- plans on the device

def test_workspace_fallback_on_out_of_memory(monkeypatch, rng):
    tried = []

    def no_workspace(nbytes):
        tried.append(nbytes)
        if nbytes:
            raise cp.cuda.memory.OutOfMemoryError(nbytes, 0, 0)

    monkeypatch.setattr(plan_conv, "pool_alloc", no_workspace)
    geom = GEOMS[4]
    x, w = Data(rng, geom.input_shape, "float32"), Data(rng, geom.weight_shape, "float32")
    dz = Data(rng, geom.output_shape, "float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = ops.conv_forward(x.dev, w.dev, geom)
        dx = ops.conv_backward_data(dz.dev, w.dev, geom)
        dw = ops.conv_backward_filter(x.dev, dz.dev, geom)
    assert_close(y, ops.conv_forward(x.ref, w.ref, geom), "float32")
    assert_close(dx, ops.conv_backward_data(dz.ref, w.ref, geom), "float32")
    assert_close(dw, ops.conv_backward_filter(x.ref, dz.ref, geom), "float32")
    plan = get_plan(geom, "float32")
    from convfuse.ops.cudnn.handle import get_handle

    for direction in ("fwd", "bwd_data", "bwd_filter"):
        assert plan.choice(direction, get_handle()).workspace == 0
    fallbacks = [c for c in caught if issubclass(c.category, WorkspaceFallbackWarning)]
    first_tries_needed_memory = any(tried)
    assert bool(fallbacks) == first_tries_needed_memory
    assert len(fallbacks) <= 3  # at most once per direction


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_deterministic_mode_picks_deterministic_algorithms(rng, dtype):
    geom = DOCUMENTED[0]
    x, w = Data(rng, geom.input_shape, dtype), Data(rng, geom.weight_shape, dtype)
    dz = Data(rng, geom.output_shape, dtype)
    from convfuse.ops.cudnn.handle import get_handle

    with config.flags(deterministic=True):
        first = [ops.conv_backward_data(dz.dev, w.dev, geom),
                 ops.conv_backward_filter(x.dev, dz.dev, geom)]
        again = [ops.conv_backward_data(dz.dev, w.dev, geom),
                 ops.conv_backward_filter(x.dev, dz.dev, geom)]
        plan = get_plan(geom, dtype)
        for direction in ("bwd_data", "bwd_filter"):
            assert plan.choice(direction, get_handle()).deterministic
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(cp.asnumpy(a), cp.asnumpy(b))
    assert_close(first[0], ops.conv_backward_data(dz.ref, w.ref, geom), dtype)
    assert_close(first[1], ops.conv_backward_filter(x.ref, dz.ref, geom), dtype)


@pytest.mark.parametrize("allow_tf32", [False, True])
def test_tf32_flag(rng, allow_tf32):
    lib = cudnn()
    geom = DOCUMENTED[1]  # channels-last; documented, so the fused choice below exists
    x, w = Data(rng, geom.input_shape, "float32"), Data(rng, geom.weight_shape, "float32")
    dz = Data(rng, geom.output_shape, "float32")
    from convfuse.ops.cudnn.handle import get_handle

    with config.flags(allow_tf32=allow_tf32):
        y, _ = ops.conv_bias_act(x.dev, w.dev, None, geom, "relu")
        dx = ops.conv_backward_data(dz.dev, w.dev, geom)
        dw = ops.conv_backward_filter(x.dev, dz.dev, geom)
        relu_plan, plan = get_plan(geom, "float32", "relu"), get_plan(geom, "float32")
    chosen = [relu_plan.choice("fwd", get_handle(), fused=True),
              plan.choice("bwd_data", get_handle()), plan.choice("bwd_filter", get_handle())]
    if allow_tf32:
        assert plan.key.math_type == "CUDNN_DEFAULT_MATH"
        assert all(c.math_type != lib.CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION for c in chosen)
        rtol = 5e-3  # TF32 keeps 10 mantissa bits
    else:
        assert plan.key.math_type == "CUDNN_FMA_MATH"
        assert all(c.math_type == lib.CUDNN_FMA_MATH for c in chosen)
        rtol = 1e-5
    y_ref, _ = ops.conv_bias_act(x.ref, w.ref, None, geom, "relu")
    assert_close(y, y_ref, "float32", rtol=rtol)
    assert_close(dx, ops.conv_backward_data(dz.ref, w.ref, geom), "float32", rtol=rtol)
    assert_close(dw, ops.conv_backward_filter(x.ref, dz.ref, geom), "float32", rtol=rtol)


def test_benchmark_mode_never_touches_the_callers_out(rng):
    """Find*Ex writes while timing; it must write a scratch buffer, not out (beta=1)."""
    geom = GEOMS[1]
    x, w = Data(rng, geom.input_shape, "float64"), Data(rng, geom.weight_shape, "float64")
    dz = Data(rng, geom.output_shape, "float64")
    start_dx, start_dw = Data(rng, geom.input_shape, "float64"), Data(rng, geom.weight_shape,
                                                                       "float64")
    with config.flags(benchmark=True):
        y = ops.conv_forward(x.dev, w.dev, geom)
        ops.conv_backward_data(dz.dev, w.dev, geom, out=start_dx.dev, beta=1.0)
        ops.conv_backward_filter(x.dev, dz.dev, geom, out=start_dw.dev, beta=1.0)
    assert_close(y, ops.conv_forward(x.ref, w.ref, geom), "float64")
    assert_close(start_dx.dev, start_dx.ref + ops.conv_backward_data(dz.ref, w.ref, geom),
                 "float64")
    assert_close(start_dw.dev, start_dw.ref + ops.conv_backward_filter(x.ref, dz.ref, geom),
                 "float64")


@pytest.mark.parametrize("geom", DOCUMENTED, ids=gid)
def test_fused_call_moves_on_when_cudnn_refuses_an_algorithm(monkeypatch, rng, geom):
    lib = cudnn()
    x, w = Data(rng, geom.input_shape, "float32"), Data(rng, geom.weight_shape, "float32")
    refused = []
    real = lib.convolutionBiasActivationForward

    def refuse_first(*args):
        if not refused:
            refused.append((args[7], args[6].getMathType()))  # (algo, math type) refused
            raise CudnnError(lib.CUDNN_STATUS_NOT_SUPPORTED,
                             "cudnnConvolutionBiasActivationForward")
        return real(*args)

    ops.conv_bias_act(x.dev, w.dev, None, geom, "relu")  # the plan ranks its algorithms
    ranked = get_plan(geom, "float32", "relu").settled("fwd", fused=True)
    if ranked is None or not ranked.remaining:
        pytest.skip("cuDNN ranks a single fused algorithm for this plan here (TF32 off): "
                    "there is no next one to move to")
    monkeypatch.setattr(lib, "convolutionBiasActivationForward", refuse_first)
    y, _ = ops.conv_bias_act(x.dev, w.dev, None, geom, "relu")
    assert_close(y, ops.conv_bias_act(x.ref, w.ref, None, geom, "relu")[0], "float32")
    from convfuse.ops.cudnn.handle import get_handle

    now = get_plan(geom, "float32", "relu").choice("fwd", get_handle(), fused=True)
    assert (now.algo, now.math_type) != refused[0]  # the plan moved to the next record
    # IDENTITY's algorithm is forced: one refusal sends the plan to the unfused fallback
    # (Note [unfused fallback]), which still computes the right numbers.
    refused.clear()
    b = Data(rng, geom.bias_shape, "float32")  # (without one, nothing to fuse)
    with pytest.warns(FusedFallbackWarning, match=r"\(3000\) for every algorithm"):
        y, _ = ops.conv_bias_act(x.dev, w.dev, b.dev, geom, "identity")
    assert refused[0][0] == lib.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM
    assert_close(y, ops.conv_bias_act(x.ref, w.ref, b.ref, geom, "identity")[0], "float32")


def test_cudnn_errors_carry_the_call_context(monkeypatch, rng):
    geom = GEOMS[0]
    x, w = Data(rng, geom.input_shape, "float32"), Data(rng, geom.weight_shape, "float32")
    plan = get_plan(geom, "float32")
    monkeypatch.setattr(plan, "choice", lambda *a, **k: Candidate(999, 0, 0, True))
    with pytest.raises(CudnnError) as info:
        ops.conv_forward(x.dev, w.dev, geom)
    msg = str(info.value)
    assert "cudnnConvolutionForward" in msg and geom.describe() in msg and "algo=999" in msg
    assert "dtype=float32" in msg


def test_handles_follow_the_stream_and_the_thread():
    from convfuse.ops.cudnn.handle import get_handle

    h = get_handle()
    assert h.getStream() == cp.cuda.get_current_stream().ptr
    with cp.cuda.Stream() as s:
        assert get_handle() is h
        assert h.getStream() == s.ptr
    assert get_handle().getStream() == cp.cuda.get_current_stream().ptr
    other = []
    t = threading.Thread(target=lambda: other.append(get_handle()))
    t.start()
    t.join()
    assert other[0] is not h


# ---------------------------------------------------------------- float64 channels-last

@pytest.mark.parametrize("geom", [g for g in GEOMS if g.channels_last], ids=gid)
def test_float64_channels_last_runs_channels_first(monkeypatch, rng, geom):
    """Note [float64 runs channels-first]: every cuDNN convolution call of a float64
    channels-last op gets the channels-first plan's descriptors (which path ran), and the
    channels-last results match the float64 reference, beta = 1 outputs accumulating once,
    with NaN-poisoned outputs."""
    from convfuse.ops.cudnn.layout import cudnn_geometry

    lib = cudnn()
    seen = []
    for name in ("convolutionForward", "convolutionBiasActivationForward",
                 "convolutionBackwardData", "convolutionBackwardFilter"):
        real = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *a, _n=name, _r=real: (
            seen.append((_n, a[2], a[4])), _r(*a))[1])
    x, w = Data(rng, geom.input_shape, "float64"), Data(rng, geom.weight_shape, "float64")
    b, res = Data(rng, geom.bias_shape, "float64"), Data(rng, geom.output_shape, "float64")
    dz = Data(rng, geom.output_shape, "float64")
    start_dx = Data(rng, geom.input_shape, "float64")
    with warnings.catch_warnings(), poison_outputs(monkeypatch):
        warnings.simplefilter("error")
        # a refused fused call may fall back (Note [unfused fallback]); its plain forward
        # then runs on the channels-first plan too, which the spy checks below
        warnings.simplefilter("ignore", FusedFallbackWarning)
        y = ops.conv_forward(x.dev, w.dev, geom)
        y2, _ = ops.conv_bias_act(x.dev, w.dev, b.dev, geom, "relu", res.dev, 0.5)
        dx = ops.conv_backward_data(dz.dev, w.dev, geom, out=start_dx.dev, beta=1.0)
        dw = ops.conv_backward_filter(x.dev, dz.dev, geom)
    assert dx is start_dx.dev and y.shape == geom.output_shape and dw.shape == geom.weight_shape
    assert y.flags.c_contiguous and dw.flags.c_contiguous
    assert_close(y, ops.conv_forward(x.ref, w.ref, geom), "float64", "y")
    assert_close(y2, ops.conv_bias_act(x.ref, w.ref, b.ref, geom, "relu", res.ref, 0.5)[0],
                 "float64", "y fused")
    assert_close(dx, start_dx.ref + ops.conv_backward_data(dz.ref, w.ref, geom), "float64",
                 "dx (beta=1)")
    assert_close(dw, ops.conv_backward_filter(x.ref, dz.ref, geom), "float64", "dw")
    cf = cudnn_geometry(geom, "float64")
    plain, fused = get_plan(cf, "float64"), get_plan(cf, "float64", "relu", True)
    want = {"convolutionForward": (plain.x_desc, plain.w_desc),
            "convolutionBiasActivationForward": (fused.x_desc, fused.w_desc),
            "convolutionBackwardData": (plain.w_desc, plain.y_desc),
            "convolutionBackwardFilter": (plain.x_desc, plain.y_desc)}
    assert {name for name, _, _ in seen} >= {"convolutionForward", "convolutionBackwardData",
                                             "convolutionBackwardFilter"}
    for name, first, second in seen:
        assert (first, second) == want[name], name
    for a in (x, w, b, res, dz):
        a.unchanged()


# ---------------------------------------------------------------- cached constants

def test_cached_zero_bias_is_ordered_before_a_reader_on_another_stream(monkeypatch, rng):
    """Note [cached constants across streams], on a device: the zero bias is made on
    stream A behind a ~0.5 s kernel, over a pool block that held NaN, and read at once by
    an IDENTITY fused call with a residual on stream B. B must wait for the fill (a read
    before it adds NaN, which IDENTITY passes through), so y is the reference's, and the
    wait is B's."""
    from convfuse.ops.cudnn import fused

    monkeypatch.setattr(fused, "_zero_bias", {})
    geom = DOCUMENTED[0]
    k = geom.out_channels
    x, w = Data(rng, geom.input_shape, "float32"), Data(rng, geom.weight_shape, "float32")
    waits = []
    real_wait = cp.cuda.runtime.streamWaitEvent
    monkeypatch.setattr(cp.cuda.runtime, "streamWaitEvent", lambda s, e, flags=0: (
        waits.append((s, flags)), real_wait(s, e, flags))[1])
    spin = cp.RawKernel(r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}""", "spin")
    b_data = Data(rng, geom.bias_shape, "float32")
    res = Data(rng, geom.output_shape, "float32")  # without one, nothing to fuse
    ops.conv_bias_act(x.dev, w.dev, b_data.dev, geom, "identity", res.dev)  # plan, algorithm
    cp.cuda.Device().synchronize()  # all that is on the device before the streams start
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with a:
        with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
            stale = cp.full((k,), np.nan, dtype=np.float32)  # the size the bias will take
            a.synchronize()
            del stale  # back to the default pool, for stream A
        spin((1,), (1,), (np.int64(1_000_000_000),))  # about 0.5 s
        bias = fused.zero_bias(cp, "float32", k)  # its fill queues behind the spin
    with b:
        y, _ = ops.conv_bias_act(x.dev, w.dev, None, geom, "identity", res.dev)
    b.synchronize()
    a.synchronize()
    assert (b.ptr, 0) in waits  # B waited for the fill, on the device
    assert not bool(cp.isnan(bias).any())
    assert_close(y, ops.conv_bias_act(x.ref, w.ref, None, geom, "identity", res.ref)[0],
                 "float32")


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("activation", ["identity", "relu"])
def test_alpha2_zero_leaves_the_nan_poisoned_y_unread(monkeypatch, rng, dtype, activation):
    """Note [z = y with alpha2 = 0]: without a residual the fused call gets z = y (NaN
    here) and alpha2 = 0; a cuDNN that read z would return NaN (0 * NaN)."""
    lib = cudnn()
    made, seen = {}, []
    real = lib.convolutionBiasActivationForward

    def spy(*a):
        z = made.get(a[12])  # the engine's output, as allocated (poisoned)
        seen.append((a[10], a[12], a[17], z is not None and bool(cp.isnan(z).all())))
        return real(*a)

    def empty(shape, dtype=float, order="C"):
        arr = poisoned(shape, dtype)
        made[arr.data.ptr] = arr
        return arr

    monkeypatch.setattr(lib, "convolutionBiasActivationForward", spy)
    geom = DOCUMENTED[0]
    x, w = Data(rng, geom.input_shape, dtype), Data(rng, geom.weight_shape, dtype)
    b = Data(rng, geom.bias_shape, dtype)
    with warnings.catch_warnings(), monkeypatch.context() as m:
        m.setattr(cp, "empty", empty)
        warnings.simplefilter("ignore", FusedFallbackWarning)  # checked through `seen`
        y, _ = ops.conv_bias_act(x.dev, w.dev, b.dev, geom, activation)
    assert seen, "the fused call did not run"
    for alpha2, z, out, z_was_nan in seen:
        assert (alpha2, z) == (0.0, out) and z_was_nan
    assert_close(y, ops.conv_bias_act(x.ref, w.ref, b.ref, geom, activation)[0], dtype)
