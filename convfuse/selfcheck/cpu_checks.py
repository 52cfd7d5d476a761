"""CPU-side checks of the cuDNN binding: everything libcudnn answers without a GPU.

Descriptors round-trip, cudnnGetConvolutionNdForwardOutputDim agrees with convfuse's
shape rule, statuses map to CudnnError, plans build, nothing leaks, and the custom CUDA
kernels compile through NVRTC. Each check returns an Outcome or raises CheckFailed.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..errors import CudnnError
from ..geometry import ConvGeometry
from .descriptors import data_type, output_dims, packed_strides
from .runner import CheckFailed, CheckSkipped, Outcome

DTYPES = ("float32", "float64", "float16", "bfloat16")
BAD_PARAM = 2000
NOT_INITIALIZED = 1001


def _expect_equal(got: Any, expected: Any, what: str) -> None:
    if _norm(got) != _norm(expected):
        raise CheckFailed(f"{what}: got {got!r}, expected {expected!r}")


def _norm(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(_norm(i) for i in v)
    if isinstance(v, float):
        return round(v, 12)
    return int(v) if hasattr(v, "__index__") else v


def descriptor_round_trips(lib: ModuleType) -> Outcome:
    """Every descriptor kind: what getNd/get returns is what setNd/set was given."""
    n = 0
    for dtype, dims, channels_last in itertools.product(
            DTYPES, ([2, 3, 4, 5], [2, 3, 4, 5, 6]), (False, True)):
        dt, strides = data_type(lib, dtype), packed_strides(dims, channels_last)
        t = lib.TensorDescriptor()
        t.setNd(dt, dims, strides)
        _expect_equal(t.getNd(), (dt, dims, strides), f"tensor {dtype} {dims}")
        fmt = lib.CUDNN_TENSOR_NHWC if channels_last else lib.CUDNN_TENSOR_NCHW
        f = lib.FilterDescriptor()
        f.setNd(dt, fmt, dims)
        _expect_equal(f.getNd(), (dt, fmt, dims), f"filter {dtype} {dims}")
        n += 2
    maths = ("CUDNN_DEFAULT_MATH", "CUDNN_TENSOR_OP_MATH",
             "CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION", "CUDNN_FMA_MATH")
    for (pads, strides, dils), groups, math_name in itertools.product(
            (([1, 0], [2, 1], [1, 2]), ([0, 1, 2], [1, 2, 1], [2, 1, 1])), (1, 3), maths):
        c = lib.ConvolutionDescriptor()
        ct = data_type(lib, "float32")
        c.setNd(pads, strides, dils, lib.CUDNN_CROSS_CORRELATION, ct)
        c.setGroupCount(groups)
        c.setMathType(getattr(lib, math_name))
        _expect_equal(c.getNd(), (pads, strides, dils, lib.CUDNN_CROSS_CORRELATION, ct),
                      "convolution descriptor")
        _expect_equal(c.getGroupCount(), groups, "group count")
        _expect_equal(c.getMathType(), getattr(lib, math_name), math_name)
        n += 1
    for mode in ("SIGMOID", "RELU", "TANH", "CLIPPED_RELU", "ELU", "IDENTITY", "SWISH"):
        a = lib.ActivationDescriptor()
        code = getattr(lib, f"CUDNN_ACTIVATION_{mode}")
        a.set(code, lib.CUDNN_NOT_PROPAGATE_NAN, 0.5)
        _expect_equal(a.get(), (code, lib.CUDNN_NOT_PROPAGATE_NAN, 0.5), f"activation {mode}")
        n += 1
    for mode in ("MAX", "AVERAGE_COUNT_INCLUDE_PADDING", "AVERAGE_COUNT_EXCLUDE_PADDING",
                 "MAX_DETERMINISTIC"):
        p = lib.PoolingDescriptor()
        code = getattr(lib, f"CUDNN_POOLING_{mode}")
        p.setNd(code, lib.CUDNN_NOT_PROPAGATE_NAN, [3, 2], [1, 0], [2, 2])
        _expect_equal(p.getNd(), (code, lib.CUDNN_NOT_PROPAGATE_NAN, [3, 2], [1, 0], [2, 2]),
                      f"pooling {mode}")
        n += 1
    return Outcome(f"{n} descriptors set and read back (tensor, filter, convolution, "
                   "activation, pooling; 4 dtypes, both layouts)")


def output_dims_grid() -> list[tuple[Any, ...]]:
    """(x shape, w shape, stride, padding, dilation, groups, channels_last) cases, some of
    which both convfuse and cuDNN must refuse (kernel wider than the padded input)."""
    cases = []
    for rank, channels_last, s, p, d, kernel, g in itertools.product(
            (1, 2, 3), (False, True), (1, 2), (0, 1), (1, 2), (3, 6), (1, 2, 4)):
        c, k = 4, 8
        x = [2, c, *([5] * rank)]
        w = [k, c // g, *([kernel] * rank)]
        if channels_last:
            x, w = [x[0], *x[2:], x[1]], [w[0], *w[2:], w[1]]
        cases.append((x, w, (s,) * rank, (p,) * rank, (d,) * rank, g, channels_last))
    return cases


def output_dims_agree(lib: ModuleType) -> Outcome:
    """cuDNN's output shape equals convfuse's rule, or both refuse the geometry."""
    accepted = refused = 0
    for x, w, s, p, d, g, channels_last in output_dims_grid():
        try:
            rule: Any = ConvGeometry.create(x, w, s, p, d, g, "NHWC" if channels_last
                                            else "NCHW").output_shape
        except ValueError as exc:
            rule = exc
        try:
            ours: Any = output_dims(lib, x, w, s, p, d, g, channels_last)
        except CudnnError as exc:
            ours = exc
        case = f"x{x} w{w} stride={s} pad={p} dil={d} groups={g}"
        if isinstance(rule, ValueError) != isinstance(ours, CudnnError):
            raise CheckFailed(f"{case}: convfuse says {rule!r}, cuDNN says {ours!r}")
        if isinstance(ours, CudnnError):
            if ours.status != BAD_PARAM:
                raise CheckFailed(f"{case}: cuDNN refused with {ours}, expected BAD_PARAM")
            refused += 1
        else:
            _expect_equal(ours, rule, case)
            accepted += 1
    return Outcome(f"{accepted} shapes equal, {refused} refused by both "
                   "(ranks 1-3, both layouts, stride, padding, dilation, groups)")


def bad_param_maps_to_cudnn_error(lib: ModuleType) -> Outcome:
    """A refused call raises CudnnError with cuDNN's status, its name and the function."""
    _expect_equal(lib.getErrorString(BAD_PARAM), "CUDNN_STATUS_BAD_PARAM", "getErrorString")
    x, w = [1, 3, 4, 4], [8, 3, 5, 5]
    try:
        output_dims(lib, x, w, (1, 1), (0, 0), (1, 1), 1, False)
    except CudnnError as exc:
        _check_error(exc, "cudnnGetConvolutionNdForwardOutputDim")
    else:
        raise CheckFailed("a 5x5 kernel over a 4x4 input was not refused by cuDNN")
    try:
        ConvGeometry.create(x, w)
    except ValueError:
        pass
    else:
        raise CheckFailed("convfuse accepted a 5x5 kernel over a 4x4 input")
    try:
        lib.ConvolutionDescriptor().setNd([0, 0], [0, 1], [1, 1], lib.CUDNN_CROSS_CORRELATION,
                                          data_type(lib, "float32"))
    except CudnnError as exc:
        _check_error(exc, "cudnnSetConvolutionNdDescriptor")
    else:
        raise CheckFailed("a stride of 0 was not refused by cuDNN")
    return Outcome("BAD_PARAM (2000) raises CudnnError naming the status and the function")


def _check_error(exc: CudnnError, function: str) -> None:
    if (exc.status != BAD_PARAM or exc.function != function
            or "CUDNN_STATUS_BAD_PARAM" not in str(exc) or function not in str(exc)):
        raise CheckFailed(f"expected BAD_PARAM from {function}, got {exc!r}")


def handle_without_gpu(lib: ModuleType, gpu: bool) -> Outcome:
    """Without a GPU cudnnCreate must fail cleanly with NOT_INITIALIZED, not crash."""
    if gpu:  # pragma: gpu
        lib.Handle()
        return Outcome("cudnnCreate succeeded")
    try:
        lib.Handle()
    except CudnnError as exc:
        if exc.status != NOT_INITIALIZED or exc.function != "cudnnCreate":
            raise CheckFailed(f"expected NOT_INITIALIZED from cudnnCreate, got {exc!r}") from exc
        return Outcome("cudnnCreate -> CUDNN_STATUS_NOT_INITIALIZED (1001), as expected "
                       "without a GPU")
    raise CheckFailed("cudnnCreate succeeded although no GPU is usable")


def plans_build(lib: ModuleType) -> Outcome:
    """get_plan builds descriptors (and checks cuDNN's output dims) for every rank, layout
    and dtype; a second request is a cache hit; clearing frees every descriptor."""
    from .. import plan

    plan.clear_plan_cache()
    gc.collect()  # descriptors held by earlier exceptions' tracebacks go first
    base = lib.liveDescriptorCount()
    geoms = [
        ConvGeometry.create((2, 4, 9), (6, 2, 3), 2, 1, 1, 2, "NCW"),
        ConvGeometry.create((2, 7, 6, 4), (4, 3, 2, 1), 1, (1, 0), (2, 1), 4, "NHWC"),
        ConvGeometry.create((1, 3, 5, 4, 4), (2, 3, 3, 2, 2), (1, 2, 1), 1, 1, 1, "NCDHW"),
    ]
    built = 0
    for geom, dtype, act in itertools.product(geoms, DTYPES, ("identity", "relu", "gelu")):
        plan.get_plan(geom, dtype, act, residual=act == "relu")
        built += 1
    before = plan.plan_cache_info()
    for geom in geoms:
        plan.get_plan(geom, "float32", "identity", residual=False)
    after = plan.plan_cache_info()
    if after.hits - before.hits != len(geoms) or after.misses != before.misses:
        raise CheckFailed(f"repeated get_plan calls were not cache hits: {before} -> {after}")
    plan.clear_plan_cache()
    gc.collect()
    if lib.liveDescriptorCount() != base:
        raise CheckFailed(f"{lib.liveDescriptorCount() - base} descriptors still alive after "
                          "clear_plan_cache()")
    return Outcome(f"{built} plans built without a GPU, cached, and freed")


def no_descriptor_leak(lib: ModuleType, baseline: int) -> Outcome:
    gc.collect()
    live = lib.liveDescriptorCount()
    if live != baseline:
        raise CheckFailed(f"{live - baseline} descriptors created by these checks are still "
                          "alive")
    return Outcome(f"live descriptor count back to {baseline} after all binding checks")


def kernels_compile(arch: str = "compute_80") -> Outcome:
    """Every shipped CUDA kernel source compiles through NVRTC to PTX (no GPU needed).

    PTX for the oldest checked architecture exercises NVRTC, the CUDA headers and every
    source in about a quarter of the time of full cubins; the CPU test suite
    (tests/test_kernels_nvrtc.py) compiles cubins for every arch in CHECKED_ARCHS.
    """
    from .. import kernels

    try:
        lib = kernels.nvrtc()
    except ImportError as exc:
        raise CheckSkipped(f"NVRTC is not available (CuPy is not installed: {exc})") from exc
    names = kernels.names()
    if not names:
        raise CheckFailed("no kernel sources are shipped in convfuse/kernels")
    for name in names:
        prog = lib.createProgram(kernels.source(name), f"{name}.cu", [], [])
        try:
            try:
                lib.compileProgram(prog, kernels.nvrtc_options(arch))
            except lib.NVRTCError as exc:
                raise CheckFailed(f"{name}.cu failed to compile for {arch}: "
                                  f"{lib.getProgramLog(prog)}") from exc
            if not lib.getPTX(prog):
                raise CheckFailed(f"{name}.cu compiled to empty PTX")
        finally:
            lib.destroyProgram(prog)
    return Outcome(f"{len(names)} sources ({', '.join(names)}) compiled to PTX for {arch}")


def binding_checks(lib: ModuleType, gpu: bool) -> list[tuple[str, Callable[[], Outcome]]]:
    """The binding checks in order; the last one needs the count taken before the first.
    The count is taken with the plan caches empty (plans_build empties them, and the
    descriptors of plans cached earlier in the process must not read as a negative
    leak)."""
    from .. import plan

    plan.clear_plan_cache()
    gc.collect()
    baseline = lib.liveDescriptorCount()
    return [
        ("descriptors round-trip", lambda: descriptor_round_trips(lib)),
        ("cuDNN output dims = convfuse rule", lambda: output_dims_agree(lib)),
        ("BAD_PARAM -> CudnnError", lambda: bad_param_maps_to_cudnn_error(lib)),
        ("cudnnCreate", lambda: handle_without_gpu(lib, gpu)),
        ("plans build and cache", lambda: plans_build(lib)),
        ("no descriptor leak", lambda: no_descriptor_leak(lib, baseline)),
    ]


def library_loaded(path: str | None, lib: ModuleType | None) -> Outcome:
    if path is None or lib is None:
        raise CheckFailed("libcudnn or convfuse._cudnn did not load (see install problems)")
    v = int(lib.getVersion())
    return Outcome(f"cuDNN {v // 10000}.{v % 10000 // 100}.{v % 100} from {path}")

