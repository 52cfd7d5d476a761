"""A numeric fake GPU for the fault-injection suite (tests/test_fault_injection*.py).

It extends tests/test_ops_cudnn_wiring.py's FakeGpu (CuPy arrays over fake addresses) with
host copies of every array, so the faked cuDNN calls and kernel launchers *compute*, with
convfuse's NumPy reference engine, and a test can compare the engine's result with an
independent float64 reference. New arrays are NaN-poisoned. Unlike FakeGpu, the
algorithm queries go through the real convfuse code down to the binding, where each call a
conv plan makes can be made to fail:

- `inject(name, status, times=None, algo=None)`: the binding function `name` raises
  CudnnError(status) on its next `times` calls (None: always), only those for algorithm
  `algo` (the last argument of a workspace-size query) when given;
- `queried`: {algo: bytes} the workspace-size queries report instead of the ranking
  record's size (Note [workspace sizes are queried] in convfuse/plan/algorithms.py);
- `oom_choice_at` / `oom_call_at`: workspace allocations of at least that many bytes fail
  with CuPy's OutOfMemoryError when an algorithm is chosen (pool_alloc) or at call time
  (Workspace);
- `perfs`: the ranked records the heuristics return (algo, workspace bytes, status).
"""

from __future__ import annotations

import numpy as np
import pytest

import convfuse.ops as ops
from convfuse.errors import CudnnError
from convfuse.plan import algorithms
from tests.test_ops_cudnn_wiring import FakeGpu

REAL_HEURISTIC_PERFS = algorithms.heuristic_perfs
REAL_FORCED_PERF = algorithms.forced_identity_perf
REAL_WORKSPACE_SIZE = algorithms.workspace_size

#: cuDNN 9 statuses the suite injects (cudnn_graph.h; ALLOC_FAILED is the deprecated
#: alias of INTERNAL_ERROR_HOST_ALLOCATION_FAILED).
NOT_SUPPORTED, BAD_PARAM, ALLOC_FAILED = 3000, 2000, 4003
FORCED = 1  # CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM
BIG = 1 << 20


class NumericGpu(FakeGpu):
    QUERIES = ("getConvolutionForwardAlgorithmMaxCount",
               "getConvolutionBackwardDataAlgorithmMaxCount",
               "getConvolutionBackwardFilterAlgorithmMaxCount",
               "getConvolutionForwardAlgorithm_v7", "getConvolutionBackwardDataAlgorithm_v7",
               "getConvolutionBackwardFilterAlgorithm_v7", "getConvolutionForwardWorkspaceSize",
               "getConvolutionBackwardDataWorkspaceSize",
               "getConvolutionBackwardFilterWorkspaceSize",
               "findConvolutionForwardAlgorithmEx", "findConvolutionBackwardDataAlgorithmEx",
               "findConvolutionBackwardFilterAlgorithmEx")

    def __init__(self, monkeypatch, geom):
        self.host = {}
        super().__init__(monkeypatch)
        from convfuse.ops import elementwise
        from convfuse.ops.cudnn import fused, layout, ranked
        from convfuse.plan import conv as plan_conv

        self.geom = geom
        # Note [float64 runs channels-first]: arrays the engine copied to channels-first
        # are computed with this geometry.
        self.cf_geom = None if geom is None else layout.cudnn_geometry(geom, "float64")
        self.channels_first = set()
        self.faults = {}
        self.oom_choice_at = self.oom_call_at = None
        self.forced_workspace = BIG
        self.queried = {}
        lib = self.lib
        # (algo, workspace bytes, status) in cuDNN's rank order: 6 is fastest and hungriest.
        self.perfs = [(6, BIG, 0), (2, 4096, 0), (0, 0, 0)]
        monkeypatch.setattr(algorithms, "heuristic_perfs", REAL_HEURISTIC_PERFS)
        monkeypatch.setattr(algorithms, "forced_identity_perf", REAL_FORCED_PERF)
        monkeypatch.setattr(algorithms, "workspace_size", REAL_WORKSPACE_SIZE)
        for name in self.QUERIES:
            monkeypatch.setattr(lib, name, lambda *a, _n=name: self._query(_n, a))
        for name in self.COMPUTE:
            monkeypatch.setattr(lib, name, lambda *a, _n=name: self._compute(_n, a))
        for name in self.LAUNCHERS:
            monkeypatch.setattr(elementwise, name, lambda *a, _n=name: self._launch(_n, a))
        monkeypatch.setattr(plan_conv, "pool_alloc", lambda n: self._alloc(n, self.oom_choice_at))
        monkeypatch.setattr(plan_conv, "release_search_memory", lambda: None)
        monkeypatch.setattr(ranked, "Workspace", self._workspace)
        monkeypatch.setattr(layout, "to_channels_first", self._to_channels_first)
        monkeypatch.setattr(layout, "to_channels_last", self._to_channels_last)
        monkeypatch.setattr(fused, "_zero_bias", {})

    # ---- arrays ----

    def array(self, shape, dtype, kind="empty"):
        a = super().array(shape, dtype, kind)
        fill = 0 if kind == "zeros" else np.nan
        self.host[a.data.ptr] = np.full(a.shape, fill, dtype=np.float64)
        return a

    def put(self, values):
        a = self.array(values.shape, "float64")
        self.host[a.data.ptr][...] = values
        return a

    def get(self, a):
        return self.host[a.data.ptr]

    def _to_channels_first(self, a):
        self.calls.append(("to_channels_first", (a,)))
        values = np.moveaxis(self.get(a), -1, 1)
        out = self.array(values.shape, a.dtype)
        self.host[out.data.ptr][...] = values
        self.channels_first.add(out.data.ptr)
        return out

    def _to_channels_last(self, a_cf, out=None):
        self.calls.append(("to_channels_last", (a_cf, out)))
        values = np.moveaxis(self.get(a_cf), 1, -1)
        if out is None:
            out = self.array(values.shape, a_cf.dtype)
        self.host[out.data.ptr][...] = values
        return out

    def _geom_of(self, *ptrs):
        return self.cf_geom if any(p in self.channels_first for p in ptrs) else self.geom

    # ---- faults ----

    def inject(self, name, status, times=None, algo=None):
        self.faults[name] = [status, times, algo]

    def _maybe_fail(self, name, args=()):
        fault = self.faults.get(name)
        if fault is None or fault[1] == 0:
            return
        if fault[2] is not None and args[-1] != fault[2]:
            return
        if fault[1] is not None:
            fault[1] -= 1
        status = fault[0]
        c_name = f"cudnn{name[0].upper()}{name[1:]}"
        raise CudnnError(status, c_name, self.lib.getErrorString(status))

    def _alloc(self, nbytes, limit):
        import cupy

        self.calls.append(("alloc", (nbytes,)))
        if limit is not None and nbytes >= limit:
            raise cupy.cuda.memory.OutOfMemoryError(nbytes, 0, 0)
        return type("Mem", (), {"ptr": 0})()

    def _workspace(self, nbytes, ctx=None):
        self._alloc(nbytes, self.oom_call_at)
        return type("Ws", (), {"ptr": 0, "size": int(nbytes)})()

    # ---- the binding ----

    def _query(self, name, args):
        self.calls.append((name, args))
        self._maybe_fail(name, args)
        lib = self.lib
        if name.endswith("MaxCount"):
            return len(self.perfs)
        if name.endswith("WorkspaceSize"):
            algo = args[-1]
            if algo in self.queried:
                return self.queried[algo]
            ranked = {a: m for a, m, _ in self.perfs}
            forced = name == "getConvolutionForwardWorkspaceSize" and algo == FORCED
            return self.forced_workspace if forced else ranked[algo]
        return [lib.AlgoPerf(a, s, 1.0, m, lib.CUDNN_DETERMINISTIC, lib.CUDNN_DEFAULT_MATH)
                for a, m, s in self.perfs]

    def _compute(self, name, args):
        self.calls.append((name, args))
        self._maybe_fail(name)
        h = self.host
        g = self._geom_of(args[3], args[5]) if name != "convolutionBackwardBias" else self.geom
        if name == "convolutionForward":
            alpha, x, w, beta, y = args[1], args[3], args[5], args[10], args[12]
            self._blend(y, alpha * ops.conv_forward(h[x], h[w], g), beta)
        elif name == "convolutionBiasActivationForward":
            x, w, alpha2, z, b, act, y = args[3], args[5], args[10], args[12], args[14], \
                args[15], args[17]
            pre = args[1] * ops.conv_forward(h[x], h[w], g) + self._bias(h[b], g)
            if alpha2:
                pre = pre + alpha2 * h[z]
            relu = act.get()[0] == self.lib.CUDNN_ACTIVATION_RELU
            h[y][...] = np.maximum(pre, 0) if relu else pre
        elif name == "convolutionBackwardData":
            w, dy, beta, dx = args[3], args[5], args[10], args[12]
            self._blend(dx, args[1] * ops.conv_backward_data(h[dy], h[w], g), beta)
        elif name == "convolutionBackwardFilter":
            x, dy, beta, dw = args[3], args[5], args[10], args[12]
            self._blend(dw, args[1] * ops.conv_backward_filter(h[x], h[dy], g), beta)
        elif name == "convolutionBackwardBias":
            dy, beta, db = args[3], args[4], args[6]
            self._blend(db, args[1] * ops.conv_backward_bias(h[dy], g), beta)
        else:
            raise AssertionError(f"the conv engine made an unexpected call: {name}")

    def _launch(self, name, args):
        self.calls.append((name, args))
        h = self.host
        if name == "bias_act_forward":
            y, b, res, scale, act, g = args
            v = h[y.data.ptr] + (0 if b is None else self._bias(self.get(b), g))
            if res is not None:
                v = v + scale * self.get(res)
            h[y.data.ptr][...] = ops.activation_forward(v, act)
        elif name == "activation_forward":
            z, act, out = args
            h[out.data.ptr][...] = ops.activation_forward(self.get(z).copy(), act)
        elif name == "activation_backward_bias":
            dy, saved, act, g, dz, db, beta = args
            assert act == "identity" and saved is None and dz is None
            self._blend(db.data.ptr, ops.conv_backward_bias(self.get(dy), g), beta)
        else:
            raise AssertionError(f"the conv engine launched an unexpected kernel: {name}")

    def _blend(self, ptr, value, beta):
        out = self.host[ptr]
        out[...] = value + (beta * out if beta else 0)

    def _bias(self, b, geom):
        shape = [1] * len(geom.output_shape)
        shape[geom.channel_axis] = -1
        return b.reshape(shape)

    def names(self):
        return [name for name, _ in self.calls]


@pytest.fixture
def make_gpu(monkeypatch):
    from convfuse.plan import clear_plan_cache

    yield lambda geom: NumericGpu(monkeypatch, geom)
    clear_plan_cache()  # plans here remember refusals; no other test should meet them
