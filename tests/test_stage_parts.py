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


def test_the_long_tail_plot_has_no_negative_counts_on_its_axis():
    from recsys import plots

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
