"""Process-wide plan caches: bounded, least-recently-used eviction, guarded by a lock.

Note [finding a plan per call]
Every engine call asks for its plan, and building the key (a frozen dataclass: the flags
read, the dtype and activation canonicalised, the device asked) costs several
microseconds of host time, four times per training step of a convolution layer. So
`PlanCache.find` remembers, per tuple of the getter's own arguments, the key they made and
its plan: a call that recurs hashes that tuple (its geometry caches its hash) and takes
the lock once. The answer is only reused while the flags object in force is the one it
was made under (`config.set_flags` makes a new one; anything else a key reads is an
argument) and while the cache still holds that very plan under that key, so eviction,
clear_plan_cache and a rebuilt plan are seen; a hit refreshes the plan's recency as `get`
does. Arguments that cannot be hashed go to `get` and its key's checks every time.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    size: int


class PlanCache:
    """Plans hold cuDNN descriptors (and chosen algorithms), so they are built once per key.

    A plan is built under the lock: two threads asking for one new key get one plan, and
    building is cheap (descriptors only; algorithms are chosen later).
    """

    # 4096: a plan is descriptors and chosen algorithms (about 2 KiB of host memory, no
    # device memory), and multi-scale training visits a few geometries per layer per size:
    # a smaller LRU visited in turn misses every lookup, and under config.benchmark an
    # evicted plan searches again (torch's benchmark cache is unbounded)
    def __init__(self, build: Callable[[Any], Any], maxsize: int = 4096) -> None:
        self._build = build
        self._maxsize = maxsize
        self._plans: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        # Note [finding a plan per call]: getter arguments -> (key, plan), under _flags
        self._found: dict[Any, tuple[Hashable, Any]] = {}
        self._flags: Any = None

    def get(self, key: Hashable) -> Any:
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._hits += 1
                self._plans.move_to_end(key)
                return plan
            self._misses += 1
            plan = self._build(key)
            self._plans[key] = plan
            if len(self._plans) > self._maxsize:
                self._plans.popitem(last=False)
                self._found = {}  # it may hold the evicted plan: let its descriptors go
            return plan

    def find(self, args: tuple[Any, ...], flags: Any,
             make_key: Callable[..., Hashable]) -> Any:
        """get(make_key(flags, *args)) for the flags object `flags` in force, remembered
        per `args` (Note [finding a plan per call])."""
        found = self._found
        if flags is not self._flags:
            self._found = found = {}
            self._flags = flags
        try:
            entry = found.get(args)
        except TypeError:  # an unhashable argument: the key's checks say what is wrong
            return self.get(make_key(flags, *args))
        if entry is not None:
            key, plan = entry
            if self.touch(key, plan):
                return plan
        key = make_key(flags, *args)
        plan = self.get(key)
        if len(found) >= 4 * self._maxsize:  # equal arguments spelled many ways
            found.clear()
        found[args] = (key, plan)
        return plan

    def touch(self, key: Hashable, plan: Any) -> bool:
        """Whether the cache still holds `plan` under `key` (nothing evicted or cleared it),
        counting and refreshing it as a hit when it does: what a caller that kept a plan
        asks at each use (`find`, and the bound calls of ops/cudnn/bound.py)."""
        with self._lock:
            if self._plans.get(key) is plan:
                self._hits += 1
                self._plans.move_to_end(key)
                return True
            return False

    def holds(self, key: Hashable, plan: Any) -> bool:
        """Whether the cache holds `plan` under `key`, asked without using it (no hit
        counted, recency unchanged)."""
        with self._lock:
            return self._plans.get(key) is plan

    def values(self) -> list[Any]:
        """The cached plans, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._plans.values())

    def info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, len(self._plans))

    def clear(self) -> None:
        """Drop every plan (their descriptors are destroyed once unreferenced) and the counts."""
        with self._lock:
            self._plans.clear()
            self._found = {}
            self._hits = self._misses = 0
