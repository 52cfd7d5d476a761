"""Plans against the real libcudnn, without a GPU: descriptors, cuDNN's own output shapes,
the cache, errors; and algorithm choice driven by stand-in perf records."""

from __future__ import annotations

import gc
import itertools
import warnings

import numpy as np
import pytest

from convfuse import backend, config
from convfuse._binding import cudnn
from convfuse.errors import CudnnError, DeviceUnavailableError
from convfuse.geometry import ConvGeometry
from convfuse.plan import (
    Candidate,
    ConvPlan,
    NoAlgorithmError,
    PlanKey,
    WorkspaceFallbackWarning,
    clear_plan_cache,
    get_plan,
    get_pool_plan,
    plan_cache_info,
    pool_plan_cache_info,
)
from convfuse.plan import algorithms as algos
from convfuse.plan import conv as plan_conv
from convfuse.plan.cache import PlanCache
from convfuse.pool_geometry import PoolGeometry

lib = cudnn()
DTYPES = ("float32", "float16", "bfloat16", "float64")
CUDNN_DTYPE = {"float32": lib.CUDNN_DATA_FLOAT, "float16": lib.CUDNN_DATA_HALF,
               "bfloat16": lib.CUDNN_DATA_BFLOAT16, "float64": lib.CUDNN_DATA_DOUBLE}


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_plan_cache()
    yield
    clear_plan_cache()


def make_geom(rank, channels_last, groups, stride=1, padding=0, dilation=1, batch=2):
    spatial = (9, 8, 7)[:rank]
    kernel = (3, 2, 3)[:rank]
    c, k = 4, 6
    x = (batch, c, *spatial)
    w = (k, c // groups, *kernel)
    if channels_last:
        x, w = (x[0], *x[2:], x[1]), (w[0], *w[2:], w[1])
    return ConvGeometry.create(x, w, stride, padding, dilation, groups,
                               "NHWC" if channels_last else "NCHW")


def cudnn_view(shape, channels_last):
    """Independent oracle for dims and element strides: what a C-contiguous NumPy array
    of `shape` looks like in cuDNN's (N, C, *spatial) order, 1-D lifted to 2-D."""
    a = np.empty(shape, np.int8)
    if len(shape) == 3:  # Note [1-D convolutions as 2-D]: a unit height
        a = a.reshape(shape[0], 1, *shape[1:]) if channels_last else a.reshape(*shape[:2], 1, -1)
    if channels_last:
        a = np.moveaxis(a, -1, 1)
    return list(a.shape), [s // a.itemsize for s in a.strides]


GRID = list(itertools.product((1, 2, 3), (False, True), DTYPES, (1, 2)))


@pytest.mark.parametrize(("rank", "channels_last", "dtype", "groups"), GRID)
def test_plan_descriptors_match_intent(rank, channels_last, dtype, groups):
    geom = make_geom(rank, channels_last, groups, stride=2, padding=1, dilation=(1, 2, 1)[:rank])
    plan = get_plan(geom, dtype, "relu")
    lifted = rank == 1

    # cuDNN's own output shape equals convfuse's.
    got = lib.getConvolutionNdForwardOutputDim(plan.conv_desc, plan.x_desc, plan.w_desc)
    want = list(geom.output_shape_cf)
    if lifted:
        want.insert(2, 1)
    assert got == want

    for desc, shape in ((plan.x_desc, geom.input_shape), (plan.y_desc, geom.output_shape)):
        dt, dims, strides = desc.getNd()
        assert dt == CUDNN_DTYPE[dtype]
        assert (dims, strides) == cudnn_view(shape, channels_last)

    dt, fmt, dims = plan.w_desc.getNd()
    assert dt == CUDNN_DTYPE[dtype]
    assert fmt == (lib.CUDNN_TENSOR_NHWC if channels_last else lib.CUDNN_TENSOR_NCHW)
    assert dims == cudnn_view(geom.weight_shape, channels_last)[0]

    pads, strides, dilations, mode, compute = plan.conv_desc.getNd()
    assert pads == ([0] if lifted else []) + list(geom.padding)
    assert strides == ([1] if lifted else []) + list(geom.stride)
    assert dilations == ([1] if lifted else []) + list(geom.dilation)
    assert mode == lib.CUDNN_CROSS_CORRELATION
    assert compute == (lib.CUDNN_DATA_DOUBLE if dtype == "float64" else lib.CUDNN_DATA_FLOAT)
    assert plan.conv_desc.getGroupCount() == groups

    dt, dims, strides = plan.bias_desc.getNd()
    assert dt == CUDNN_DTYPE[dtype]
    assert dims == [1, 6] + [1] * (max(rank, 2))
    assert strides[1] == 1

    assert plan.act_desc.get() == (lib.CUDNN_ACTIVATION_RELU, lib.CUDNN_NOT_PROPAGATE_NAN, 0.0)


@pytest.mark.parametrize(("dtype", "allow_tf32", "expected"), [
    ("float32", True, "CUDNN_DEFAULT_MATH"),
    ("float32", False, "CUDNN_FMA_MATH"),
    ("float16", True, "CUDNN_TENSOR_OP_MATH"),
    ("float16", False, "CUDNN_TENSOR_OP_MATH"),
    ("bfloat16", False, "CUDNN_TENSOR_OP_MATH"),
    ("float64", True, "CUDNN_DEFAULT_MATH"),
    ("float64", False, "CUDNN_DEFAULT_MATH"),
])
def test_math_type_per_dtype_and_flag(dtype, allow_tf32, expected):
    with config.flags(allow_tf32=allow_tf32):
        plan = get_plan(make_geom(2, False, 1), dtype)
    assert plan.key.math_type == expected
    assert plan.conv_desc.getMathType() == getattr(lib, expected)


@pytest.mark.parametrize(("activation", "mode"), [
    ("identity", "CUDNN_ACTIVATION_IDENTITY"), (None, "CUDNN_ACTIVATION_IDENTITY"),
    ("relu", "CUDNN_ACTIVATION_RELU"), ("silu", "CUDNN_ACTIVATION_IDENTITY"),
    ("gelu", "CUDNN_ACTIVATION_IDENTITY"), ("tanh", "CUDNN_ACTIVATION_IDENTITY"),
])
def test_only_relu_and_identity_are_fused(activation, mode):
    plan = get_plan(make_geom(2, True, 2), "float16", activation)
    assert plan.act_desc.get() == (getattr(lib, mode), lib.CUDNN_NOT_PROPAGATE_NAN, 0.0)
    assert plan.key.activation in ("identity", "relu")


def test_cache_hits_and_misses():
    geom = make_geom(2, False, 1)
    p1 = get_plan(geom, "float32")
    assert plan_cache_info() == (0, 1, 1)
    p2 = get_plan(make_geom(2, False, 1), np.float32)  # an equal geometry, another spelling
    assert p2 is p1
    assert plan_cache_info() == (1, 1, 1)
    assert get_plan(geom, "float32", "silu") is p1  # silu runs IDENTITY in the fused call
    with config.flags(allow_tf32=False):
        p3 = get_plan(geom, "float32")
    assert p3 is not p1 and p3.key.math_type == "CUDNN_FMA_MATH"
    with config.flags(allow_tf32=False):
        assert get_plan(geom, "float64") is get_plan(geom, "float64")
    with config.flags(allow_tf32=False):  # float64 ignores the TF32 flag: same math type
        p64 = get_plan(geom, "float64")
    assert get_plan(geom, "float64") is p64
    others = [get_plan(geom, "float32", "relu"), get_plan(geom, "float32", residual=True),
              get_plan(geom, "float16")]
    with config.flags(deterministic=True):
        others.append(get_plan(geom, "float32"))
    with config.flags(benchmark=True):
        others.append(get_plan(geom, "float32"))
    with config.flags(workspace_limit=1024):
        others.append(get_plan(geom, "float32"))
    assert len({id(p) for p in [p1, p3, p64, *others]}) == 9
    info = plan_cache_info()
    assert info.size == 9 and info.misses == 9
    clear_plan_cache()
    assert plan_cache_info() == (0, 0, 0)


def test_plan_key_holds_the_flags():
    geom = make_geom(3, True, 2)
    with config.flags(deterministic=True, benchmark=True, workspace_limit=77):
        key = PlanKey.create(geom, "bfloat16", "relu", True)
    assert key == PlanKey(device=-1 if not backend.gpu_available() else key.device,
                          dtype="bfloat16", geometry=geom, activation="relu", residual=True,
                          math_type="CUDNN_TENSOR_OP_MATH", deterministic=True, benchmark=True,
                          workspace_limit=77)
    hash(key)


def test_plan_key_rejects_bad_arguments():
    geom = make_geom(2, False, 1)
    with pytest.raises(TypeError, match=r"geom must be a ConvGeometry, got tuple"):
        get_plan((1, 2), "float32")
    with pytest.raises(ValueError, match=r"unsupported dtype int32"):
        get_plan(geom, np.int32)
    with pytest.raises(ValueError, match=r"unknown activation 'softmax'"):
        get_plan(geom, "float32", "softmax")
    assert plan_cache_info().size == 0


def test_lru_eviction_and_stats():
    built = []
    cache = PlanCache(lambda k: built.append(k) or f"plan{k}", maxsize=2)
    assert cache.get(1) == "plan1" and cache.get(2) == "plan2"
    cache.get(1)  # 1 is now the most recent
    cache.get(3)  # evicts 2
    assert cache.info() == (1, 3, 2)
    cache.get(1)
    cache.get(2)
    assert built == [1, 2, 3, 2]


def test_descriptors_are_destroyed_with_their_plans():
    gc.collect()
    before = lib.liveDescriptorCount()
    plan = get_plan(make_geom(2, False, 1), "float32")
    assert lib.liveDescriptorCount() == before + 6  # x, y, bias, w, conv, activation
    del plan
    clear_plan_cache()
    gc.collect()
    assert lib.liveDescriptorCount() == before


def test_bad_param_from_cudnn_is_a_cudnn_error_with_context():
    # Bypass ConvGeometry's validation: a negative pad reaches cudnnSetConvolutionNdDescriptor.
    geom = ConvGeometry((1, 2, 5, 5), (3, 2, 3, 3), (1, 1), (-1, 0), (1, 1), 1, False)
    with pytest.raises(CudnnError) as info:
        get_plan(geom, "float32")
    err = info.value
    assert err.status == lib.CUDNN_STATUS_BAD_PARAM == 2000
    assert err.function == "cudnnSetConvolutionNdDescriptor"
    assert "x[1, 2, 5, 5] w[3, 2, 3, 3] NCHW" in str(err) and "dtype=float32" in str(err)
    with pytest.raises(CudnnError, match="BAD_PARAM"):
        lib.TensorDescriptor().setNd(lib.CUDNN_DATA_FLOAT, [1, -2, 3, 3], [18, 9, 3, 1])


def test_output_dims_disagreement_is_an_internal_error():
    class Skewed(ConvGeometry):
        @property
        def output_spatial(self):
            return tuple(s + 1 for s in super().output_spatial)

    geom = Skewed((1, 2, 5, 5), (3, 2, 3, 3), (1, 1), (0, 0), (1, 1), 1, False)
    with pytest.raises(RuntimeError, match=r"internal error: cuDNN computes output dims "
                                           r"\[1, 3, 3, 3\] but convfuse computes \[1, 3, 4, 4\]"):
        ConvPlan(PlanKey.create(geom, "float32"))


# ---------------------------------------------------------------- pooling plans

@pytest.mark.parametrize(("rank", "channels_last", "mode"),
                         list(itertools.product((1, 2, 3), (False, True), ("max", "avg"))))
def test_pool_plan(rank, channels_last, mode):
    spatial = (9, 8, 7)[:rank]
    shape = (2, 3, *spatial) if not channels_last else (2, *spatial, 3)
    pg = PoolGeometry.create(shape, (3, 2, 3)[:rank], (2, 1, 2)[:rank], (1, 0, 1)[:rank], mode,
                             "NHWC" if channels_last else "NCHW")
    plan = get_pool_plan(pg, "float16")
    lifted = rank == 1
    got_mode, nan, window, pads, strides = plan.pool_desc.getNd()
    assert got_mode == (lib.CUDNN_POOLING_MAX if mode == "max"
                        else lib.CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING)
    assert nan == lib.CUDNN_PROPAGATE_NAN
    assert window == ([1] if lifted else []) + list(pg.kernel_size)
    assert pads == ([0] if lifted else []) + list(pg.padding)
    assert strides == ([1] if lifted else []) + list(pg.stride)
    for desc, s in ((plan.x_desc, pg.input_shape), (plan.y_desc, pg.output_shape)):
        dt, dims, st = desc.getNd()
        assert dt == lib.CUDNN_DATA_HALF
        assert (dims, st) == cudnn_view(s, channels_last)
    assert lib.getPoolingNdForwardOutputDim(plan.pool_desc, plan.x_desc) == \
        cudnn_view(pg.output_shape, channels_last)[0]
    assert get_pool_plan(pg, "float16") is plan
    assert pool_plan_cache_info() == (1, 1, 1)


def test_deterministic_max_pooling():
    pg = PoolGeometry.create((1, 2, 6, 6), 2)
    with config.flags(deterministic=True):
        plan = get_pool_plan(pg, "float32")
    assert plan.pool_desc.getNd()[0] == lib.CUDNN_POOLING_MAX_DETERMINISTIC
    with pytest.raises(TypeError, match=r"pgeom must be a PoolGeometry"):
        get_pool_plan(make_geom(2, False, 1), "float32")


# ---------------------------------------------------------------- handles

@pytest.mark.skipif(backend.gpu_available(), reason="checks the no-GPU error")
def test_handle_without_gpu():
    from convfuse.ops.cudnn.handle import get_handle

    with pytest.raises(DeviceUnavailableError, match=r"no usable CUDA device or driver"):
        get_handle()


# ---------------------------------------------------------------- algorithm choice

def perf(algo, memory=0, status=None, det=True, math="CUDNN_DEFAULT_MATH", time=1.0):
    return lib.AlgoPerf(algo, lib.CUDNN_STATUS_SUCCESS if status is None else status, time,
                        memory, lib.CUDNN_DETERMINISTIC if det else lib.CUDNN_NON_DETERMINISTIC,
                        getattr(lib, math))


def test_usable_candidates_filters_and_keeps_cudnn_order():
    perfs = [perf(5, 100, det=False), perf(1, 10, status=lib.CUDNN_STATUS_NOT_SUPPORTED),
             perf(7, 5000), perf(0, 0, math="CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION"),
             perf(2, 50, math="CUDNN_FMA_MATH"), perf(3, 0)]
    use = algos.usable_candidates
    kw = dict(deterministic=False, workspace_limit=None, fma_only=False)
    assert [c.algo for c in use(perfs, lib, **kw)] == [5, 7, 2, 3]
    assert [c.algo for c in use(perfs, lib, **{**kw, "deterministic": True})] == [7, 2, 3]
    assert [c.algo for c in use(perfs, lib, **{**kw, "workspace_limit": 100})] == [5, 2, 3]
    assert [c.algo for c in use(perfs, lib, **{**kw, "fma_only": True})] == [2]
    first = use(perfs, lib, **kw)[0]
    assert first == Candidate(5, 100, lib.CUDNN_DEFAULT_MATH, False)
    why = algos.describe_empty(perfs, lib, deterministic=True, workspace_limit=20, fma_only=True)
    assert why == ("cuDNN reported 6 algorithm(s), 5 runnable, 4 deterministic, "
                   "2 within workspace_limit=20, 1 with FMA math (allow_tf32=False)")


def oom_above(limit, log):
    cp = pytest.importorskip("cupy")

    def allocate(n):
        log.append(n)
        if n > limit:
            raise cp.cuda.memory.OutOfMemoryError(n, 0, 0)
        return object()
    return allocate


def test_workspace_fallback_skips_to_the_next_algorithm():
    cands = [Candidate(a, m, 0, True) for a, m in ((6, 4000), (1, 3000), (0, 200), (2, 0))]
    log = []
    with pytest.warns(WorkspaceFallbackWarning, match=r"algo 6 \(4000 bytes\), algo 1 \(3000 "
                                                       r"bytes\); using algo 0 \(200 bytes\)"):
        chosen, rest = algos.first_allocatable(cands, oom_above(1000, log), "fwd")
    assert chosen == cands[2] and rest == (cands[3],) and log == [4000, 3000, 200]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the first one fitting: no warning
        assert algos.first_allocatable(cands, oom_above(10**6, []), "fwd")[0] == cands[0]
    with pytest.raises(NoAlgorithmError, match=r"out of memory for every algorithm's workspace "
                                               r"\(4000, 3000, 200 bytes\)"):
        algos.first_allocatable(cands[:3], oom_above(100, []), "fwd")
    with pytest.raises(NoAlgorithmError, match=r"no algorithm to try"):
        algos.first_allocatable([], oom_above(100, []), "fwd")


class FakeQueries:
    """Stands in for the handle-needing cuDNN queries and CuPy's pool."""

    def __init__(self, monkeypatch, perfs, limit=10**9):
        self.calls = []
        self.alloc_log = []
        monkeypatch.setattr(algos, "heuristic_perfs", self.heuristic)
        monkeypatch.setattr(algos, "forced_identity_perf", self.forced)
        monkeypatch.setattr(algos, "benchmark_perfs", self.benchmark)
        monkeypatch.setattr(plan_conv, "pool_alloc", oom_above(limit, self.alloc_log))
        self.perfs = perfs

    def heuristic(self, lib_, handle, plan, direction):
        self.calls.append(("heuristic", direction))
        return self.perfs[direction]

    def benchmark(self, lib_, handle, plan, direction, inputs, allocate, limit):
        self.calls.append(("benchmark", direction, inputs))
        return self.perfs[direction]

    def forced(self, lib_, handle, plan):
        self.calls.append(("forced",))
        return [perf(lib.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, 64,
                     math=plan.key.math_type)]


PERFS = {
    "fwd": [perf(lib.CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD, 9000),
            perf(lib.CUDNN_CONVOLUTION_FWD_ALGO_GEMM, 500),
            perf(lib.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, 0)],
    "bwd_data": [perf(1, 100, det=False), perf(0, 0)],
    "bwd_filter": [perf(3, 10, det=False, math="CUDNN_TENSOR_OP_MATH"),
                   perf(1, 20, math="CUDNN_FMA_MATH")],
}


def test_plan_chooses_lazily_once_per_direction(monkeypatch):
    q = FakeQueries(monkeypatch, PERFS, limit=1000)
    plan = get_plan(make_geom(2, False, 1), "float32", "relu")
    assert q.calls == []  # building a plan chooses nothing
    with pytest.warns(WorkspaceFallbackWarning):
        fwd = plan.choice("fwd", "handle")
    assert fwd.algo == lib.CUDNN_CONVOLUTION_FWD_ALGO_GEMM
    assert plan.choice("fwd", "handle") is fwd
    # relu's fused forward is the plain forward's choice.
    assert plan.choice("fwd", "handle", fused=True) is fwd
    assert plan.choice("bwd_data", "handle").algo == 1
    assert plan.choice("bwd_filter", "handle").algo == 3
    assert q.calls == [("heuristic", "fwd"), ("heuristic", "bwd_data"),
                       ("heuristic", "bwd_filter")]
    with pytest.raises(ValueError, match=r"direction must be one of"):
        plan.choice("bwd_bias", "handle")


def test_identity_fused_forward_is_forced(monkeypatch):
    """Note [IDENTITY needs IMPLICIT_PRECOMP_GEMM]"""
    q = FakeQueries(monkeypatch, PERFS)
    plan = get_plan(make_geom(2, True, 2), "float16", "identity")
    fused = plan.choice("fwd", "handle", fused=True)
    assert fused.algo == lib.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM
    assert fused.workspace == 64
    assert not plan.reject("fwd", fused, fused=True)  # nothing to fall back to
    plain = plan.choice("fwd", "handle")  # convolutionForward ranks every algorithm
    assert plain.algo == lib.CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD
    assert q.calls == [("forced",), ("heuristic", "fwd")]


def test_reject_moves_to_the_next_ranked_algorithm(monkeypatch):
    FakeQueries(monkeypatch, PERFS)
    plan = get_plan(make_geom(2, False, 1), "float32", "relu")
    first = plan.choice("fwd", "handle", fused=True)
    assert plan.reject("fwd", first, fused=True)
    second = plan.choice("fwd", "handle", fused=True)
    assert second.algo == lib.CUDNN_CONVOLUTION_FWD_ALGO_GEMM
    assert plan.reject("fwd", first, fused=True)  # stale: another caller already moved on
    assert plan.reject("fwd", second, fused=True)
    last = plan.choice("fwd", "handle")
    assert last.algo == lib.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM
    assert not plan.reject("fwd", last)


def test_deterministic_and_tf32_flags_filter_choices(monkeypatch):
    FakeQueries(monkeypatch, PERFS)
    geom = make_geom(2, False, 1)
    with config.flags(deterministic=True):
        plan = get_plan(geom, "float32")
    assert plan.choice("bwd_data", "h").algo == 0
    assert plan.choice("bwd_filter", "h") == Candidate(1, 20, lib.CUDNN_FMA_MATH, True)
    with config.flags(allow_tf32=False):
        fma = get_plan(geom, "float32")
    assert fma.choice("bwd_filter", "h").math_type == lib.CUDNN_FMA_MATH
    with pytest.raises(NoAlgorithmError, match=r"no cuDNN bwd_data algorithm for .* fits: "
                                               r"cuDNN reported 2 algorithm\(s\), 2 runnable, "
                                               r"0 with FMA math"):
        fma.choice("bwd_data", "h")


def test_math_type_of_a_choice_gets_its_own_descriptor(monkeypatch):
    FakeQueries(monkeypatch, PERFS)
    plan = get_plan(make_geom(3, True, 2), "float32")
    cand = plan.choice("bwd_filter", "h")
    desc = plan.conv_desc_for(cand)
    assert desc is not plan.conv_desc
    assert desc.getMathType() == lib.CUDNN_TENSOR_OP_MATH
    assert plan.conv_desc.getMathType() == lib.CUDNN_DEFAULT_MATH  # never mutated
    assert desc.getNd() == plan.conv_desc.getNd()
    assert desc.getGroupCount() == 2
    assert plan.conv_desc_for(cand) is desc
    same = Candidate(9, 0, lib.CUDNN_DEFAULT_MATH, True)
    assert plan.conv_desc_for(same) is plan.conv_desc


def test_benchmark_flag_uses_find(monkeypatch):
    q = FakeQueries(monkeypatch, PERFS)
    with config.flags(benchmark=True, workspace_limit=600):
        plan = get_plan(make_geom(1, False, 1), "float64")
    cand = plan.choice("fwd", "h", inputs=(4096, 8192))
    assert cand.algo == lib.CUDNN_CONVOLUTION_FWD_ALGO_GEMM  # 9000 bytes exceeds the limit
    assert q.calls == [("benchmark", "fwd", (4096, 8192))]


class RecordingLib:
    """The real binding's constants and descriptors, with the handle-needing queries
    replaced by recorders (they cannot run without a GPU)."""

    def __init__(self, results):
        self.calls = []
        self.results = results

    def __getattr__(self, name):
        if name.startswith(("get", "find")) and name != "getConvolutionNdForwardOutputDim":
            def call(*args):
                self.calls.append((name, args))
                return self.results.get(name, 4)
            return call
        return getattr(lib, name)


class Buffer:
    def __init__(self, ptr):
        self.ptr = ptr


def test_heuristic_queries_pass_the_plan_descriptors_in_cudnn_order():
    plan = get_plan(make_geom(2, True, 2), "float32")
    rl = RecordingLib({})
    for direction in algos.DIRECTIONS:
        algos.heuristic_perfs(rl, "H", plan, direction)
    p = plan
    assert rl.calls == [
        ("getConvolutionForwardAlgorithmMaxCount", ("H",)),
        ("getConvolutionForwardAlgorithm_v7", ("H", p.x_desc, p.w_desc, p.conv_desc, p.y_desc, 4)),
        ("getConvolutionBackwardDataAlgorithmMaxCount", ("H",)),
        ("getConvolutionBackwardDataAlgorithm_v7",
         ("H", p.w_desc, p.y_desc, p.conv_desc, p.x_desc, 4)),
        ("getConvolutionBackwardFilterAlgorithmMaxCount", ("H",)),
        ("getConvolutionBackwardFilterAlgorithm_v7",
         ("H", p.x_desc, p.y_desc, p.conv_desc, p.w_desc, 4)),
    ]


def test_forced_identity_record():
    with config.flags(allow_tf32=False):
        plan = get_plan(make_geom(1, False, 1), "float32")
    rl = RecordingLib({"getConvolutionForwardWorkspaceSize": 1234})
    [rec] = algos.forced_identity_perf(rl, "H", plan)
    algo = lib.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM
    assert rl.calls == [("getConvolutionForwardWorkspaceSize",
                         ("H", plan.x_desc, plan.w_desc, plan.conv_desc, plan.y_desc, algo))]
    assert (rec.algo, rec.status, rec.memory, rec.determinism, rec.mathType) == (
        algo, lib.CUDNN_STATUS_SUCCESS, 1234, lib.CUDNN_DETERMINISTIC, lib.CUDNN_FMA_MATH)


@pytest.mark.parametrize("direction", algos.DIRECTIONS)
def test_benchmark_offers_the_largest_workspace_that_fits_and_a_scratch_output(direction):
    plan = get_plan(make_geom(3, False, 2), "float64")
    heur = {"fwd": "getConvolutionForwardAlgorithm_v7",
            "bwd_data": "getConvolutionBackwardDataAlgorithm_v7",
            "bwd_filter": "getConvolutionBackwardFilterAlgorithm_v7"}[direction]
    rl = RecordingLib({heur: [perf(0, 100), perf(1, 9000), perf(2, 5000),
                              perf(3, 7000, status=lib.CUDNN_STATUS_NOT_SUPPORTED),
                              perf(4, 3000)]})
    sizes = []

    def allocate(n):
        sizes.append(n)
        if n in (5000, 7000, 9000):
            raise MemoryError
        return Buffer(10_000 + n)

    algos.benchmark_perfs(rl, "H", plan, direction, (111, 222), allocate, workspace_limit=8000)
    # 9000 is above the limit, 7000 failed, 5000 does not fit: 3000 is offered.
    out_bytes = {"fwd": plan.nbytes("y"), "bwd_data": plan.nbytes("x"),
                 "bwd_filter": plan.nbytes("w")}[direction]
    assert sizes == [5000, 3000, out_bytes]
    find_name, args = rl.calls[-1]
    p = plan
    expected = {
        "fwd": ("findConvolutionForwardAlgorithmEx",
                ("H", p.x_desc, 111, p.w_desc, 222, p.conv_desc, p.y_desc)),
        "bwd_data": ("findConvolutionBackwardDataAlgorithmEx",
                     ("H", p.w_desc, 111, p.y_desc, 222, p.conv_desc, p.x_desc)),
        "bwd_filter": ("findConvolutionBackwardFilterAlgorithmEx",
                       ("H", p.x_desc, 111, p.y_desc, 222, p.conv_desc, p.w_desc)),
    }[direction]
    assert (find_name, args[:7]) == expected
    assert args[7:] == (10_000 + out_bytes, 4, 13_000, 3000)  # scratch out, n, workspace


def test_plan_nbytes():
    geom = make_geom(2, True, 2)
    plan = get_plan(geom, "bfloat16")
    assert plan.nbytes("x") == 2 * np.prod(geom.input_shape)
    assert plan.nbytes("w") == 2 * np.prod(geom.weight_shape)
    assert plan.nbytes("y") == 2 * np.prod(geom.output_shape)


def test_pool_plan_errors():
    from convfuse.plan.pool import PoolPlan, PoolPlanKey, pooling_mode_name

    with pytest.raises(ValueError, match=r"pooling mode must be 'max' or 'avg', got 'min'"):
        pooling_mode_name("min", False)
    # Bypass PoolGeometry's validation: an empty window reaches cuDNN.
    bad = PoolGeometry((1, 2, 6, 6), (0, 2), (2, 2), (0, 0), "max", False)
    with pytest.raises(CudnnError, match=r"BAD_PARAM.*building a pooling plan for max-pool "
                                         r"x\[1, 2, 6, 6\]") as info:
        get_pool_plan(bad, "float32")
    assert info.value.status == lib.CUDNN_STATUS_BAD_PARAM

    class Skewed(PoolGeometry):
        @property
        def output_spatial(self):
            return tuple(s + 1 for s in super().output_spatial)

    skewed = Skewed((1, 2, 6, 6), (2, 2), (2, 2), (0, 0), "avg", False)
    with pytest.raises(RuntimeError, match=r"internal error: cuDNN computes pooling output dims "
                                           r"\[1, 2, 3, 3\] but convfuse computes \[1, 2, 4, 4\]"):
        PoolPlan(PoolPlanKey.create(skewed, "float32"))


def test_query_errors_name_the_plan(monkeypatch):
    def refuse(*args):
        raise CudnnError(lib.CUDNN_STATUS_NOT_SUPPORTED, "cudnnGetConvolutionForwardAlgorithm_v7")

    monkeypatch.setattr(algos, "heuristic_perfs", refuse)
    geom = make_geom(2, False, 1)
    plan = get_plan(geom, "float32")
    with pytest.raises(CudnnError, match=r"choosing the fwd algorithm for .*dtype=float32") as info:
        plan.choice("fwd", "H")
    assert geom.describe() in str(info.value)
