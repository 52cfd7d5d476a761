"""The cuDNN batch-normalization engine on the faked GPU of tests/test_ops_cudnn_wiring.py:
which binding calls it makes, with which arguments, and Note [BatchNorm fallback] (a
refusal of the fused ops at the size query, the forward call or the backward call lands
on the plain path with one FusedFallbackWarning, remembered per plan). Other errors still
raise. tests/gpu/test_batchnorm_gpu.py covers the numbers on a device."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import convfuse.ops as ops
from convfuse.errors import CudnnError
from convfuse.ops.cudnn import batchnorm as engine
from convfuse.plan import FusedFallbackWarning
from convfuse.plan.batchnorm import (
    BatchNormGeometry,
    clear_batchnorm_plan_cache,
    get_batchnorm_plan,
)
from tests.test_ops_cudnn_wiring import FakeGpu, ptr

SIZES = {"getBatchNormalizationForwardTrainingExWorkspaceSize": 1024,
         "getBatchNormalizationBackwardExWorkspaceSize": 2048,
         "getBatchNormalizationTrainingExReserveSpaceSize": 4096}
BN_CALLS = ("batchNormalizationForwardTraining", "batchNormalizationForwardTrainingEx",
            "batchNormalizationBackward", "batchNormalizationBackwardEx",
            "batchNormalizationForwardInference")
FWD_EX, BWD_EX = "batchNormalizationForwardTrainingEx", "batchNormalizationBackwardEx"
FWD, BWD = "batchNormalizationForwardTraining", "batchNormalizationBackward"


class FakeWorkspace:
    def __init__(self, nbytes, ctx=None):
        self.size = int(nbytes)
        self.ptr = (1 << 44) + self.size if self.size else 0


@pytest.fixture
def gpu(monkeypatch):
    fake = FakeGpu(monkeypatch)
    clear_batchnorm_plan_cache()
    monkeypatch.setattr(engine, "get_handle", lambda *a: "H")
    monkeypatch.setattr(engine, "Workspace", FakeWorkspace)
    monkeypatch.setattr(engine, "_affine_defaults", {})
    monkeypatch.setattr(fake.cp, "ones", lambda shape, dtype=float: fake.array(shape, dtype))
    for name in BN_CALLS:
        monkeypatch.setattr(fake.lib, name, lambda *a, _n=name: fake.record(_n, a))
    for name, size in SIZES.items():
        def query(*a, _n=name, _s=size):
            fake.record(_n, a)
            return _s
        monkeypatch.setattr(fake.lib, name, query)
    yield fake
    clear_batchnorm_plan_cache()  # plans here remember refusals


def names(calls):
    return [n for n, _ in calls]


def arrays(gpu, shape, dtype, residual=True, layout="NHWC"):
    pd = "float64" if dtype == "float64" else "float32"
    c = BatchNormGeometry.create(shape, layout).channels
    x = gpu.array(shape, dtype)
    per = [gpu.array((c,), pd) for _ in range(4)]
    res = gpu.array(shape, dtype) if residual else None
    return x, per, res


FUSED_SHAPE = (2, 3, 3, 8)  # NHWC, C = 8: Note [BatchNorm in cuDNN]'s documented fused config


def refusal(gpu, fn, status=3000):
    return CudnnError(status, fn, gpu.lib.getErrorString(status))


def test_documented_config_runs_fused_forward_and_backward(gpu):
    lib = gpu.lib
    x, (w, b, rm, rv), res = arrays(gpu, FUSED_SHAPE, "float16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, saved = ops.batchnorm_forward_training(x, w, b, rm, rv, "NHWC", 1e-3, 0.25, "relu", res)
    g = BatchNormGeometry.create(FUSED_SHAPE, "NHWC")
    plan = get_batchnorm_plan(g, "float16", "relu", True)
    assert plan.training_mode == lib.CUDNN_BATCHNORM_SPATIAL_PERSISTENT
    assert plan.fused_ops == lib.CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION
    assert names(gpu.calls) == [*SIZES, FWD_EX]
    a = gpu.calls[-1][1]
    assert a[:5] == ("H", plan.training_mode, plan.fused_ops, 1.0, 0.0)
    assert (a[5], a[6], a[7], a[8], a[9], a[10]) == (plan.x_desc, ptr(x), plan.x_desc, ptr(res),
                                                      plan.x_desc, ptr(y))
    assert (a[11], a[12], a[13], a[14]) == (plan.bn_desc_training, ptr(w), ptr(b), 0.25)
    assert (a[15], a[16], a[17]) == (ptr(rm), ptr(rv), 1e-3)
    assert (a[18], a[19]) == (ptr(saved.mean), ptr(saved.invstd))
    assert a[20] is plan.act_desc and a[21:] == (1024 + (1 << 44), 1024, 4096 + (1 << 44), 4096)
    assert saved.saved is y and saved.engine_state.fused
    gpu.calls.clear()
    dy = gpu.array(FUSED_SHAPE, "float16")
    gw, gb = gpu.array((8,), "float32"), gpu.array((8,), "float32")
    dx, dw, db, dres = ops.batchnorm_backward(dy, x, w, b, saved, "NHWC", 1e-3, "relu", True,
                                              weight_grad=gw, bias_grad=gb, param_beta=1.0)
    assert names(gpu.calls) == [BWD_EX]  # sizes were asked once, by the forward
    a = gpu.calls[0][1]
    assert a[:7] == ("H", plan.training_mode, plan.fused_ops, 1.0, 0.0, 1.0, 1.0)
    assert (a[8], a[10], a[12], a[14], a[16]) == (ptr(x), ptr(y), ptr(dy), ptr(dres), ptr(dx))
    assert (a[18], a[19], a[20], a[21], a[22]) == (ptr(w), ptr(b), ptr(gw), ptr(gb), 1e-3)
    assert (a[23], a[24]) == (ptr(saved.mean), ptr(saved.invstd))
    assert a[-4:] == (2048 + (1 << 44), 2048, 4096 + (1 << 44), 4096)
    assert dw is gw and db is gb


@pytest.mark.parametrize("forward_residual", [True, False])
def test_a_backward_of_other_bnops_than_its_forwards_takes_the_plain_call(gpu,
                                                                          forward_residual):
    """BackwardEx reads the reserve space its own bnOps' forward wrote: after
    BN_ADD_ACTIVATION's forward, a backward that does not ask for the residual's gradient
    (BN_ACTIVATION's plan), or the other way round, runs the ReLU kernel's backward and the
    plain call, never BackwardEx on the other bnOps' reserve space."""
    x, (w, b, rm, rv), res = arrays(gpu, FUSED_SHAPE, "float16", residual=forward_residual)
    _, saved = ops.batchnorm_forward_training(x, w, b, rm, rv, "NHWC", 1e-3, 0.25, "relu", res)
    assert saved.engine_state.fused
    gpu.calls.clear()
    dy = gpu.array(FUSED_SHAPE, "float16")
    *_, dres = ops.batchnorm_backward(dy, x, w, b, saved, "NHWC", 1e-3, "relu",
                                      not forward_residual)
    assert names(gpu.calls) == ["activation_backward", BWD]
    assert (dres is not None) == (not forward_residual)


@pytest.mark.parametrize(("dtype", "shape", "layout", "act"), [
    ("float16", (2, 8, 3, 3), "NCHW", "relu"),  # channels-first
    ("float32", (2, 3, 3, 8), "NHWC", "relu"),  # not half
    ("bfloat16", (2, 3, 3, 8), "NHWC", "relu"),  # not half
    ("float16", (2, 3, 3, 6), "NHWC", "relu"),  # C % 4 != 0
    ("float16", (2, 3, 3, 8), "NHWC", "tanh"),  # not relu
])
def test_undocumented_configs_run_plain_without_warning(gpu, dtype, shape, layout, act):
    x, (w, b, rm, rv), res = arrays(gpu, shape, dtype, True, layout)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, saved = ops.batchnorm_forward_training(x, w, b, rm, rv, layout, 1e-5, 0.1, act, res)
        assert names(gpu.calls) == [FWD, "addTensor", "activation_forward"]
        plan = get_batchnorm_plan(BatchNormGeometry.create(shape, layout), dtype, act, True)
        a = gpu.calls[0][1]
        assert a[1] == plan.training_mode and a[11:] == (0.1, ptr(rm), ptr(rv), 1e-5,
                                                        ptr(saved.mean), ptr(saved.invstd))
        assert gpu.calls[1][1] == ("H", 1.0, plan.x_desc, ptr(res), 1.0, plan.x_desc, ptr(y))
        assert gpu.calls[2][1] == (y, act, y) and saved.saved is y
        gpu.calls.clear()
        dy = gpu.array(shape, dtype)
        ops.batchnorm_backward(dy, x, w, b, saved, layout, 1e-5, act, True)
    assert names(gpu.calls) == ["activation_backward", BWD]
    dz = gpu.calls[0][1][3]
    assert gpu.calls[0][1][:3] == (dy, y, act)
    a = gpu.calls[1][1]
    assert a[1] == plan.training_mode and a[5] == 0.0  # fresh gradients: betaParamDiff 0
    assert (a[9], a[13], a[16], a[17]) == (ptr(dz), ptr(w), 1e-5, ptr(saved.mean))


def test_persistent_mode_only_for_4d_channels_last_non_double(gpu):
    lib = gpu.lib
    for shape, layout, dtype, mode in [
        ((2, 3, 3, 4), "NHWC", "float32", lib.CUDNN_BATCHNORM_SPATIAL_PERSISTENT),
        ((2, 3, 3, 4), "NHWC", "bfloat16", lib.CUDNN_BATCHNORM_SPATIAL_PERSISTENT),
        ((2, 3, 3, 4), "NHWC", "float64", lib.CUDNN_BATCHNORM_SPATIAL),
        ((2, 4, 3, 3), "NCHW", "float16", lib.CUDNN_BATCHNORM_SPATIAL),
        ((5, 4), "NHWC", "float32", lib.CUDNN_BATCHNORM_SPATIAL),  # (N, C): no spatial dims
        ((2, 5, 4), "NHWC", "float16", lib.CUDNN_BATCHNORM_SPATIAL_PERSISTENT),  # 4-d lifted
        # 5-d: PyTorch runs channels_last_3d SPATIAL (its getCudnnBatchNormMode)
        ((2, 3, 3, 3, 4), "NHWC", "float32", lib.CUDNN_BATCHNORM_SPATIAL),
        ((2, 3, 3, 3, 4), "NHWC", "float16", lib.CUDNN_BATCHNORM_SPATIAL),
    ]:
        plan = get_batchnorm_plan(BatchNormGeometry.create(shape, layout), dtype)
        assert plan.training_mode == mode, (shape, layout, dtype)
        assert plan.inference_mode == lib.CUDNN_BATCHNORM_SPATIAL
        rank = len(plan.x_desc.getNd()[1])
        assert rank in (4, 5) and plan.bn_desc_training.getNd()[1][1] == shape[
            -1 if layout == "NHWC" and len(shape) > 2 else 1]


STAGES = {  # where cuDNN refuses -> the calls of the first (refused) forward
    "size query": ("getBatchNormalizationForwardTrainingExWorkspaceSize",
                   ["getBatchNormalizationForwardTrainingExWorkspaceSize"]),
    "forward call": (FWD_EX, [*SIZES, FWD_EX]),
}


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("status", [3000, 3004, 3007])
@pytest.mark.parametrize("residual", [True, False])
def test_forward_refusal_falls_back_once(gpu, stage, status, residual):
    fn, attempted = STAGES[stage]
    x, (w, b, rm, rv), res = arrays(gpu, FUSED_SHAPE, "float16", residual)
    gpu.fail[fn] = [refusal(gpu, fn, status)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _y1, s1 = ops.batchnorm_forward_training(x, w, b, rm, rv, "NHWC", 1e-5, 0.1, "relu", res)
        first = names(gpu.calls)
        gpu.calls.clear()
        _y2, s2 = ops.batchnorm_forward_training(x, w, b, rm, rv, "NHWC", 1e-5, 0.1, "relu", res)
    plain = [FWD, *(["addTensor"] if residual else []), "activation_forward"]
    assert first == attempted + plain
    assert names(gpu.calls) == plain  # remembered: no size query, no Ex call
    [w_] = [r for r in record if issubclass(r.category, FusedFallbackWarning)]
    msg = str(w_.message)
    assert f"({status})" in msg and "float16" in msg and f"residual={residual}" in msg
    assert w_.filename == __file__
    assert not s1.engine_state.fused and not s2.engine_state.fused
    plan = get_batchnorm_plan(BatchNormGeometry.create(FUSED_SHAPE, "NHWC"), "float16", "relu",
                              residual)
    assert plan.fused_refusal.status == status and not plan.tries_fused


def test_backward_refusal_falls_back_within_the_step(gpu):
    x, (w, b, rm, rv), res = arrays(gpu, FUSED_SHAPE, "float16")
    y, saved = ops.batchnorm_forward_training(x, w, b, rm, rv, "NHWC", 1e-5, 0.1, "relu", res)
    gpu.calls.clear()
    gpu.fail[BWD_EX] = [refusal(gpu, BWD_EX, 3000)]
    dy = gpu.array(FUSED_SHAPE, "float16")
    gw, gb = gpu.array((8,), "float32"), gpu.array((8,), "float32")
    with pytest.warns(FusedFallbackWarning, match="batchNormalizationBackwardEx"):
        dx, _, _, dres = ops.batchnorm_backward(dy, x, w, b, saved, "NHWC", 1e-5, "relu", True,
                                                weight_grad=gw, bias_grad=gb, param_beta=1.0)
    assert names(gpu.calls) == [BWD_EX, "activation_backward", BWD]
    dz = gpu.calls[1][1][3]
    assert gpu.calls[1][1][:3] == (dy, y, "relu")
    a = gpu.calls[2][1]
    assert a[5] == 1.0 and (a[9], a[11], a[14], a[15]) == (ptr(dz), ptr(dx), ptr(gw), ptr(gb))
    assert dres is dz
    gpu.calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per plan
        ops.batchnorm_forward_training(x, w, b, rm, rv, "NHWC", 1e-5, 0.1, "relu", res)
    assert names(gpu.calls) == [FWD, "addTensor", "activation_forward"]


@pytest.mark.parametrize("fn", ["getBatchNormalizationTrainingExReserveSpaceSize", FWD_EX, FWD])
def test_other_errors_raise_with_context(gpu, fn):
    x, (w, b, rm, rv), res = arrays(gpu, FUSED_SHAPE, "float16")
    gpu.fail[fn] = [refusal(gpu, fn, 2000)]
    if fn == FWD:  # the plain path: a channels-first plan
        x, (w, b, rm, rv), res = arrays(gpu, (2, 8, 3, 3), "float16", True, "NCHW")
    layout = "NCHW" if fn == FWD else "NHWC"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CudnnError) as info:
            ops.batchnorm_forward_training(x, w, b, rm, rv, layout, 1e-5, 0.1, "relu", res)
    assert info.value.status == 2000 and "batchnorm x=" in str(info.value)
    plan = get_batchnorm_plan(BatchNormGeometry.create(x.shape, layout), "float16", "relu", True)
    assert plan.fused_refusal is None


def test_affine_false_passes_cached_ones_and_zeros(gpu):
    x, (_, _, rm, rv), _ = arrays(gpu, (2, 4, 3, 3), "float32", False, "NCHW")
    ops.batchnorm_forward_training(x, None, None, rm, rv)
    ops.batchnorm_forward_training(x, None, None, None, None)
    (ones, zeros), = (c.arrays for c in engine._affine_defaults.values())
    for _, a in gpu.calls:
        assert (a[9], a[10]) == (ptr(ones), ptr(zeros))
    assert (gpu.calls[1][1][12], gpu.calls[1][1][13]) == (0, 0)  # no running statistics
    assert ones.dtype == np.float32 and ones.shape == (4,)


def test_affine_defaults_are_ordered_before_other_streams(gpu):
    """Note [cached constants across streams]: the ones and zeros filled on stream A are
    waited for by a call on stream B, until the host has seen the fill complete."""
    from tests.test_ops_cudnn_wiring import FakeStream

    x, (_, _, rm, rv), _ = arrays(gpu, (2, 4, 3, 3), "float32", False, "NCHW")
    ops.batchnorm_forward_training(x, None, None, rm, rv)
    [(kind, event, on)] = [op for op in gpu.stream_ops if op[0] == "record"]
    assert (kind, on) == ("record", 0x5000)
    gpu.stream = FakeStream(0x6000)
    ops.batchnorm_forward_training(x, None, None, rm, rv)
    assert gpu.stream_ops[-1] == ("wait", event, 0x6000, 0)
    [item] = engine._affine_defaults.values()
    item.event.done = True
    n = len(gpu.stream_ops)
    gpu.stream = FakeStream(0x7000)
    ops.batchnorm_forward_training(x, None, None, rm, rv)
    assert len(gpu.stream_ops) == n  # complete: no wait
    ones, zeros = item.arrays
    assert all((a[9], a[10]) == (ptr(ones), ptr(zeros)) for _, a in gpu.calls
               if _ == FWD)


@pytest.mark.parametrize("act", ["identity", "relu", "tanh", "silu"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_eval_backward_is_the_reference_engines_with_numpy_standing_in(monkeypatch, act,
                                                                       layout):
    """The evaluation-mode backward's arithmetic (CuPy's on a GPU) is array-generic: run
    with NumPy arrays and the reference activation kernel, it gives the reference engine's
    gradients, and the activation's backward gets the forward's saved tensor (y or z), not
    the statistics record."""
    from convfuse.ops.reference import activation as ref_act
    from convfuse.plan.batchnorm import BatchNormGeometry

    rng = np.random.default_rng(0)
    shape = (3, 4, 5, 2) if layout == "NCHW" else (3, 5, 2, 4)
    x, dy, res = (rng.standard_normal(shape) for _ in range(3))
    w, b, rm = (rng.standard_normal(4) for _ in range(3))
    rv = rng.uniform(0.5, 2.0, 4)
    _, saved = ops.batchnorm_forward_inference(x, w, b, rm, rv, layout, 1e-3, act, res)
    want = ops.batchnorm_backward(dy, x, w, b, saved, layout, 1e-3, act, True)
    got_saved = []

    def act_backward(dy_, saved_, act_, out):
        got_saved.append(saved_)
        out[...] = ref_act.activation_backward(dy_, saved_, act_)

    class Ctx:
        @staticmethod
        def empty(shape_, dtype):
            return np.empty(shape_, dtype)

    monkeypatch.setattr(engine.elementwise, "activation_backward", act_backward)
    monkeypatch.setattr(engine, "context_of", lambda a: Ctx)
    dw, db = np.full(4, np.nan), np.full(4, np.nan)  # beta 0: never read
    dx, dres = engine._eval_backward(dy, x, w, saved, BatchNormGeometry.create(shape, layout),
                                     act, True, True, dw, db, 0.0)
    for got, ref, what in ((dx, want[0], "dx"), (dw, want[1], "dweight"),
                           (db, want[2], "dbias"), (dres, want[3], "dresidual")):
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12, err_msg=what)
    assert got_saved == ([] if act == "identity" else [saved.saved])
    assert act == "identity" or got_saved[0] is not None


@pytest.mark.parametrize("shape", [(65543, 3), (65543, 5, 1, 1)])
def test_inference_parts_start_on_16_byte_boundaries_within_cudnns_bound(gpu, shape):
    """Note [cuDNN's inference batch] at the real bound: a BatchNorm1d(3) sample is 6
    bytes in float16, so parts of 65,535 samples would start the second call 10 bytes past
    a multiple of 16; parts of INFERENCE_BATCH keep every offset aligned, and stay within
    the 65,535 samples cuDNN takes."""
    assert engine.INFERENCE_BATCH <= 65535 and engine.INFERENCE_BATCH % 16 == 0
    x, y = gpu.array(shape, "float16"), gpu.array(shape, "float16")
    c = shape[1]
    scale, shift, rm, rv = (gpu.array((c,), "float32") for _ in range(4))
    plan = get_batchnorm_plan(BatchNormGeometry.create(shape, "NCHW"), "float16")
    engine._inference_calls(plan, "H", x, y, scale, shift, rm, rv, 1e-3)
    calls = [a for n, a in gpu.calls if n == "batchNormalizationForwardInference"]
    assert len(calls) == 2 and ptr(x) % 16 == ptr(y) % 16 == 0
    assert [(a[5] - ptr(x)) % 16 for a in calls] == [0, 0]
    assert [(a[7] - ptr(y)) % 16 for a in calls] == [0, 0]


@pytest.mark.parametrize(("shape", "layout"), [((10, 3), "NCHW"), ((10, 2, 5, 3), "NHWC"),
                                               ((10, 3, 7), "NCHW")])
def test_inference_runs_a_batch_above_cudnns_bound_in_parts(gpu, monkeypatch, shape, layout):
    """Note [cuDNN's inference batch], with the bound lowered to 4: 10 samples are three
    calls (4, 4, 2) on offsets into x and y, each with the descriptors of its own shape;
    the statistics and parameters are the same arrays in every call."""
    monkeypatch.setattr(engine, "INFERENCE_BATCH", 4)
    x, y = gpu.array(shape, "float16"), gpu.array(shape, "float16")
    c = shape[-1] if layout == "NHWC" else shape[1]
    scale, shift, rm, rv = (gpu.array((c,), "float32") for _ in range(4))
    geom = BatchNormGeometry.create(shape, layout)
    plan = get_batchnorm_plan(geom, "float16")
    engine._inference_calls(plan, "H", x, y, scale, shift, rm, rv, 1e-3)
    calls = [a for n, a in gpu.calls if n == "batchNormalizationForwardInference"]
    sample = int(np.prod(shape[1:])) * 2  # bytes of one float16 sample
    assert [a[5] - ptr(x) for a in calls] == [0, 4 * sample, 8 * sample]
    assert [a[7] - ptr(y) for a in calls] == [0, 4 * sample, 8 * sample]
    parts = [get_batchnorm_plan(BatchNormGeometry.create((n, *shape[1:]), layout), "float16")
             for n in (4, 4, 2)]
    assert [(a[4], a[6], a[8]) for a in calls] == [
        (p.x_desc, p.x_desc, p.bn_desc_inference) for p in parts]
    assert all(a[9:13] == (ptr(scale), ptr(shift), ptr(rm), ptr(rv)) and a[13] == 1e-3
               for a in calls)
    gpu.calls.clear()
    monkeypatch.setattr(engine, "INFERENCE_BATCH", 10)  # at the bound: one call, the plan's
    engine._inference_calls(plan, "H", x, y, scale, shift, rm, rv, 1e-3)
    [(name, a)] = gpu.calls
    assert name == "batchNormalizationForwardInference"
    assert (a[4], a[5], a[7]) == (plan.x_desc, ptr(x), ptr(y))


@pytest.mark.parametrize("zero", ["getBatchNormalizationForwardTrainingExWorkspaceSize",
                                  "getBatchNormalizationBackwardExWorkspaceSize"])
def test_a_zero_byte_fused_workspace_is_taken_as_a_refusal(gpu, monkeypatch, zero):
    """cuDNN runs an Ex call given a NULL, zero-byte workspace as the non-extended call,
    without bnOps' add and ReLU: a fused call sized at 0 bytes is never made, the plain
    path runs instead, warned once."""
    def query(*a):
        gpu.record(zero, a)
        return 0

    monkeypatch.setattr(gpu.lib, zero, query)
    x, (w, b, rm, rv), res = arrays(gpu, FUSED_SHAPE, "float16")
    with pytest.warns(FusedFallbackWarning, match=r"0 bytes of workspace"):
        _y, saved = ops.batchnorm_forward_training(x, w, b, rm, rv, "NHWC", 1e-5, 0.1, "relu",
                                                   res)
        dy = gpu.array(FUSED_SHAPE, "float16")
        gw, gb = gpu.array((8,), "float32"), gpu.array((8,), "float32")
        ops.batchnorm_backward(dy, x, w, b, saved, "NHWC", 1e-5, "relu", True,
                               weight_grad=gw, bias_grad=gb, param_beta=1.0)
    made = names(gpu.calls)
    assert BWD_EX not in made and made[-2:] == ["activation_backward", BWD]
    if zero.startswith("getBatchNormalizationForward"):
        assert made[:4] == [*SIZES, FWD] and not saved.engine_state.fused
    else:  # the forward's own workspace is there: it runs fused, its backward falls back
        assert made[:4] == [*SIZES, FWD_EX] and saved.engine_state.fused
