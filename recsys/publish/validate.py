"""Validation of the scored output before anything is published, and the profile the run reports.

The nightly job validates in its scoring pass, with no second pass over the output and no join:

- each scoring task checks the rows it emits against the histories and candidates it has in hand
  (:mod:`recsys.scoring.checks`: users missing, unexpected or twice, excluded items, unavailable items,
  unexplained short lists, and how often each item was recommended), and reports the counts with
  its statistics row;
- the rows' own checks (list length, distinct items, finite and ordered scores, source, model
  version) are Spark aggregates observed on the rows as they are written (:func:`row_checks`), so
  they see exactly what lands in staging;
- the driver adds the totals: rows out = users in (``row_count_mismatch``).

:func:`in_pass_report` turns those figures into the report. A non-zero count on any check fails
the run: nothing is published and the report says what was wrong.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
from pyspark.sql import Column
from pyspark.sql import functions as F

from recsys.data.contracts import SOURCE_MODEL
from recsys.scoring.checks import TASK_CHECKS

# check name -> what a violation means (the report and the README use the same words)
CHECKS = {
    "missing_users": "users with history in the window but no output row",
    "unexpected_users": "output rows for users without history in the window",
    "null_user_ids": "output rows without a user id",
    "duplicate_rows": "users with more than one output row",
    "empty_lists": "rows without any recommendation",
    "too_long_lists": "rows with more than top_n items",
    "short_lists_unexplained": "rows shorter than top_n although enough unseen items were available",
    "duplicate_items": "rows recommending an item twice",
    "excluded_items": "rows recommending an item excluded for the user (by the rules, or from the user's history "
                      "while known items are masked)",
    "unavailable_items": "recommended items not available in the catalog snapshot used",
    "nonfinite_scores": "rows with a NaN, infinite or null score",
    "unordered_scores": "rows whose scores are not in descending order",
    "unknown_source": "rows whose source is neither the model nor the named fallback",
    "wrong_model_version": "rows stamped with another model version",
    "row_count_mismatch": "difference between the output rows and the users counted while the histories were built",
}


@dataclass
class ValidationReport:
    violations: dict[str, int]
    figures: dict[str, Any] = field(default_factory=dict)
    item_counts: tuple[np.ndarray, np.ndarray] | None = None  # (item_ids, times recommended)

    @property
    def passed(self) -> bool:
        return not any(self.violations.values())

    def failures(self) -> list[str]:
        return [f"{name}={count} ({CHECKS[name]})" for name, count in self.violations.items() if count]

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "violations": dict(self.violations), "figures": dict(self.figures),
                "checks": dict(CHECKS)}


# the checks row_checks counts (the rest are the tasks' or the driver's)
ROW_CHECKS = ("null_user_ids", "empty_lists", "too_long_lists", "duplicate_items", "nonfinite_scores",
              "unordered_scores", "unknown_source", "wrong_model_version")


def row_checks(*, top_n: int, fallback_name: str, model_version: str, where: Column | None = None) -> list[Column]:
    """Aggregates over output rows (user_id, recommendations, source, model_version) for the checks
    a row answers alone, plus the figures the report carries: usable in ``agg`` and in ``observe``.
    ``where``: count only the rows where it holds (a join's output side)."""
    ids = F.transform("recommendations", lambda x: x["item_id"])
    scores = F.transform("recommendations", lambda x: x["score"])
    size = F.size(ids)
    pairs = F.zip_with(
        F.slice(scores, 1, F.greatest(size - 1, F.lit(0))),
        F.slice(scores, 2, F.greatest(size - 1, F.lit(0))),
        lambda a, b: a >= b,
    )
    on = F.lit(True) if where is None else where
    return [
        F.count_if(on).alias("rows"),
        F.count_if(on & F.col("user_id").isNull()).alias("null_user_ids"),
        F.count_if(on & (size == 0)).alias("empty_lists"),
        F.count_if(on & (size > top_n)).alias("too_long_lists"),
        F.count_if(on & (F.size(F.array_distinct(ids)) != size)).alias("duplicate_items"),
        F.count_if(on & F.exists(scores, lambda s: s.isNull() | F.isnan(s) | (F.abs(s) == F.lit(float("inf"))))).alias("nonfinite_scores"),
        F.count_if(on & ~F.forall(pairs, lambda ok: ok)).alias("unordered_scores"),
        F.count_if(on & ~F.col("source").isin(SOURCE_MODEL, fallback_name)).alias("unknown_source"),
        F.count_if(on & (F.col("model_version") != F.lit(model_version))).alias("wrong_model_version"),
        F.count_if(on & (F.col("source") == F.lit(fallback_name))).alias("fallback_rows"),
        F.count_if(on & (size < top_n)).alias("short_lists"),
        F.coalesce(F.sum(F.when(on, size)), F.lit(0)).alias("recommended_items"),
    ]


def in_pass_report(observed: Mapping[str, Any], tasks: Mapping[str, int], item_counts: tuple[np.ndarray, np.ndarray],
                   *, candidate_ids: np.ndarray, users_in_window: int) -> ValidationReport:
    """The report from the scoring pass's figures: ``observed`` (:func:`row_checks` over the written
    rows), ``tasks`` (the tasks' summed :data:`recsys.scoring.checks.TASK_CHECKS`) and the summed
    per-item counts."""
    violations = {name: int(observed.get(name) or 0) for name in ROW_CHECKS}
    violations.update({name: int(tasks.get(name) or 0) for name in TASK_CHECKS})
    rows = int(observed.get("rows") or 0)
    violations["row_count_mismatch"] = abs(rows - users_in_window)
    item_ids, times = item_counts
    n_candidates = len(candidate_ids)
    available = np.isin(item_ids, np.asarray(candidate_ids, dtype=np.int64))
    figures = {
        "rows": rows,
        "fallback_rows": int(observed.get("fallback_rows") or 0),
        "short_lists": int(observed.get("short_lists") or 0),
        "recommended_items": int(observed.get("recommended_items") or 0),
        "distinct_items_recommended": int(len(item_ids)),
        "catalog_coverage": float(available.sum() / n_candidates) if n_candidates else 0.0,
    }
    return ValidationReport({name: violations[name] for name in CHECKS}, figures, (item_ids, times))
