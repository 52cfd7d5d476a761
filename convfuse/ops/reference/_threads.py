"""A small thread pool for the reference engine's elementwise passes.

NumPy's ufuncs, copies and reductions release the GIL, so splitting one pass over the batch
axis across threads runs it on every core, as BLAS already does for the GEMMs. Each chunk
writes its own slice of the result, so the chunks never race and results are bitwise the
same for any thread count.

The thread count is `CONVFUSE_NUM_THREADS`, else `OMP_NUM_THREADS` (which BLAS also reads),
else the number of usable cores; `set_num_threads` overrides all three.

Note [GEMMs on the pool]
`matmul` splits a large GEMM's output into about 16 column (or row) blocks, a multiple of
64 wide, fixed by the shape alone; the pool's threads take contiguous runs of blocks, each
block one single-threaded BLAS call. So the numbers do not depend on the thread count (nor
on BLAS's own thread setting, which changes OpenBLAS's results in the last bits). Why not
BLAS's own
threads: on a shared machine OpenBLAS's threads spin-wait for each other, and a GEMM
whose partner thread was descheduled took 2-8x its quiet time here (16 ms quiet, 45-140
ms under load 4 on 2 cores), while two pool threads each running a one-thread GEMM stayed
within 10% of 40 ms under the same load. Small GEMMs run as one call, also on one BLAS
thread: after a threaded GEMM OpenBLAS's threads spin for a while, and the next pass on the
pool (or PyTorch's next op, in a benchmark) ran 2-3x slower beside them (MNIST step here:
150 ms with small GEMMs on BLAS's threads, 75-85 ms without). BLAS is held to one thread
(threadpoolctl, when installed; without it `matmul` leaves every GEMM to BLAS) only
during the engine's GEMMs, and restored after.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np

# Below this many elements per pass the cost of a hand-off (~20 us) outweighs the split.
MIN_ELEMENTS = 1 << 16

# A GEMM below this many multiply-adds runs as one call (splitting costs ~50 us).
MIN_GEMM_FLOPS = 1 << 24
# OpenBLAS runs a GEMM below 65536 * GEMM_MULTITHREAD_THRESHOLD (4 by default) multiply-adds
# on one thread whatever its setting (interface/gemm.c), so for these the ~15 us of
# switching BLAS to one thread and back (threadpoolctl) buys nothing.
TINY_GEMM_FLOPS = 1 << 16
GEMM_BLOCKS = 16  # blocks per split GEMM: enough to balance 2-8 threads
GEMM_ALIGN = 64  # block widths are multiples of BLAS kernels' tile sizes

# (pool, its worker count), swapped whole under _pool_lock, read without it
_pool: tuple[ThreadPoolExecutor, int] | None = None
_pool_lock = threading.Lock()
_override: int | None = None


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def num_threads() -> int:
    """How many threads an elementwise pass may use (>= 1)."""
    if _override is not None:
        return _override
    for var in ("CONVFUSE_NUM_THREADS", "OMP_NUM_THREADS"):
        n = _count(os.environ.get(var, ""))
        if n is not None:
            return n
    return _usable_cores()


def _count(text: str) -> int | None:
    """A thread count's value, None for anything but a positive decimal int (unset, junk,
    OpenMP's nested "4,2": the next source decides). isdecimal, not isdigit: "²" is a
    digit int() refuses."""
    text = text.strip()
    if not text.isascii() or not text.isdecimal() or len(text) > 9:
        return None  # (nine digits: more threads than any machine, and no int() limit)
    n = int(text)
    return n if n > 0 else None


def set_num_threads(n: int | None) -> None:
    """Use `n` threads for elementwise passes; None restores the environment's choice."""
    global _override
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"set_num_threads: n must be a positive int or None, got {n!r}")
    _override = n


def _after_fork_in_child() -> None:
    """A forked child (multiprocessing's fork, a DataLoader worker) has only the forking
    thread: the parent's pool threads do not exist there, and a pass submitted to that
    pool would wait forever. The child makes a pool of its own at its first pass."""
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()  # (another thread may have held it at the fork)


if hasattr(os, "register_at_fork"):  # (not on Windows, which cannot fork)
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _executor(workers: int) -> ThreadPoolExecutor:
    """A pool of at least `workers` threads. A smaller one is replaced, never shut down:
    another thread may hold it and still submit (a shut-down pool refuses, which crashed
    concurrent calls); once nothing holds it, it is collected and its idle threads end."""
    global _pool
    state = _pool
    if state is not None and state[1] >= workers:
        return state[0]
    with _pool_lock:
        if _pool is None or _pool[1] < workers:
            _pool = (ThreadPoolExecutor(workers, thread_name_prefix="convfuse-ref"), workers)
        return _pool[0]


def chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous, nearly equal [lo, hi) ranges covering range(n) (none empty)."""
    parts = max(1, min(parts, n))
    step, extra = divmod(n, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + step + (i < extra)
        out.append((lo, hi))
        lo = hi
    return out


def parallel_for(n: int, elements: int, fn: Callable[[int, int], None],
                 cached: bool = False) -> None:
    """Run fn(lo, hi) over contiguous chunks of range(n), one run of chunks per thread.

    `elements` is the size of the pass (to skip threading when it would not pay). With
    `cached`, each thread's range is further walked in pieces of about CACHE_ELEMENTS
    elements (Note [cache-sized pieces]). The caller's thread runs the first range; an
    exception in any chunk is re-raised here after every chunk has finished, so no thread
    is still writing when the caller sees it.
    """
    most = min(n, elements // MIN_ELEMENTS)
    threads = min(num_threads(), most) if most > 1 else 1  # small passes skip the env read
    if cached and n > 1 and elements > CACHE_ELEMENTS:
        step = max(1, CACHE_ELEMENTS * n // elements)
        inner = fn

        def fn(lo: int, hi: int) -> None:
            for start in range(lo, hi, step):
                inner(start, min(hi, start + step))

    if threads <= 1:
        fn(0, n)
        return
    run_chunks(n, threads, fn)


# Note [cache-sized pieces]
# A pass of several ufuncs over arrays of many MiB streams every temporary through memory:
# the relu gradient's four ufuncs over a 6 MiB activation took 1.0 ms with the arrays in
# cache and 2.9 ms as one pass from memory here. Walked in pieces of CACHE_ELEMENTS
# elements, a piece's temporaries stay in cache (the 32 MiB L3 here; L2-sized pieces cost
# more in per-call overhead than they saved: a 2x2 max-pool backward at batch 128 took
# 17 ms in pieces of 2^15 elements, 6 ms at 2^17 and 4.5 ms at 2^19), and mostly the
# pass's real inputs and outputs cross the memory bus. Pieces are whole rows of the split
# axis (samples).
CACHE_ELEMENTS = 1 << 19


# Note [scratch buffers]
# A fresh array of tens of MiB comes from mmap, and its first touch page-faults: filling
# 58 MiB took 11.6 ms fresh against 4.8 ms reused here, and a ResNet block step allocates
# four such transients. The engine's transients (im2col of dz, GEMM results copied out
# right after) are therefore reused per calling thread and tag; what a call returns or a
# context keeps is never a scratch buffer. Held: at most one buffer per tag and thread,
# each between SCRATCH_MIN_BYTES and SCRATCH_MAX_BYTES.
SCRATCH_MIN_BYTES = 1 << 20
SCRATCH_MAX_BYTES = 128 << 20
_scratch_local = threading.local()

_blas_lock = threading.Lock()
_blas_depth = 0
_blas_saved: list[tuple[Any, int]] = []
_blas_libs: list[Any] | None = None


def _blas_controllers() -> list[Any]:
    global _blas_libs
    if _blas_libs is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            _blas_libs = []
        else:
            _blas_libs = [lib for lib in ThreadpoolController().lib_controllers
                          if lib.user_api == "blas"]
    return _blas_libs


def _set_blas_threads(lib: Any, n: int) -> None:
    """lib's thread count, from any Python thread. threadpoolctl >= 3.6 lets only one
    "controlling" thread change a process-wide pool (OpenBLAS on pthreads), ignoring the
    others without a word: a call from another thread then ran its GEMM blocks on several
    BLAS threads, and its results differed in the last bits from the main thread's. The
    blocks here are already serialised by _blas_lock and undone at depth 0, so the real
    setter is called where threadpoolctl has one."""
    real = getattr(lib, "_real_set_num_threads", None)
    if real is not None:
        real(n)
    else:
        lib.set_num_threads(n)


@contextmanager
def single_threaded_blas() -> Iterator[None]:
    """BLAS on one thread within the block (nested and concurrent blocks share it), whichever
    thread enters it."""
    global _blas_depth, _blas_saved
    libs = _blas_controllers()
    with _blas_lock:
        if _blas_depth == 0:
            _blas_saved = [(lib, lib.get_num_threads()) for lib in libs]
            for lib, _ in _blas_saved:
                _set_blas_threads(lib, 1)
        _blas_depth += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_depth -= 1
            if _blas_depth == 0:
                for lib, n in _blas_saved:
                    _set_blas_threads(lib, n)


def gemm_blocks(n: int) -> list[tuple[int, int]]:
    """The fixed split of a GEMM's n output columns (or rows): about GEMM_BLOCKS blocks, each
    a multiple of GEMM_ALIGN wide, whatever the thread count (Note [GEMMs on the pool])."""
    width = max(GEMM_ALIGN, -(-n // (GEMM_BLOCKS * GEMM_ALIGN)) * GEMM_ALIGN)
    return [(lo, min(n, lo + width)) for lo in range(0, n, width)]


def scratch(tag: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array for a transient result of the calling thread, reused across
    calls (Note [scratch buffers]); tags name the use, so two live ones never share."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if not SCRATCH_MIN_BYTES <= nbytes <= SCRATCH_MAX_BYTES:
        return np.empty(shape, dtype)
    cache = getattr(_scratch_local, "cache", None)
    if cache is None:
        cache = _scratch_local.cache = {}
    buf = cache.get(tag)
    if buf is None or buf.nbytes < nbytes:
        buf = cache[tag] = np.empty(nbytes, np.uint8)
    return buf[:nbytes].view(dtype).reshape(shape)


def matmul(a: np.ndarray, b: np.ndarray, out_tag: str | None = None) -> np.ndarray:
    """np.matmul(a, b) for (..., M, K) @ (..., K, N); large ones in fixed blocks of output
    columns (or rows, when M > N) over the pool (Note [GEMMs on the pool])."""
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if m * n * k < TINY_GEMM_FLOPS or not _blas_controllers():
        # one BLAS thread anyway, and an output far below SCRATCH_MIN_BYTES
        return np.matmul(a, b)
    if m * n * k < MIN_GEMM_FLOPS:
        with single_threaded_blas() if m * n * k >= TINY_GEMM_FLOPS else nullcontext():
            if out_tag is None:
                return np.matmul(a, b)
            shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), m, n)
            return np.matmul(a, b, out=scratch(out_tag, shape, np.result_type(a, b)))
    shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), m, n)
    out = (np.empty(shape, np.result_type(a, b)) if out_tag is None
           else scratch(out_tag, shape, np.result_type(a, b)))
    blocks = gemm_blocks(max(m, n))

    def run(first: int, last: int) -> None:
        for lo, hi in blocks[first:last]:
            if n >= m:
                np.matmul(a, b[..., lo:hi], out=out[..., lo:hi])
            else:
                np.matmul(a[..., lo:hi, :], b, out=out[..., lo:hi, :])

    with single_threaded_blas():
        threads = min(num_threads(), len(blocks))
        if threads <= 1:
            run(0, len(blocks))
        else:
            run_chunks(len(blocks), threads, run)
    return out


def run_chunks(n: int, threads: int, fn: Callable[[int, int], None]) -> None:
    ranges = chunks(n, threads)
    pool = _executor(threads - 1)  # once: a later lookup may find a bigger pool
    futures = [pool.submit(fn, lo, hi) for lo, hi in ranges[1:]]
    first_error: BaseException | None = None
    try:
        fn(*ranges[0])
    except BaseException as exc:  # wait for the others before raising
        first_error = exc
    for f in futures:
        err = f.exception()
        if err is not None and first_error is None:
            first_error = err
    if first_error is not None:
        raise first_error
