"""Fault injection, BatchNorm: each cuDNN call a BatchNorm plan makes for a fused training
step (the three size queries, the workspace and reserve-space allocations, the fused
forward and the fused backward) refuses or fails in turn (NOT_SUPPORTED and its 3xxx
sub-codes, BAD_PARAM, ALLOC_FAILED, CuPy's OutOfMemoryError). Every case must end on the
documented fallback (Note [BatchNorm fallback] in convfuse/ops/cudnn/batchnorm.py: the
plain calls plus convfuse's add and ReLU kernels, one FusedFallbackWarning per plan) with
the right numbers, or on a typed CudnnError naming the call and the plan; never anything
else, and never a running statistic updated twice or left stale (issue #13).

The faked binding computes through convfuse's float64 NumPy reference engine
(tests/_fault_injection.py's host copies); the expected values come from PyTorch's CPU
batch_norm in float64 with autograd, an independent oracle.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import convfuse.ops as ops
from convfuse.errors import CudnnError
from convfuse.ops.cudnn import batchnorm as engine
from convfuse.ops.reference import batchnorm as ref
from convfuse.plan import FusedFallbackWarning, clear_plan_cache
from convfuse.plan.batchnorm import BatchNormGeometry, get_batchnorm_plan
from tests._fault_injection import ALLOC_FAILED, BAD_PARAM, NOT_SUPPORTED, NumericGpu

torch = pytest.importorskip("torch")

SHAPE, LAYOUT = (2, 3, 3, 8), "NHWC"  # half NHWC, C % 4 == 0: the documented fused config
EPS, FACTOR = 1e-3, 0.25
FWD_WS = "getBatchNormalizationForwardTrainingExWorkspaceSize"
BWD_WS = "getBatchNormalizationBackwardExWorkspaceSize"
RESERVE = "getBatchNormalizationTrainingExReserveSpaceSize"
FWD_EX, BWD_EX = "batchNormalizationForwardTrainingEx", "batchNormalizationBackwardEx"
FWD, BWD = "batchNormalizationForwardTraining", "batchNormalizationBackward"
SIZES = {FWD_WS: 1024, BWD_WS: 2048, RESERVE: 4096}


class BatchNormGpu(NumericGpu):
    """NumericGpu whose BatchNorm binding calls compute (float64 reference engine)."""

    BN = (FWD, FWD_EX, BWD, BWD_EX, "batchNormalizationForwardInference", "addTensor")

    def __init__(self, monkeypatch, shape, layout):
        super().__init__(monkeypatch, None)
        self.g = BatchNormGeometry.create(shape, layout)
        self.oom_sizes = set()  # allocations of these byte counts fail
        self.sizes = dict(SIZES)
        cp, lib = self.cp, self.lib
        monkeypatch.setattr(engine, "get_handle", lambda *a: "H")
        monkeypatch.setattr(engine, "Workspace", self._bn_workspace)
        monkeypatch.setattr(engine, "_affine_defaults", {})
        monkeypatch.setattr(cp, "ones", lambda s, dtype=float: self._filled(s, dtype, 1.0))
        monkeypatch.setattr(cp, "zeros", lambda s, dtype=float, order="C":
                            self._filled(s, dtype, 0.0))
        for name in self.BN:
            monkeypatch.setattr(lib, name, lambda *a, _n=name: self._bn(_n, a))
        for name in SIZES:
            monkeypatch.setattr(lib, name, lambda *a, _n=name: self._size(_n, a))

    def _filled(self, shape, dtype, value):
        a = self.array(shape, dtype)
        self.host[a.data.ptr][...] = value
        return a

    def _bn_workspace(self, nbytes, ctx=None):
        import cupy

        self.calls.append(("alloc", (nbytes,)))
        if nbytes in self.oom_sizes:
            raise cupy.cuda.memory.OutOfMemoryError(nbytes, 0, 0)
        return type("Ws", (), {"ptr": (1 << 44) + nbytes if nbytes else 0,
                               "size": int(nbytes)})()

    def _size(self, name, args):
        self.calls.append((name, args))
        self._maybe_fail(name)
        return self.sizes[name]

    # ---- the BatchNorm binding, computing ----

    def _train(self, x, scale, bias, rm, rv, factor, eps, mean, invstd, z, relu):
        h = self.host
        run_m = h[rm].copy() if rm else None
        run_v = h[rv].copy() if rv else None
        y, _, m, s = ref.batchnorm_forward_training(
            h[x], h[scale], h[bias], run_m, run_v, self.g, eps, factor,
            "relu" if relu else "identity", h[z] if z is not None else None)
        if rm:
            h[rm][...], h[rv][...] = run_m, run_v
        h[mean][...], h[invstd][...] = m, s
        return y

    def _param_grads(self, dpre, x, scale, mean, invstd, beta, dscale, dbias, dx, beta_dx):
        h = self.host
        gx, gw, gb, _ = ref.batchnorm_backward(h[dpre] if isinstance(dpre, int) else dpre,
                                               h[x], h[scale], None, h[mean], h[invstd], True,
                                               self.g, "identity", False, True)
        self._blend(dx, gx, beta_dx)
        self._blend(dscale, gw, beta)
        self._blend(dbias, gb, beta)

    def _bn(self, name, a):
        self.calls.append((name, a))
        self._maybe_fail(name)
        h = self.host
        if name == "addTensor":
            self._blend(a[6], a[1] * h[a[3]], a[4])
        elif name == FWD:
            h[a[7]][...] = self._train(a[5], a[9], a[10], a[12], a[13], a[11], a[14], a[15],
                                       a[16], None, False)
        elif name == FWD_EX:
            assert a[2] in (self.lib.CUDNN_BATCHNORM_OPS_BN_ACTIVATION,
                            self.lib.CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION)
            z = a[8] if a[7] is not None else None
            assert a[21:] == (1024 + (1 << 44), 1024, 4096 + (1 << 44), 4096)
            h[a[10]][...] = self._train(a[6], a[12], a[13], a[15], a[16], a[14], a[17], a[18],
                                        a[19], z, True)
        elif name == BWD:
            self._param_grads(a[9], a[7], a[13], a[17], a[18], a[5], a[14], a[15], a[11], a[3])
        elif name == BWD_EX:
            assert a[-4:] == (2048 + (1 << 44), 2048, 4096 + (1 << 44), 4096)
            dpre = h[a[12]] * (h[a[10]] > 0)  # relu's backward through cuDNN's saved y
            if a[13] is not None:
                h[a[14]][...] = dpre
            self._param_grads(dpre, a[8], a[18], a[23], a[24], a[6], a[20], a[21], a[16], a[4])
        else:
            raise AssertionError(f"the BatchNorm engine made an unexpected call: {name}")

    def _launch(self, name, args):
        self.calls.append((name, args))
        if name == "activation_forward":
            z, act, out = args
            self.host[out.data.ptr][...] = ops.activation_forward(self.get(z).copy(), act)
        elif name == "activation_backward":
            dy, saved, act, dz = args[:4]
            self.host[dz.data.ptr][...] = self.get(dy) * (self.get(saved) > 0)
            assert act == "relu"
        else:
            raise AssertionError(f"the BatchNorm engine launched an unexpected kernel: {name}")


@pytest.fixture
def bn_gpu(monkeypatch):
    made = []

    def make(shape=SHAPE, layout=LAYOUT):
        clear_plan_cache()
        made.append(BatchNormGpu(monkeypatch, shape, layout))
        return made[-1]

    yield make
    clear_plan_cache()  # plans here remember refusals and back-offs


def _oracle(host, residual):
    """y, running mean/var, dx, dweight, dbias, dresidual from torch in float64 (NCHW)."""
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in host.items() if v is not None}
    x = t["x"].permute(0, 3, 1, 2).requires_grad_(True)
    w, b = t["w"].clone().requires_grad_(True), t["b"].clone().requires_grad_(True)
    rm, rv = t["rm"].clone(), t["rv"].clone()
    pre = torch.nn.functional.batch_norm(x, rm, rv, w, b, True, FACTOR, EPS)
    res = None
    if residual:
        res = t["res"].permute(0, 3, 1, 2).requires_grad_(True)
        pre = pre + res
    y = torch.relu(pre)
    y.backward(t["dy"].permute(0, 3, 1, 2))
    def nhwc(v):
        return v.permute(0, 2, 3, 1).detach().numpy()

    return {"y": nhwc(y), "rm": rm.numpy(), "rv": rv.numpy(), "dx": nhwc(x.grad),
            "dw": w.grad.numpy(), "db": b.grad.numpy(),
            "dres": nhwc(res.grad) if residual else None}


def _inputs(gpu, rng, residual):
    c = SHAPE[-1]
    host = {"x": rng.standard_normal(SHAPE), "w": rng.uniform(0.5, 1.5, c),
            "b": rng.standard_normal(c), "rm": rng.standard_normal(c),
            "rv": rng.uniform(0.5, 2.0, c), "dy": rng.standard_normal(SHAPE),
            "res": rng.standard_normal(SHAPE) if residual else None}
    dev = {}
    for k, v in host.items():
        if v is None:
            dev[k] = None
            continue
        dev[k] = gpu.array(v.shape, "float16" if v.ndim == 4 else "float32")
        gpu.host[dev[k].data.ptr][...] = v
    return host, dev


def _step(gpu, dev, residual):
    """One training forward + backward through the ops; (outputs, warning categories)."""
    gw, gb = gpu.array((SHAPE[-1],), "float32"), gpu.array((SHAPE[-1],), "float32")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        y, saved = ops.batchnorm_forward_training(dev["x"], dev["w"], dev["b"], dev["rm"],
                                                  dev["rv"], LAYOUT, EPS, FACTOR, "relu",
                                                  dev["res"])
        dx, dw, db, dres = ops.batchnorm_backward(dev["dy"], dev["x"], dev["w"], dev["b"],
                                                  saved, LAYOUT, EPS, "relu", residual,
                                                  weight_grad=gw, bias_grad=gb)
    out = {"y": gpu.get(y), "rm": gpu.get(dev["rm"]).copy(), "rv": gpu.get(dev["rv"]).copy(),
           "dx": gpu.get(dx), "dw": gpu.get(dw), "db": gpu.get(db),
           "dres": gpu.get(dres) if residual else None}
    return out, [w.category for w in record], saved


def _check(out, want):
    for k, v in want.items():
        if v is None:
            assert out[k] is None
        else:
            np.testing.assert_allclose(out[k], v, rtol=1e-10, atol=1e-10, err_msg=k)


def _oom(nbytes):
    def setup(gpu):
        gpu.oom_sizes = {nbytes}
    return setup


def _inject(name, status, times=None):
    return lambda gpu: gpu.inject(name, status, times)


PLAIN_FWD = [FWD, "activation_forward"]
PLAIN_BWD = ["activation_backward", BWD]

# (id, setup, outcome): "fused"/"plain-forward"/"plain-backward" with the warning count,
# or ("raises", C function name)
CASES = [
    ("no-fault", lambda gpu: None, ("fused", 0)),
    *[(f"{q}-{s}", _inject(q, code), ("plain-forward", 1))
      for q in (FWD_WS, BWD_WS, RESERVE) for s, code in (("not-supported", NOT_SUPPORTED),
                                                         ("not-supported-layout", 3004))],
    *[(f"{q}-{s}", _inject(q, code), ("raises", f"cudnn{q[0].upper()}{q[1:]}"))
      for q in (FWD_WS, BWD_WS, RESERVE) for s, code in (("bad-param", BAD_PARAM),
                                                         ("alloc-failed", ALLOC_FAILED))],
    ("oom-forward-workspace", _oom(1024), ("plain-forward", 1)),
    ("oom-reserve", _oom(4096), ("plain-forward", 1)),
    ("oom-backward-workspace", _oom(2048), ("plain-backward", 1)),
    ("forward-call-not-supported", _inject(FWD_EX, NOT_SUPPORTED), ("plain-forward", 1)),
    ("forward-call-shape", _inject(FWD_EX, 3002), ("plain-forward", 1)),
    ("forward-call-bad-param", _inject(FWD_EX, BAD_PARAM),
     ("raises", "cudnnBatchNormalizationForwardTrainingEx")),
    ("forward-call-alloc-failed", _inject(FWD_EX, ALLOC_FAILED),
     ("raises", "cudnnBatchNormalizationForwardTrainingEx")),
    ("backward-call-not-supported", _inject(BWD_EX, NOT_SUPPORTED), ("plain-backward", 1)),
    ("backward-call-bad-param", _inject(BWD_EX, BAD_PARAM),
     ("raises", "cudnnBatchNormalizationBackwardEx")),
]


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no-residual"])
@pytest.mark.parametrize(("case", "setup", "outcome"), CASES, ids=[c[0] for c in CASES])
def test_training_step_fault(bn_gpu, rng, residual, case, setup, outcome):
    gpu = bn_gpu()
    host, dev = _inputs(gpu, rng, residual)
    want = _oracle(host, residual)
    setup(gpu)
    kind, detail = outcome
    if kind == "raises":
        before = (gpu.get(dev["rm"]).copy(), gpu.get(dev["rv"]).copy())
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a typed error, and no warning on the way
            with pytest.raises(CudnnError) as info:
                _step(gpu, dev, residual)
        msg = str(info.value)
        assert info.value.function == detail and "batchnorm x=[2, 3, 3, 8]" in msg, msg
        assert f"residual={residual}" in msg
        if "Backward" not in detail:  # a failed forward leaves the running statistics alone
            np.testing.assert_array_equal(gpu.get(dev["rm"]), before[0])
            np.testing.assert_array_equal(gpu.get(dev["rv"]), before[1])
        plan = get_batchnorm_plan(gpu.g, "float16", "relu", residual)
        assert plan.fused_refusal is None and not plan.fell_back  # an error is no refusal
        return
    gpu.calls.clear()
    out, warned, saved = _step(gpu, dev, residual)
    _check(out, want)
    assert warned == [FusedFallbackWarning] * detail
    names = [n for n in gpu.names() if n not in ("alloc", *SIZES)]
    add = ["addTensor"] if residual else []
    fwd_plain = kind == "plain-forward"
    tried = [FWD_EX] if case.startswith("forward-call") else []  # refused before writing
    assert names == ([*tried, FWD, *add, "activation_forward", *PLAIN_BWD] if fwd_plain
                     else [FWD_EX] + ([BWD_EX] if kind == "fused" else
                                      ([BWD_EX] if "call" in case else []) + PLAIN_BWD))
    assert saved.engine_state.fused is not fwd_plain
    # the second step: same numbers from fresh inputs, silently, on the remembered path
    host2, dev2 = _inputs(gpu, np.random.default_rng(7), residual)
    want2 = _oracle(host2, residual)
    gpu.calls.clear()
    out2, warned2, _ = _step(gpu, dev2, residual)
    _check(out2, want2)
    assert warned2 == []
    names2 = gpu.names()
    if kind == "fused":
        assert FWD_EX in names2 and BWD_EX in names2
    elif "oom" in case:  # backing off the whole fused step, the forward included
        assert FWD_EX not in names2 and "alloc" not in names2
    else:
        assert not set(names2) & {FWD_EX, BWD_EX, *SIZES}  # refused for good


def test_out_of_memory_backs_off_then_retries(bn_gpu, rng):
    gpu = bn_gpu()
    _, dev = _inputs(gpu, rng, True)
    gpu.oom_sizes = {4096}
    _, warned, saved = _step(gpu, dev, True)
    assert warned == [FusedFallbackWarning] and not saved.engine_state.fused
    plan = get_batchnorm_plan(gpu.g, "float16", "relu", True)
    assert plan.fused_refusal is None and not plan.tries_fused and plan.fell_back
    gpu.oom_sizes = set()  # memory came back
    paths = [_step(gpu, dev, True)[2].engine_state.fused for _ in range(12)]
    assert paths[:8] == [False] * 8 and all(paths[8:])  # 8 calls of back-off, then fused
    assert plan.tries_fused


def test_one_warning_per_plan_across_causes(bn_gpu, rng):
    """An out-of-memory, then a refusal: the plan warns once in all."""
    gpu = bn_gpu()
    _, dev = _inputs(gpu, rng, False)
    gpu.oom_sizes = {1024}
    assert _step(gpu, dev, False)[1] == [FusedFallbackWarning]
    gpu.oom_sizes = set()
    gpu.inject(FWD_EX, NOT_SUPPORTED)
    categories = []
    for _ in range(10):
        categories += _step(gpu, dev, False)[1]
    assert categories == []
    assert get_batchnorm_plan(gpu.g, "float16", "relu", False).fused_refusal.status == 3000


def test_oom_warning_names_plan_and_buffer(bn_gpu, rng):
    gpu = bn_gpu()
    _, dev = _inputs(gpu, rng, True)
    gpu.oom_sizes = {4096}
    with pytest.warns(FusedFallbackWarning) as record:
        ops.batchnorm_forward_training(dev["x"], dev["w"], dev["b"], dev["rm"], dev["rv"],
                                       LAYOUT, EPS, FACTOR, "relu", dev["res"])
    msg = str(record[0].message)
    assert "reserve space" in msg and "OutOfMemoryError" in msg and "float16" in msg
    assert "retried after a back-off" in msg and record[0].filename == __file__


def test_clear_plan_cache_forgets_batchnorm_refusals(bn_gpu, rng):
    from convfuse.plan import batchnorm_plan_cache_info

    gpu = bn_gpu()
    _, dev = _inputs(gpu, rng, False)
    gpu.inject(FWD_EX, NOT_SUPPORTED, times=1)
    assert not _step(gpu, dev, False)[2].engine_state.fused
    assert batchnorm_plan_cache_info().size == 1
    clear_plan_cache()
    assert batchnorm_plan_cache_info().size == 0
    _, warned, saved = _step(gpu, dev, False)
    assert saved.engine_state.fused and warned == []


def test_affine_defaults_refused_inside_capture(bn_gpu, monkeypatch, rng):
    """Cached device buffers and first size queries cannot be made while capturing."""
    from convfuse.errors import CaptureError
    from convfuse.plan import capture

    gpu = bn_gpu()
    _, dev = _inputs(gpu, rng, False)
    monkeypatch.setattr(capture, "stream_is_capturing", lambda: True)
    with pytest.raises(CaptureError, match="ones and zeros"):
        ops.batchnorm_forward_training(dev["x"], None, None, None, None, LAYOUT, EPS, FACTOR,
                                       "relu")
    with pytest.raises(CaptureError, match="fused batch-normalization sizes"):
        ops.batchnorm_forward_training(dev["x"], dev["w"], dev["b"], None, None, LAYOUT, EPS,
                                       FACTOR, "relu")
    monkeypatch.setattr(capture, "stream_is_capturing", lambda: False)
    ops.batchnorm_forward_training(dev["x"], None, None, None, None, LAYOUT, EPS, FACTOR, "relu")
    monkeypatch.setattr(capture, "stream_is_capturing", lambda: True)
    gpu.calls.clear()  # warmed up: the capture records only the calls
    ops.batchnorm_forward_training(dev["x"], None, None, None, None, LAYOUT, EPS, FACTOR, "relu")
    assert [n for n in gpu.names() if n != "alloc"] == [FWD_EX]


def test_torch_allocator_out_of_memory_is_cupys(monkeypatch):
    """Under convfuse.torch, CuPy allocates from PyTorch's caching allocator; its
    torch.OutOfMemoryError (a RuntimeError) must arrive as CuPy's OutOfMemoryError (a
    MemoryError), the exception the fused-call and workspace fallbacks above catch."""
    import cupy

    from convfuse.torch import _arrays

    def no_memory(n, dtype=None, device=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 KiB")

    monkeypatch.setattr(torch, "empty", no_memory)
    alloc = _arrays._torch_allocator(torch.device("cuda", 0))
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
        alloc(4096)
    assert isinstance(info.value, MemoryError)
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


@pytest.mark.parametrize("path", ["fused", "plain-backward", "plain"])
def test_parameter_gradients_accumulate_over_two_backwards(bn_gpu, rng, path):
    """Review 7.5: param_beta = 1 is cuDNN's betaParamDiff = 1. Two steps into the same
    NaN-poisoned weight_grad/bias_grad, the first overwriting (param_beta = 0, which never
    reads them) and the second accumulating, leave the sum of both steps' PyTorch
    gradients, on the fused backward (BackwardEx), after a refused fused backward, and on
    the plain path."""
    gpu = bn_gpu()
    if path == "plain-backward":
        gpu.inject(BWD_EX, NOT_SUPPORTED)
    elif path == "plain":
        gpu.inject(FWD_EX, NOT_SUPPORTED)
    c = SHAPE[-1]
    gw, gb = gpu.array((c,), "float32"), gpu.array((c,), "float32")  # NaN-poisoned
    wants = []
    for step, beta in enumerate((0.0, 1.0)):
        host, dev = _inputs(gpu, np.random.default_rng(20 + step), True)
        wants.append(_oracle(host, True))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FusedFallbackWarning)  # the refusal cases
            _, saved = ops.batchnorm_forward_training(dev["x"], dev["w"], dev["b"], dev["rm"],
                                                      dev["rv"], LAYOUT, EPS, FACTOR, "relu",
                                                      dev["res"])
            dx, dw, db, _ = ops.batchnorm_backward(dev["dy"], dev["x"], dev["w"], dev["b"],
                                                   saved, LAYOUT, EPS, "relu", True,
                                                   weight_grad=gw, bias_grad=gb,
                                                   param_beta=beta)
        assert dw is gw and db is gb
        np.testing.assert_allclose(gpu.get(dx), wants[-1]["dx"], rtol=1e-10, atol=1e-10)
        if step == 0:
            np.testing.assert_allclose(gpu.get(gw), wants[0]["dw"], rtol=1e-10, atol=1e-10)
    for key, out in (("dw", gw), ("db", gb)):
        np.testing.assert_allclose(gpu.get(out), wants[0][key] + wants[1][key], rtol=1e-10,
                                   atol=1e-10, err_msg=key)
    ex = [(a[6], a[20], a[21]) for n, a in gpu.calls if n == BWD_EX]  # betaParamDiff, dw, db
    plain = [(a[5], a[14], a[15]) for n, a in gpu.calls if n == BWD]
    ran = plain if path != "fused" else ex
    assert ran == [(0.0, gw.data.ptr, gb.data.ptr), (1.0, gw.data.ptr, gb.data.ptr)]
    if path == "plain-backward":
        assert [beta for beta, _, _ in ex] == [0.0]  # refused, nothing written; remembered
