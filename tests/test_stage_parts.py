"""The pure parts of the nightly stages: candidate set, popularity counts, fallback list, id lookup,
hooks. Plain numpy, no Spark."""
import numpy as np
import pytest

from recsys.data.contracts import SOURCE_POPULARITY
from recsys.errors import ConfigError
from recsys.hooks import NO_HOOKS, Hooks
from recsys.scoring.core import candidate_set, counts_per_candidate, popularity_fallback
from recsys.sequences import Vocabulary, lookup_sorted


def test_lookup_sorted_finds_present_ids_and_flags_the_rest():
    pos, found = lookup_sorted(np.array([10, 20, 30]), np.array([30, 5, 20, 99, 10]))
    assert found.tolist() == [True, False, True, False, True]
    assert pos[found].tolist() == [2, 1, 0]
    pos, found = lookup_sorted(np.array([], dtype=np.int64), np.array([1, 2]))
    assert found.tolist() == [False, False] and pos.tolist() == [0, 0]


def test_candidates_are_the_available_items_the_model_knows_in_model_index_order():
    vocab = Vocabulary(np.array([50, 10, 40, 30]))          # index: 50->1, 10->2, 40->3, 30->4
    candidates, unknown = candidate_set(np.array([10, 20, 30, 50]), vocab)   # 20: unknown to the model
    assert unknown == 1
    assert candidates.index.tolist() == [1, 2, 4]
    assert candidates.item_ids.tolist() == [50, 10, 30]


def test_no_available_item_known_gives_an_empty_candidate_set():
    candidates, unknown = candidate_set(np.array([7, 8]), Vocabulary(np.array([1, 2])))
    assert len(candidates.index) == 0 and unknown == 2


def test_counts_per_candidate_follow_the_candidates_order_even_when_it_is_not_id_order():
    # candidates in model-index order, which a vocabulary need not keep sorted by id
    candidate_ids = np.array([50, 10, 30])
    counts = counts_per_candidate(candidate_ids, np.array([10, 30, 99, 50, 10]), np.array([3, 1, 7, 2, 1]))
    assert counts.tolist() == [2, 4, 1]                     # 99 is not a candidate; 10 counted twice


def test_popularity_fallback_ranks_by_count_then_item_id_with_shares_as_scores():
    fb = popularity_fallback(np.array([50, 10, 30]), np.array([2, 4, 2]), top_n=2)
    assert fb.name == SOURCE_POPULARITY
    assert fb.item_ids.tolist() == [10, 30]                 # 30 before 50: equal counts, lower id first
    assert fb.scores.tolist() == pytest.approx([0.5, 0.25])


def test_hooks_are_off_unless_the_environment_asks_and_unknown_names_are_refused():
    assert Hooks.from_environ({}) == NO_HOOKS
    hooks = Hooks.from_environ({"RECSYS_PAUSE_AT": "staged", "RECSYS_PAUSE_MAX_S": "5",
                                "RECSYS_FAULT_INJECTION": "fail_first_attempt, kill_worker_first_attempt"})
    assert hooks == Hooks("staged", 5.0, ("fail_first_attempt", "kill_worker_first_attempt"))
    assert not NO_HOOKS.holds_while_writing() and Hooks(pause_at="writing").holds_while_writing()
    with pytest.raises(ConfigError, match="RECSYS_FAULT_INJECTION holds unknown faults"):
        Hooks.from_environ({"RECSYS_FAULT_INJECTION": "fail_everything"})
    with pytest.raises(ConfigError, match="is not a pause point"):
        Hooks.from_environ({"RECSYS_PAUSE_AT": "nowhere"})
    with pytest.raises(RuntimeError, match="injected fault"):
        Hooks(faults=("fail_first_attempt",)).inject_faults(attempt=0)
    Hooks(faults=("fail_first_attempt",)).inject_faults(attempt=1)    # the retry goes through


def test_stage_shares_and_the_breakdown_account_for_the_whole_wall_time(monkeypatch):
    from recsys.pipelines import timing

    clock = iter([0.0, 1.0, 4.0, 5.0, 6.0, 10.0, 10.0])   # start; a 3 s stage; a 1 s stage; then the reads
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    timer = timing.StageTimer()
    with timer.stage("score"):
        pass
    with timer.stage("validate"):
        pass
    shares = timer.shares()                                  # total 10 s
    assert shares == {"stage_score_share": 0.3, "stage_validate_share": 0.1, "outside_stages_share": 0.6}
    assert timer.breakdown() == {"score": 3.0, "validate": 1.0, "outside_stages": 6.0, "total": 10.0}


def test_a_catalog_snapshot_is_counted_on_the_driver_with_duplicates_and_nulls_named():
    import datetime as dt

    import pyarrow as pa

    from recsys.data.readers import CatalogSnapshot, catalog_figures
    from recsys.errors import InputDataError

    table = pa.table({"item_id": pa.array([5, 3, 9, 1], pa.int64()), "available": pa.array([True, None, True, False])})
    figures, available = catalog_figures(CatalogSnapshot(dt.date(2024, 5, 1), None, table), "cat")
    assert figures == {"rows": 4, "null_item_ids": 0, "distinct_items": 4, "available_items": 2}
    assert available.tolist() == [5, 9]
    dup = pa.table({"item_id": pa.array([5, 5, 7, 7, 7], pa.int64()), "available": pa.array([True] * 5)})
    with pytest.raises(InputDataError, match=r"3 duplicate row\(s\) \(item_id 5, 7 among them\)"):
        catalog_figures(CatalogSnapshot(dt.date(2024, 5, 1), None, dup), "cat")
    nulls = pa.table({"item_id": pa.array([5, None], pa.int64()), "available": pa.array([True, True])})
    with pytest.raises(InputDataError, match="1 row\\(s\\) with a null item_id"):
        catalog_figures(CatalogSnapshot(dt.date(2024, 5, 1), None, nulls), "cat")


def test_the_long_tail_plot_has_no_negative_counts_on_its_axis():
    from recsys.tracking import plots

    recommended = np.array([120, 40, 0, 3, 0, 1, 0, 0, 9, 0])
    popularity = np.arange(10, 0, -1)
    fig = plots.popularity_long_tail(recommended, popularity)
    ax = fig.axes[0]
    fig.canvas.draw()
    low, high = ax.get_ylim()
    ticks = [t for t in ax.get_yticks() if low <= t <= high]
    assert low == 0 and high >= 120
    assert ticks and min(ticks) >= 0, ticks
    plots._pyplot().close(fig)


def test_scoring_tasks_sizes_long_runs_and_keeps_small_ones_and_explicit_counts():
    from recsys.scoring.stage import scoring_tasks

    # explicit partitions win
    assert scoring_tasks(10, partitions=6, users_per_task=50_000, cores=2) == 6
    # everything fits in one task's worth: keep Spark's split (one task per file split, at least the cores)
    assert scoring_tasks(50_000, partitions=0, users_per_task=50_000, cores=2) == 0
    # the 2-core 1M-user run that scored in 2 tasks: now 18 tasks of <= 50k users, a multiple of the cores
    assert scoring_tasks(864_120, partitions=0, users_per_task=50_000, cores=2) == 18
    assert scoring_tasks(50_001, partitions=0, users_per_task=50_000, cores=8) == 8
    assert scoring_tasks(250_000, partitions=0, users_per_task=50_000, cores=2) == 6
    # cores unknown (Spark Connect): just enough tasks
    assert scoring_tasks(250_000, partitions=0, users_per_task=50_000, cores=None) == 5
    # the previous night's lists join the histories in an exchange anyway: at least one task per core
    assert scoring_tasks(50_000, partitions=0, users_per_task=50_000, cores=2, exchange=True) == 2
    assert scoring_tasks(10, partitions=0, users_per_task=50_000, cores=None, exchange=True) == 1
    assert scoring_tasks(250_000, partitions=0, users_per_task=50_000, cores=2, exchange=True) == 6


def test_candidate_index_dense_and_sparse_agree_with_a_plain_lookup():
    from recsys.scoring.checks import CandidateIndex

    rng = np.random.default_rng(3)
    dense_ids = np.unique(rng.integers(0, 5_000, 700))
    sparse_ids = np.unique(rng.integers(0, 2**62, 700))           # too wide for the dense table
    for ids in (dense_ids, sparse_ids):
        index = CandidateIndex(ids)
        assert (index._table is None) == (ids is sparse_ids)
        probe = np.concatenate([rng.choice(ids, 300), rng.integers(-10, 6_000, 300), [ids[0] - 1, ids[-1] + 1]])
        where = {int(v): i for i, v in enumerate(ids)}
        assert index.positions(probe).tolist() == [where.get(int(v), -1) for v in probe]
    assert CandidateIndex(np.zeros(0, np.int64)).positions(np.array([1, 2])).tolist() == [-1, -1]


@pytest.mark.parametrize("block_pairs", [8_000_000, 100])       # one block, and blocks of 2 rows
def test_seen_rows_match_a_row_by_row_check(monkeypatch, block_pairs):
    from recsys.scoring import checks
    from recsys.scoring.checks import _rows_with_seen_items

    monkeypatch.setattr(checks, "_SEEN_BLOCK", block_pairs)
    rng = np.random.default_rng(5)
    rec_len, hist_len = rng.integers(0, 6, 300), rng.integers(0, 8, 200)
    rec_ids, hist_ids = rng.integers(0, 40, rec_len.sum()), rng.integers(0, 40, hist_len.sum())
    in_row = rng.integers(-1, 200, 300)                            # -1: an output row whose user was not read
    recs = np.split(rec_ids, np.cumsum(rec_len)[:-1])
    hists = np.split(hist_ids, np.cumsum(hist_len)[:-1])
    expected = sum(1 for r, h in zip(recs, in_row) if h >= 0 and set(r.tolist()) & set(hists[h].tolist()))
    assert 0 < expected < 300
    assert _rows_with_seen_items(rec_len, rec_ids, in_row, hist_len, hist_ids) == expected


def test_task_checks_count_items_over_chunks_with_equal_candidate_arrays():
    import pyarrow as pa

    from recsys.data.contracts import RECOMMENDATION_TYPE
    from recsys.scoring.checks import ListRules, TaskChecks

    def chunk(users, lists):
        return pa.RecordBatch.from_arrays(
            [pa.array(users, pa.int64()),
             pa.array([[{"item_id": i, "score": 1.0} for i in items] for items in lists], RECOMMENDATION_TYPE),
             pa.array(["model"] * len(users), pa.string())], names=["user_id", "recommendations", "source"])

    task = TaskChecks()
    for users, lists in (([1, 2], [[3, 4], [3, 99]]), ([5], [[4, 3]])):
        task.add_chunk(np.array(users), pa.array([[1]] * len(users), pa.list_(pa.int64())), chunk(users, lists),
                       candidate_ids_sorted=np.arange(1, 11), rules=ListRules(2, "popularity", 2))
    figures = task.finish()
    assert figures["item_counts"] == [[3, 4, 99], [3, 2, 1]]      # 99: not a candidate, still counted
    assert figures["unavailable_items"] == 1 and figures["excluded_items"] == 0
    with pytest.raises(ValueError, match="candidate set changed"):
        task.add_chunk(np.array([7]), pa.array([[1]], pa.list_(pa.int64())), chunk([7], [[3, 4]]),
                       candidate_ids_sorted=np.arange(1, 12), rules=ListRules(2, "popularity", 2))
