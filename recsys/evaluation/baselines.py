"""The baselines every evaluation reports next to the project's models: popularity and Spark ALS.

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
"""
from __future__ import annotations

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

    def label(self) -> str:
        return f"rank={self.rank} reg={self.reg_param:g} alpha={self.alpha:g}"


@dataclass
class ALSSearch:
    """The grid, each point's validation score, the chosen point, and the refitted test scorer."""

    chosen: ALSParams
    chosen_score: float          # its validation NDCG@10
    scorer: FactorScorer
    grid: list[dict[str, Any]] = field(default_factory=list)   # params + validation metric + seconds


def als_grid(ranks: list[int], reg_params: list[float], alphas: list[float], max_iter: int, seed: int) -> list[ALSParams]:
    return [ALSParams(r, g, a, max_iter, seed) for r, g, a in itertools.product(ranks, reg_params, alphas)]


def fit_als_scorer(spark, phase: Phase, params: ALSParams) -> FactorScorer:
    """Fit implicit ALS on ``phase.history`` and return a scorer from its collected factors."""
    from pyspark.ml.recommendation import ALS

    users = np.repeat(np.arange(len(phase.history), dtype=np.int32), phase.history.lengths)
    item_ids, items = np.unique(phase.history.items, return_inverse=True)
    if len(item_ids) == 0:
        raise ValueError("ALS needs at least one interaction in the phase history")
    import pandas as pd

    frame = spark.createDataFrame(pd.DataFrame({"user": users, "item": items.astype(np.int32),
                                                "rating": np.ones(len(users), dtype=np.float32)}))
    als = ALS(rank=params.rank, regParam=params.reg_param, alpha=params.alpha, maxIter=params.max_iter,
              implicitPrefs=True, seed=params.seed, userCol="user", itemCol="item", ratingCol="rating",
              coldStartStrategy="nan")
    model = als.fit(frame)
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
