"""The reference engine's thread pool and the blocked CPU optimizer passes.

Chunking must never change a number: every threaded op is compared bitwise against the
same op on one thread, and the blocked SGD/Adam against the whole-buffer NumPy form of
PyTorch's rule, with blocks and thread counts small enough to split tiny buffers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import convfuse as cf
from convfuse.geometry import ConvGeometry
from convfuse.ops import reference as ref
from convfuse.ops.reference import _threads
from convfuse.ops.reference import conv as rc
from convfuse.optim import _cpu
from convfuse.pool_geometry import PoolGeometry


@pytest.fixture
def threads(monkeypatch):
    """Split every pass, however small, over `n` threads (tiny convolutions' columns too,
    which would otherwise be one gather: reference/conv.py Note [choosing the method])."""
    monkeypatch.setattr(rc, "GATHER_ELEMENTS", 0)
    monkeypatch.setattr(_threads, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(_threads, "MIN_GEMM_FLOPS", 1)
    monkeypatch.setattr(_threads, "GEMM_ALIGN", 8)

    def use(n):
        _threads.set_num_threads(n)

    yield use
    _threads.set_num_threads(None)


def test_chunks_cover_the_range_evenly():
    assert _threads.chunks(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert _threads.chunks(2, 5) == [(0, 1), (1, 2)]
    assert _threads.chunks(0, 2) == [(0, 0)]


def test_num_threads_reads_the_environment(monkeypatch):
    monkeypatch.setenv("CONVFUSE_NUM_THREADS", "3")
    assert _threads.num_threads() == 3
    monkeypatch.delenv("CONVFUSE_NUM_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert _threads.num_threads() == 1
    _threads.set_num_threads(2)
    try:
        assert _threads.num_threads() == 2
    finally:
        _threads.set_num_threads(None)
    with pytest.raises(ValueError, match="positive int"):
        _threads.set_num_threads(0)


@pytest.mark.parametrize("junk", ["abc", "0", "-1", "4,2", "\u00b2", "\u0663", "9" * 5000, ""])
def test_a_thread_count_that_is_not_a_positive_int_is_skipped(monkeypatch, junk):
    # "²" is a digit int() refuses, "٣" a decimal it takes; 5000 digits exceed int()'s
    # limit: each once crashed every large enough CPU convolution, naming nothing
    monkeypatch.setenv("CONVFUSE_NUM_THREADS", junk)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _threads.num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", junk)
    assert _threads.num_threads() == _threads._usable_cores()


def test_callers_on_several_threads_while_the_pool_grows(monkeypatch):
    """Passes of 2..8 chunks from 8 threads at once: the pool is replaced by a bigger one
    while other callers hold the smaller (it used to be shut down under them: "cannot
    schedule new futures after shutdown"). Every pass still covers its range once."""
    import sys
    import threading

    monkeypatch.setattr(_threads, "MIN_ELEMENTS", 1)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    _threads.set_num_threads(8)
    errors: list[BaseException] = []

    def worker(tid: int) -> None:
        try:
            for i in range(60):
                n = 2 + (i + tid) % 7
                out = np.zeros(n)

                def fn(lo: int, hi: int, out: np.ndarray = out) -> None:
                    out[lo:hi] += 1

                _threads.parallel_for(n, n, fn)
                assert (out == 1).all(), out
        except BaseException as exc:  # reported below
            errors.append(exc)

    try:
        for _ in range(5):
            monkeypatch.setattr(_threads, "_pool", None)  # a fresh process's pool
            workers = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
            for t in workers:
                t.start()
            for t in workers:
                t.join(60)
            assert not errors, errors[0]
    finally:
        sys.setswitchinterval(interval)
        _threads.set_num_threads(None)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_runs_passes_on_a_pool_of_its_own(threads):
    """multiprocessing's fork (a DataLoader worker): the parent's pool threads do not exist
    in the child, which used to wait forever on its first threaded pass."""
    import os
    import warnings

    threads(2)
    out = np.zeros(4)

    def fn(lo: int, hi: int) -> None:
        out[lo:hi] += 1

    _threads.parallel_for(4, 4, fn)  # the parent's pool exists now
    assert _threads._pool is not None and (out == 1).all()
    with warnings.catch_warnings():  # (3.12 warns about forking a threaded process)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the pass ran; SIGALRM ends a hang
        import signal

        signal.alarm(30)
        try:
            _threads.parallel_for(4, 4, fn)
            os._exit(0 if (out == 2).all() else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_an_error_in_a_worker_reaches_the_caller_after_all_chunks_finish(threads):
    threads(3)
    done = []

    def fn(lo, hi):
        done.append((lo, hi))
        if lo == 3:
            raise RuntimeError("chunk failed")

    with pytest.raises(RuntimeError, match="chunk failed"):
        _threads.parallel_for(9, 9, fn)
    assert sorted(done) == [(0, 3), (3, 6), (6, 9)]


def _conv_outputs(layout, act, groups, stride=(1, 2)):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 4, 7, 6) if layout == "NCHW" else (5, 7, 6, 4))
    x = x.astype(np.float32)
    w_shape = (6, 4 // groups, 3, 2) if layout == "NCHW" else (6, 3, 2, 4 // groups)
    w = rng.standard_normal(w_shape).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    g = ConvGeometry.create(x.shape, w.shape, stride, 1, 1, groups, layout)
    res = rng.standard_normal(g.output_shape).astype(np.float32)
    y, z = ref.conv_bias_act(x, w, b, g, act, residual=res, residual_scale=0.5)
    dy = rng.standard_normal(g.output_shape).astype(np.float32)
    return [y, z, ref.conv_forward(x, w, g), ref.conv_backward_data(dy, w, g),
            ref.conv_backward_filter(x, dy, g)]


@pytest.mark.parametrize("stride", [(1, 2), 1])  # col2im, and dx as a convolution of dz
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize(("act", "groups"), [("relu", 1), ("gelu", 2)])
def test_threaded_conv_is_bitwise_the_single_thread_result(threads, layout, act, groups,
                                                           stride):
    threads(1)
    one = _conv_outputs(layout, act, groups, stride)
    threads(3)
    many = _conv_outputs(layout, act, groups, stride)
    for a, b in zip(one, many):
        if a is None:
            assert b is None
        else:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("m", "k", "n"), [(5, 40, 70), (70, 40, 5)])  # split n, split m
@pytest.mark.parametrize("transposed", [False, True])
def test_pool_matmul_is_bitwise_the_same_for_any_thread_count(threads, m, k, n, transposed):
    pytest.importorskip("threadpoolctl")
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, m, k)).astype(np.float32)
    b = rng.standard_normal((2, n, k)).astype(np.float32).transpose(0, 2, 1)
    if not transposed:
        b = np.ascontiguousarray(b)
    before = [lib.get_num_threads() for lib in _threads._blas_controllers()]
    assert len(_threads.gemm_blocks(max(m, n))) > 3
    threads(1)
    one = _threads.matmul(a, b)
    threads(3)
    np.testing.assert_array_equal(_threads.matmul(a, b), one)
    np.testing.assert_allclose(one, np.matmul(a, b), rtol=1e-5, atol=1e-5)
    assert [lib.get_num_threads() for lib in _threads._blas_controllers()] == before


@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize(("kernel", "stride", "padding"), [(2, 2, 0), (3, 1, 1), (3, 2, 1)])
def test_threaded_pooling_is_bitwise_the_single_thread_result(threads, mode, kernel, stride,
                                                              padding):
    rng = np.random.default_rng(1)
    x = rng.integers(-3, 3, (7, 3, 9, 8)).astype(np.float32)
    x[0, 0, 0, :3] = np.nan
    pg = PoolGeometry.create(x.shape, kernel, stride, padding, mode)
    dy = rng.standard_normal(pg.output_shape).astype(np.float32)
    results = []
    for n in (1, 3):
        threads(n)
        y = ref.pool_forward(x, pg)
        results.append((y, ref.pool_backward(dy, x, y, pg)))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


# --- the blocked optimizer passes against the whole-buffer form --------------------------

def _adam_whole(p, g, m, v, ct, t, lr, b1, b2, eps, wd, decoupled):
    """The former whole-buffer implementation: PyTorch's order, NumPy temporaries."""
    one = ct.type(1)
    p = p if p.dtype == ct else p.astype(ct)
    d = g.astype(ct)
    if decoupled:
        p *= 1.0 - lr * wd
    elif wd != 0:
        d += wd * p
    w1 = ct.type(1.0 - b1)
    if abs(w1) < 0.5:
        m += w1 * (d - m)
    else:
        m[...] = d - (d - m) * (one - w1)
    v *= b2
    v += ((1.0 - b2) * d) * d
    denom = np.sqrt(v) / math.sqrt(1.0 - b2**t) + eps
    p += -(lr / (1.0 - b1**t)) * (m / denom)
    return p


def _sgd_whole(p, g, buf, ct, t, lr, momentum, wd, nesterov):
    p = p if p.dtype == ct else p.astype(ct)
    d = g.astype(ct)
    if wd != 0:
        d += wd * p
    if momentum != 0:
        if t == 1:
            buf[...] = d
        else:
            buf *= momentum
            buf += d
        d = d + momentum * buf if nesterov else buf
    p += -lr * d
    return p


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize(("b1", "wd", "decoupled"),
                         [(0.9, 0.0, False), (0.9, 0.1, False), (0.3, 0.1, True)])
def test_blocked_adam_is_bitwise_the_whole_buffer_rule(threads, monkeypatch, dtype, b1, wd,
                                                       decoupled):
    monkeypatch.setattr(_cpu, "BLOCK_BYTES", 4096)  # 1024-element blocks: several per buffer
    threads(3)
    rng = np.random.default_rng(2)
    n = 5000
    ct = np.dtype(np.float64 if dtype == np.float64 else np.float32)
    p0 = rng.standard_normal(n).astype(dtype)
    g = rng.standard_normal(n).astype(dtype)
    p, m, v = p0.copy(), np.zeros(n, ct), np.zeros(n, ct)
    pw, mw, vw = p0.copy(), np.zeros(n, ct), np.zeros(n, ct)
    for t in (1, 2, 3):
        _cpu.adam(p, g, m, v, ct, t, 1e-2, (b1, 0.999), 1e-8, wd, decoupled)
        pw[...] = _adam_whole(pw, g, mw, vw, ct, t, 1e-2, b1, 0.999, 1e-8, wd, decoupled)
    np.testing.assert_array_equal(p, pw)
    np.testing.assert_array_equal(m, mw)
    np.testing.assert_array_equal(v, vw)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(("momentum", "wd", "nesterov"),
                         [(0.0, 0.0, False), (0.9, 0.01, False), (0.9, 0.0, True)])
def test_blocked_sgd_is_bitwise_the_whole_buffer_rule(threads, monkeypatch, dtype, momentum,
                                                      wd, nesterov):
    monkeypatch.setattr(_cpu, "BLOCK_BYTES", 4096)
    threads(2)
    rng = np.random.default_rng(3)
    n = 4099
    ct = np.dtype(np.float32)
    p0 = rng.standard_normal(n).astype(dtype)
    g = rng.standard_normal(n).astype(dtype)
    p, pw = p0.copy(), p0.copy()
    buf = np.zeros(n, ct) if momentum else None
    bufw = np.zeros(n, ct)
    for t in (1, 2):
        _cpu.sgd(p, g, buf, ct, t, 0.1, momentum, wd, nesterov)
        pw[...] = _sgd_whole(pw, g, bufw, ct, t, 0.1, momentum, wd, nesterov)
    np.testing.assert_array_equal(p, pw)


def test_adam_leaves_the_gradient_untouched_and_matches_torch(threads):
    torch = pytest.importorskip("torch")
    threads(2)
    rng = np.random.default_rng(4)
    w = rng.standard_normal(3000).astype(np.float32)
    g = rng.standard_normal(3000).astype(np.float32)
    param = cf.Parameter(w.copy(), "w")
    opt = cf.optim.Adam([param], lr=1e-2, weight_decay=0.1)
    tp = torch.nn.Parameter(torch.from_numpy(w.copy()))
    topt = torch.optim.Adam([tp], lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(3):
        param.grad[...] = g
        tp.grad = torch.from_numpy(g.copy())
        opt.step()
        topt.step()
        np.testing.assert_array_equal(param.grad, g)
    np.testing.assert_allclose(param.data, tp.detach().numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("act", ["relu", "gelu", "identity"])
def test_activation_backward_bias_in_pieces_is_bitwise_the_same_for_any_thread_count(
        threads, monkeypatch, layout, act):
    """Note [cache-sized pieces]: pieces of one sample, per-sample bias rows."""
    monkeypatch.setattr(_threads, "CACHE_ELEMENTS", 8)
    rng = np.random.default_rng(7)
    x_shape = (7, 3, 5, 4) if layout == "NCHW" else (7, 5, 4, 3)
    w_shape = (6, 3, 3, 3)  # (K, C, 3, 3) or (K, 3, 3, C): C is 3
    g = ConvGeometry.create(x_shape, w_shape, 1, 1, 1, 1, layout)
    dy = rng.standard_normal(g.output_shape)
    saved = np.maximum(rng.standard_normal(g.output_shape), 0) if act == "relu" else (
        rng.standard_normal(g.output_shape))
    results = []
    for n in (1, 3):
        threads(n)
        results.append(ref.activation_backward_bias(dy, saved, act, g))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    dz = dy * (saved > 0) if act == "relu" else (dy if act == "identity" else results[0][0])
    np.testing.assert_allclose(results[0][0], dz, rtol=1e-15)
    np.testing.assert_allclose(results[0][1], dz.sum(axis=g.reduce_axes), rtol=1e-12)


def test_a_call_from_another_python_thread_is_bitwise_the_main_threads():
    """threadpoolctl >= 3.6 ignores a thread count set from a thread other than the one
    that first set it (OpenBLAS on pthreads): the engine's one-BLAS-thread blocks must hold
    from any thread, or a conv run off the main thread (a server, an executor) differs in
    the last bits."""
    import contextlib
    import threading

    libs = _threads._blas_controllers()
    if not libs or max(lib.get_num_threads() for lib in libs) <= 1:
        pytest.skip("no multi-threaded BLAS here (threadpoolctl finds none, or it runs on "
                    "one thread anyway): nothing to hold")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 16, 24, 24)).astype(np.float32)
    w = rng.standard_normal((16, 16, 3, 3)).astype(np.float32)
    main = cf.functional.conv_bias_act(x, w, padding=1)
    seen, out = [], {}
    real = _threads.single_threaded_blas

    def spied():
        with real():
            seen.append([lib.get_num_threads() for lib in _threads._blas_controllers()])
            yield

    def work():
        out["y"] = cf.functional.conv_bias_act(x, w, padding=1)

    _threads.single_threaded_blas = contextlib.contextmanager(spied)
    try:
        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
    finally:
        _threads.single_threaded_blas = real
    assert seen and all(counts == [1] * len(counts) for counts in seen)
    np.testing.assert_array_equal(out["y"], main)
