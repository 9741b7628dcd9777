"""The backtest's figures without Spark: the next-day figures of one list (repeats and new items apart) and the
two-way bootstrap over users and nights."""
from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from recsys.model.list_metrics import Lists, next_day_figures, next_day_names

K, N = 2, 3


def _figures(lists, targets, seen):
    return next_day_figures(Lists.of(lists), Lists.of(targets), Lists.of(seen), K, N)


def test_a_list_of_only_new_items_scores_nothing_on_repeats_and_personal_frequency_scores_there():
    """Two users who come back to what they know (1 and 2; 5) and try one new item (9; 7)."""
    targets, seen = [[1, 9], [5, 7]], [[1, 2, 3], [5, 6]]
    masked = _figures([[9, 4, 8], [7, 8, 4]], targets, seen)          # history masked: every item new to the user
    personal = _figures([[1, 2, 3], [5, 6]], targets, seen)           # the user's own items, best first
    for name in ("hr@2.repeat", "ndcg@2.repeat", "recall@3.repeat"):
        assert masked[name].tolist() == [0.0, 0.0]
        assert personal[name].tolist() == [1.0, 1.0]
    for name in ("hr@2.new", "ndcg@2.new", "recall@3.new"):
        assert masked[name].tolist() == [1.0, 1.0]
        assert personal[name].tolist() == [0.0, 0.0]
    assert masked["repeat_share@2"].tolist() == [0.0, 0.0] and personal["repeat_share@2"].tolist() == [1.0, 1.0]
    # over all next-day items both hit every user; their place in the list decides NDCG
    assert masked["hr@2"].tolist() == personal["hr@2"].tolist() == [1.0, 1.0]


def test_each_figure_by_hand():
    out = _figures([[1, 2, 3], [4, 5], []], [[2, 9], [6], [1]], [[2, 3], [], [1]])
    ideal_2 = 1 + 1 / math.log2(3)
    assert list(out) == next_day_names(K, N)
    assert out["hr@2"].tolist() == [1.0, 0.0, 0.0]
    assert out["ndcg@2"][0] == pytest.approx((1 / math.log2(3)) / ideal_2)    # 2 is second, two targets
    assert out["recall@3"].tolist() == [0.5, 0.0, 0.0]
    assert out["ndcg@2.repeat"][0] == pytest.approx(1 / math.log2(3))        # one repeat target, found second
    # a figure over targets a user did not have is NaN (not 0): means cover only the users who had them
    assert math.isnan(out["hr@2.repeat"][1]) and math.isnan(out["hr@2.new"][2])
    assert out["hr@2.repeat"][2] == 0.0                                        # an empty list is a miss
    assert out["repeat_share@2"][0] == 0.5 and out["repeat_share@2"][1] == 0.0 and math.isnan(out["repeat_share@2"][2])
    assert out["listed"].tolist() == [1.0, 1.0, 0.0]


def test_recall_counts_hits_up_to_n_beyond_k():
    out = _figures([[7, 8, 1]], [[1, 2]], [[]])
    assert out["hr@2"].tolist() == [0.0] and out["recall@3"].tolist() == [0.5]


def test_rows_must_line_up():
    with pytest.raises(ValueError, match="one row per user"):
        _figures([[1]], [[1], [2]], [[1]])


def test_lists_from_arrow_and_where():
    lists = Lists.from_arrow(pa.array([[3, 4], None, [5]], pa.list_(pa.int64())))
    assert lists.lengths.tolist() == [2, 0, 1]
    kept = lists.where(np.array([False, True, True]))
    assert kept.lengths.tolist() == [1, 0, 1] and kept.ids.tolist() == [4, 5]


# ------------------------------------------------------------------------------------------------
# the two-way bootstrap


def test_paired_difference_of_a_system_with_itself_is_zero_and_intervals_hold_the_mean():
    from recsys.evaluation.report import TwoWayDraws, interval

    rng = np.random.default_rng(0)
    users, nights = np.repeat(np.arange(200), 4), np.tile(np.arange(4), 200)
    values = rng.random(800)
    draws = TwoWayDraws(users, nights, 500, seed=1)
    resampled = draws.means_many(np.column_stack([values, values]))
    lo, hi = interval(resampled[:, 0])
    assert lo < values.mean() < hi
    assert interval(resampled[:, 0] - resampled[:, 1]) == (0.0, 0.0)


def test_the_interval_holds_the_variation_between_nights():
    """Every user scores the same on a night, but one night of four is a disaster: resampling users alone
    would call the mean certain; resampling nights too says it is not."""
    from recsys.evaluation.report import TwoWayDraws, interval

    users, nights = np.repeat(np.arange(300), 4), np.tile(np.arange(4), 300)
    values = np.where(nights == 3, 0.0, 1.0)
    lo, hi = interval(TwoWayDraws(users, nights, 1000, seed=2).means(values))
    assert lo <= 0.5 and hi == 1.0
    one_night = TwoWayDraws(users, np.zeros_like(nights), 1000, seed=2).means(values)
    assert interval(one_night) == pytest.approx((0.75, 0.75))


def test_nan_pairs_are_left_out_of_each_resampled_mean():
    from recsys.evaluation.report import TwoWayDraws

    values = np.array([1.0, np.nan, 1.0, np.nan])
    means = TwoWayDraws(np.array([1, 2, 3, 4]), np.zeros(4), 50, seed=0).means(values)
    assert np.all((means == 1.0) | np.isnan(means))          # NaN only when a resample drew no covered pair
    with pytest.raises(ValueError, match="one of each per pair"):
        TwoWayDraws(np.array([1, 2]), np.zeros(3), 10, seed=0)
