"""The scoring stage as a DataFrame transform: histories in, scored rows out, worker figures observed.

Shared by the nightly job and the benchmark, so what ``recsys bench`` measures as "the job's
scoring stage" is the job's code, not a copy.
"""
from __future__ import annotations

import math

from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F

from recsys.scoring.figures import WorkerFigures
from recsys.scoring.udf import SCORED_DDL, STATS_COLUMN, ScoringSpec, make_partition_scorer


def scoring_tasks(users: int, *, partitions: int, users_per_task: int, cores: int | None,
                  exchange: bool = False) -> int:
    """How many tasks score ``users`` users: ``partitions`` when set, else enough for at most
    ``users_per_task`` users each, rounded up to a multiple of ``cores`` (when known) so the last
    wave keeps every core busy. 0: keep Spark's split (small inputs: one task per file split), unless
    ``exchange``: the histories go through an exchange by user anyway (the previous night's lists are
    brought next to them), which makes at least one task per core (one when the cores are unknown).

    Why not keep Spark's split always: reading the histories back, Spark packs files into one split
    per core, so a 2-core run scored 864,120 users in 2 tasks of 16 minutes each. Progress (tasks
    done, users from finished tasks) then said nothing for 16 minutes, and a lost executor lost half
    the run. Tasks of ``users_per_task`` users finish every few seconds to a minute, at the cost of
    one hash shuffle of the histories (a few seconds per million users).
    """
    if partitions:
        return partitions
    if users <= users_per_task:
        return max(1, cores or 1) if exchange else 0
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
    """The observed statistics rows -> the run's totals and per-worker cache figures."""
    return WorkerFigures.from_rows(observation.get["worker_stats"])
