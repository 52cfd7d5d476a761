"""The handle-needing cuDNN algorithm queries behind a plan's choice, run against a
recording stand-in for the binding (they cannot run without a GPU): the descriptors each
passes, and the workspace and scratch output offered to cuDNN's find."""

from __future__ import annotations

import numpy as np
import pytest

from convfuse import config
from convfuse.plan import algorithms as algos
from convfuse.plan import get_plan
from tests import _plan_helpers
from tests._plan_helpers import lib, make_geom, perf

fresh_cache = _plan_helpers.fresh_cache  # autouse fixture


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
