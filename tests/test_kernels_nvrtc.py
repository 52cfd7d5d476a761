"""The CUDA sources compile with NVRTC for every checked architecture (no GPU needed), and
the launchers agree with them: kernel names, activation codes, block sizes, and a launch
plan that covers every element exactly once."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

from convfuse import activations, kernels, loss
from convfuse.geometry import ConvGeometry
from convfuse.kernels import KernelCompileError
from convfuse.ops import elementwise

#: Each source with the kernels its launchers call.
LAUNCHED = [("activation", elementwise.kernel_names()), ("loss", loss.kernel_names())]


@functools.cache
def cubin(name: str, arch: str) -> bytes:
    return kernels.nvrtc_compile(name, arch)


def test_sources_are_shipped():
    assert {"activation", "loss"} <= set(kernels.names())


@pytest.mark.parametrize("arch", kernels.CHECKED_ARCHS)
@pytest.mark.parametrize("name", kernels.names())
def test_source_compiles(name, arch):
    try:
        binary = cubin(name, arch)
    except KernelCompileError as exc:  # the message carries NVRTC's log
        pytest.fail(str(exc), pytrace=False)
    assert binary[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", kernels.CHECKED_ARCHS)
@pytest.mark.parametrize(("module", "names"), LAUNCHED)
def test_every_launched_kernel_is_in_the_cubin(module, names, arch):
    binary = cubin(module, arch)
    # extern "C" names sit unmangled, NUL-delimited, in the ELF string table.
    missing = [n for n in names if b"\0" + n.encode() + b"\0" not in binary]
    assert not missing, f"{module}.cu lacks kernels the launchers call: {missing}"


def test_broken_source_raises_with_the_log(monkeypatch):
    broken = 'extern "C" __global__ void k(float* a) { a[0] = undeclared_thing_xyz; }\n'
    monkeypatch.setattr(kernels, "source", lambda name: broken)
    with pytest.raises(KernelCompileError) as info:
        kernels.nvrtc_compile("tmp_broken", "sm_90")
    msg = str(info.value)
    assert "tmp_broken.cu failed to compile for sm_90" in msg
    assert "undeclared_thing_xyz" in msg and "error" in msg


def _defines(name: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"#define (\w+) (\d+)\b", kernels.source(name))}


def test_activation_codes_match_the_source():
    defines = _defines("activation")
    in_source = {k[4:].lower(): v for k, v in defines.items() if k.startswith("ACT_")}
    assert in_source == elementwise.ACTIVATION_CODES
    assert set(in_source) == set(activations.ACTIVATIONS)
    assert defines["BIAS_BLOCK"] == elementwise.BIAS_BLOCK
    assert _defines("loss")["XENT_BLOCK"] == loss.XENT_BLOCK


@pytest.mark.parametrize("name", ["activation", "loss"])
def test_reductions_use_no_atomics(name):
    # Determinism rests on fixed-order sums; an atomic would break reproducibility.
    assert not re.search(r"\batomic\w*\s*\(", kernels.source(name))


_F64_MATH = re.compile(
    r"^\s*(?:@!?%p\d+\s+)?(?:add|sub|mul|fma|div|rcp|sqrt|ex2|lg2|neg|abs|min|max)(?:\.\w+)*\.f64\b",
    re.M,
)


@pytest.mark.parametrize(("name", "launched"), LAUNCHED)
def test_narrow_dtypes_compute_in_float_not_double(name, launched):
    # An accidental promotion (say fabs(float) resolving to the double overload) would
    # silently run float kernels at double rate, 1/64 of float on consumer GPUs.
    lib = kernels.nvrtc()
    prog = lib.createProgram(kernels.source(name), f"{name}.cu", [], [])
    try:
        lib.compileProgram(prog, kernels.nvrtc_options("compute_80"))  # PTX only
        ptx = lib.getPTX(prog)
    finally:
        lib.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    entries = {e.split("(")[0]: e for e in ptx.split(".entry ")[1:]}
    narrow = [k for k in entries if not k.endswith("_f64") and "_f64_" not in k]
    assert set(narrow) == {k for k in launched if "_f64" not in k}
    promoted = {k: len(_F64_MATH.findall(entries[k])) for k in narrow}
    assert not any(promoted.values()), promoted
    # ...while the pattern does find the double kernels' arithmetic
    double_kernel = {"activation": "act_forward_f64", "loss": "xent_rows_f64_i64"}[name]
    assert _F64_MATH.search(entries[double_kernel])


def test_activation_code_and_suffix():
    assert elementwise.activation_code("swish") == elementwise.ACTIVATION_CODES["silu"]
    assert elementwise.activation_code(None) == 0
    with pytest.raises(ValueError, match="unknown activation 'mish'"):
        elementwise.activation_code("mish")
    assert [elementwise.kernel_suffix(d) for d in ("float32", "float64", "float16", "bfloat16")] \
        == ["f32", "f64", "f16", "bf16"]


# ---- launch plan of the fused activation-backward + bias kernels ----

def _visit_channel(plan, shape):
    """Transliterates bias_channel's index walk: visits[i] counts how often i is read."""
    n, k, s = plan.int_args[:3]
    parts = plan.parts
    visits = np.zeros(int(np.prod(shape)), dtype=np.int64)
    channel_of = np.broadcast_to(np.arange(k)[None, :, None], (n, k, s)).ravel()
    length, step = n * s, plan.block
    chunk = -(-length // parts)
    dn, ds = divmod(step, s)
    for b in range(plan.grid[0]):
        kk, p = divmod(b, parts)
        begin, end = p * chunk, min(length, p * chunk + chunk)
        for t in range(step):
            j = begin + t
            nn, ss = divmod(j, s)
            while j < end:
                i = (nn * k + kk) * s + ss
                assert channel_of[i] == kk
                visits[i] += 1
                j += step
                ss += ds
                nn += dn
                if ss >= s:
                    ss -= s
                    nn += 1
    return visits


def _visit_rows(plan, channel_of):
    """Transliterates bias_rows' walk; also checks each (part, column) partial is written."""
    rows, cols, tile = plan.int_args
    groups = plan.block // tile
    tiles, parts = plan.grid
    visits = np.zeros(rows * cols, dtype=np.int64)
    written = np.zeros((parts, cols), dtype=np.int64)
    chunk = -(-rows // parts)
    for bx in range(tiles):
        for p in range(parts):
            begin, end = p * chunk, min(rows, p * chunk + chunk)
            for t in range(plan.block):
                rg, c = t // tile, bx * tile + t % tile
                if c >= cols:
                    continue
                for r in range(begin + rg, end, groups):
                    i = r * cols + c
                    assert channel_of[i] == c // plan.group
                    visits[i] += 1
                if rg == 0:
                    written[p, c] += 1
    assert (written == 1).all()
    return visits


@pytest.mark.parametrize(
    ("shape", "layout", "sm_count"),
    [
        ((2, 3, 7, 9), "NCHW", 4),       # channel kernel, several parts per channel
        ((1, 1, 64, 80), "NCHW", 2),     # K=1: parts spread one channel over blocks
        ((3, 5, 2, 2), "NCHW", 4),       # 4 spatial elements: rows kernel with groups
        ((4, 70, 1, 1), "NCHW", 1),      # 1x1 spatial: (N, K) rows, tile < K
        ((2, 5, 6, 3), "NHWC", 4),       # K=3 channels-last
        ((1, 9, 11, 130), "NHWC", 8),    # K=130: two tiles of 65 columns
        ((3, 17, 1), "NWC", 2),          # 1-D conv output, K=1
    ],
)
def test_bias_plan_visits_every_element_once(shape, layout, sm_count):
    channels_last = layout.endswith("C")
    plan = elementwise.plan_bias_grad(shape, channels_last, sm_count)
    k = shape[-1] if channels_last else shape[1]
    assert plan.channels == k
    assert 1 <= plan.parts <= elementwise.MAX_PARTS and plan.block <= elementwise.BIAS_BLOCK
    cf_axis = len(shape) - 1 if channels_last else 1
    channel_of = np.indices(shape)[cf_axis].ravel()
    if plan.kernel == "channel":
        assert not channels_last and plan.block % 32 == 0
        visits = _visit_channel(plan, shape)
    else:
        tile = plan.int_args[2]
        assert plan.block % tile == 0 and plan.grid[0] * tile >= plan.cols
        visits = _visit_rows(plan, channel_of)
    assert (visits == 1).all()
    assert plan.partial_size == (plan.parts * plan.cols if plan.needs_finish else 0)


def test_bias_plan_parts_follow_the_device_and_size():
    small = elementwise.plan_bias_grad((1, 4, 8, 8), False, 132)
    assert small.kernel == "channel" and small.parts == 1 and not small.needs_finish
    big = elementwise.plan_bias_grad((128, 4, 74, 74), False, 132)
    assert big.parts > 1 and big.grid == (4 * big.parts,)
    assert big.parts == elementwise.plan_bias_grad((128, 4, 74, 74), False, 132).parts
    nhwc = elementwise.plan_bias_grad((128, 74, 74, 64), True, 132)
    assert nhwc.kernel == "rows" and nhwc.grid[0] == 1 and nhwc.parts > 1
    assert elementwise.plan_bias_grad((2, 3, 4, 4), False, 1).group == 16
    # bias_finish runs one warp per channel, 8 warps per block
    assert elementwise.plan_bias_grad((64, 70, 1, 1), False, 1).finish_grid == (9,)
    assert elementwise.plan_bias_grad((2, 3, 4, 4), False, 1).finish_grid == (1,)


# ---- launcher validation (runs before any launch, so NumPy arrays exercise it) ----

def _geom(layout="NCHW"):
    if layout == "NCHW":
        return ConvGeometry.create((2, 3, 6, 6), (4, 3, 3, 3), padding=1)
    return ConvGeometry.create((2, 6, 6, 3), (4, 3, 3, 3), padding=1, layout="NHWC")


def test_launchers_validate_before_launching():
    z = np.zeros((2, 4, 6, 6), np.float32)
    with pytest.raises(TypeError, match="out must be a CuPy array, got list"):
        elementwise.activation_forward(z, "relu", [0.0])
    with pytest.raises(ValueError, match="unknown activation"):
        elementwise.activation_forward(z, "mish", z)
    with pytest.raises(ValueError, match=r"out has shape \(3,\), but z has shape"):
        elementwise.activation_forward(z, "relu", np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="out has dtype float64"):
        elementwise.activation_forward(z, "relu", z.astype(np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        elementwise.activation_forward(z, "relu", np.zeros((6, 6, 4, 2), np.float32).T)
    with pytest.raises(TypeError, match="z: unsupported dtype int32"):
        elementwise.activation_forward(z.astype(np.int32), "relu", z)
    with pytest.raises(TypeError, match="takes CuPy arrays"):
        elementwise.activation_forward(z, "relu", z)
    with pytest.raises(ValueError, match="'gelu' needs the saved tensor"):
        elementwise.activation_backward(z, None, "gelu", z)
    with pytest.raises(TypeError, match="takes CuPy arrays"):
        elementwise.activation_backward(z, None, "identity", z)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_bias_launcher_validates_before_launching(layout):
    geom = _geom(layout)
    dy = np.zeros(geom.output_shape, np.float32)
    db = np.zeros(4, np.float32)
    before = dy.copy()
    call = elementwise.activation_backward_bias
    with pytest.raises(TypeError, match="ConvGeometry"):
        call(dy, dy, "relu", "geom", dy, db)
    with pytest.raises(ValueError, match="convolution's output has shape"):
        call(dy[:1], dy[:1], "relu", geom, dy[:1], db)
    with pytest.raises(ValueError, match=r"db_out has shape \(3,\), expected \(4,\)"):
        call(dy, dy, "relu", geom, dy, db[:3])
    with pytest.raises(TypeError, match="db_out has dtype float64"):
        call(dy, dy, "relu", geom, dy, db.astype(np.float64))
    with pytest.raises(TypeError, match="beta must be a real number"):
        call(dy, dy, "relu", geom, dy, db, beta="1")
    with pytest.raises(ValueError, match="beta must be finite"):
        call(dy, dy, "relu", geom, dy, db, beta=float("nan"))
    with pytest.raises(ValueError, match="'silu' needs the saved tensor"):
        call(dy, None, "silu", geom, dy, db)
    with pytest.raises(TypeError, match="takes CuPy arrays"):
        call(dy, dy, "relu", geom, dy, db, beta=1.0)
    np.testing.assert_array_equal(dy, before)


# ---- Note [kernels need no CUDA headers] ----

def test_sources_are_self_contained():
    """Every #include is pasted in (CuPy's cache key then covers common.cuh) and NVRTC gets
    no include folder: a user without a CUDA toolkit compiles the same source."""
    from importlib import resources

    common = (resources.files(kernels.__name__) / "common.cuh").read_text()
    for name in kernels.names():
        src = kernels.source(name)
        assert not re.search(r"^\s*#\s*include", src, re.M), name
        assert common.split("#pragma once", 1)[1] in src, name
    assert not any(opt.startswith("-I") for opt in kernels.compile_options("sm_90"))


def test_an_unshipped_include_is_refused():
    from convfuse.kernels import _inline_includes

    with pytest.raises(ValueError, match=r"includes 'nope\.cuh', which convfuse does not ship"):
        _inline_includes('#include "nope.cuh"\n', set())
    twice = _inline_includes('#include "common.cuh"\n#include "common.cuh"\n', set())
    assert twice.count("struct Io<float>") == 1 and "already included" in twice


_BF16_HOST = r"""
#include <cstring>
#define __device__
#define __forceinline__ inline
#define __align__(n) alignas(n)
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
struct __align__(2) __nv_bfloat16 { unsigned short x; };
BODY
extern "C" void to_bf16(const float* in, unsigned short* out, long n) {
    for (long i = 0; i < n; ++i) out[i] = __float2bfloat16_rn(in[i]).x;
}
extern "C" void from_bf16(const unsigned short* in, float* out, long n) {
    for (long i = 0; i < n; ++i) { __nv_bfloat16 b; b.x = in[i]; out[i] = __bfloat162float(b); }
}
"""


def test_bfloat16_conversions_round_like_cuda(tmp_path):
    """common.cuh's own bfloat16 conversions (no cuda_bf16.h), run on the host: round to
    nearest even, NaN stays NaN, exactly as ml_dtypes (and cuda_bf16.hpp) round."""
    import ctypes
    import shutil
    import subprocess
    from importlib import resources

    ml_dtypes = pytest.importorskip("ml_dtypes")
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    common = (resources.files(kernels.__name__) / "common.cuh").read_text()
    body = re.search(r"(__device__ __forceinline__ float __bfloat162float.*?)\n#endif",
                     common, re.S).group(1)
    (tmp_path / "bf16.cpp").write_text(_BF16_HOST.replace("BODY", body))
    lib_path = tmp_path / "libbf16.so"
    proc = subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-o", str(lib_path),
                           str(tmp_path / "bf16.cpp")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lib = ctypes.CDLL(str(lib_path))
    rng = np.random.default_rng(0)
    bits = np.concatenate([
        rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32),
        np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF,
                  0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00000001, 0x00008000,
                  0x7F7F8000], dtype=np.uint32)])
    x = bits.view(np.float32)
    got = np.empty(x.size, np.uint16)
    lib.to_bf16(x.ctypes.data_as(ctypes.c_void_p), got.ctypes.data_as(ctypes.c_void_p),
                ctypes.c_long(x.size))
    with np.errstate(invalid="ignore"):  # NaN inputs
        want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(got[nan].view(ml_dtypes.bfloat16).astype(np.float32)).all()
    back = np.empty(x.size, np.float32)
    lib.from_bf16(got.ctypes.data_as(ctypes.c_void_p), back.ctypes.data_as(ctypes.c_void_p),
                  ctypes.c_long(x.size))
    np.testing.assert_array_equal(back[~nan], want[~nan].view(ml_dtypes.bfloat16).astype(
        np.float32))


@functools.cache
def _module_ptx(name: str) -> str:
    """A shipped kernel module's PTX for compute_80, compiled with CuPy's options."""
    lib = kernels.nvrtc()
    prog = lib.createProgram(kernels.source(name), f"{name}.cu", [], [])
    try:
        lib.compileProgram(prog, kernels.nvrtc_options("compute_80"))
        ptx = lib.getPTX(prog)
    finally:
        lib.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def test_half_conversions_are_the_ptx_instructions():
    """__half loads and stores compile to cvt.f32.f16 and cvt.rn.f16.f32 (what
    cuda_fp16.hpp emits), found in the PTX of the float16 kernels."""
    f16 = _module_ptx("activation").split(".entry act_forward_f16")[1].split(".entry")[0]
    assert "cvt.f32.f16" in f16 and "cvt.rn.f16.f32" in f16


_ACT_HOST = r"""
#include <cmath>
#include <cstring>
#define __device__
#define __forceinline__ inline
static inline float m_exp(float x) { return std::exp(x); }
static inline double m_exp(double x) { return std::exp(x); }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline long long __double_as_longlong(double d) {
    long long u; std::memcpy(&u, &d, 8); return u;
}
using std::expm1; using std::tanh; using std::fabs; using std::erfc;
BODY
template <typename C>
static void run(int act, int backward, const C* dy, const C* s, C* out, long n) {
#define ONE(A) for (long i = 0; i < n; ++i) \
        out[i] = backward ? act_backward<A, C>(dy[i], s[i]) : act_forward<A, C>(s[i]);
    ACT_SWITCH(act, ONE)
}
extern "C" void run_f32(int act, int bwd, const float* dy, const float* s, float* o, long n) {
    run<float>(act, bwd, dy, s, o, n);
}
extern "C" void run_f64(int act, int bwd, const double* dy, const double* s, double* o,
                        long n) {
    run<double>(act, bwd, dy, s, o, n);
}
#if defined(__SSE__)
#include <xmmintrin.h>
// -ftz=true on the host: SSE's DAZ reads subnormal operands (comparisons included) as
// zero of the same sign, FTZ flushes subnormal results, as .ftz instructions do.
static const unsigned FTZ_DAZ = 0x8040u;
__attribute__((noinline)) static void run_f32_noinline(int act, int bwd, const float* dy,
                                                       const float* s, float* o, long n) {
    run<float>(act, bwd, dy, s, o, n);
}
extern "C" void run_f32_ftz(int act, int bwd, const float* dy, const float* s, float* o,
                            long n) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | FTZ_DAZ);
    run_f32_noinline(act, bwd, dy, s, o, n);
    _mm_setcsr(csr);
}
// What the kernels did before Note [branches on saved values read their bits]: a float
// comparison with zero, here under the same flush.
__attribute__((noinline)) static int float_le_zero(volatile float s) { return s <= 0.0f; }
extern "C" int float_le_zero_ftz(float s) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | FTZ_DAZ);
    const int r = float_le_zero(s);
    _mm_setcsr(csr);
    return r;
}
#endif
"""


@functools.cache
def _host_activation_lib(tmp: str):
    """activation.cu's act_forward / act_backward compiled for the host (g++), so their
    per-element rules run here exactly as written for the GPU."""
    import ctypes
    import shutil
    import subprocess
    from importlib import resources
    from pathlib import Path

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = (resources.files(kernels.__name__) / "activation.cu").read_text()
    defines = "\n".join(re.findall(r"^#define ACT_\w+ \d+$", src, re.M))
    body = re.search(r"(// Explicit overloads so float math.*?\n}\n)\n__device__ __forceinline__"
                     r" long long global_thread", src, re.S).group(1)
    path = Path(tmp)
    (path / "act.cpp").write_text(_ACT_HOST.replace("BODY", defines + "\n" + body))
    lib_path = path / "libact.so"
    # -fno-fast-math semantics (the default): NaN comparisons must stay IEEE, as on the GPU
    # -frounding-math: no float work moved across the MXCSR changes of the _ftz entries
    proc = subprocess.run([cxx, "-O1", "-std=c++17", "-frounding-math", "-shared", "-fPIC",
                           "-o", str(lib_path), str(path / "act.cpp")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return ctypes.CDLL(str(lib_path))


def _run_host(lib, act, backward, dy, s, ftz=False):
    import ctypes

    out = np.empty_like(s)
    fn = lib.run_f32 if s.dtype == np.float32 else lib.run_f64
    if ftz:
        assert s.dtype == np.float32
        fn = lib.run_f32_ftz
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    fn(ctypes.c_int(elementwise.ACTIVATION_CODES[act]), ctypes.c_int(int(backward)), ptr(dy),
       ptr(s), ptr(out), ctypes.c_long(s.size))
    return out


KERNEL_EDGE = [-np.inf, -1e30, -20.0, -1.0, -1e-30, -0.0, 0.0, 1e-30, 0.5, 3.0, 6.0,
               6.0000005, 7.0, 1e30, np.inf, np.nan]


@pytest.mark.parametrize("act", list(activations.ACTIVATIONS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernel_activation_rules_match_the_reference_on_the_host(act, dtype, tmp_path_factory):
    """The kernels' per-element forward and backward agree with the NumPy engine at NaN,
    +-inf, -0 and the kinks (0 and 6): the same NaNs, infinities and zeros, the same
    values to within the two engines' rounding (the kernels use libm's erfc/expm1/tanh)."""
    from convfuse.ops import reference as ref

    lib = _host_lib(tmp_path_factory)
    z = np.array(KERNEL_EDGE, dtype)
    y_ref = ref.activation_forward(z, act)
    y = _run_host(lib, act, False, z, z)
    saves = activations.saves(act)
    saved = z if saves == "preactivation" else y_ref
    dy = np.linspace(1.0, 2.0, z.size).astype(dtype)
    dz_ref = ref.activation_backward(dy, None if saves == "none" else saved, act)
    dz = _run_host(lib, act, True, dy, saved)
    tol = 8 * np.finfo(dtype).eps
    for got, want in ((y, y_ref), (dz, dz_ref)):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(got == 0, want == 0)
        if act in ("relu6", "elu", "identity"):  # -0.0 stays -0.0, as in torch
            np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
        np.testing.assert_allclose(got, want, rtol=tol, atol=0, equal_nan=True)
    if act in ("relu", "relu6", "elu"):  # Note [edge values]: a NaN y (elu: z) passes dy on
        assert dz[-1] == dy[-1]


@pytest.mark.parametrize("ftz", [False, True], ids=["plain", "ftz"])
def test_elu_backward_rule_is_exp_of_the_saved_z(ftz, tmp_path_factory):
    """elu's kernel rule takes the saved z and computes dy * exp(z) (Note [what backward
    saves]): relative accuracy all the way down, where y + 1 from a saved y would cancel
    (0 below z ~ -16.6 in float32). Half-precision z (float16, bfloat16 values) included;
    under -ftz=true only a result below float32's smallest normal may be lost."""
    lib = _ftz_lib(tmp_path_factory) if ftz else _host_lib(tmp_path_factory)
    z = np.concatenate([np.linspace(-87.0, -0.5, 301), np.linspace(-12.0, -0.5, 200)
                        .astype(np.float16)]).astype(np.float32)
    dy = np.linspace(0.5, 2.0, z.size).astype(np.float32)
    dz = _run_host(lib, "elu", True, dy, z, ftz=ftz).astype(np.float64)
    want = dy.astype(np.float64) * np.exp(z.astype(np.float64))
    np.testing.assert_allclose(dz, want, rtol=4 * np.finfo(np.float32).eps, atol=2 * TINY)
    assert np.all(dz[want > 2 * TINY] > 0)


# ---- Note [CuPy compiles with -ftz=true] ----

def test_cupy_appends_ftz_to_every_kernel_and_the_checks_compile_with_it():
    """The installed CuPy still appends -ftz=true in its one compile path (RawModule
    included), so the CPU-side NVRTC checks above compile exactly what the GPU runs."""
    import inspect

    from cupy.cuda import compiler

    src = inspect.getsource(compiler._compile_with_cache_cuda)
    assert "options += ('-ftz=true',)" in src
    assert kernels.CUPY_ADDED_OPTIONS == ("-ftz=true",)
    assert kernels.nvrtc_options("sm_90") == [*kernels.compile_options("sm_90"), "-ftz=true"]


_F32_ARITH = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:add|sub|mul|fma|div|rcp|sqrt|ex2|lg2|neg|abs|"
                        r"min|max|setp|tanh)(?:\.\w+)*\.f32)\b", re.M)


@pytest.mark.parametrize("name", ["activation", "loss", "optim"])
def test_float_arithmetic_flushes_subnormals_to_zero(name):
    """With CuPy's options every float32 arithmetic instruction is .ftz: a subnormal
    float32 (or bfloat16, same exponent range) operand or result is read as, or becomes,
    zero of the same sign; loads, stores and conversions are untouched, so float16 data
    (whose subnormals are normal floats) and float64 keep every value."""
    if name not in kernels.names():
        pytest.skip(f"no {name}.cu")
    lib = kernels.nvrtc()

    def ptx(options):
        prog = lib.createProgram(kernels.source(name), f"{name}.cu", [], [])
        try:
            lib.compileProgram(prog, options)
            out = lib.getPTX(prog)
        finally:
            lib.destroyProgram(prog)
        return out.decode() if isinstance(out, bytes) else out

    flushed = _F32_ARITH.findall(ptx(kernels.nvrtc_options("compute_80")))
    assert flushed and all(".ftz" in ins for ins in flushed), \
        sorted({ins for ins in flushed if ".ftz" not in ins})
    # ...and it is the option that does it: without it the same kernels keep subnormals
    plain = _F32_ARITH.findall(ptx(kernels.compile_options("compute_80")))
    assert any(".ftz" not in ins for ins in plain)


#: bfloat16's smallest positive subnormal (bits 0x0001) as the kernels load it: 9.18e-41
BF16_TINY = float(np.uint32(0x00010000).view(np.float32))
TINY = float(np.finfo(np.float32).tiny)  # 1.18e-38, float32's smallest normal
SUBNORMAL = np.array([1e-40, -1e-40, 1e-45, -3e-39, 1.1e-38, BF16_TINY], np.float32)
#: saved values at which a branch could go either way
SAVED_EDGE = np.array([1e-40, -1e-40, 1e-45, -1e-45, BF16_TINY, -BF16_TINY, 1.1e-38, 0.0, -0.0,
                       TINY, -TINY, 1.0, -1.0, 5.999, 6.0, 7.0, np.inf, -np.inf, np.nan],
                      np.float32)


def _host_lib(tmp_path_factory):
    """The host build of the activation rules, compiled once per session."""
    path = tmp_path_factory.getbasetemp() / "host_activation"
    path.mkdir(exist_ok=True)
    return _host_activation_lib(str(path))


def _ftz_lib(tmp_path_factory):
    lib = _host_lib(tmp_path_factory)
    if not hasattr(lib, "run_f32_ftz"):
        pytest.skip("no SSE on this host: -ftz=true is not emulated")
    return lib


def test_the_host_emulates_the_flushed_comparison(tmp_path_factory):
    """The emulation of -ftz=true reproduces the flaw: a float `s <= 0` holds for positive
    subnormals (float32's and bfloat16's), not for the smallest normal."""
    import ctypes

    lib = _ftz_lib(tmp_path_factory)
    lib.float_le_zero_ftz.argtypes = [ctypes.c_float]
    assert lib.float_le_zero_ftz(1e-40) == 1
    assert lib.float_le_zero_ftz(BF16_TINY) == 1
    assert lib.float_le_zero_ftz(-0.0) == 1
    assert lib.float_le_zero_ftz(TINY) == 0


_PROBE_TYPES = {"f32": "float", "f16": "__half", "bf16": "__nv_bfloat16"}
#: (direction, activation) whose branches decide on a sign. elu's forward is left out: its
#: sign test is the same integer test, but expm1f inside compares its own intermediates.
_PROBED = [("bwd", "relu"), ("bwd", "relu6"), ("bwd", "leaky_relu"), ("bwd", "elu"),
           ("fwd", "relu"), ("fwd", "relu6"), ("fwd", "leaky_relu")]
_F32_SETP = re.compile(r"setp\.\w+(?:\.ftz)?\.f32\s+%p\d+,\s*(%f\d+),\s*([^;]+);")


@functools.cache
def _probe_ptx() -> str:
    """activation.cu's rules with one kernel per (direction, activation, dtype) that runs
    only the per-element rule on a loaded value, compiled with CuPy's options (-ftz=true)."""
    probes = []
    for d, act in _PROBED:
        code = f"ACT_{act.upper()}"
        for t, T in _PROBE_TYPES.items():
            io = f"Io<{T}>"
            call = (f"act_backward<{code}, {io}::C>({io}::load(dy[0]), {io}::load(s[0]))"
                    if d == "bwd" else f"act_forward<{code}, {io}::C>({io}::load(s[0]))")
            probes.append(f'extern "C" __global__ void probe_{d}_{act}_{t}(const {T}* dy, '
                          f"const {T}* s, {T}* o) {{ o[0] = {io}::store({call}); }}")
    # only the probes are instantiated: the shipped kernels take most of a compile
    rules, shipped = re.subn(r"^CONVFUSE_ACTIVATION_KERNELS\(\w+, [\w ]+\)$", "",
                             kernels.source("activation"), flags=re.M)
    assert shipped == 4
    lib = kernels.nvrtc()
    prog = lib.createProgram(rules + "\n" + "\n".join(probes) + "\n", "probe.cu", [], [])
    try:
        lib.compileProgram(prog, kernels.nvrtc_options("compute_80"))
        ptx = lib.getPTX(prog)
    finally:
        lib.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


@pytest.mark.parametrize("dtype", list(_PROBE_TYPES))
@pytest.mark.parametrize(("direction", "act"), _PROBED)
def test_no_flushed_comparison_decides_a_sign(direction, act, dtype):
    """Note [branches on saved values read their bits], in the PTX NVRTC makes with CuPy's
    -ftz=true: the per-element rule compares no float with zero and no float with another
    (either would read a subnormal as 0); what float compares remain are with a nonzero
    constant (relu6's 6), where a flushed subnormal is on the right side anyway."""
    ptx = _probe_ptx()
    body = ptx.split(f".entry probe_{direction}_{act}_{dtype}(")[1].split(".entry")[0]
    compares = _F32_SETP.findall(body)
    zero = {"0f00000000", "0f80000000"}
    bad = [c for c in compares if c[1].strip() in zero or c[1].strip().startswith("%f")]
    assert not bad, bad
    assert all(c[1].strip() == "0f40C00000" for c in compares)  # 6.0, relu6 only
    assert bool(compares) == (act == "relu6")


@pytest.mark.parametrize("act", ["relu", "relu6", "leaky_relu", "elu", "silu"])
def test_branches_on_saved_values_follow_their_bits_under_ftz(act, tmp_path_factory):
    """Note [branches on saved values read their bits]: run flushed, as CuPy compiles
    them, the backward branches on the saved tensor as the NumPy engine (and PyTorch) does
    at every value: relu and relu6 pass dy at y = 1e-40 and at bfloat16's 9.18e-41, and
    leaky_relu passes dy there, not 0.01 dy. The forward's branches likewise (relu keeps a
    subnormal input)."""
    from convfuse.ops import reference as ref

    lib = _ftz_lib(tmp_path_factory)
    s = SAVED_EDGE
    dy = np.full_like(s, 3.0)
    saves = activations.saves(act)
    got = _run_host(lib, act, True, dy, s, ftz=True)
    with np.errstate(all="ignore"):
        want = ref.activation_backward(dy.astype(np.float64),
                                       None if saves == "none" else s.astype(np.float64), act)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, equal_nan=True)
    y = _run_host(lib, act, False, s, s, ftz=True)
    with np.errstate(all="ignore"):
        y_want = ref.activation_forward(s.astype(np.float64), act)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(y_want))
    np.testing.assert_allclose(y, y_want, rtol=1e-6, atol=TINY, equal_nan=True)
    if act == "relu":
        np.testing.assert_array_equal(y[:5], s[:5] * (s[:5] > 0))  # subnormals kept


@pytest.mark.parametrize("y0", [1e-40, BF16_TINY])
@pytest.mark.parametrize("act", ["relu", "relu6", "leaky_relu"])
def test_bias_gradient_keeps_the_subnormal_outputs_terms(act, y0, tmp_path_factory):
    """The fused bias gradient sums these dz: for dy = [1, 1] and y = [y0, 1], db = 2 (the
    flushed comparison gave 1 for relu and relu6, and 1.01 for leaky_relu)."""
    lib = _ftz_lib(tmp_path_factory)
    dz = _run_host(lib, act, True, np.ones(2, np.float32), np.array([y0, 1.0], np.float32),
                   ftz=True)
    assert dz.tolist() == [1.0, 1.0] and dz.sum() == 2.0


@pytest.mark.parametrize("act", list(activations.ACTIVATIONS))
def test_what_flush_to_zero_still_changes(act, tmp_path_factory):
    """Note [CuPy compiles with -ftz=true], emulated on the host (SSE's FTZ and DAZ). The
    forward moves by less than float32's smallest normal, 1.18e-38. The backward's flushed
    intermediates are scaled by dy (and by z in silu and gelu), so there the bound is
    about (|dy| (1 + |s|) + 1) * 1.18e-38: at z = -95 silu's sigmoid (5.5e-42) flushes and
    dy = 1e10 gives -0.0 instead of -5.19e-30."""
    from convfuse.ops import reference as ref

    lib = _ftz_lib(tmp_path_factory)
    z = np.concatenate([SUBNORMAL, -SUBNORMAL, np.float32([-95.0, -20.0, -14.0, 0.5])])
    exact = ref.activation_forward(z.astype(np.float64), act)
    y = _run_host(lib, act, False, z, z, ftz=True)
    assert np.all(np.abs(y - exact) < TINY + 1e-6 * np.abs(exact)), (z, y, exact)
    saves = activations.saves(act)
    s = z if saves == "preactivation" else exact.astype(np.float32)
    for scale in (1.0, 1e10):
        dy = np.full_like(z, scale)
        dz = _run_host(lib, act, True, dy, s, ftz=True)
        with np.errstate(all="ignore"):
            want = ref.activation_backward(dy.astype(np.float64), s.astype(np.float64), act)
        bound = (scale * (1 + np.abs(s.astype(np.float64))) + 1) * TINY + 1e-6 * np.abs(want)
        assert np.all(np.abs(dz - want) <= bound), (s, dz, want)
    if act == "silu":  # the example of the Note
        dz = _run_host(lib, act, True, np.float32([1e10]), np.float32([-95.0]), ftz=True)
        assert dz[0] == 0.0 and np.signbit(dz[0])
        want = ref.activation_backward(np.array([1e10]), np.array([-95.0]), "silu")[0]
        assert want == pytest.approx(-5.19e-30, rel=1e-2) and abs(want) > 1e8 * TINY


def test_a_kernel_is_looked_up_once_per_device(monkeypatch):
    """kernels.function: one CuPy Function per (source, kernel, device), not a new one per
    launch (the loss and the optimizers launch through it at every step)."""
    cupy = pytest.importorskip("cupy")
    looked = []

    class Module:
        def get_function(self, name):
            looked.append(name)
            return object()

    device = {"id": 0}
    monkeypatch.setattr(kernels, "_module", lambda name, device_id: Module())
    monkeypatch.setattr(cupy.cuda, "Device", lambda: type("D", (), {"id": device["id"]})())
    kernels.function_on.cache_clear()
    try:
        first = kernels.function("loss", "xent_mean_f32")
        assert kernels.function("loss", "xent_mean_f32") is first and looked == ["xent_mean_f32"]
        device["id"] = 1  # another device: its own lookup
        assert kernels.function("loss", "xent_mean_f32") is not first and len(looked) == 2
    finally:
        kernels.function_on.cache_clear()


@pytest.mark.parametrize("labels", ["i32", "i64"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_the_argmax_compares_no_two_floats_under_ftz(dtype, labels):
    """Note [argmax compares keys] in loss.cu, in the PTX NVRTC makes with CuPy's -ftz=true:
    a float comparison there would read a subnormal logit as 0, and the correct count
    would part from numpy.argmax's. What float compares of two registers remain are a
    value with itself (the NaN tests, which flushing does not change)."""
    body = _module_ptx("loss").split(f".entry xent_rows_{dtype}_{labels}(")[1].split(".entry")[0]
    pairs = [(a, b.strip()) for a, b in _F32_SETP.findall(body) if b.strip().startswith("%f")]
    assert pairs  # the NaN tests are there: the pattern reads this PTX
    assert all(a == b for a, b in pairs), [p for p in pairs if p[0] != p[1]]
