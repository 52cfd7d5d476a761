"""Regressions found by the GPU-code review of the kernels and training utilities.

- loss.cu's xent_rows took the argmax of a row ignoring NaN (and found none in an all -inf
  row), so `CrossEntropyLoss.correct` disagreed with the CPU engine's numpy.argmax there.
  With no GPU, the real kernel source runs here on the host: each CUDA thread is a
  std::thread, warp shuffles and __syncthreads are barriers (skipped without a C++ compiler).
- metrics.Mean created (and zeroed) its device buffer inside a CUDA-graph capture when its
  first add came during the capture, so every replay reset the totals; now CaptureError.
  Its buffer also came from the current allocator, a capture's private pool during
  warm-up, whose blocks CuPy 14.0 frees with the pool; now from raw cudaMalloc.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import shutil
import subprocess
from importlib import resources

import numpy as np
import pytest

from convfuse import kernels, loss
from convfuse.errors import CaptureError
from convfuse.metrics import Mean

_SHIM = r"""
#include <math.h>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>
#include <xmmintrin.h>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(x)

struct Barrier {
    std::mutex m; std::condition_variable cv; unsigned n, count = 0, gen = 0;
    explicit Barrier(unsigned n_) : n(n_) {}
    void wait() {
        std::unique_lock<std::mutex> lock(m);
        const unsigned g = gen;
        if (++count == n) { count = 0; ++gen; cv.notify_all(); }
        else cv.wait(lock, [&] { return g != gen; });
    }
};
static Barrier* g_block;
static std::vector<Barrier*> g_warps;
static unsigned char g_lanes[32][32][8];
inline void __syncthreads() { g_block->wait(); }
template <typename T> T __shfl_xor_sync(unsigned, T v, int o) {
    const unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
    std::memcpy(g_lanes[w][l], &v, sizeof(T));
    g_warps[w]->wait();
    T out;
    std::memcpy(&out, g_lanes[w][l ^ o], sizeof(T));
    g_warps[w]->wait();
    return out;
}
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline long long __double_as_longlong(double f) { long long i; std::memcpy(&i, &f, 8); return i; }
// CuPy's -ftz=true, as SSE has it: MXCSR's DAZ (subnormal operands read as zero, so a float
// compare sees 1e-40 as 0) and FTZ bits, set in every emulated thread while g_ftz is on.
static bool g_ftz = false;
inline double __longlong_as_double(long long i) { double f; std::memcpy(&f, &i, 8); return f; }
struct __half { float v; };
struct __nv_bfloat16 { float v; };
inline float __half2float(__half h) { return h.v; }
inline __half __float2half_rn(float f) { return {f}; }
inline float __bfloat162float(__nv_bfloat16 h) { return h.v; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {f}; }

template <typename K, typename... A>
void launch(unsigned grid, unsigned block, K kernel, A... args) {
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    for (unsigned b = 0; b < grid; ++b) {  // blocks in turn, so `static` acts as __shared__
        Barrier bb(block);
        g_block = &bb;
        std::vector<Barrier*> warps;
        for (unsigned w = 0; w < block / 32; ++w) warps.push_back(new Barrier(32));
        g_warps = warps;
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < block; ++t)
            ts.emplace_back([=] {
                if (g_ftz) _mm_setcsr(_mm_getcsr() | 0x8040);
                threadIdx = {t, 0, 0};
                blockIdx = {b, 0, 0};
                kernel(args...);
            });
        for (auto& th : ts) th.join();
        for (auto* w : warps) delete w;
    }
}
"""

_RUNNERS = r"""
extern "C" void run_kept(const long long* lab, long long n, long long ignore, long long* rc) {
    launch(1, XENT_BLOCK, xent_kept_i64, lab, n, ignore, rc);
}
extern "C" void run_rows(unsigned g, const float* x, const long long* lab, long long n,
                         long long c, long long ignore, float* d, float* rl, long long* rc) {
    launch(g, XENT_BLOCK, xent_rows_f32_i64, x, lab, n, c, ignore, d, rl, rc);
}
extern "C" void set_ftz(int on) { g_ftz = on != 0; }
extern "C" void run_mean(float* rl, long long* rc, long long n) {
    launch(1, XENT_BLOCK, xent_mean_f32, rl, rc, n);
}
"""


def _host_source() -> str:
    common = (resources.files(kernels.__name__) / "common.cuh").read_text()
    body = kernels.source("loss").replace('#include "common.cuh"', common)
    body = re.sub(r"#include <cuda_(fp16|bf16)\.h>", "", body).replace("#pragma once", "")
    return _SHIM + body + _RUNNERS


@pytest.fixture(scope="module")
def host_loss_kernels(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to run loss.cu on the host")
    folder = tmp_path_factory.mktemp("hostloss")
    (folder / "loss_host.cpp").write_text(_host_source())
    lib = folder / "libloss_host.so"
    proc = subprocess.run(
        [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-pthread", "-o", str(lib),
         str(folder / "loss_host.cpp")], capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return ctypes.CDLL(str(lib))


def _run_host(lib, x: np.ndarray, labels: np.ndarray, ignore_index: int = -100):
    """loss.py's three launches, in its order, on NaN-filled buffers."""
    n, c = x.shape
    p = lambda a: ctypes.c_void_p(a.ctypes.data)  # noqa: E731
    d = np.full_like(x, np.nan)
    rl = np.full(n + 1, np.nan, np.float32)
    rc = np.full(n + 2, -7, np.int64)
    blocks = max(1, -(-n // (loss.XENT_BLOCK // 32)))
    ignore = ctypes.c_longlong(ignore_index)
    lib.run_kept(p(labels), ctypes.c_longlong(n), ignore, p(rc))
    lib.run_rows(ctypes.c_uint(blocks), p(x), p(labels), ctypes.c_longlong(n),
                 ctypes.c_longlong(c), ignore, p(d), p(rl), p(rc))
    lib.run_mean(p(rl), p(rc), ctypes.c_longlong(n))
    return rl, rc, d


@pytest.mark.parametrize("classes", [1, 3, 32, 45])
def test_xent_kernel_counts_correct_as_numpy_argmax_on_nan_and_minus_inf_rows(
    host_loss_kernels, classes
):
    rng = np.random.default_rng(classes)
    n = 12
    x = rng.integers(-2, 3, (n, classes)).astype(np.float32)  # small ints: many ties
    x[0] = -np.inf                                           # argmax 0
    x[1, classes // 2 :] = np.nan                            # first NaN wins
    x[2, -1] = np.nan
    x[3, 0] = np.inf
    x[4] = np.nan
    labels = np.argmax(x, axis=1).astype(np.int64)           # every row "correct" ...
    labels[5] = (labels[5] + 1) % classes if classes > 1 else 0  # ... but a few
    rl, rc, d = _run_host(host_loss_kernels, x, labels)
    want = np.argmax(x, axis=1) == labels
    np.testing.assert_array_equal(rc[:n], want.astype(np.int64))
    assert rc[n] == int(want.sum())
    with np.errstate(all="ignore"):
        cpu_loss, cpu_correct, cpu_grad = loss._forward_cpu(x, labels)
    assert int(cpu_correct) == rc[n]
    assert np.isnan(rl[n]) and np.isnan(cpu_loss)  # rows 0-4 make the mean NaN
    np.testing.assert_allclose(d, cpu_grad, rtol=1e-5, atol=1e-7, equal_nan=True)


def test_xent_kernel_argmax_reads_subnormal_logits_under_ftz(host_loss_kernels):
    """Note [argmax compares keys] (loss.cu): run with subnormal operands read as zero, as
    CuPy's -ftz=true compiles the kernel, the correct count is still numpy.argmax's on
    rows where a subnormal logit decides it, within a lane and across lanes (column 33 is
    lane 1), with negative values and signed zeros."""
    rows = [[0.0, 1e-40], [-1e-40, 0.0], [1e-41, 3e-39, 2e-39], [-0.0, 0.0, -1e-40],
            [-3e-39, -1e-39, -2e-39], [-1e-40, -0.0]]
    x = np.full((2 * len(rows), 40), -1.0, np.float32)
    for i, row in enumerate(rows):
        x[2 * i, :len(row)] = row
        x[2 * i + 1, [0, 33, 34][:len(row)]] = row
    labels = np.argmax(x, axis=1).astype(np.int64)
    assert list(labels[:2]) == [1, 33]  # a subnormal beats 0
    host_loss_kernels.set_ftz(1)
    try:
        _, rc, _ = _run_host(host_loss_kernels, x, labels)
    finally:
        host_loss_kernels.set_ftz(0)
    np.testing.assert_array_equal(rc[:len(x)], 1)


def test_xent_kernel_matches_cpu_on_finite_rows(host_loss_kernels):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((37, 41)).astype(np.float32)
    labels = rng.integers(0, 41, 37).astype(np.int64)
    rl, rc, d = _run_host(host_loss_kernels, x, labels)
    cpu_loss, cpu_correct, cpu_grad = loss._forward_cpu(x, labels)
    assert rc[37] == int(cpu_correct)
    np.testing.assert_allclose(rl[37], cpu_loss, rtol=1e-5)
    np.testing.assert_allclose(d, cpu_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("ignore_index", "ignored_rows"),
    [(-100, []), (-100, [0, 3, 4, 36]), (-100, list(range(37))), (5, None), (-1, [1, 2])],
)
def test_xent_kernel_ignore_index_matches_cpu(host_loss_kernels, ignore_index, ignored_rows):
    """xent_kept counts the rows whose label is not ignore_index, and the rows and mean
    kernels divide by that count on the device: torch's ignore_index, as the CPU engine.
    The first ignored row holds inf and NaN logits, which must not leak into anything."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((37, 41)).astype(np.float32)
    labels = rng.integers(0, 41, 37).astype(np.int64)
    if ignored_rows is None:  # ignore_index a class: its rows are ignored
        labels[[3, 9, 20]] = ignore_index
        ignored_rows = list(np.flatnonzero(labels == ignore_index))
    else:
        labels[ignored_rows] = ignore_index
        x[ignored_rows[:1], :3] = [np.inf, np.nan, -np.inf]
    rl, rc, d = _run_host(host_loss_kernels, x, labels, ignore_index)
    with np.errstate(all="ignore"):
        cpu_loss, cpu_correct, cpu_grad = loss._forward_cpu(x, labels, ignore_index)
    assert rc[38] == 37 - len(ignored_rows)  # row_correct[N + 1]: xent_kept's count
    assert rc[37] == int(cpu_correct)
    np.testing.assert_allclose(rl[37], cpu_loss, rtol=1e-5, equal_nan=True)
    assert np.isnan(rl[37]) == (len(ignored_rows) == 37)
    assert (d[ignored_rows] == 0).all() and (rl[ignored_rows] == 0).all()
    np.testing.assert_allclose(d, cpu_grad, rtol=1e-5, atol=1e-7)


class _FakeStream:
    def __init__(self, capturing: bool) -> None:
        self.capturing = capturing

    def is_capturing(self) -> bool:
        return self.capturing


class _FakeCuda:
    def __init__(self, capturing: bool) -> None:
        self.stream = _FakeStream(capturing)
        self.allocator: list = []  # the using_allocator stack

    def get_current_stream(self) -> _FakeStream:
        return self.stream

    @contextlib.contextmanager
    def using_allocator(self, allocator=None):
        self.allocator.append(allocator)
        try:
            yield
        finally:
            self.allocator.pop()


class _FakeCupy:
    """Just enough of CuPy for Mean._init_buffer's GPU branch."""

    def __init__(self, capturing: bool) -> None:
        self.cuda = _FakeCuda(capturing)
        self.zeros_allocators: list = []
        self.pool = type("Pool", (), {"malloc": staticmethod(lambda n: None)})()

    def get_default_memory_pool(self):
        return self.pool

    def zeros(self, n, dtype):
        self.zeros_allocators.append(list(self.cuda.allocator))
        return np.zeros(n, dtype=dtype)


class _FakeValue:
    device = contextlib.nullcontext()


def test_mean_refuses_to_create_its_buffer_during_capture():
    xp = _FakeCupy(capturing=True)
    acc = Mean()
    with pytest.raises(CaptureError, match="before capturing"):
        acc._init_buffer(xp, _FakeValue())
    assert xp.zeros_allocators == [] and acc._buffer is None


def test_mean_creates_its_buffer_outside_capture_from_the_default_pool():
    # Not from the current allocator, which may be a capture's private pool: with CuPy 14.0
    # a pooled array's memory is freed with its pool, under a Mean that outlives it. Nor
    # from the raw allocator (issue #13): freeing that is a cudaFree, a hidden device sync.
    xp = _FakeCupy(capturing=False)
    acc = Mean()
    acc._init_buffer(xp, _FakeValue())
    assert xp.zeros_allocators == [[xp.pool.malloc]] and acc._buffer.shape == (2,)
    acc._total += 2.5
    acc._count += 2
    assert acc.compute() == 1.25
