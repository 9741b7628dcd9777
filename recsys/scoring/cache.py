"""The per-worker model cache: the one piece of global state the project allows.

Loading a model and preparing its candidate matrix costs seconds; a nightly run has hundreds of
tasks. Each Python worker keeps what it loaded in a small LRU keyed by an id the driver mints
(model URI + version + device for models; plus the catalog snapshot's candidate digest for
prepared scorers), so the second task on a worker is a hit.

Operational caveats (same as pyspark's own ``ml/model_cache.py``):

- The cache survives across tasks only because Spark reuses Python workers
  (``spark.python.worker.reuse``, default true). With reuse off, every task is a miss.
- Idle Python workers are killed after about a minute, so a long pause between stages (or
  between dates of a backfill) can empty it; the run's metrics show that as extra misses.
- Each worker holds its own copy: memory is (workers per executor) x (model + candidate matrix),
  which is why the cache is bounded (``scoring.cache_size``).
- A retried task may land on a fresh worker and reload; that is visible as a miss, not hidden.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Callable, Generic, Hashable, TypeVar

V = TypeVar("V")


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    load_seconds: float = 0.0

    def minus(self, earlier: "CacheStats") -> "CacheStats":
        return CacheStats(
            self.hits - earlier.hits,
            self.misses - earlier.misses,
            self.evictions - earlier.evictions,
            self.load_seconds - earlier.load_seconds,
        )

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class CacheUse:
    """One task's (or many tasks') use of a worker cache: hits, misses, and the seconds its loads took."""

    hits: int = 0
    misses: int = 0
    load_s: float = 0.0

    @classmethod
    def between(cls, before: CacheStats, after: CacheStats) -> "CacheUse":
        """What happened between two snapshots of one cache (:meth:`BoundedCache.snapshot`)."""
        delta = after.minus(before)
        return cls(delta.hits, delta.misses, delta.load_seconds)

    def __add__(self, other: "CacheUse") -> "CacheUse":
        return CacheUse(self.hits + other.hits, self.misses + other.misses, self.load_s + other.load_s)


class BoundedCache(Generic[V]):
    """A thread-safe LRU. Loads run under the lock so two threads never load the same key twice."""

    def __init__(self, maxsize: int = 2):
        if maxsize < 1:
            raise ValueError(f"cache maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._data: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.RLock()
        self.stats = CacheStats()

    def get_or_load(self, key: Hashable, loader: Callable[[], V]) -> tuple[V, bool]:
        """Return (value, hit). On a miss, ``loader()`` runs once and its time is recorded."""
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                self.stats.hits += 1
                return self._data[key], True
            start = time.perf_counter()
            value = loader()
            self.stats.load_seconds += time.perf_counter() - start
            self.stats.misses += 1
            self._data[key] = value
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)
                self.stats.evictions += 1
            return value, False

    def resize(self, maxsize: int) -> None:
        with self._lock:
            self.maxsize = max(1, maxsize)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)
                self.stats.evictions += 1

    def snapshot(self) -> CacheStats:
        with self._lock:
            return CacheStats(**self.stats.as_dict())

    def clear(self) -> None:
        with self._lock:
            self._data.clear()


# The worker-global caches. Models (weights on a device) and scorers (a model prepared for one
# candidate set) are cached separately: a backfill over dates with different catalog snapshots
# reloads no weights, only re-gathers the candidate rows. INT8 holds, under the model's own key, what
# scoring.dtype=int8 derives from a model (its int8 encoder layers and item matrix,
# recsys.model.int8.Int8Model): quantized once per model load, whatever the candidate sets.
MODELS: BoundedCache = BoundedCache(maxsize=2)
SCORERS: BoundedCache = BoundedCache(maxsize=2)
INT8: BoundedCache = BoundedCache(maxsize=2)


def worker_identity() -> dict:
    """Which Python worker this is (the unit the cache lives in), and which interpreter runs it.

    ``python`` shows on a cluster whether the worker runs the shipped environment (``./environment``).
    """
    return {"host": socket.gethostname(), "pid": os.getpid(), "python": sys.executable}
