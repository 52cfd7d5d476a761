"""Process-wide plan caches: bounded, least-recently-used eviction, guarded by a lock."""

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

    def __init__(self, build: Callable[[Any], Any], maxsize: int = 512) -> None:
        self._build = build
        self._maxsize = maxsize
        self._plans: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

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
            return plan

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
            self._hits = self._misses = 0
