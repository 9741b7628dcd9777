"""Each validation check fires on exactly the violation it names, and a correct output passes, checked as the
nightly job checks: in the scoring pass (recsys.scoring.checks) and on the rows as they are written."""
import numpy as np
import pytest

from recsys.publish.validate import CHECKS
from recsys.scoring.checks import ListRules

pytestmark = pytest.mark.spark

HISTORIES = [(1, [1, 2]), (2, [3]), (3, [4, 5, 6])]
GOOD = {
    1: [(3, 0.9), (4, 0.8), (5, 0.7)],
    2: [(1, 0.5), (2, 0.4), (4, 0.3)],
    3: [(1, 0.9), (2, 0.8), (3, 0.7)],
}
NAN = float("nan")

# check -> (how to spoil the good output, the checks expected to fire)
CASES = {
    "missing_users": (lambda rows: [r for r in rows if r[0] != 3], {"missing_users", "row_count_mismatch"}),
    "unexpected_users": (lambda rows: rows + [(4, GOOD[1], "model", "7")], {"unexpected_users", "row_count_mismatch"}),
    "null_user_ids": (lambda rows: rows + [(None, GOOD[1], "model", "7")], {"null_user_ids", "row_count_mismatch"}),
    "duplicate_rows": (lambda rows: rows + [rows[0]], {"duplicate_rows", "row_count_mismatch"}),
    "empty_lists": (lambda rows: _set(rows, 2, []), {"empty_lists", "short_lists_unexplained"}),
    "too_long_lists": (lambda rows: _set(rows, 2, GOOD[2] + [(5, 0.1)]), {"too_long_lists"}),
    "short_lists_unexplained": (lambda rows: _set(rows, 2, GOOD[2][:2]), {"short_lists_unexplained"}),
    "duplicate_items": (lambda rows: _set(rows, 2, [(1, 0.5), (1, 0.4), (4, 0.3)]), {"duplicate_items"}),
    "excluded_items": (lambda rows: _set(rows, 1, [(1, 0.9), (4, 0.8), (5, 0.7)]), {"excluded_items"}),
    "unavailable_items": (lambda rows: _set(rows, 2, [(1, 0.5), (2, 0.4), (99, 0.3)]), {"unavailable_items"}),
    "nonfinite_scores": (lambda rows: _set(rows, 2, [(1, NAN), (2, 0.4), (4, 0.3)]), {"nonfinite_scores"}),
    "unordered_scores": (lambda rows: _set(rows, 2, [(1, 0.3), (2, 0.4), (4, 0.5)]), {"unordered_scores"}),
    "unknown_source": (lambda rows: [(u, r, "random" if u == 3 else s, v) for u, r, s, v in rows], {"unknown_source"}),
    "wrong_model_version": (lambda rows: [(u, r, s, "6" if u == 3 else v) for u, r, s, v in rows],
                            {"wrong_model_version"}),
    "row_count_mismatch": (None, {"row_count_mismatch"}),   # the histories were read with 4 users, 3 were written
}


def _set(rows, user, recs):
    return [(u, recs if u == user else r, s, v) for u, r, s, v in rows]


def _good_rows():
    return [(u, recs, "model", "7") for u, recs in GOOD.items()]


def _validate(spark, rows, users_in_window=3):
    """The checks the way the nightly job runs them, inside the scoring pass: the tasks' checks (one task
    holding every row, as it emitted them) plus the row checks aggregated over the written rows, combined
    by the driver; no join, no second read."""
    import pyarrow as pa

    from recsys.data.contracts import RECOMMENDATION_TYPE
    from recsys.publish.validate import in_pass_report, row_checks
    from recsys.scoring.checks import TaskChecks

    out = pa.RecordBatch.from_arrays(
        [pa.array([r[0] for r in rows], pa.int64()),
         pa.array([[{"item_id": i, "score": s} for i, s in r[1]] for r in rows], RECOMMENDATION_TYPE),
         pa.array([r[2] for r in rows], pa.string())],
        names=["user_id", "recommendations", "source"])
    task = TaskChecks()
    task.add_chunk(np.array([u for u, _ in HISTORIES]), pa.array([h for _, h in HISTORIES], pa.list_(pa.int64())), out,
                   candidate_ids_sorted=np.arange(1, 11), rules=ListRules(3, "popularity", 3))
    figures = task.finish()
    recs = spark.createDataFrame(
        rows, "user_id bigint, recommendations array<struct<item_id: bigint, score: float>>, source string, "
              "model_version string")
    observed = recs.agg(*row_checks(top_n=3, fallback_name="popularity", model_version="7")).first().asDict()
    item_counts = tuple(np.asarray(x, dtype=np.int64) for x in figures["item_counts"])
    return in_pass_report(observed, figures, item_counts, candidate_ids=np.arange(1, 11), users_in_window=users_in_window)


def test_every_check_has_a_case_here():
    assert set(CASES) == set(CHECKS)


def test_a_correct_output_passes_with_its_figures(spark):
    report = _validate(spark, _good_rows())
    assert report.passed and not any(report.violations.values())
    assert report.figures == {"rows": 3, "fallback_rows": 0, "short_lists": 0, "recommended_items": 9,
                              "distinct_items_recommended": 5, "catalog_coverage": 0.5}
    counted = dict(zip(*(a.tolist() for a in report.item_counts)))
    assert counted == {1: 2, 2: 2, 3: 2, 4: 2, 5: 1}   # times each item was recommended over GOOD's lists


@pytest.mark.parametrize("check", sorted(CASES))
def test_each_violation_is_caught_by_its_check(spark, check):
    spoil, expected = CASES[check]
    if spoil is None:
        report = _validate(spark, _good_rows(), users_in_window=4)
    else:
        report = _validate(spark, spoil(_good_rows()))
    assert not report.passed
    assert {name for name, count in report.violations.items() if count} == expected
    assert any(f.startswith(f"{check}=") for f in report.failures())
