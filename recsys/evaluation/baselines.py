"""The baselines every evaluation reports next to the project's models: popularity and Spark ALS; and the
lists the backtest (``recsys backtest``) sets beside the job's every night.

- **popularity**: items ranked by how many users have them in their phase history.
- **Spark ALS** (``pyspark.ml.recommendation.ALS``, implicit feedback, every interaction a 1): a
  small grid over rank, regularisation and alpha, each point fitted on the validation phase's
  histories and scored on the validation targets; the best point by validation NDCG@10 is refitted
  on the test phase's histories (which add the validation interactions — ALS has no other way to
  use them) and only that refit is tested.

ALS is scored from its collected user and item factors under exactly the masking the other models
get (:mod:`recsys.evaluation.ranking`), never with ``recommendForUserSubset``, which silently drops
users it does not know. A user ALS has no factors for scores 0 everywhere: every item ties, and
ties count against the target, so such a user is a miss.

The backtest's lists (the second half of this module) are Spark DataFrame code from end to end, so they
scale with the events: nothing per user reaches the driver. Each is a DataFrame ``user_id, items``
(``array<bigint>``, best first, at most ``n``) for the users asked about, over the available items:

- **personal frequency** (:func:`personal_frequency_lists`): the user's own items by time-decayed count;
- **the same padded with recent popularity** (:func:`padded_lists`);
- **recent popularity** (:func:`popularity_ranking`, :func:`popularity_lists`), the user's history masked or not;
- **Spark ALS** (:func:`als_lists`), implicit, its ``recommendForUserSubset`` over-fetched and then
  filtered (unavailable items always, the user's history when masked). Users it does not know get no list
  (and score 0), never silently fewer users.
"""
from __future__ import annotations

import datetime as dt
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from recsys.evaluation.protocols import Phase
from recsys.evaluation.ranking import VALID_SELECTION, ConstantScorer, FactorScorer, interaction_counts
from recsys.model.metrics import SELECTION_METRIC

log = logging.getLogger(__name__)


def popularity_scorer(phase: Phase) -> ConstantScorer:
    return ConstantScorer(interaction_counts(phase))


@dataclass(frozen=True)
class ALSParams:
    rank: int
    reg_param: float
    alpha: float
    max_iter: int = 10
    seed: int = 42
    blocks: int = 10        # user blocks and item blocks (Spark's numUserBlocks, numItemBlocks; its default 10)

    def label(self) -> str:
        return f"rank={self.rank} reg={self.reg_param:g} alpha={self.alpha:g}"


@dataclass
class ALSSearch:
    """The grid, each point's validation score, the chosen point, and the refitted test scorer."""

    chosen: ALSParams
    chosen_score: float          # its validation NDCG@10
    scorer: FactorScorer
    grid: list[dict[str, Any]] = field(default_factory=list)   # params + validation metric + seconds


def als_grid(ranks: list[int], reg_params: list[float], alphas: list[float], max_iter: int, seed: int,
             blocks: int) -> list[ALSParams]:
    return [ALSParams(r, g, a, max_iter, seed, blocks) for r, g, a in itertools.product(ranks, reg_params, alphas)]


def als_estimator(params: ALSParams, *, user_col: str = "user", item_col: str = "item", rating_col: str = "rating",
                  cold_start: str = "nan"):
    """Spark's implicit ALS with ``params``: the one configuration evaluation and the backtest fit.

    The blocks are a setting because they are not only a matter of speed: each block's factors start from a
    random draw seeded by the seed and the block, so another number of blocks is another initialisation, and
    after 10 iterations other factors and other lists. A small session wants fewer than Spark's 10 (each
    iteration shuffles between the blocks and ``recommendForUserSubset`` runs a task per pair of them)."""
    from pyspark.ml.recommendation import ALS

    return ALS(rank=params.rank, regParam=params.reg_param, alpha=params.alpha, maxIter=params.max_iter,
               implicitPrefs=True, seed=params.seed, userCol=user_col, itemCol=item_col, ratingCol=rating_col,
               coldStartStrategy=cold_start, numUserBlocks=params.blocks, numItemBlocks=params.blocks)


def fit_als_scorer(spark, phase: Phase, params: ALSParams) -> FactorScorer:
    """Fit implicit ALS on ``phase.history`` and return a scorer from its collected factors."""
    users = np.repeat(np.arange(len(phase.history), dtype=np.int32), phase.history.lengths)
    item_ids, items = np.unique(phase.history.items, return_inverse=True)
    if len(item_ids) == 0:
        raise ValueError("ALS needs at least one interaction in the phase history")
    import pandas as pd

    frame = spark.createDataFrame(pd.DataFrame({"user": users, "item": items.astype(np.int32),
                                                "rating": np.ones(len(users), dtype=np.float32)}))
    model = als_estimator(params).fit(frame)
    user_f = _factors(model.userFactors.toArrow(), len(phase.history), params.rank)    # [U, r], 0 if unknown
    item_f = _factors(model.itemFactors.toArrow(), len(item_ids), params.rank)         # [I, r]
    user_t = torch.from_numpy(user_f)
    return FactorScorer(phase, item_ids, torch.from_numpy(item_f), lambda rows: user_t[torch.from_numpy(rows)])


def search_als(spark, valid: Phase, test: Phase, grid: list[ALSParams],
               validate: Callable[[FactorScorer], float]) -> ALSSearch:
    """Choose the grid point by ``validate`` (the selection metric on validation, NDCG@10) and refit it on the test phase's histories."""
    if not grid:
        raise ValueError("the ALS grid is empty: give at least one rank, reg_param and alpha")
    rows, best, best_score = [], None, -np.inf
    for params in grid:
        started = time.perf_counter()
        score = validate(fit_als_scorer(spark, valid, params))
        seconds = time.perf_counter() - started
        log.info("[evaluate] ALS %s: validation %s %.4f (%.1f s)", params.label(), SELECTION_METRIC, score, seconds)
        rows.append({"rank": params.rank, "reg_param": params.reg_param, "alpha": params.alpha,
                     VALID_SELECTION: score, "seconds": seconds})
        if score > best_score:
            best, best_score = params, score
    assert best is not None
    return ALSSearch(chosen=best, chosen_score=best_score, scorer=fit_als_scorer(spark, test, best), grid=rows)


def _factors(table, n: int, rank: int) -> np.ndarray:
    """Collected ALS factors (id, features) -> dense [n, rank]; ids without factors stay zero."""
    out = np.zeros((n, rank), dtype=np.float32)
    ids = table.column("id").to_numpy()
    if len(ids):
        features = np.asarray(table.column("features").combine_chunks().flatten().to_numpy(zero_copy_only=False),
                              dtype=np.float32).reshape(len(ids), rank)
        out[ids] = features
    return out


# --------------------------------------------------------------------------------------------
# The backtest's lists: Spark DataFrames, user_id + items (array<bigint>, best first).

LIST_COLUMN = "items"
MAX_OVERFETCH = 2000       # most items fetched (ALS) or ranked (popularity) beyond n to mask a history: longer
                           # histories may leave a masked list short
_INT_MAX = 2**31 - 1       # ALS ids are Spark integers


def ranked_lists(ranked, n: int, *keys):
    """``user_id, item_id`` + sort ``keys`` (Columns, best first) -> ``user_id, items``: each user's first ``n``.

    One window over each user's candidates, then the first ``n`` gathered in order: no per-user Python.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    place = F.row_number().over(Window.partitionBy("user_id").orderBy(*keys))
    kept = ranked.select("user_id", "item_id", place.alias("_place")).where(F.col("_place") <= n)
    entries = F.array_sort(F.collect_list(F.struct(F.col("_place"), F.col("item_id"))))
    return kept.groupBy("user_id").agg(F.transform(entries, lambda e: e["item_id"]).alias(LIST_COLUMN))


def personal_frequency_lists(past, users, available, night: dt.date, n: int, half_life_days: float, seed: int):
    """Each of ``users``' own available items, by time-decayed event count, best first.

    ``past``: ``user_id, item_id, ts`` (the events before ``night``); an event ``a`` days before the night's
    start weighs ``2 ** (-a / half_life_days)``. Ties (equal weight) go to the item touched last, then to a
    seeded hash of (user, item), never to the item id.
    """
    from pyspark.sql import functions as F

    start = dt.datetime.combine(night, dt.time())
    age_days = (F.lit(start).cast("double") - F.col("ts").cast("double")) / 86_400.0
    weight = F.pow(F.lit(2.0), -age_days / F.lit(float(half_life_days)))
    scored = (past.join(users.select("user_id"), "user_id", "left_semi").join(available, "item_id", "left_semi")
              .groupBy("user_id", "item_id").agg(F.sum(weight).alias("_score"), F.max("ts").alias("_last")))
    tie = F.xxhash64(F.col("user_id"), F.col("item_id"), F.lit(seed))
    return ranked_lists(scored, n, F.col("_score").desc(), F.col("_last").desc(), tie)


def popularity_ranking(past, available, night: dt.date, days: int, length: int, seed: int):
    """One row, ``ranking``: the ``length`` available items most users touched in the ``days`` days before
    ``night``, best first (ties: a seeded hash of the item, never its id)."""
    from pyspark.sql import functions as F

    since = dt.datetime.combine(night - dt.timedelta(days=days), dt.time())
    counted = (past.where(F.col("ts") >= F.lit(since)).join(available, "item_id", "left_semi")
               .groupBy("item_id").agg(F.countDistinct("user_id").alias("_users"))
               .withColumn("_tie", F.xxhash64(F.col("item_id"), F.lit(seed))))
    top = counted.orderBy(F.col("_users").desc(), F.col("_tie")).limit(length)
    entries = F.array_sort(F.collect_list(F.struct((-F.col("_users")).alias("u"), F.col("_tie"), F.col("item_id"))))
    return top.agg(F.transform(entries, lambda e: e["item_id"]).alias("ranking"))


def popularity_lists(users, ranking, n: int, *, masked: bool):
    """``ranking``'s first ``n`` items for each of ``users`` (``user_id, seen``); ``masked``: without the
    user's ``seen`` items. ``array_except`` keeps the ranking's order (and each item once)."""
    from pyspark.sql import functions as F

    items = F.array_except("ranking", "seen") if masked else F.col("ranking")
    return users.select("user_id", "seen").crossJoin(F.broadcast(ranking)).select(
        "user_id", F.slice(items, 1, n).alias(LIST_COLUMN))


def padded_lists(users, personal, ranking, n: int):
    """Each user's ``personal`` list, its free places filled with ``ranking``'s items not already in it."""
    from pyspark.sql import functions as F

    own = F.coalesce(F.col("p." + LIST_COLUMN), F.array().cast("array<bigint>"))
    return (users.select("user_id").alias("u").join(personal.alias("p"), "user_id", "left")
            .crossJoin(F.broadcast(ranking))
            .select("user_id", F.slice(F.concat(own, F.array_except("ranking", own)), 1, n).alias(LIST_COLUMN)))


@dataclass(frozen=True)
class ALSLists:
    """The two ALS lists of a night (history kept, history masked) and what the fit saw."""

    unmasked: Any
    masked: Any
    fetched: int            # items fetched per user before filtering
    ids_remapped: bool      # ids outside Spark's integer range were numbered densely for the fit


def als_lists(past, users, available, n: int, params: ALSParams, max_seen: int, out_dir: str) -> ALSLists:
    """Implicit ALS fitted on ``past`` (each user's event count per item as the rating), asked for ``users``.

    ``recommendForUserSubset`` is asked for ``n`` plus the longest history among ``users`` (at most
    :data:`MAX_OVERFETCH` more) so that masking the history still leaves ``n`` items; then unavailable
    items are dropped always, the user's own items in the masked lists. Users ALS has no factors for are
    not in the result (they get no list). The fetched lists are written to ``out_dir`` and read back, so
    that both lists come from one ``recommendForUserSubset``.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    ratings = past.groupBy("user_id", "item_id").agg(F.count(F.lit(1)).cast("float").alias("rating"))
    bounds = ratings.agg(F.min("user_id"), F.max("user_id"), F.min("item_id"), F.max("item_id")).first()
    remap = bounds[0] is not None and not all(0 <= int(v) <= _INT_MAX for v in bounds)
    if remap:   # number ids densely (one window over the distinct ids: a narrow table)
        user_ids = ratings.select("user_id").distinct().withColumn("user", F.dense_rank().over(Window.orderBy("user_id")) - 1)
        item_ids = ratings.select("item_id").distinct().withColumn("item", F.dense_rank().over(Window.orderBy("item_id")) - 1)
    else:
        user_ids = ratings.select("user_id").distinct().withColumn("user", F.col("user_id").cast("int"))
        item_ids = ratings.select("item_id").distinct().withColumn("item", F.col("item_id").cast("int"))
    frame = ratings.join(user_ids, "user_id").join(item_ids, "item_id").select("user", "item", "rating")
    model = als_estimator(params, cold_start="drop").fit(frame)
    items_known = model.itemFactors.count()
    fetched = int(min(items_known, n + min(max(0, max_seen), MAX_OVERFETCH)))
    subset = users.select("user_id").join(user_ids, "user_id").select("user")
    recs = model.recommendForUserSubset(subset, max(1, fetched))
    exploded = (recs.select("user", F.posexplode("recommendations").alias("_pos", "r"))
                .select("user", "_pos", F.col("r.item").alias("item"))
                .join(user_ids, "user").join(item_ids, "item").select("user_id", "item_id", "_pos")
                .join(available, "item_id", "left_semi"))
    exploded.write.mode("overwrite").parquet(out_dir)
    exploded = exploded.sparkSession.read.parquet(out_dir)
    seen = past.select("user_id", "item_id").distinct()
    return ALSLists(unmasked=ranked_lists(exploded, n, F.col("_pos")),
                    masked=ranked_lists(exploded.join(seen, ["user_id", "item_id"], "left_anti"), n, F.col("_pos")),
                    fetched=fetched, ids_remapped=remap)
