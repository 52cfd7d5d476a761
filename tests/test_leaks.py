"""Creating and destroying many thousands of descriptors and plans leaks nothing.

Two measures: the binding's liveDescriptorCount() (descriptors created and not destroyed)
must return exactly to its baseline, and the resident set size (from /proc/self/statm)
must not grow by more than LEAK_BUDGET. Calibration, measured with ctypes on libcudnn
9.28: 20,000 never-destroyed tensor, filter or convolution descriptors take 4.3 to 5.2 MB,
so a leak of one descriptor per cycle exceeds the budget; test_measurement_sees_a_leak
shows both measures do catch one.

scripts/sanitize.sh runs this file under AddressSanitizer and valgrind. There the RSS
checks are skipped (ASan's quarantine keeps freed memory resident by design; valgrind
replaces the allocator) and the sanitizer's own leak report takes their place; the
descriptor count is still checked. CONVFUSE_LEAK_CYCLES scales the runs down for valgrind.
"""

from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path

import pytest

from convfuse.errors import CudnnError
from convfuse.geometry import ConvGeometry
from convfuse.selfcheck.descriptors import output_dims, packed_strides

CYCLES = int(os.environ.get("CONVFUSE_LEAK_CYCLES", "20000"))
PLANS = CYCLES // 4
LEAK_BUDGET = 2 * 2**20  # bytes of RSS growth tolerated over a whole run

pytestmark = pytest.mark.skipif(not Path("/proc/self/statm").exists(),
                                reason="RSS is read from /proc/self/statm (Linux only)")


@pytest.fixture(scope="module")
def lib():
    from convfuse._binding import cudnn

    return cudnn()


def sanitizer() -> str | None:
    """'asan' or 'valgrind' when this process runs under one (their runtimes are mapped)."""
    maps = Path("/proc/self/maps").read_text()
    if "libasan" in maps:
        return "asan"
    return "valgrind" if "vgpreload_memcheck" in maps else None


SANITIZER = sanitizer() if Path("/proc/self/maps").exists() else None


def assert_rss_bounded(grown: int) -> None:
    if SANITIZER is None:
        assert grown < LEAK_BUDGET, f"RSS grew by {grown / 2**20:.2f} MiB"


def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return lambda pad: 0


_TRIM = _malloc_trim()


def rss() -> int:
    """Resident set size in bytes, after returning free heap pages to the system: without
    the trim, memory freed by earlier tests in the same process absorbs a leak unseen."""
    gc.collect()
    _TRIM(0)
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def measure(lib, body, cycles: int, settle=lambda: None) -> tuple[int, int]:
    """Run `body(i)` for a warm-up, then `cycles` times; (descriptor growth, RSS growth).
    `settle()` runs before both readings (e.g. to empty a cache the body fills)."""
    for i in range(min(cycles // 10, 2000)):  # allocator pools and caches reach steady state
        body(i)
    settle()
    rss0 = rss()
    count0 = lib.liveDescriptorCount()
    for i in range(cycles):
        body(i)
    settle()
    rss1 = rss()
    return lib.liveDescriptorCount() - count0, rss1 - rss0


def test_descriptor_cycles_do_not_leak(lib):
    """Every descriptor kind set, read back and used in the output-dim query, 20k times."""
    float_t = lib.CUDNN_DATA_FLOAT

    def cycle(i: int) -> None:
        dims = [2, 3, 4 + i % 7, 5]
        t = lib.TensorDescriptor()
        t.setNd(float_t, dims, packed_strides(dims, i % 2 == 1))
        t.getNd()
        f = lib.FilterDescriptor()
        f.setNd(float_t, lib.CUDNN_TENSOR_NCHW, [4, 3, 3, 3])
        c = lib.ConvolutionDescriptor()
        c.setNd([1, 1], [1, 1], [1, 1], lib.CUDNN_CROSS_CORRELATION, float_t)
        c.setGroupCount(1)
        lib.getConvolutionNdForwardOutputDim(c, t, f)
        a = lib.ActivationDescriptor()
        a.set(lib.CUDNN_ACTIVATION_RELU, lib.CUDNN_NOT_PROPAGATE_NAN, 0.0)
        p = lib.PoolingDescriptor()
        p.setNd(lib.CUDNN_POOLING_MAX, lib.CUDNN_NOT_PROPAGATE_NAN, [2, 2], [0, 0], [2, 2])
        lib.getPoolingNdForwardOutputDim(p, t)

    grown, rss_grown = measure(lib, cycle, CYCLES)
    assert grown == 0
    assert_rss_bounded(rss_grown)


def test_error_paths_do_not_leak(lib):
    """Statuses raised as CudnnError, and the binding's own ValueErrors, release everything
    they touched (an exception's traceback holds the frame's descriptors until collected)."""

    def cycle(i: int) -> None:
        with pytest.raises(CudnnError):  # kernel wider than the input: BAD_PARAM
            output_dims(lib, [1, 3, 4, 4], [8, 3, 5, 5], (1, 1), (0, 0), (1, 1), 1, i % 2 == 1)
        with pytest.raises(CudnnError):  # zero stride, refused when set
            lib.ConvolutionDescriptor().setNd([0, 0], [0, 1], [1, 1],
                                              lib.CUDNN_CROSS_CORRELATION, lib.CUDNN_DATA_FLOAT)
        with pytest.raises(ValueError):  # dims and strides of different lengths
            lib.TensorDescriptor().setNd(lib.CUDNN_DATA_FLOAT, [2, 3, 4, 5], [60, 20, 5])

    grown, rss_grown = measure(lib, cycle, CYCLES // 4)
    assert grown == 0
    assert_rss_bounded(rss_grown)


def test_plans_built_and_cleared_do_not_leak(lib):
    """5,000 distinct plans (every one a cache miss), the cache cleared every 250."""
    from convfuse import plan

    layouts = ("NCHW", "NHWC")
    dtypes = ("float32", "float64", "float16", "bfloat16")

    def cycle(i: int) -> None:
        layout = layouts[i % 2]
        x = (1, 4, 6 + i % 40, 7) if layout == "NCHW" else (1, 6 + i % 40, 7, 4)
        w = (8, 2, 3, 3) if layout == "NCHW" else (8, 3, 3, 2)
        geom = ConvGeometry.create(x, w, 1 + i % 2, 1, 1, 2, layout)
        plan.get_plan(geom, dtypes[i % 4], ("identity", "relu", "gelu")[i % 3],
                      residual=i % 5 == 0)
        if i % 250 == 249:
            plan.clear_plan_cache()

    grown, rss_grown = measure(lib, cycle, PLANS, settle=plan.clear_plan_cache)
    assert grown == 0
    assert_rss_bounded(rss_grown)
    assert plan.plan_cache_info().size == 0


def test_measurement_sees_a_leak(lib):
    """The two measures above do detect descriptors that are kept alive."""
    kept = []

    def cycle(i: int) -> None:
        for _ in range(3):
            kept.append(lib.TensorDescriptor())

    cycles = CYCLES if SANITIZER else 20_000  # the budget is calibrated on 20k cycles
    grown, rss_grown = measure(lib, cycle, cycles)
    assert grown == 3 * cycles
    if SANITIZER is None:
        assert rss_grown > LEAK_BUDGET
    before = lib.liveDescriptorCount()
    n = len(kept)
    kept.clear()
    gc.collect()
    assert lib.liveDescriptorCount() == before - n


def _report_module():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "sanitizer_report.py"
    spec = importlib.util.spec_from_file_location("sanitizer_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ASAN_LOG = """\
=================================================================
==7==ERROR: LeakSanitizer: detected memory leaks

Direct leak of 48 byte(s) in 2 object(s) allocated from:
    #0 0x7f in malloc
    #1 0x7f in _PyLong_FromMedium Objects/longobject.c:203

Direct leak of 96 byte(s) in 1 object(s) allocated from:
    #0 0x7f in operator new(unsigned long)
    #1 0x7f in convfuse::TensorDescriptor::setNd csrc/descriptors.cpp:27
    #2 0x7f in _cudnn.cpython-311-x86_64-linux-gnu.so

SUMMARY: AddressSanitizer: 144 byte(s) leaked in 3 allocation(s).
"""

VALGRIND_LOG = """\
==9== Invalid read of size 8
==9==    at 0x4023C6C: strncmp (strcmp-sse2.S:160)
==9==    by 0x4004BEE: is_dst (dl-load.c:216)
==9==
==9== 56 bytes in 1 blocks are definitely lost in loss record 1 of 3
==9==    at 0x48417B4: malloc (vg_replace_malloc.c:381)
==9==    by 0x49DC7C9: PyLong_FromLong (longobject.c:299)
==9==
==9== 1,024 (64 direct, 960 indirect) bytes in 1 blocks are definitely lost in loss record 2 of 3
==9==    at 0x48417B4: malloc (vg_replace_malloc.c:381)
==9==    by 0x8EF: convfuse::FilterDescriptor::setNd (in /x/convfuse/_cudnn.cpython-311.so)
==9==
"""


def test_sanitizer_report_blames_only_findings_through_the_extension(tmp_path, capsys):
    report = _report_module()
    errors, ours, other = report.asan_findings(ASAN_LOG)
    assert errors == [] and len(ours) == 1 and "TensorDescriptor" in ours[0] and other == 48
    ours_vg, other_errors, other_lost = report.valgrind_findings(VALGRIND_LOG)
    assert len(ours_vg) == 1 and "FilterDescriptor" in ours_vg[0]
    assert other_errors == 1 and other_lost == 56
    log = tmp_path / "asan.log.1"
    log.write_text(ASAN_LOG)
    assert report.main(["asan", str(log)]) == 1
    elsewhere = ASAN_LOG.replace("convfuse::", "foo::").replace("csrc/", "src/")
    log.write_text(elsewhere.replace("_cudnn.", "_other."))
    assert report.main(["asan", str(log)]) == 0
    log.write_text("==7==ERROR: AddressSanitizer: heap-use-after-free on address 0x1\n")
    assert report.main(["asan", str(log)]) == 1
    assert "heap-use-after-free" in capsys.readouterr().out
    vg = tmp_path / "valgrind.log"
    vg.write_text(VALGRIND_LOG)
    assert report.main(["valgrind", str(vg)]) == 1
    assert report.main(["bogus"]) == 2
