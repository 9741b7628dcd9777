"""The figures the nightly guard judges, against values worked out by hand (recsys.model.list_metrics)."""
import math

import numpy as np
import pyarrow as pa
import pytest

from recsys.model import list_metrics as lm
from recsys.model.list_metrics import Lists


def test_realized_hit_rate_and_ndcg_match_a_hand_computation():
    lists = Lists.of([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]])
    touched = Lists.of([[12, 99], [98], [30, 33]])   # user 0: position 2; user 1: nothing; user 2: positions 0 and 3
    out = lm.realized(lists, touched, (2, 4))
    assert out[2].hit.tolist() == [False, False, True]
    assert out[4].hit.tolist() == [True, False, True]
    # NDCG@4: user 0 (1/log2(4)) / (1 + 1/log2(3)); user 2 (1 + 1/log2(5)) / (1 + 1/log2(3))
    ideal2 = 1 + 1 / math.log2(3)
    assert out[4].ndcg == pytest.approx([0.5 / ideal2, 0.0, (1 + 1 / math.log2(5)) / ideal2])
    # NDCG@2: user 2's hit at position 0 only; ideal of min(2, 2 touched)
    assert out[2].ndcg == pytest.approx([0.0, 0.0, 1 / ideal2])


def test_the_popularity_baseline_skips_each_user_s_seen_items():
    ranking = np.array([5, 4, 3, 2, 1])
    seen = Lists.of([[4], [5, 3, 77], []])
    pop = lm.popularity_lists(ranking, seen, 3)
    assert [pop.ids[pop.offsets[r]:pop.offsets[r + 1]].tolist() for r in range(3)] == [[5, 3, 2], [4, 2, 1], [5, 4, 3]]


def test_jaccard_counts_shared_items_over_the_union_and_items_outside_the_columns_match_nothing():
    new = Lists.of([[0, 1, 2, 3], [4, 5], [], [6]])
    old = Lists.of([[3, 2, 9, 8], [4, 5], [], [-1]])
    assert lm.jaccard(new, old, n_cols=10).tolist() == pytest.approx([2 / 6, 1.0, 1.0, 0.0])


def test_membership_by_row_is_the_same_with_a_table_and_with_sorted_keys(monkeypatch):
    rng = np.random.default_rng(0)
    rows_a, rows_b = np.sort(rng.integers(0, 50, 2000)), np.sort(rng.integers(0, 50, 2000))
    pos_a, pos_b = rng.integers(-1, 300, 2000), rng.integers(0, 300, 2000)
    expected = np.array([(r, p) in set(zip(rows_b.tolist(), pos_b.tolist())) for r, p in zip(rows_a, pos_a)])
    assert (lm.member_dense(rows_a, pos_a, rows_b, pos_b, 50, 300) == expected).all()
    monkeypatch.setattr(lm, "TABLE_CELLS", 300)   # one row per block: the sort path
    assert (lm.member_dense(rows_a, pos_a, rows_b, pos_b, 50, 300) == expected).all()


def test_jaccard_quantiles_come_from_the_histogram_bins():
    hist = lm.jaccard_histogram(np.array([0.0, 0.5, 0.505, 0.9, 1.0, 1.0]))
    assert hist[0] == 1 and hist[50] == 2 and hist[90] == 1 and hist[100] == 2 and hist.sum() == 6
    assert lm.histogram_quantile(hist, 0.5) == 0.5
    assert lm.histogram_quantile(hist, 0.9) == 1.0
    assert math.isnan(lm.histogram_quantile(np.zeros(lm.JACCARD_BINS), 0.5))


def test_gini_and_top_share_of_exposure():
    assert lm.gini(np.array([5, 5, 5, 5])) == pytest.approx(0.0)
    assert lm.gini(np.array([0, 0, 0, 12])) == pytest.approx(0.75)       # (n - 1) / n: one item takes every slot
    assert lm.gini(np.array([1, 2, 3, 4])) == pytest.approx(0.25)        # 2*(1+4+9+16)/(4*10) - 5/4
    assert lm.top_share(np.array([1, 2, 3, 14]), 1) == pytest.approx(0.7)
    assert lm.top_share(np.array([1, 2, 3, 14]), 2) == pytest.approx(0.85)
    assert lm.top_percent_items(9743) == 98 and lm.top_percent_items(30) == 1


def test_psi_is_zero_for_the_same_distribution_and_grows_with_the_shift():
    e = np.full(10, 0.1)
    assert lm.psi(e, np.full(10, 7)) == pytest.approx(0.0)
    # half the mass moved from bin 0 to bin 9: (0.05-0.1)ln(0.5) + (0.15-0.1)ln(1.5)
    shifted = np.array([5, 10, 10, 10, 10, 10, 10, 10, 10, 15])
    assert lm.psi(e, shifted) == pytest.approx(-0.05 * math.log(0.5) + 0.05 * math.log(1.5))
    sample = np.arange(1000, dtype=float)
    edges = lm.decile_edges(sample)
    assert len(edges) == 9 and lm.bin_counts(sample, edges).tolist() == [100] * 10


def test_lists_take_and_head_keep_rows_intact():
    lists = Lists.of([[1, 2, 3], [], [4, 5]])
    taken = lists.take(np.array([2, 0]))
    assert taken.offsets.tolist() == [0, 2, 5] and taken.ids.tolist() == [4, 5, 1, 2, 3]
    head = lists.head(2)
    assert head.offsets.tolist() == [0, 2, 2, 4] and head.ids.tolist() == [1, 2, 4, 5]
    assert lists.positions().tolist() == [0, 1, 2, 0, 1]


def _random_lists(rng, rows, lo, hi, n_items, distinct=True):
    out = []
    for _ in range(rows):
        n = int(rng.integers(lo, hi + 1))
        out.append(rng.choice(n_items, n, replace=False).tolist() if distinct else rng.integers(0, n_items, n).tolist())
    return Lists.of(out)


@pytest.mark.parametrize("table_cells", [lm.TABLE_CELLS, 64])   # the table, and the sort for huge catalogs
def test_the_matrix_forms_the_tasks_use_equal_the_ragged_definitions(monkeypatch, table_cells):
    monkeypatch.setattr(lm, "TABLE_CELLS", table_cells)
    rng = np.random.default_rng(3)
    n_items, k = 60, 4
    new, old = _random_lists(rng, 40, 0, 8, n_items), _random_lists(rng, 40, 0, 8, n_items)
    inter_all, inter_k = lm.overlap_counts(lm.padded(new), lm.padded(old), n_items, k)
    j_all = np.divide(inter_all, new.lengths + old.lengths - inter_all, out=np.ones(40),
                      where=new.lengths + old.lengths - inter_all > 0)
    assert j_all == pytest.approx(lm.jaccard(new, old, n_items))
    union_k = np.minimum(new.lengths, k) + np.minimum(old.lengths, k) - inter_k
    assert np.divide(inter_k, union_k, out=np.ones(40), where=union_k > 0) == \
        pytest.approx(lm.jaccard(new.head(k), old.head(k), n_items))

    touched = _random_lists(rng, 40, 1, 5, n_items)
    reference = lm.realized(new, touched, (k, 8))
    fast = lm.hits_in_lists(lm.padded(new, pad=np.iinfo(np.int64).min), touched.rows(), touched.ids, touched.lengths,
                            (k, 8))
    for cut in (k, 8):
        assert (fast[cut].hit == reference[cut].hit).all() and fast[cut].ndcg == pytest.approx(reference[cut].ndcg)

    ranking = rng.choice(n_items, 30, replace=False)
    seen = _random_lists(rng, 40, 0, 10, n_items)
    reference = lm.realized(lm.popularity_lists(ranking, seen, 8), touched, (k, 8))
    fast = lm.popularity_hits(ranking, seen.rows(), seen.ids, touched, (k, 8))
    for cut in (k, 8):
        assert (fast[cut].hit == reference[cut].hit).all() and fast[cut].ndcg == pytest.approx(reference[cut].ndcg)

    scores = rng.normal(size=500)
    edges = np.sort(rng.normal(size=9))
    assert lm.bin_counts_sorted_edges(scores, edges).tolist() == lm.bin_counts(scores, edges).tolist()
