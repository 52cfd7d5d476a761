"""The transposed convolution on a real GPU: the cuDNN calls that ran (BackwardData for the
forward, no bias pass when there is nothing to add, the fused activation-backward +
bias-gradient kernel for db and never cudnnConvolutionBackwardBias), no fallback warning
of any kind, results equal to the float64 reference engine with NaN-poisoned outputs over
a grid (rank, layout, dtype, stride, output_padding, dilation, groups, activation,
residual), float64 channels-last run channels-first (Note [float64 runs channels-first]),
and a captured training step that replays the eager one."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

import convfuse as cf
import convfuse.ops as ops
from convfuse import activations
from convfuse._binding import cudnn
from convfuse.functional_transpose import (
    conv_transpose_bias_act_backward,
    conv_transpose_bias_act_forward,
)
from convfuse.ops import elementwise
from convfuse.ops.cudnn.layout import cudnn_geometry
from convfuse.plan import (
    BiasGradFallbackWarning,
    FusedFallbackWarning,
    WorkspaceFallbackWarning,
    get_transpose_plan,
)
from convfuse.transpose_geometry import ConvTransposeGeometry
from tests.gpu.test_cudnn_ops import (  # noqa: F401  (the autouse fixture is used by name)
    DTYPES,
    Data,
    assert_close,
    full_precision_fresh_plans,
    poison_outputs,
)
from tests.gpu.test_layers_gpu import with_device_saved

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

LAYOUTS = {1: ("NCW", "NWC"), 2: ("NCHW", "NHWC"), 3: ("NCDHW", "NDHWC")}


def _geoms():
    out = []
    for rank, (cin, cout, k, s, p, op, d, g) in itertools.product((1, 2, 3), (
            (8, 4, 2, 2, 0, 0, 1, 1),    # the U-Net up-sampling layer
            (8, 8, 4, 2, 1, 0, 1, 2),
            (4, 6, 3, 2, 1, 1, 1, 1),
            (4, 4, 3, 1, 1, 1, 2, 2))):  # output_padding >= stride: windowed
        for cl in (False, True):
            sp = [5, 4, 3][:rank]
            x = (2, cin, *sp) if not cl else (2, *sp, cin)
            w = (cin, cout // g, *[k] * rank) if not cl else (cin, *[k] * rank, cout // g)
            out.append(ConvTransposeGeometry.create(x, w, s, p, op, d, g, LAYOUTS[rank][cl]))
    return out


GEOMS = _geoms()


#: warnings of a fallback: none may occur here
FALLBACKS = (FusedFallbackWarning, WorkspaceFallbackWarning, BiasGradFallbackWarning)


class Calls(list):
    """Names of the calls that ran, in order, with their arguments in `args`. A call is
    recorded once it returns: one cuDNN refused raised, and the walk down the ranking to
    the next algorithm counts once."""

    def __init__(self):
        super().__init__()
        self.args = []

    def clear(self):
        super().clear()
        self.args.clear()

    def spy(self, name, real):
        def call(*a):
            out = real(*a)
            self.append(name)
            self.args.append(a)
            return out
        return call


@pytest.fixture
def spied(monkeypatch):
    lib = cudnn()
    calls = Calls()
    for name in ("convolutionForward", "convolutionBackwardData", "convolutionBackwardFilter",
                 "convolutionBackwardBias", "convolutionBiasActivationForward"):
        monkeypatch.setattr(lib, name, calls.spy(name, getattr(lib, name)))
    for name in ("bias_act_forward", "activation_forward", "activation_backward",
                 "activation_backward_bias"):
        monkeypatch.setattr(elementwise, name, calls.spy(name, getattr(elementwise, name)))
    return calls


@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: g.describe())
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_and_runs_the_fused_path(monkeypatch, spied, geom, dtype):
    rng = np.random.default_rng(0)
    x = Data(rng, geom.input_shape, dtype)
    w = Data(rng, geom.weight_shape, dtype)
    b = Data(rng, geom.bias_shape, dtype)
    res = Data(rng, geom.output_shape, dtype)
    dy = Data(rng, geom.output_shape, dtype)
    for act, with_bias, with_res in (("identity", False, False), ("relu", True, False),
                                     ("gelu", True, True), ("tanh", False, True)):
        y_ref, ctx_ref = conv_transpose_bias_act_forward(
            x.ref, w.ref, b.ref if with_bias else None, activation=act,
            residual=res.ref if with_res else None, geom=geom)
        spied.clear()
        with warnings.catch_warnings(), poison_outputs(monkeypatch):
            for category in FALLBACKS:  # no fallback of any kind
                warnings.simplefilter("error", category)
            y, ctx = conv_transpose_bias_act_forward(
                x.dev, w.dev, b.dev if with_bias else None, activation=act,
                residual=res.dev if with_res else None, geom=geom)
            forward_calls = list(spied)
            forward_args = list(spied.args)
            g = conv_transpose_bias_act_backward(dy.dev, ctx)
        if dtype in ("float16", "bfloat16") and activations.saves(act) == "output":
            # a mask flipped by rounding near 0 is the forward's difference, not the
            # backward's: the reference backward reads the device's output
            ctx_ref = with_device_saved(ctx_ref, y)
        g_ref = conv_transpose_bias_act_backward(dy.ref, ctx_ref)
        what = f"{act} bias={with_bias} residual={with_res} {dtype}"
        assert_close(y, y_ref, dtype, f"y {what}")
        assert_close(g.dx, g_ref.dx, dtype, f"dx {what}")
        assert_close(g.dweight, g_ref.dweight, dtype, f"dw {what}")
        if with_bias:
            assert_close(g.dbias, g_ref.dbias, dtype, f"db {what}")
        assert forward_calls[0] == "convolutionBackwardData"
        assert forward_calls.count("convolutionBackwardData") == 1
        plan = get_transpose_plan(cudnn_geometry(geom, dtype), dtype)
        # the plan that ran: for float64 channels-last the channels-first one's (NCHW)
        # descriptors (w, G's dy = this x, G's dx = this y)
        call = forward_args[0]
        assert call[2] is plan.w_desc and call[4] is plan.y_desc and call[11] is plan.x_desc
        passes = forward_calls[1:]
        if act == "identity" and not with_bias and not with_res:
            assert passes == []  # no pass at all
        elif act == "gelu":
            assert passes == ["bias_act_forward", "activation_forward"]
        else:
            assert passes == ["bias_act_forward"]
        backward_calls = spied[len(forward_calls):]
        assert "convolutionBackwardBias" not in backward_calls
        if with_bias:
            assert backward_calls.count("activation_backward_bias") == 1
            assert "activation_backward" not in backward_calls
        for a in (x, w, b, res, dy):
            a.unchanged()


def test_layer_float64_equals_the_cpu_layer():
    rng = np.random.default_rng(1)
    for layout in ("NCHW", "NHWC"):
        gpu = cf.ConvTranspose2d(8, 4, 4, 2, 1, activation="relu", layout=layout,
                                 dtype="float64", device="cuda", seed=0)
        cpu = cf.ConvTranspose2d(8, 4, 4, 2, 1, activation="relu", layout=layout,
                                 dtype="float64", device="cpu", seed=0)
        shape = (2, 8, 5, 6) if layout == "NCHW" else (2, 5, 6, 8)
        x = rng.standard_normal(shape)
        y_cpu = cpu(x)
        y_gpu = gpu(cp.asarray(x))
        np.testing.assert_allclose(cp.asnumpy(y_gpu), y_cpu, rtol=1e-10, atol=1e-12)
        dy = rng.standard_normal(y_cpu.shape)
        np.testing.assert_allclose(cp.asnumpy(gpu.backward(cp.asarray(dy))), cpu.backward(dy),
                                   rtol=1e-10, atol=1e-12)
        for pg, pc in zip(gpu.parameters(), cpu.parameters()):
            np.testing.assert_allclose(cp.asnumpy(pg.grad), pc.grad, rtol=1e-10, atol=1e-12)


def _decoder(seed):
    model = cf.Sequential(
        cf.Conv2d(1, 8, 3, padding=1, activation="relu", device="cuda", seed=seed),
        cf.MaxPool2d(2),
        cf.ConvTranspose2d(8, 4, 2, 2, activation="relu", device="cuda", seed=seed + 1),
        cf.Conv2d(4, 1, 3, padding=1, device="cuda", seed=seed + 2),
    )
    opt = cf.optim.Adam(model.parameters(), lr=1e-2)

    def step(x, t):
        opt.zero_grad()
        y = model(x)
        diff = y - t
        model.backward(2 * diff / diff.size)
        opt.step()
        return (diff * diff).mean()

    return model, step


def test_captured_step_replays_the_eager_one():
    rng = np.random.default_rng(2)
    data = [(rng.random((8, 1, 8, 8), dtype=np.float32),
             rng.random((8, 1, 8, 8), dtype=np.float32)) for _ in range(5)]
    # deterministic algorithms on both sides, as test_graph_gpu's: an atomics-summing
    # gradient algorithm could round the two runs apart, and Adam would carry it on
    with cf.config.flags(deterministic=True):
        eager, eager_step = _decoder(0)
        for x, t in data:
            eager_step(cp.asarray(x), cp.asarray(t))
        graphed, graph_step = _decoder(0)
        captured = cf.graph.capture(graph_step, cp.asarray(data[0][0]),
                                    cp.asarray(data[0][1]))
        for x, t in data[1:]:
            captured(cp.asarray(x), cp.asarray(t))
        captured.synchronize()
    for pe, pg in zip(eager.parameters(), graphed.parameters()):
        np.testing.assert_allclose(pg.data.get(), pe.data.get(), rtol=1e-5, atol=1e-6)


def test_plan_is_shared_with_the_forward_convolution():
    from convfuse.plan import get_plan, get_transpose_plan

    geom = GEOMS[0]
    assert get_transpose_plan(geom, "float32") is get_plan(geom.conv, "float32")
    x = cp.asarray(np.ones(geom.input_shape, np.float32))
    w = cp.asarray(np.ones(geom.weight_shape, np.float32))
    ops.conv_transpose_forward(x, w, geom)
    assert get_transpose_plan(geom, "float32").choice("bwd_data", None) is not None
