"""convfuse._cudnn against the real libcudnn, on the CPU (no handle, so no compute calls).

Oracles: the cuDNN headers themselves (constants), numpy's own stride arithmetic (layouts),
convfuse.geometry.conv_output_size and a pooling formula written here (output shapes).

Note [1-D convolutions in cuDNN] (csrc/descriptors.h): cuDNN accepts 3-d descriptors for
shapes, but its kernels want 4-d; the tests below check both forms give the same shape.
"""

from __future__ import annotations

import gc
import itertools
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from convfuse._binding import cudnn
from convfuse.backend import gpu_available
from convfuse.errors import CudnnError
from convfuse.geometry import conv_output_size

lib = cudnn()

DTYPES = {  # cuDNN data type -> numpy dtype of the same width
    "CUDNN_DATA_FLOAT": np.float32,
    "CUDNN_DATA_HALF": np.float16,
    "CUDNN_DATA_BFLOAT16": np.uint16,  # only the item size matters for strides
    "CUDNN_DATA_DOUBLE": np.float64,
}

DESIGN_CONSTANTS = [
    "CUDNN_DATA_FLOAT", "CUDNN_DATA_HALF", "CUDNN_DATA_BFLOAT16", "CUDNN_DATA_DOUBLE",
    "CUDNN_TENSOR_NCHW", "CUDNN_TENSOR_NHWC", "CUDNN_CROSS_CORRELATION", "CUDNN_CONVOLUTION",
    "CUDNN_DEFAULT_MATH", "CUDNN_TENSOR_OP_MATH", "CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION",
    "CUDNN_FMA_MATH", "CUDNN_ACTIVATION_SIGMOID", "CUDNN_ACTIVATION_RELU",
    "CUDNN_ACTIVATION_TANH", "CUDNN_ACTIVATION_CLIPPED_RELU", "CUDNN_ACTIVATION_ELU",
    "CUDNN_ACTIVATION_IDENTITY", "CUDNN_ACTIVATION_SWISH", "CUDNN_NOT_PROPAGATE_NAN",
    "CUDNN_PROPAGATE_NAN", "CUDNN_POOLING_MAX", "CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING",
    "CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING", "CUDNN_POOLING_MAX_DETERMINISTIC",
    "CUDNN_NON_DETERMINISTIC", "CUDNN_DETERMINISTIC", "CUDNN_STATUS_SUCCESS",
    "CUDNN_STATUS_BAD_PARAM", "CUDNN_STATUS_NOT_INITIALIZED", "CUDNN_STATUS_NOT_SUPPORTED",
    "CUDNN_STATUS_INTERNAL_ERROR", "CUDNN_STATUS_EXECUTION_FAILED",
]
ALGO_PREFIXES = (
    "CUDNN_CONVOLUTION_FWD_ALGO_", "CUDNN_CONVOLUTION_BWD_DATA_ALGO_",
    "CUDNN_CONVOLUTION_BWD_FILTER_ALGO_", "CUDNN_STATUS_",
)


def _header_dir() -> Path | None:
    for site in sys.path:
        cand = Path(site) / "nvidia" / "cudnn" / "include"
        if (cand / "cudnn_graph.h").is_file():
            return cand
    return None


def _header_enums() -> dict[str, int]:
    """NAME = number pairs from the cuDNN headers (comments stripped)."""
    folder = _header_dir()
    if folder is None:
        pytest.skip("cuDNN headers not found on sys.path")
    names = ("cudnn_graph.h", "cudnn_ops.h", "cudnn_cnn.h")
    text = "".join((folder / n).read_text() for n in names)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    pairs = re.findall(r"\b(CUDNN_[A-Z0-9_]+)\s*(?:CUDNN_DEPRECATED_ENUM\s*)?=\s*(\d+)", text)
    return {name: int(value) for name, value in pairs}


def _header_define(name: str) -> int:
    folder = _header_dir()
    if folder is None:
        pytest.skip("cuDNN headers not found on sys.path")
    text = (folder / "cudnn_version.h").read_text()
    return int(re.search(rf"#define {name} (\d+)", text).group(1))


def packed_strides(dims: list[int], channels_last: bool, itemsize: int) -> list[int]:
    """Element strides of a C-contiguous array in dims' logical (N, C, *spatial) order."""
    if not channels_last:
        arr = np.empty(dims, dtype=np.dtype(f"V{itemsize}"))
        return [s // itemsize for s in arr.strides]
    stored = [dims[0], *dims[2:], dims[1]]  # how a channels-last array lies in memory
    arr = np.empty(stored, dtype=np.dtype(f"V{itemsize}"))
    logical = np.moveaxis(arr, -1, 1)
    return [s // itemsize for s in logical.strides]


def tensor(dims, dtype="CUDNN_DATA_FLOAT", channels_last=False):
    d = lib.TensorDescriptor()
    d.setNd(getattr(lib, dtype), list(dims), packed_strides(list(dims), channels_last, 4))
    return d


def filt(dims, dtype="CUDNN_DATA_FLOAT", fmt="CUDNN_TENSOR_NCHW"):
    d = lib.FilterDescriptor()
    d.setNd(getattr(lib, dtype), getattr(lib, fmt), list(dims))
    return d


def conv(pads, strides, dilations, groups=1, compute="CUDNN_DATA_FLOAT"):
    d = lib.ConvolutionDescriptor()
    d.setNd(list(pads), list(strides), list(dilations), lib.CUDNN_CROSS_CORRELATION,
            getattr(lib, compute))
    d.setGroupCount(groups)
    return d


# --- library ---------------------------------------------------------------------------


def test_version_matches_header():
    assert lib.getVersion() >= 90000
    major, minor = _header_define("CUDNN_MAJOR"), _header_define("CUDNN_MINOR")
    from_header = major * 10000 + minor * 100 + _header_define("CUDNN_PATCHLEVEL")
    assert from_header == lib.CUDNN_VERSION
    assert lib.getVersion() // 10000 == lib.CUDNN_VERSION // 10000 == lib.CUDNN_MAJOR
    assert lib.getCudartVersion() >= 11000


def test_error_strings():
    assert lib.getErrorString(2000) == "CUDNN_STATUS_BAD_PARAM"
    assert lib.getErrorString(1001) == "CUDNN_STATUS_NOT_INITIALIZED"
    assert lib.getErrorString(0) == "CUDNN_STATUS_SUCCESS"
    assert lib.getErrorString(3000) == "CUDNN_STATUS_NOT_SUPPORTED"
    assert isinstance(lib.getErrorString(123456), str)  # unknown codes must not crash


def test_constants_equal_header_values():
    header = _header_enums()
    names = DESIGN_CONSTANTS + [n for n in dir(lib) if n.startswith(ALGO_PREFIXES)]
    for name in names:
        assert getattr(lib, name) == header[name], name
    # every algorithm the header declares is exported
    for name in header:
        if name.startswith(ALGO_PREFIXES[:3]):
            assert hasattr(lib, name), name
    assert lib.CUDNN_DIM_MAX == 8


def _binding_params(obj) -> list[str]:
    """Parameter names of a pybind11 callable, from its signature line (self dropped)."""
    first = obj.__doc__.splitlines()[0]
    names = re.findall(r"(?:\(|, )(\w+): ", first[: first.rindex(")")])
    return [n for n in names if n != "self"]


def _design_calls():
    """(class or None, name, argument names) for each call DESIGN.md's Binding section shows."""
    text = (Path(__file__).parents[1] / "docs" / "DESIGN.md").read_text()
    section = text[text.index("## Binding"): text.index("## Geometry")]
    items = re.split(r"\n(?=- |\S)", section)
    for item in items:
        owner = re.match(r"- `(\w+)\(\)`", item)
        for dot, name, args in re.findall(r"`(\.?)(\w+)\(([^)]*)\)", item):
            if dot or not isinstance(getattr(lib, name, None), type):
                names = [a.split(":")[0].strip() for a in args.split(",") if a.strip()]
                yield (owner.group(1) if dot else None), name, names


def test_signatures_follow_design_doc():
    seen = 0
    for owner, name, design in _design_calls():
        target = getattr(getattr(lib, owner), name) if owner else getattr(lib, name)
        bound = _binding_params(target)
        assert len(bound) == len(design), (owner, name, bound, design)
        for b, d in zip(bound, design):
            # DESIGN abbreviates a few names to one letter (n, m): only the position counts.
            assert b == d or (len(d) == 1 and d in "nm"), (owner, name, bound, design)
        seen += 1
    assert seen >= 35


# --- descriptor round trips ------------------------------------------------------------

GEOMETRIES = {  # logical N, C, *spatial
    "1d": [2, 3, 10],
    "1d-as-2d": [2, 3, 1, 10],
    "2d": [2, 3, 7, 5],
    "3d": [1, 4, 3, 5, 6],
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "NHWC"])
def test_tensor_descriptor_round_trip(dtype, geometry, channels_last):
    dims = GEOMETRIES[geometry]
    strides = packed_strides(dims, channels_last, np.dtype(DTYPES[dtype]).itemsize)
    d = lib.TensorDescriptor()
    dims_in, strides_in = list(dims), list(strides)
    d.setNd(getattr(lib, dtype), dims_in, strides_in)
    assert d.getNd() == (getattr(lib, dtype), dims, strides)
    assert (dims_in, strides_in) == (dims, strides)  # inputs untouched
    assert d.ptr != 0


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("fmt", ["CUDNN_TENSOR_NCHW", "CUDNN_TENSOR_NHWC"])
@pytest.mark.parametrize("dims", [[4, 3, 5], [4, 3, 1, 5], [8, 3, 3, 2], [6, 2, 3, 1, 2]])
def test_filter_descriptor_round_trip(dtype, fmt, dims):
    d = filt(dims, dtype, fmt)
    assert d.getNd() == (getattr(lib, dtype), getattr(lib, fmt), dims)


@pytest.mark.parametrize("compute", ["CUDNN_DATA_FLOAT", "CUDNN_DATA_DOUBLE", "CUDNN_DATA_HALF"])
@pytest.mark.parametrize("mode", ["CUDNN_CROSS_CORRELATION", "CUDNN_CONVOLUTION"])
@pytest.mark.parametrize(
    "pads,strides,dilations",
    [([1], [2], [3]), ([0, 2], [1, 3], [2, 1]), ([1, 0, 2], [2, 2, 1], [1, 3, 1])],
)
def test_convolution_descriptor_round_trip(compute, mode, pads, strides, dilations):
    d = lib.ConvolutionDescriptor()
    assert d.getGroupCount() == 1 and d.getMathType() == lib.CUDNN_DEFAULT_MATH  # defaults
    d.setNd(pads, strides, dilations, getattr(lib, mode), getattr(lib, compute))
    assert d.getNd() == (pads, strides, dilations, getattr(lib, mode), getattr(lib, compute))


def test_convolution_descriptor_rejects_bfloat16_compute():
    # A cuDNN fact worth knowing upstream: bfloat16 data computes in float.
    d = lib.ConvolutionDescriptor()
    with pytest.raises(CudnnError) as info:
        d.setNd([1, 1], [1, 1], [1, 1], lib.CUDNN_CROSS_CORRELATION, lib.CUDNN_DATA_BFLOAT16)
    assert info.value.status == lib.CUDNN_STATUS_BAD_PARAM
    assert info.value.function == "cudnnSetConvolutionNdDescriptor"


def test_convolution_group_count_and_math_type():
    d = conv([1, 1], [1, 1], [1, 1])
    for groups in (1, 2, 3, 32):
        d.setGroupCount(groups)
        assert d.getGroupCount() == groups
    for name in ("CUDNN_DEFAULT_MATH", "CUDNN_TENSOR_OP_MATH",
                 "CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION", "CUDNN_FMA_MATH"):
        d.setMathType(getattr(lib, name))
        assert d.getMathType() == getattr(lib, name)
    with pytest.raises(CudnnError) as info:
        d.setGroupCount(0)
    assert (info.value.status, info.value.function) == (2000, "cudnnSetConvolutionGroupCount")
    with pytest.raises(CudnnError) as info:
        d.setMathType(4)
    assert info.value.function == "cudnnSetConvolutionMathType"
    assert d.getMathType() == lib.CUDNN_FMA_MATH  # a failed set leaves the last good one


@pytest.mark.parametrize("mode", [n for n in DESIGN_CONSTANTS if n.startswith("CUDNN_ACTIVATION_")])
@pytest.mark.parametrize("nan", ["CUDNN_NOT_PROPAGATE_NAN", "CUDNN_PROPAGATE_NAN"])
def test_activation_descriptor_round_trip(mode, nan):
    d = lib.ActivationDescriptor()
    d.set(getattr(lib, mode), getattr(lib, nan), 6.5)
    assert d.get() == (getattr(lib, mode), getattr(lib, nan), 6.5)


def test_activation_descriptor_rejects_unknown_mode():
    d = lib.ActivationDescriptor()
    with pytest.raises(CudnnError) as info:
        d.set(7, lib.CUDNN_NOT_PROPAGATE_NAN, 0.0)
    assert (info.value.status, info.value.function) == (2000, "cudnnSetActivationDescriptor")


@pytest.mark.parametrize("mode", [n for n in DESIGN_CONSTANTS if n.startswith("CUDNN_POOLING_")])
@pytest.mark.parametrize(
    "window,pads,strides",
    [([3], [1], [2]), ([2, 3], [0, 1], [2, 1]), ([2, 3, 2], [1, 1, 0], [1, 2, 2])],
)
def test_pooling_descriptor_round_trip(mode, window, pads, strides):
    d = lib.PoolingDescriptor()
    d.setNd(getattr(lib, mode), lib.CUDNN_PROPAGATE_NAN, window, pads, strides)
    assert d.getNd() == (getattr(lib, mode), lib.CUDNN_PROPAGATE_NAN, window, pads, strides)


# --- output shapes ---------------------------------------------------------------------


def test_forward_output_dim_facts_example():
    x, w = tensor([2, 3, 32, 32]), filt([8, 3, 3, 3])
    c = conv([1, 1], [2, 2], [1, 1])
    assert lib.getConvolutionNdForwardOutputDim(c, x, w) == [2, 8, 16, 16]


def _conv_cases():
    """(x dims, w dims, pads, strides, dilations, groups) over ranks 1-3, kept valid."""
    cases = []
    sizes = {1: [9], 2: [7, 6], 3: [5, 4, 6]}
    kernels = {1: [3], 2: [3, 2], 3: [2, 3, 1]}
    for rank, pad, stride, dil, groups in itertools.product((1, 2, 3), (0, 1, 2), (1, 2, 3),
                                                            (1, 2), (1, 2)):
        n, k = sizes[rank], kernels[rank]
        if any(d * (kk - 1) + 1 > nn + 2 * pad for nn, kk, d in zip(n, k, [dil] * rank)):
            continue
        cases.append(([2, 4, *n], [6, 4 // groups, *k], [pad] * rank, [stride] * rank,
                      [dil] * rank, groups))
    return cases


@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "NHWC"])
def test_forward_output_dim_matches_geometry(channels_last):
    fmt = "CUDNN_TENSOR_NHWC" if channels_last else "CUDNN_TENSOR_NCHW"
    cases = _conv_cases()
    assert len(cases) > 80
    for xd, wd, pads, strides, dils, groups in cases:
        spatial = zip(xd[2:], wd[2:], strides, pads, dils)
        expect = [xd[0], wd[0]] + [conv_output_size(n, k, s, p, d) for n, k, s, p, d in spatial]
        x = tensor(xd, channels_last=channels_last)
        got = lib.getConvolutionNdForwardOutputDim(conv(pads, strides, dils, groups), x,
                                                   filt(wd, fmt=fmt))
        assert got == expect, (xd, wd, pads, strides, dils, groups)


def test_one_d_as_three_d_or_unit_height_agree():
    x3, w3 = tensor([2, 3, 11]), filt([5, 3, 3])
    x4, w4 = tensor([2, 3, 1, 11]), filt([5, 3, 1, 3])
    got3 = lib.getConvolutionNdForwardOutputDim(conv([2], [3], [2]), x3, w3)
    got4 = lib.getConvolutionNdForwardOutputDim(conv([0, 2], [1, 3], [1, 2]), x4, w4)
    assert got3 == [2, 5, conv_output_size(11, 3, 3, 2, 2)]
    assert got4 == [2, 5, 1, got3[2]]


@pytest.mark.parametrize(
    "xd,wd,pads",
    [
        ([2, 3, 2, 2], [8, 3, 3, 3], [0, 0]),  # kernel larger than the input
        ([2, 5, 32, 32], [8, 3, 3, 3], [1, 1]),  # channel mismatch
        ([2, 3, 8, 8, 8], [8, 3, 3, 3, 3], [1, 1]),  # conv rank 2, tensors rank 3
    ],
)
def test_forward_output_dim_bad_shape_raises_cudnn_error(xd, wd, pads):
    with pytest.raises(CudnnError, match="cudnnGetConvolutionNdForwardOutputDim") as info:
        lib.getConvolutionNdForwardOutputDim(conv(pads, [1, 1], [1, 1]), tensor(xd), filt(wd))
    err = info.value
    assert err.status == lib.CUDNN_STATUS_BAD_PARAM
    assert err.function == "cudnnGetConvolutionNdForwardOutputDim"
    assert err.status_name == "CUDNN_STATUS_BAD_PARAM" and "BAD_PARAM" in str(err)


def test_forward_output_dim_with_unset_descriptors_raises():
    x, w, c = tensor([2, 3, 8, 8]), filt([4, 3, 3, 3]), conv([1, 1], [1, 1], [1, 1])
    for args in ((lib.ConvolutionDescriptor(), x, w), (c, lib.TensorDescriptor(), w),
                 (c, x, lib.FilterDescriptor())):
        with pytest.raises(CudnnError) as info:
            lib.getConvolutionNdForwardOutputDim(*args)
        assert info.value.status == lib.CUDNN_STATUS_BAD_PARAM


def pool_output_size(size: int, window: int, pad: int, stride: int) -> int:
    return (size + 2 * pad - window) // stride + 1


def test_pooling_output_dim_matches_formula():
    checked = 0
    sizes = {1: [9], 2: [7, 8], 3: [5, 6, 7]}
    for rank, window, pad, stride in itertools.product((1, 2, 3), (1, 2, 3), (0, 1), (1, 2, 3)):
        if pad >= window:
            continue
        p = lib.PoolingDescriptor()
        p.setNd(lib.CUDNN_POOLING_MAX, lib.CUDNN_NOT_PROPAGATE_NAN, [window] * rank, [pad] * rank,
                [stride] * rank)
        xd = [2, 3, *sizes[rank]]
        expect = xd[:2] + [pool_output_size(n, window, pad, stride) for n in xd[2:]]
        assert lib.getPoolingNdForwardOutputDim(p, tensor(xd)) == expect
        checked += 1
    assert checked > 40


def test_pooling_output_dim_window_too_large_raises():
    p = lib.PoolingDescriptor()
    p.setNd(lib.CUDNN_POOLING_MAX, lib.CUDNN_NOT_PROPAGATE_NAN, [9, 9], [0, 0], [1, 1])
    with pytest.raises(CudnnError, match="cudnnGetPoolingNdForwardOutputDim"):
        lib.getPoolingNdForwardOutputDim(p, tensor([2, 3, 7, 8]))


# --- handle, lifetime, validation --------------------------------------------------------


def test_handle_without_gpu_raises_not_initialized():
    if gpu_available():
        pytest.skip("a GPU is present: cudnnCreate succeeds")
    with pytest.raises(CudnnError, match="cudnnCreate") as info:
        lib.Handle()
    assert info.value.status == lib.CUDNN_STATUS_NOT_INITIALIZED == 1001
    assert info.value.status_name == "CUDNN_STATUS_NOT_INITIALIZED"


def test_live_descriptor_count_tracks_lifetimes():
    gc.collect()
    base = lib.liveDescriptorCount()
    kinds = (lib.TensorDescriptor, lib.FilterDescriptor, lib.ConvolutionDescriptor,
             lib.ActivationDescriptor, lib.PoolingDescriptor)
    made = [k() for k in kinds for _ in range(3)]
    assert lib.liveDescriptorCount() == base + 15
    with pytest.raises(ValueError):
        made[0].setNd(lib.CUDNN_DATA_FLOAT, [1, 2, 3], [1])  # a failed set leaks nothing
    del made
    gc.collect()
    assert lib.liveDescriptorCount() == base
    lib.getConvolutionNdForwardOutputDim(conv([0], [1], [1]), tensor([1, 2, 5]), filt([3, 2, 2]))
    gc.collect()
    assert lib.liveDescriptorCount() == base  # temporaries freed


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: lib.TensorDescriptor().setNd(0, [2, 3, 4, 5], [60, 20, 5]), "dims and strides"),
        (lambda: lib.TensorDescriptor().setNd(0, [2, 3], [3, 1]), "3 to 8 entries, got 2"),
        (lambda: lib.TensorDescriptor().setNd(0, [1] * 9, [1] * 9), "3 to 8 entries, got 9"),
        (lambda: lib.TensorDescriptor().setNd(0, [], []), "got 0"),
        (lambda: lib.FilterDescriptor().setNd(0, 0, [4, 3]), "dims must have 3 to 8"),
        (lambda: lib.FilterDescriptor().setNd(0, 0, [1] * 9), "got 9"),
        (lambda: conv([1, 1], [1], [1, 1]), "pads and strides"),
        (lambda: conv([1, 1], [1, 1], [1]), "pads and dilations"),
        (lambda: conv([], [], []), "1 to 6 entries, got 0"),
        (lambda: conv([0] * 7, [1] * 7, [1] * 7), "1 to 6 entries, got 7"),
        (lambda: lib.PoolingDescriptor().setNd(0, 0, [2, 2], [0], [2, 2]), "windowDims and pads"),
        (lambda: lib.PoolingDescriptor().setNd(0, 0, [2], [0], [2, 2]), "windowDims and strides"),
        (lambda: lib.PoolingDescriptor().setNd(0, 0, [], [], []), "got 0"),
        (lambda: lib.PoolingDescriptor().setNd(0, 0, [2] * 7, [0] * 7, [1] * 7), "got 7"),
    ],
)
def test_wrong_list_lengths_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_wrong_argument_types_raise_type_error():
    with pytest.raises(TypeError):
        lib.TensorDescriptor().setNd(0, [2, "3", 4], [12, 4, 1])
    with pytest.raises(TypeError):
        lib.getConvolutionNdForwardOutputDim(None, tensor([1, 2, 3]), filt([1, 2, 3]))
    with pytest.raises(TypeError):
        lib.getPoolingNdForwardOutputDim(lib.PoolingDescriptor(), filt([1, 2, 3]))


def test_cudnn_error_on_bad_values_names_the_function():
    with pytest.raises(CudnnError) as info:
        lib.TensorDescriptor().setNd(lib.CUDNN_DATA_FLOAT, [2, 0, 4, 4], [0, 16, 4, 1])
    assert info.value.function == "cudnnSetTensorNdDescriptor"
    assert info.value.status == lib.CUDNN_STATUS_BAD_PARAM
    assert lib.getErrorString(info.value.status) == info.value.status_name


def test_algo_perf_fields_are_read_only():
    p = lib.AlgoPerf(algo=1, status=0, time=0.25, memory=1 << 33, determinism=1, mathType=3)
    fields = (p.algo, p.status, p.time, p.memory, p.determinism, p.mathType)
    assert fields == (1, 0, 0.25, 1 << 33, 1, 3)
    with pytest.raises(AttributeError):
        p.algo = 2
    assert "memory=8589934592" in repr(p)
