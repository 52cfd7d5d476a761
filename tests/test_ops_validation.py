"""Every op rejects bad input with a typed error naming what is wrong, before any engine
runs, and leaves its inputs untouched.

CuPy arrays here are real `cupy.ndarray` objects over an address nobody dereferences
(CuPy builds arrays over unowned memory without a device): validation reads only their
metadata, and every test below fails validation, or stubs the engine, before the memory
could be touched.
"""

from __future__ import annotations

import numpy as np
import pytest

import convfuse.ops as ops
from convfuse import backend
from convfuse.dtypes import bfloat16
from convfuse.errors import DeviceMismatchError, DeviceUnavailableError
from convfuse.geometry import ConvGeometry
from convfuse.ops import _checks
from convfuse.pool_geometry import PoolGeometry

cp = pytest.importorskip("cupy")

GEOM = ConvGeometry.create((2, 4, 6, 6), (6, 2, 3, 3), stride=1, padding=1, groups=2)
GEOM_NHWC = ConvGeometry.create((2, 6, 6, 4), (6, 3, 3, 2), padding=1, groups=2, layout="NHWC")
PGEOM = PoolGeometry.create((2, 3, 6, 6), 2)
FAKE_BASE = 1 << 40  # never dereferenced


def fake_cupy(shape, dtype=np.float32, offset=0, device_id=0):
    """A cupy.ndarray over unowned (fake) device memory."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dt.itemsize + offset
    mem = cp.cuda.memory.UnownedMemory(FAKE_BASE, nbytes, None, device_id=device_id)
    return cp.ndarray(shape, dt, memptr=cp.cuda.memory.MemoryPointer(mem, offset))


@pytest.fixture(autouse=True)
def no_engine(monkeypatch):
    """Any engine use is a test failure: validation must raise first."""
    def forbidden(xp, kind):
        raise AssertionError(f"engine {kind} reached for {xp.__name__} arrays")

    monkeypatch.setattr(_checks, "engine", forbidden)


def arrays(rng, geom=GEOM, dtype=np.float32):
    x = rng.standard_normal(geom.input_shape).astype(dtype)
    w = rng.standard_normal(geom.weight_shape).astype(dtype)
    b = rng.standard_normal(geom.bias_shape).astype(dtype)
    dz = rng.standard_normal(geom.output_shape).astype(dtype)
    return x, w, b, dz


def raises_unchanged(inputs, exc, match, call):
    """`call()` raises `exc` matching `match`, and no array in `inputs` changed."""
    before = [a.copy() for a in inputs]
    with pytest.raises(exc, match=match):
        call()
    for a, b in zip(inputs, before, strict=True):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- types and None

def test_non_array_is_a_type_error_naming_the_argument(rng):
    x, w, b, dz = arrays(rng)
    raises_unchanged([w], TypeError, r"conv_forward: x must be a NumPy or CuPy array, got list",
                     lambda: ops.conv_forward(x.tolist(), w, GEOM))
    raises_unchanged([x], TypeError, r"conv_bias_act: w must be .* got None",
                     lambda: ops.conv_bias_act(x, None, b, GEOM))
    raises_unchanged([x, w], TypeError, r"b must be a NumPy or CuPy array, got float",
                     lambda: ops.conv_bias_act(x, w, 1.0, GEOM))
    raises_unchanged([dz], TypeError, r"saved must be .* got tuple",
                     lambda: ops.activation_backward(dz, (1,), "relu"))


def test_geometry_of_the_wrong_type(rng):
    x, w, _b, dz = arrays(rng)
    with pytest.raises(TypeError, match=r"conv_forward: geom must be a ConvGeometry.*got dict"):
        ops.conv_forward(x, w, {"stride": 1})
    with pytest.raises(TypeError,
                       match=r"pool_forward: pgeom must be a PoolGeometry.*ConvGeometry"):
        ops.pool_forward(x, GEOM)
    with pytest.raises(TypeError, match=r"activation_backward_bias: geom must be a ConvGeometry"):
        ops.activation_backward_bias(dz, dz, "relu", PGEOM)


# ---------------------------------------------------------------- dtypes

@pytest.mark.parametrize("bad", [np.int32, np.float128 if hasattr(np, "float128") else np.int8,
                                 np.complex64, np.bool_])
def test_unsupported_dtype(rng, bad):
    x, w, _b, _dz = arrays(rng)
    xb = x.astype(bad)
    raises_unchanged([xb, w], ValueError,
                     rf"conv_forward: x has unsupported dtype {np.dtype(bad)}; convfuse supports "
                     r"float32, float16, bfloat16, float64",
                     lambda: ops.conv_forward(xb, w, GEOM))


def test_mismatched_dtypes_name_both(rng):
    x, w, b, dz = arrays(rng)
    w64 = w.astype(np.float64)
    raises_unchanged([x, w64], ValueError,
                     r"conv_forward: w has dtype float64 but x has dtype float32",
                     lambda: ops.conv_forward(x, w64, GEOM))
    b16 = b.astype(bfloat16)
    raises_unchanged([x, w, b16], ValueError, r"b has dtype bfloat16 but x has dtype float32",
                     lambda: ops.conv_bias_act(x, w, b16, GEOM))
    out16 = np.zeros(GEOM.input_shape, np.float16)
    raises_unchanged([dz, w, out16], ValueError, r"out has dtype float16 but dz has dtype float32",
                     lambda: ops.conv_backward_data(dz, w, GEOM, out=out16))
    saved = dz.astype(np.float64)
    raises_unchanged([dz, saved], ValueError, r"saved has dtype float64 but dy has dtype float32",
                     lambda: ops.activation_backward(dz, saved, "tanh"))


# ---------------------------------------------------------------- shapes

def test_wrong_shapes_name_argument_expected_actual_and_layout(rng):
    x, w, b, _dz = arrays(rng)
    wt = np.ascontiguousarray(w[:, :, :2])
    raises_unchanged([x, wt], ValueError,
                     r"conv_forward: w has shape \(6, 2, 2, 3\) but \(6, 2, 3, 3\) is expected "
                     r"\(layout NCHW\)",
                     lambda: ops.conv_forward(x, wt, GEOM))
    raises_unchanged([x, w], ValueError,
                     r"b has shape \(5,\) but \(6,\) is expected",
                     lambda: ops.conv_bias_act(x, w, b[:5].copy(), GEOM))
    res = np.zeros((2, 6, 5, 6), np.float32)
    raises_unchanged([x, w, b, res], ValueError,
                     r"residual has shape \(2, 6, 5, 6\) but \(2, 6, 6, 6\) is expected",
                     lambda: ops.conv_bias_act(x, w, b, GEOM, residual=res))
    # The same arrays in the other layout: the message names it.
    raises_unchanged([x, w], ValueError,
                     r"x has shape \(2, 4, 6, 6\) but \(2, 6, 6, 4\) is expected \(layout NHWC\)",
                     lambda: ops.conv_forward(x, w, GEOM_NHWC))


def test_wrong_shapes_of_gradients_and_outputs(rng):
    x, w, _b, dz = arrays(rng)
    raises_unchanged([x, w], ValueError, r"conv_backward_data: dz has shape \(2, 4, 6, 6\)",
                     lambda: ops.conv_backward_data(x, w, GEOM))
    raises_unchanged([x, dz], ValueError,
                     r"conv_backward_filter: out has shape \(6, 2, 3\) but \(6, 2, 3, 3\)",
                     lambda: ops.conv_backward_filter(x, dz, GEOM,
                                                      out=np.zeros((6, 2, 3), np.float32)))
    raises_unchanged([dz], ValueError, r"conv_backward_bias: out has shape \(6, 1\)",
                     lambda: ops.conv_backward_bias(dz, GEOM, out=np.zeros((6, 1), np.float32)))
    raises_unchanged([dz], ValueError, r"activation_forward: out has shape \(3,\)",
                     lambda: ops.activation_forward(dz, "relu", out=np.zeros(3, np.float32)))
    raises_unchanged([dz, x], ValueError, r"activation_backward: saved has shape \(2, 4, 6, 6\)",
                     lambda: ops.activation_backward(dz, x, "sigmoid"))
    raises_unchanged([dz], ValueError, r"activation_backward_bias: db_out has shape \(7,\)",
                     lambda: ops.activation_backward_bias(dz, dz, "relu", GEOM,
                                                          db_out=np.zeros(7, np.float32)))


def test_pooling_shapes(rng):
    x = rng.standard_normal(PGEOM.input_shape).astype(np.float32)
    y = rng.standard_normal(PGEOM.output_shape).astype(np.float32)
    raises_unchanged([x], ValueError, r"pool_forward: x has shape \(2, 3, 6\) but \(2, 3, 6, 6\)",
                     lambda: ops.pool_forward(np.ascontiguousarray(x[..., 0]), PGEOM))
    raises_unchanged([x, y], ValueError, r"pool_backward: dy has shape \(2, 3, 6, 6\)",
                     lambda: ops.pool_backward(x, x, y, PGEOM))
    raises_unchanged([x, y], ValueError, r"pool_backward: y has shape \(2, 3, 6, 6\)",
                     lambda: ops.pool_backward(y, x, x, PGEOM))


# ---------------------------------------------------------------- contiguity, writability

def test_non_contiguous_inputs(rng):
    x, w, _b, dz = arrays(rng)
    wide = rng.standard_normal((2, 4, 6, 12)).astype(np.float32)
    strided = wide[..., ::2]
    assert strided.shape == GEOM.input_shape
    raises_unchanged([wide, w], ValueError,
                     r"conv_forward: x is not C-contiguous; call ascontiguousarray",
                     lambda: ops.conv_forward(strided, w, GEOM))
    wf = np.asfortranarray(w)
    raises_unchanged([x, wf], ValueError, r"w is not C-contiguous; call ascontiguousarray",
                     lambda: ops.conv_backward_data(dz, wf, GEOM))
    out = np.zeros(GEOM.input_shape[::-1], np.float32).T
    raises_unchanged([dz, w], ValueError, r"out is not C-contiguous",
                     lambda: ops.conv_backward_data(dz, w, GEOM, out=out))


def test_read_only_out(rng):
    _x, _w, _b, dz = arrays(rng)
    out = np.zeros(GEOM.bias_shape, np.float32)
    out.flags.writeable = False
    raises_unchanged([dz], ValueError, r"conv_backward_bias: out is read-only",
                     lambda: ops.conv_backward_bias(dz, GEOM, out=out))


# ---------------------------------------------------------------- scalars and names

def test_scalar_arguments(rng):
    x, w, _b, dz = arrays(rng)
    raises_unchanged([dz], ValueError, r"conv_backward_bias: beta=1.0 accumulates into out, "
                     r"but out is None", lambda: ops.conv_backward_bias(dz, GEOM, beta=1.0))
    raises_unchanged([dz], ValueError, r"beta=0.5 accumulates into db_out, but db_out is None",
                     lambda: ops.activation_backward_bias(dz, dz, "relu", GEOM, beta=0.5))
    out = np.zeros(GEOM.input_shape, np.float32)
    raises_unchanged([dz, w, out], ValueError, r"beta must be finite, got nan",
                     lambda: ops.conv_backward_data(dz, w, GEOM, out=out, beta=float("nan")))
    raises_unchanged([dz, w, out], TypeError, r"beta must be a real number, got str",
                     lambda: ops.conv_backward_data(dz, w, GEOM, out=out, beta="1"))
    raises_unchanged([x, w], TypeError, r"residual_scale must be a real number, got bool",
                     lambda: ops.conv_bias_act(x, w, None, GEOM, residual_scale=True))
    raises_unchanged([x, w], ValueError, r"residual_scale must be finite, got inf",
                     lambda: ops.conv_bias_act(x, w, None, GEOM, residual_scale=float("inf")))


def test_activation_names_and_saved(rng):
    x, w, b, dz = arrays(rng)
    raises_unchanged([x, w], ValueError, r"unknown activation 'softplus'",
                     lambda: ops.conv_bias_act(x, w, b, GEOM, "softplus"))
    raises_unchanged([dz], ValueError, r"unknown activation 'mish'",
                     lambda: ops.activation_forward(dz, "mish"))
    raises_unchanged([dz], ValueError,
                     r"activation_backward: activation 'relu' needs saved \(its output y\), "
                     r"got None",
                     lambda: ops.activation_backward(dz, None, "relu"))
    raises_unchanged([dz], ValueError, r"activation 'gelu' needs saved \(the pre-activation z\)",
                     lambda: ops.activation_backward_bias(dz, None, "gelu", GEOM))


# ---------------------------------------------------------------- CuPy arrays

def test_mixing_numpy_and_cupy(rng):
    x, w, _b, dz = arrays(rng)
    wc = fake_cupy(GEOM.weight_shape)
    raises_unchanged([x], DeviceMismatchError,
                     r"conv_forward: cannot mix NumPy and CuPy arrays in one call "
                     r"\(x: NumPy, w: CuPy\)",
                     lambda: ops.conv_forward(x, wc, GEOM))
    out = fake_cupy(GEOM.input_shape)
    raises_unchanged([dz, w], DeviceMismatchError, r"dz: NumPy, w: NumPy, out: CuPy",
                     lambda: ops.conv_backward_data(dz, w, GEOM, out=out))
    # DeviceMismatchError is also a ValueError, as users may catch.
    assert issubclass(DeviceMismatchError, ValueError)


def test_cupy_dtype_shape_and_contiguity():
    x = fake_cupy(GEOM.input_shape)
    with pytest.raises(ValueError, match=r"w has dtype float16 but x has dtype float32"):
        ops.conv_forward(x, fake_cupy(GEOM.weight_shape, np.float16), GEOM)
    with pytest.raises(ValueError, match=r"w has shape \(6, 2, 3\) but \(6, 2, 3, 3\)"):
        ops.conv_forward(x, fake_cupy((6, 2, 3)), GEOM)
    wide = fake_cupy((2, 4, 6, 12))
    with pytest.raises(ValueError, match=r"x is not C-contiguous; call ascontiguousarray"):
        ops.conv_forward(wide[..., ::2], fake_cupy(GEOM.weight_shape), GEOM)
    with pytest.raises(ValueError, match=r"unsupported dtype int64"):
        ops.activation_forward(fake_cupy((3, 4), np.int64), "relu")


def test_cupy_overlap_and_missing_arrays():
    """All-CuPy calls take validate's fast lane; what it skips (a missing array) and what it
    keeps (outputs overlapping inputs) still get their errors."""
    dz, w = fake_cupy(GEOM.output_shape), fake_cupy(GEOM.weight_shape)
    out = fake_cupy(GEOM.input_shape)  # every fake_cupy starts at FAKE_BASE: they overlap
    with pytest.raises(ValueError, match=r"conv_backward_data: out overlaps input 'dz' "
                                         r"\(cuDNN cannot compute in place\)"):
        ops.conv_backward_data(dz, w, GEOM, out=out)
    with pytest.raises(TypeError, match=r"conv_forward: w must be a NumPy or CuPy array, "
                                        r"got None"):
        ops.conv_forward(fake_cupy(GEOM.input_shape), None, GEOM)


def test_cupy_alignment():
    x = fake_cupy(GEOM.input_shape, offset=4)
    assert x.data.ptr % 16 == 4
    with pytest.raises(ValueError, match=r"conv_forward: x starts at address 0x[0-9a-f]+, which is "
                                         r"not 16-byte aligned"):
        ops.conv_forward(x, fake_cupy(GEOM.weight_shape), GEOM)


def test_cupy_array_on_another_device(monkeypatch):
    monkeypatch.setattr(_checks, "current_device", lambda: 1)
    x = fake_cupy(GEOM.input_shape, device_id=1)
    w = fake_cupy(GEOM.weight_shape, device_id=0)
    with pytest.raises(DeviceMismatchError,
                       match=r"conv_forward: w lives on CUDA device 0 but the current device is 1"):
        ops.conv_forward(x, w, GEOM)


@pytest.mark.skipif(backend.gpu_available(), reason="checks the no-GPU message")
def test_cupy_arrays_without_a_gpu():
    x, w = fake_cupy(GEOM.input_shape), fake_cupy(GEOM.weight_shape)
    with pytest.raises(DeviceUnavailableError, match=r"no usable CUDA device or driver"):
        ops.conv_forward(x, w, GEOM)


def test_validate_returns_the_array_module(monkeypatch):
    x = np.zeros((2, 3), np.float32)
    assert _checks.validate("op", [_checks.Arg("x", x, (2, 3))]) is np
    monkeypatch.setattr(_checks, "current_device", lambda: 0)
    xc = fake_cupy((2, 3))
    assert _checks.validate("op", [_checks.Arg("x", xc, (2, 3))]) is cp


def test_layers_hand_the_ops_aligned_copies_of_unaligned_device_slices():
    """_checks.engine_ready, the layers' and functional API's `contiguous`: a C-contiguous
    slice of device data at an address the ops refuse (a batch cut from a dataset on the
    GPU, x[i:i + n]) is copied once; an aligned one, and any NumPy array, passes as it is;
    a non-contiguous one is made contiguous."""
    from types import SimpleNamespace

    aligned = fake_cupy(GEOM.input_shape)
    assert _checks.engine_ready(aligned) is aligned

    class Slice(SimpleNamespace):
        def copy(self):
            return "the copy"

    flags = SimpleNamespace(c_contiguous=True)
    odd = Slice(flags=flags, data=SimpleNamespace(ptr=FAKE_BASE + 40))
    assert _checks.engine_ready(odd) == "the copy"
    assert _checks.engine_ready(Slice(flags=flags, data=SimpleNamespace(ptr=FAKE_BASE + 64))) \
        .data.ptr == FAKE_BASE + 64
    host = np.arange(10.0)[1:]  # 8-byte offset: NumPy arrays go to the CPU engine as they are
    assert _checks.engine_ready(host) is host
    strided = np.arange(10.0)[::2]
    ready = _checks.engine_ready(strided)
    assert ready.flags.c_contiguous and np.array_equal(ready, strided)


@pytest.mark.parametrize("activation, exc, match", [
    ("foo", ValueError, "unknown activation 'foo'"),
    (5, TypeError, "activation must be a str or None, got int 5"),
])
def test_a_bad_activation_names_the_op(rng, activation, exc, match):
    from convfuse.transpose_geometry import ConvTransposeGeometry

    x, w, b, dz = arrays(rng)
    tgeom = ConvTransposeGeometry.create((2, 4, 3, 3), (4, 3, 3, 3))
    xt = rng.standard_normal(tgeom.input_shape).astype(np.float32)
    wt = rng.standard_normal(tgeom.weight_shape).astype(np.float32)
    rm, rv = np.zeros(4, np.float32), np.ones(4, np.float32)
    xb = rng.standard_normal((2, 4, 3, 3)).astype(np.float32)
    calls = {
        "conv_bias_act": lambda: ops.conv_bias_act(x, w, b, GEOM, activation),
        "conv_transpose_bias_act": lambda: ops.conv_transpose_bias_act(xt, wt, None, tgeom,
                                                                       activation),
        "activation_forward": lambda: ops.activation_forward(dz, activation),
        "batchnorm_forward_training": lambda: ops.batchnorm_forward_training(
            xb, rm + 1, rm, rm, rv, activation=activation),
    }
    for op, call in calls.items():
        raises_unchanged([x, w, b, dz, xt, wt, rm, rv, xb], exc, rf"^{op}: {match}", call)
