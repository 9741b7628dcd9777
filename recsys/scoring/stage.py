"""The scoring stage as a DataFrame transform: histories in, scored rows out, worker figures observed.

Shared by the nightly job and the benchmark, so what ``recsys bench`` measures as "the job's
scoring stage" is the job's code, not a copy.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Any

import numpy as np
from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F

from recsys.scoring.checks import TASK_CHECKS
from recsys.scoring.compare import merge as merge_comparisons
from recsys.scoring.udf import SCORED_DDL, STATS_COLUMN, ScoringSpec, make_partition_scorer

# run totals and per-worker figures; see worker_figures for the keys
WorkerFigures = dict[str, Any]

_SUMMED = ("users", "model_users", "fallback_users", "nonfinite_users", "short_lists", "chunks", "history_items",
           "unknown_items", "encode_s", "score_s", "to_arrow_s", "model_hits", "model_misses", "model_load_s",
           "scorer_hits", "scorer_misses", "scorer_load_s", "int8_hits", "int8_misses", "int8_build_s", "task_s",
           "check_s")


def scoring_tasks(users: int, *, partitions: int, users_per_task: int, cores: int | None) -> int:
    """How many tasks score ``users`` users: ``partitions`` when set, else enough for at most
    ``users_per_task`` users each, rounded up to a multiple of ``cores`` (when known) so the last
    wave keeps every core busy. 0: keep Spark's split (small inputs: one task per file split).

    Why not keep Spark's split always: reading the histories back, Spark packs files into one split
    per core, so a 2-core run scored 864,120 users in 2 tasks of 16 minutes each. Progress (tasks
    done, users from finished tasks) then said nothing for 16 minutes, and a lost executor lost half
    the run. Tasks of ``users_per_task`` users finish every few seconds to a minute, at the cost of
    one hash shuffle of the histories (a few seconds per million users).
    """
    if partitions:
        return partitions
    if users <= users_per_task:
        return 0
    tasks = math.ceil(users / users_per_task)
    if cores and cores > 0:
        tasks = math.ceil(tasks / cores) * cores
    return tasks


def score_histories(histories: DataFrame, spec: ScoringSpec, partitions: int = 0) -> tuple[DataFrame, Observation]:
    """-> (rows in the output contract's columns, an Observation that fills when an action runs).

    Workers append one statistics row per task; it is observed (``worker_figures``) and dropped
    here, so the returned frame holds recommendations only.
    """
    # hash by user: deterministic (a retried task gets the same users), and no sort before the shuffle
    to_score = histories if partitions == 0 else histories.repartition(partitions, "user_id")
    observation = Observation("scoring")
    scored = to_score.mapInArrow(make_partition_scorer(spec), SCORED_DDL).observe(
        observation,
        F.collect_list(STATS_COLUMN).alias("worker_stats"),
        F.count_if(F.col("user_id").isNotNull()).alias("rows"),
    )
    return scored.filter(F.col("user_id").isNotNull()).drop(STATS_COLUMN), observation


def worker_figures(observation: Observation) -> WorkerFigures:
    """Per-task statistics rows -> run totals and per-worker cache figures."""
    rows = [json.loads(s) for s in observation.get["worker_stats"]]
    per_worker: dict[tuple, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    totals: dict[str, float] = defaultdict(float)
    devices = set()
    gpus: dict[tuple, set[str]] = defaultdict(set)
    pythons: dict[tuple, str] = {}
    rss = []
    for row in rows:
        key = (row["host"], row["pid"])
        pythons[key] = row.get("python", "")
        gpus[key].update(g for g in row.get("gpus", "").split(",") if g)
        for name in _SUMMED:
            totals[name] += row.get(name, 0) or 0
            per_worker[key][name] += row.get(name, 0) or 0
        per_worker[key]["tasks"] += 1
        devices.add(row["device"])
        rss.append(row["peak_rss_mb"])
    workers = [{"host": h, "pid": p, "python": pythons[(h, p)], "gpus": ",".join(sorted(gpus[(h, p)])), **dict(v)}
               for (h, p), v in sorted(per_worker.items())]
    checks = {name: sum(int(row.get("checks", {}).get(name, 0)) for row in rows) for name in TASK_CHECKS}
    ids = [np.asarray(row["checks"]["item_counts"][0], dtype=np.int64) for row in rows if "checks" in row]
    times = [np.asarray(row["checks"]["item_counts"][1], dtype=np.int64) for row in rows if "checks" in row]
    all_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    item_ids, inverse = np.unique(all_ids, return_inverse=True)
    item_times = np.bincount(inverse, weights=np.concatenate(times) if times else None,
                             minlength=len(item_ids)).astype(np.int64)
    out: dict[str, Any] = {name: (float(totals[name]) if name.endswith("_s") else int(totals[name])) for name in _SUMMED}
    out.update(
        tasks=len(rows),
        task_retries=sum(1 for row in rows if row.get("attempt", 0) > 0),  # successful attempts after a failure
        workers=len(workers),
        model_loads_per_worker_max=max((w["model_misses"] for w in workers), default=0),
        model_load_s_max=max((w["model_load_s"] for w in workers), default=0.0),
        worker_rss_mb_max=max(rss, default=float("nan")),
        device=",".join(sorted(devices)) or "none",
        gpus=",".join(sorted(set().union(*gpus.values()))),   # GPU addresses Spark assigned to the tasks
        per_worker=workers,
        checks={**checks, "item_ids": item_ids, "item_times": item_times},   # the tasks' validation counts
        compare=merge_comparisons(row.get("compare") for row in rows),       # None unless the spec asked for it
    )
    return out
