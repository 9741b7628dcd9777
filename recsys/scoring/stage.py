"""The scoring stage as a DataFrame transform: histories in, scored rows out, worker figures observed.

Shared by the nightly job and the benchmark, so what ``recsys bench`` measures as "the job's
scoring stage" is the job's code, not a copy.
"""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F

from recsys.scoring.udf import SCORED_DDL, STATS_COLUMN, ScoringSpec, make_partition_scorer

# run totals and per-worker figures; see worker_figures for the keys
WorkerFigures = dict[str, Any]

_SUMMED = ("users", "model_users", "fallback_users", "nonfinite_users", "short_lists", "chunks", "history_items",
           "unknown_items", "encode_s", "score_s", "to_arrow_s", "model_hits", "model_misses", "model_load_s",
           "scorer_hits", "scorer_misses", "scorer_load_s", "task_s")


def score_histories(histories: DataFrame, spec: ScoringSpec, partitions: int = 0) -> tuple[DataFrame, Observation]:
    """-> (rows in the output contract's columns, an Observation that fills when an action runs).

    Workers append one statistics row per task; it is observed (``worker_figures``) and dropped
    here, so the returned frame holds recommendations only.
    """
    to_score = histories if partitions == 0 else histories.repartition(partitions)
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
    rss = []
    for row in rows:
        key = (row["host"], row["pid"])
        for name in _SUMMED:
            totals[name] += row.get(name, 0) or 0
            per_worker[key][name] += row.get(name, 0) or 0
        per_worker[key]["tasks"] += 1
        devices.add(row["device"])
        rss.append(row["peak_rss_mb"])
    workers = [{"host": h, "pid": p, **dict(v)} for (h, p), v in sorted(per_worker.items())]
    out: dict[str, Any] = {name: (float(totals[name]) if name.endswith("_s") else int(totals[name])) for name in _SUMMED}
    out.update(
        tasks=len(rows),
        task_retries=sum(1 for row in rows if row.get("attempt", 0) > 0),  # successful attempts after a failure
        workers=len(workers),
        model_loads_per_worker_max=max((w["model_misses"] for w in workers), default=0),
        model_load_s_max=max((w["model_load_s"] for w in workers), default=0.0),
        worker_rss_mb_max=max(rss, default=float("nan")),
        device=",".join(sorted(devices)) or "none",
        per_worker=workers,
    )
    return out
