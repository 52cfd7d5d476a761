"""A small thread pool for the reference engine's elementwise passes.

NumPy's ufuncs, copies and reductions release the GIL, so splitting one pass over the batch
axis across threads runs it on every core, as BLAS already does for the GEMMs. Each chunk
writes its own slice of the result, so the chunks never race and results are bitwise the
same for any thread count.

The thread count is `CONVFUSE_NUM_THREADS`, else `OMP_NUM_THREADS` (which BLAS also reads),
else the number of usable cores; `set_num_threads` overrides all three.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

# Below this many elements per pass the cost of a hand-off (~20 us) outweighs the split.
MIN_ELEMENTS = 1 << 16

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
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
        text = os.environ.get(var, "").strip()
        if text.isdigit() and int(text) > 0:
            return int(text)
    return _usable_cores()


def set_num_threads(n: int | None) -> None:
    """Use `n` threads for elementwise passes; None restores the environment's choice."""
    global _override
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"set_num_threads: n must be a positive int or None, got {n!r}")
    _override = n


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    if _pool is None or _pool_size < workers:
        if _pool is not None:
            _pool.shutdown(wait=True)
        _pool = ThreadPoolExecutor(workers, thread_name_prefix="convfuse-ref")
        _pool_size = workers
    return _pool


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


def parallel_for(n: int, elements: int, fn: Callable[[int, int], None]) -> None:
    """Run fn(lo, hi) over contiguous chunks of range(n), one per thread.

    `elements` is the size of the pass (to skip threading when it would not pay). The
    caller's thread runs the first chunk; an exception in any chunk is re-raised here after
    every chunk has finished, so no thread is still writing when the caller sees it.
    """
    threads = min(num_threads(), n, max(1, elements // MIN_ELEMENTS))
    if threads <= 1:
        fn(0, n)
        return
    ranges = chunks(n, threads)
    futures = [_executor(threads - 1).submit(fn, lo, hi) for lo, hi in ranges[1:]]
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
