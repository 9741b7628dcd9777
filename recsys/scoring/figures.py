"""What the scoring tasks report, as records: one per task, and the run's totals and per-worker figures.

Each task builds a :class:`TaskFigures` on its executor from the scoring core's chunk statistics
(:class:`recsys.scoring.core.ChunkStats`), the worker caches' statistics before and after the task
(:class:`recsys.scoring.cache.CacheStats`), its in-pass checks and comparison, and ships it back as one
JSON statistics row (:mod:`recsys.scoring.udf`): executor figures travel as data, never as accumulators,
so Spark Connect works too. The driver reads the rows back (:meth:`TaskFigures.from_json`) and adds them
up into :class:`WorkerFigures`: the stage log, the run's metrics, the manifest's ``workers``, the
per-worker MLflow series, validation, the guard, the benchmark and the on-demand frontend read its
attributes, and :meth:`WorkerFigures.metrics` gives the figures that become the run's metrics.

The names of the additive figures come from the records' fields, so a counter added to ``ChunkStats``
reaches the metrics without being spelled again anywhere.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable, Mapping

import numpy as np

from recsys.scoring.cache import CacheUse
from recsys.scoring.checks import TASK_CHECKS
from recsys.scoring.compare import merge as merge_comparisons
from recsys.scoring.core import ChunkStats


# the caches a task reports, and the name of the seconds its misses took in the metrics
CACHES = (("model", "load_s"), ("scorer", "load_s"), ("int8", "build_s"))


@dataclass(frozen=True)
class TaskSums:
    """The figures that add up over tasks (per worker and per run).

    ``model.hits`` counts tasks that found the weights already loaded in their worker (the scorer cache
    sits in front of the model cache, so the model cache's own hit count misses the tasks whose whole
    scorer was cached); ``model.misses`` counts the loads. ``int8``: scoring.dtype=int8's quantized
    parts, built once per model load.
    """

    chunks: ChunkStats = field(default_factory=ChunkStats)
    model: CacheUse = CacheUse()
    scorer: CacheUse = CacheUse()
    int8: CacheUse = CacheUse()
    task_s: float = 0.0
    check_s: float = 0.0

    def __add__(self, other: "TaskSums") -> "TaskSums":
        chunks = ChunkStats(**{f.name: getattr(self.chunks, f.name) + getattr(other.chunks, f.name)
                               for f in fields(ChunkStats)})
        return TaskSums(chunks, self.model + other.model, self.scorer + other.scorer, self.int8 + other.int8,
                        self.task_s + other.task_s, self.check_s + other.check_s)

    def as_dict(self) -> dict[str, int | float]:
        """Flat, by metric name: the chunk statistics, ``<cache>_hits|misses|load_s`` (``int8_build_s``),
        ``task_s``, ``check_s``."""
        out: dict[str, int | float] = dict(asdict(self.chunks))
        for name, seconds in CACHES:
            use: CacheUse = getattr(self, name)
            out.update({f"{name}_hits": use.hits, f"{name}_misses": use.misses, f"{name}_{seconds}": use.load_s})
        out.update(task_s=self.task_s, check_s=self.check_s)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TaskSums":
        chunks = ChunkStats(**{f.name: data.get(f.name, f.default) for f in fields(ChunkStats)})
        caches = {name: CacheUse(int(data.get(f"{name}_hits", 0)), int(data.get(f"{name}_misses", 0)),
                                 float(data.get(f"{name}_{seconds}", 0.0))) for name, seconds in CACHES}
        return cls(chunks, **caches, task_s=float(data.get("task_s", 0.0)), check_s=float(data.get("check_s", 0.0)))


@dataclass(frozen=True)
class TaskFigures:
    """What one scoring task reports: which worker ran it, on what, and its sums, checks and comparison."""

    host: str
    pid: int
    python: str                        # the worker's interpreter: on a cluster, whether it runs the shipped environment
    partition: int
    attempt: int                       # > 0: the task succeeded only on a retry
    device: str
    gpus: str                          # the GPU address(es) Spark assigned to the task; "" without GPU scheduling
    threads: int | None                # torch threads on a CPU; None on a GPU
    peak_rss_mb: float
    sums: TaskSums
    checks: Mapping[str, Any]          # recsys.scoring.checks.TaskChecks.finish: counts and item_counts
    compare: Mapping[str, Any] | None  # recsys.scoring.compare.TaskComparison.finish; None: not asked for

    def to_json(self) -> str:
        """The statistics row's payload (plain JSON; the sums flat, by metric name)."""
        return json.dumps({"host": self.host, "pid": self.pid, "python": self.python, "partition": self.partition,
                           "attempt": self.attempt, "device": self.device, "gpus": self.gpus, "threads": self.threads,
                           "peak_rss_mb": self.peak_rss_mb, **self.sums.as_dict(), "checks": self.checks,
                           "compare": self.compare})

    @classmethod
    def from_json(cls, text: str) -> "TaskFigures":
        data = json.loads(text)
        return cls(host=data["host"], pid=int(data["pid"]), python=data.get("python", ""),
                   partition=int(data.get("partition", -1)), attempt=int(data.get("attempt", 0)),
                   device=data["device"], gpus=data.get("gpus", ""), threads=data.get("threads"),
                   peak_rss_mb=float(data["peak_rss_mb"]), sums=TaskSums.from_dict(data),
                   checks=data.get("checks") or {}, compare=data.get("compare"))


@dataclass(frozen=True)
class Worker:
    """One Python worker's tasks added up: the unit the model cache lives in."""

    host: str
    pid: int
    python: str
    gpus: str
    tasks: int
    sums: TaskSums

    def as_dict(self) -> dict[str, Any]:
        """As ``worker_stats.json`` lists it (figures as floats, as they always were there)."""
        return {"host": self.host, "pid": self.pid, "python": self.python, "gpus": self.gpus,
                **{k: float(v) for k, v in self.sums.as_dict().items()}, "tasks": float(self.tasks)}


@dataclass(frozen=True)
class CheckTotals:
    """The tasks' validation counts (:data:`recsys.scoring.checks.TASK_CHECKS`) and how often each item
    was recommended, summed over the run."""

    counts: Mapping[str, int]
    item_ids: np.ndarray               # [I] int64, sorted
    item_times: np.ndarray             # [I] int64

    @classmethod
    def of(cls, tasks: Iterable[TaskFigures]) -> "CheckTotals":
        tasks = list(tasks)
        counts = {name: sum(int(t.checks.get(name, 0)) for t in tasks) for name in TASK_CHECKS}
        with_counts = [t.checks["item_counts"] for t in tasks if "item_counts" in t.checks]
        ids = [np.asarray(c[0], dtype=np.int64) for c in with_counts]
        times = [np.asarray(c[1], dtype=np.int64) for c in with_counts]
        all_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        item_ids, inverse = np.unique(all_ids, return_inverse=True)
        item_times = np.bincount(inverse, weights=np.concatenate(times) if times else None,
                                 minlength=len(item_ids)).astype(np.int64)
        return cls(counts, item_ids, item_times)


@dataclass(frozen=True)
class WorkerFigures:
    """The scoring pass's figures: run totals, per-worker cache figures, the tasks' checks and comparison."""

    totals: TaskSums
    tasks: int
    task_retries: int                  # successful attempts after a failure
    device: str                        # the devices the tasks ran on, comma-separated ("none": no task)
    gpus: str                          # GPU addresses Spark assigned to the tasks
    worker_rss_mb_max: float           # NaN when no task reported
    workers: tuple[Worker, ...]
    checks: CheckTotals
    compare: Mapping[str, Any] | None  # the tasks' merged comparison (recsys.scoring.compare.merge); None: not asked

    @classmethod
    def of(cls, tasks: Iterable[TaskFigures]) -> "WorkerFigures":
        tasks = list(tasks)
        by_worker: dict[tuple[str, int], list[TaskFigures]] = defaultdict(list)
        for task in tasks:
            by_worker[(task.host, task.pid)].append(task)
        workers = tuple(
            Worker(host, pid, ts[-1].python, ",".join(sorted({g for t in ts for g in t.gpus.split(",") if g})), len(ts),
                   sum((t.sums for t in ts), TaskSums()))
            for (host, pid), ts in sorted(by_worker.items()))
        return cls(totals=sum((t.sums for t in tasks), TaskSums()), tasks=len(tasks),
                   task_retries=sum(1 for t in tasks if t.attempt > 0),
                   device=",".join(sorted({t.device for t in tasks})) or "none",
                   gpus=",".join(sorted({g for t in tasks for g in t.gpus.split(",") if g})),
                   worker_rss_mb_max=max((t.peak_rss_mb for t in tasks), default=float("nan")),
                   workers=workers, checks=CheckTotals.of(tasks),
                   compare=merge_comparisons(t.compare for t in tasks))

    @classmethod
    def from_rows(cls, rows: Iterable[str]) -> "WorkerFigures":
        """From the tasks' statistics rows (their JSON payloads)."""
        return cls.of(TaskFigures.from_json(row) for row in rows)

    @property
    def users(self) -> int:
        return self.totals.chunks.users

    @property
    def model_loads_per_worker_max(self) -> float:
        return float(max((w.sums.model.misses for w in self.workers), default=0))

    @property
    def model_load_s_max(self) -> float:
        return max((w.sums.model.load_s for w in self.workers), default=0.0)

    def metrics(self) -> dict[str, int | float]:
        """The figures that are run metrics (and the manifest's), by name: the totals, then the task,
        worker and memory figures."""
        return {**self.totals.as_dict(), "tasks": self.tasks, "task_retries": self.task_retries,
                "workers": len(self.workers), "model_loads_per_worker_max": self.model_loads_per_worker_max,
                "model_load_s_max": self.model_load_s_max, "worker_rss_mb_max": self.worker_rss_mb_max}
