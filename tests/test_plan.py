"""Convolution plans against the real libcudnn, without a GPU: descriptors, cuDNN's own
output shapes, the cache, errors; and the handle's no-GPU error.

Pooling plans, algorithm choice, and the cuDNN queries behind that choice are tested in
test_plan_pool.py, test_plan_algorithms.py and test_plan_queries.py."""

from __future__ import annotations

import gc
import itertools

import numpy as np
import pytest

from convfuse import backend, config
from convfuse.errors import CudnnError, DeviceUnavailableError
from convfuse.geometry import ConvGeometry
from convfuse.plan import ConvPlan, PlanKey, clear_plan_cache, get_plan, plan_cache_info
from convfuse.plan.cache import PlanCache
from tests import _plan_helpers
from tests._plan_helpers import cudnn_view, lib, make_geom

fresh_cache = _plan_helpers.fresh_cache  # autouse fixture

DTYPES = ("float32", "float16", "bfloat16", "float64")
CUDNN_DTYPE = {"float32": lib.CUDNN_DATA_FLOAT, "float16": lib.CUDNN_DATA_HALF,
               "bfloat16": lib.CUDNN_DATA_BFLOAT16, "float64": lib.CUDNN_DATA_DOUBLE}


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
    # The layout's strides, as PyTorch gives the fused call's bias descriptor (issue #13).
    bias_shape = (1, *[1] * rank, 6) if channels_last else (1, 6, *[1] * rank)
    assert (dims, strides) == cudnn_view(bias_shape, channels_last)
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


def test_found_plans_follow_the_cache():
    """Note [finding a plan per call]: a getter's arguments are keyed once per flags
    object, and a remembered plan is served only while the cache holds it."""
    built, made = [], []
    cache = PlanCache(lambda k: built.append(k) or [f"plan{k}"], maxsize=2)

    def make_key(flags, n):
        made.append((flags, n))
        return ("key", n)

    f1, f2 = object(), object()
    p1 = cache.find((1,), f1, make_key)
    assert cache.find((1,), f1, make_key) is p1 and made == [(f1, 1)]
    assert cache.info() == (1, 1, 1)
    assert cache.find((1,), f2, make_key) is p1  # other flags: keyed again, same key
    assert made == [(f1, 1), (f2, 1)] and built == [("key", 1)]
    cache.find((2,), f2, make_key)
    cache.find((1,), f2, make_key)  # found: its recency is refreshed, as get's is
    cache.find((3,), f2, make_key)  # so 2 is evicted, not 1
    assert cache.find((1,), f2, make_key) is p1
    p2 = cache.find((2,), f2, make_key)
    assert built == [("key", 1), ("key", 2), ("key", 3), ("key", 2)]
    assert p2 is not None and p2 is cache.get(("key", 2))
    cache.clear()
    assert cache.find((1,), f2, make_key) is not p1  # rebuilt, never the dropped plan
    made.clear()
    unhashable = ([1],)
    with pytest.raises(TypeError):
        hash(unhashable)
    cache.find(unhashable, f2, lambda flags, n: made.append(n) or ("key", 9))
    cache.find(unhashable, f2, lambda flags, n: made.append(n) or ("key", 9))
    assert made == [[1], [1]]  # keyed every time


def test_a_kept_plan_is_touched_as_a_hit():
    """PlanCache.touch: what a caller that kept a plan (a bound call) asks at each use."""
    cache = PlanCache(lambda k: [f"plan{k}"], maxsize=2)
    p1, p2 = cache.get(1), cache.get(2)
    assert cache.touch(1, p1) and cache.info() == (1, 2, 2)  # refreshed: 2 is the oldest
    cache.get(3)
    assert cache.touch(1, p1) and not cache.touch(2, p2)  # 2 was evicted, not 1
    assert not cache.touch(1, ["plan1"])  # an equal plan is not the cached one
    cache.clear()
    assert not cache.touch(1, p1) and cache.info() == (0, 0, 0)


def test_plan_key_hash_is_cached_but_not_pickled():
    """PlanKey caches its hash (it is hashed at each bound call), which holds salted str
    hashes: a key pickled into another process must hash as that process's equal keys."""
    import pickle
    import subprocess
    import sys

    key = PlanKey.create(make_geom(2, False, 1), np.float32, "relu", False, device=-1)
    assert hash(key) == hash(key) and "_hash" in key.__dict__
    code = ("import pickle, sys; from convfuse.plan import PlanKey; "
            "k = pickle.loads(sys.stdin.buffer.read()); "
            "fresh = PlanKey(**{f: getattr(k, f) for f in k.__dataclass_fields__}); "
            "print(k == fresh and hash(k) == hash(fresh))")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(key),
                         capture_output=True, check=True, env={"PYTHONHASHSEED": "7",
                         "PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1])})
    assert out.stdout.strip() == b"True"


def test_get_plan_follows_flags_and_clearing():
    geom = make_geom(2, False, 1)
    p = get_plan(geom, "float32", "relu")
    with config.flags(deterministic=True):
        q = get_plan(geom, "float32", "relu")
        assert q is not p and q.key.deterministic and get_plan(geom, "float32", "relu") is q
    assert get_plan(geom, "float32", "relu") is p
    clear_plan_cache()
    r = get_plan(geom, "float32", "relu")
    assert r is not p and r.key == p.key and plan_cache_info() == (0, 1, 1)


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


# ---------------------------------------------------------------- handles

@pytest.mark.skipif(backend.gpu_available(), reason="checks the no-GPU error")
def test_handle_without_gpu():
    from convfuse.ops.cudnn.handle import get_handle

    with pytest.raises(DeviceUnavailableError, match=r"no usable CUDA device or driver"):
        get_handle()
