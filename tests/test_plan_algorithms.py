"""A plan's algorithm choice driven by stand-in perf records, without a GPU: filtering,
workspace fallback, one lazy choice per direction, rejection, and the deterministic,
TF32 and benchmark flags."""

from __future__ import annotations

import warnings

import pytest

from convfuse import config
from convfuse.errors import CudnnError
from convfuse.plan import Candidate, NoAlgorithmError, WorkspaceFallbackWarning, get_plan
from convfuse.plan import algorithms as algos
from convfuse.plan import conv as plan_conv
from tests import _plan_helpers
from tests._plan_helpers import lib, make_geom, perf

fresh_cache = _plan_helpers.fresh_cache  # autouse fixture


# ---------------------------------------------------------------- algorithm choice

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
                   "2 within workspace_limit=20, 1 with FMA math (allow_tf32=False); "
                   "not runnable: CUDNN_STATUS_NOT_SUPPORTED (3000) x1")
    failed = [perf(0, 0, status=5000), perf(1, 0, status=5000), perf(2, 0, status=3002)]
    assert algos.describe_empty(failed, lib, deterministic=False, workspace_limit=None,
                                fma_only=False) == (
        "cuDNN reported 3 algorithm(s), 0 runnable; not runnable: "
        "CUDNN_STATUS_NOT_SUPPORTED_SHAPE (3002) x1, CUDNN_STATUS_EXECUTION_FAILED (5000) x2")


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
        monkeypatch.setattr(algos, "workspace_size", self.workspace)
        monkeypatch.setattr(plan_conv, "pool_alloc", oom_above(limit, self.alloc_log))
        self.released = []  # release_search_memory calls: the pool is this fake
        monkeypatch.setattr(plan_conv, "release_search_memory",
                            lambda: self.released.append(len(self.calls)))
        self.perfs = perfs
        self.sizes = {}  # (direction, algo) -> what the size query answers, if not the record's
        self.size_calls = []

    def workspace(self, lib_, handle, plan, direction, algo, desc):
        self.size_calls.append((direction, algo, desc.getMathType()))
        record = next(p for p in self.perfs[direction] if p.algo == algo)
        return self.sizes.get((direction, algo), record.memory)

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
    # CuPy's pool gets the search's blocks back once, right after it; not at later calls
    assert q.released == [1]
    plan.choice("fwd", "h", inputs=(4096, 8192))
    assert q.released == [1]


def test_only_a_search_in_cupys_pool_hands_its_blocks_back(monkeypatch):
    q = FakeQueries(monkeypatch, PERFS)
    plan = get_plan(make_geom(1, False, 1), "float64")
    plan.choice("fwd", "h")  # heuristics: nothing searched
    with config.flags(benchmark=True):
        found = get_plan(make_geom(1, False, 1), "float64")
    found.choice("fwd", "h", inputs=(1, 2), allocate=lambda n: None)  # a caller's memory
    assert q.released == []
    # the identity slot's algorithm is forced: no search, so CuPy's pool keeps its blocks
    with config.flags(benchmark=True):
        identity = get_plan(make_geom(1, False, 1), "float64", "identity")
    identity.choice("fwd", "h", inputs=(1, 2), fused=True)
    assert q.calls[-1] == ("forced",) and q.released == []


def test_query_errors_name_the_plan(monkeypatch):
    def refuse(*args):
        raise CudnnError(lib.CUDNN_STATUS_NOT_SUPPORTED, "cudnnGetConvolutionForwardAlgorithm_v7")

    monkeypatch.setattr(algos, "heuristic_perfs", refuse)
    geom = make_geom(2, False, 1)
    plan = get_plan(geom, "float32")
    with pytest.raises(CudnnError, match=r"choosing the fwd algorithm for .*dtype=float32") as info:
        plan.choice("fwd", "H")
    assert geom.describe() in str(info.value)


def test_workspace_is_queried_for_the_algorithm_and_math_type_that_run(monkeypatch):
    """Note [workspace sizes are queried]: the record's size is an estimate for the plan's
    math type; the choice carries what cudnnGetConvolution*WorkspaceSize reports with the
    descriptor of the record's own math type, and the pool is asked for that size."""
    q = FakeQueries(monkeypatch, PERFS)
    q.sizes[("bwd_filter", 3)] = 77  # the record said 10
    plan = get_plan(make_geom(2, False, 1), "float32")
    cand = plan.choice("bwd_filter", "h")
    assert cand == Candidate(3, 77, lib.CUDNN_TENSOR_OP_MATH, False)
    assert q.size_calls == [("bwd_filter", 3, lib.CUDNN_TENSOR_OP_MATH),
                            ("bwd_filter", 1, lib.CUDNN_FMA_MATH)]
    assert q.alloc_log == [77]


def test_workspace_limit_applies_to_the_queried_size(monkeypatch):
    q = FakeQueries(monkeypatch, PERFS)
    q.sizes[("fwd", lib.CUDNN_CONVOLUTION_FWD_ALGO_GEMM)] = 700  # the record said 500
    with config.flags(workspace_limit=600):
        plan = get_plan(make_geom(2, False, 1), "float32")
    assert plan.choice("fwd", "h").algo == lib.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM
    q.sizes[("bwd_data", 0)] = 900
    q.sizes[("bwd_data", 1)] = 800
    with pytest.raises(NoAlgorithmError, match=r"2 usable algorithm\(s\), 0 within "
                                               r"workspace_limit=600 \(queried workspace "
                                               r"bytes algo 1: 800, algo 0: 900\)"):
        plan.choice("bwd_data", "h")


def test_a_refused_size_query_drops_the_algorithm_and_other_errors_name_the_plan(monkeypatch):
    q = FakeQueries(monkeypatch, PERFS)
    real = q.workspace

    def size(lib_, handle, plan, direction, algo, desc):
        if algo == lib.CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD:
            raise CudnnError(3002, "cudnnGetConvolutionForwardWorkspaceSize")  # NOT_SUPPORTED_SHAPE
        if direction == "bwd_data":
            raise CudnnError(lib.CUDNN_STATUS_BAD_PARAM,
                             "cudnnGetConvolutionBackwardDataWorkspaceSize")
        return real(lib_, handle, plan, direction, algo, desc)

    monkeypatch.setattr(algos, "workspace_size", size)
    geom = make_geom(2, False, 1)
    plan = get_plan(geom, "float32")
    first = plan.choice("fwd", "h")
    assert first.algo == lib.CUDNN_CONVOLUTION_FWD_ALGO_GEMM  # WINOGRAD was dropped
    assert plan.reject("fwd", first)
    assert plan.choice("fwd", "h").algo == lib.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM
    assert not plan.reject("fwd", plan.choice("fwd", "h"))  # nothing else is ranked
    with pytest.raises(CudnnError, match=r"sizing the bwd_data workspace for .*dtype=float32"):
        plan.choice("bwd_data", "h")
