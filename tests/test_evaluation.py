"""Evaluation without Spark: the splits never leak, ranking follows the metric conventions, the report adds up."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from recsys.model.metrics import hit_rate_at_k, mrr, ndcg_at_k, user_metrics
from recsys.evaluation.protocols import Phase, WindowInputs, leave_last_out, temporal_split
from recsys.evaluation.ranking import ConstantScorer, FactorScorer, SequenceModelScorer, coverage, rank_phase
from recsys.evaluation.report import Bootstrap, compare, format_table
from recsys.sequences import Sequences

INF = math.inf


# ---------------------------------------------------------------------------------------------
# metrics: several targets per user


def test_user_metrics_with_one_target_each_equal_the_single_target_metrics():
    ranks = torch.tensor([0.0, 1.0, 3.0, INF, 12.0])
    per_user = user_metrics(ranks, np.arange(6), ks=(3, 5))
    for k in (3, 5):
        assert per_user[f"ndcg@{k}"].mean() == pytest.approx(ndcg_at_k(ranks, k))
        assert per_user[f"hr@{k}"].mean() == pytest.approx(hit_rate_at_k(ranks, k))
        assert per_user[f"recall@{k}"].mean() == pytest.approx(hit_rate_at_k(ranks, k))
        assert per_user[f"mrr@{k}"].mean() == pytest.approx(mrr(ranks, k=k))


def test_user_metrics_with_several_targets_by_hand():
    # user 0: targets at list positions 0 and 2 (k=3): DCG = 1 + 1/2, IDCG = 1 + 1/log2(3)
    # user 1: targets at 4 and a miss; k=3 -> nothing; best rank 4 -> MRR@3 0
    # user 2: one target at position 1
    ranks = torch.tensor([0.0, 2.0, 4.0, INF, 1.0])
    per_user = user_metrics(ranks, np.array([0, 2, 4, 5]), ks=(3,))
    assert per_user["ndcg@3"] == pytest.approx([1.5 / (1 + 1 / math.log2(3)), 0.0, 1 / math.log2(3)])
    assert per_user["hr@3"].tolist() == [1.0, 0.0, 1.0]
    assert per_user["recall@3"].tolist() == [1.0, 0.0, 1.0]
    assert per_user["mrr@3"] == pytest.approx([1.0, 0.0, 0.5])
    # k=1: user 0 finds one of its two targets, the ideal list holds one
    assert user_metrics(ranks, np.array([0, 2, 4, 5]), ks=(1,))["ndcg@1"] == pytest.approx([1.0, 0.0, 0.0])


def test_user_metrics_refuse_users_without_targets():
    with pytest.raises(ValueError, match="at least one target"):
        user_metrics(torch.tensor([0.0]), np.array([0, 0, 1]), ks=(10,))


# ---------------------------------------------------------------------------------------------
# protocols: what is learned from, validated and tested


def _owned(seqs: Sequences, row: int) -> set[int]:
    return set(seqs.items[seqs.offsets[row]:seqs.offsets[row + 1]].tolist())


def test_leave_last_out_tests_the_last_item_validates_the_one_before_and_trains_on_the_rest():
    seqs = Sequences.from_lists([[5, 3, 9, 1], [7], [2, 4], [8, 6, 10]])
    split = leave_last_out(np.array([10, 11, 12, 13]), seqs, candidates=np.arange(1, 11))
    assert split.test.rows.tolist() == split.valid.rows.tolist() == [0, 3]          # users with >= 3 items
    assert split.test.targets.to_lists()[0].tolist() == [1] and split.test.targets.to_lists()[1].tolist() == [10]
    assert split.valid.targets.items.tolist() == [9, 6]
    assert [x.tolist() for x in split.valid.history.to_lists()] == [[5, 3], [7], [2, 4], [8]]
    assert [x.tolist() for x in split.test.history.to_lists()] == [[5, 3, 9], [7], [2, 4], [8, 6]]
    assert split.info["users_too_short"] == 2


def test_no_test_interaction_leaks_into_training_or_validation():
    rng = np.random.default_rng(3)
    lists = [rng.permutation(np.arange(1, 60))[: rng.integers(1, 40)] for _ in range(200)]
    split = leave_last_out(np.arange(200), Sequences.from_lists(lists), candidates=np.arange(1, 60))
    for e, user in enumerate(split.test.rows):
        test_item = int(split.test.targets.items[e])
        valid_item = int(split.valid.targets.items[e])
        assert test_item == lists[user][-1]
        assert test_item not in _owned(split.valid.history, user)          # what models train on
        assert test_item not in _owned(split.test.history, user)           # what they read at test time
        assert test_item != valid_item
        assert valid_item not in _owned(split.valid.history, user)
        assert _owned(split.test.history, user) == _owned(split.valid.history, user) | {valid_item}
    # the training data (all users' validation histories) has exactly the non-held-out interactions
    assert len(split.valid.history.items) == sum(len(x) for x in lists) - 2 * len(split.test.rows)


def test_temporal_split_tests_only_new_items_of_users_with_history():
    users = np.array([1, 2, 3])
    valid_history = Sequences.from_lists([[10, 11], [], [12]])
    test_history = Sequences.from_lists([[10, 11, 13], [14], [12]])
    valid_window = Sequences.from_lists([[13], [14], []])
    test_window = Sequences.from_lists([[11, 15, 16], [15], [12]])
    split = temporal_split(users, WindowInputs(valid_history, valid_window, np.arange(10, 20)),
                           WindowInputs(test_history, test_window, np.arange(10, 20)))
    assert split.valid.rows.tolist() == [0]                    # user 2 had no history before the window
    assert split.test.rows.tolist() == [0, 1]                  # user 3's only test item is already in its history
    assert [sorted(x.tolist()) for x in split.test.targets.to_lists()] == [[15, 16], [15]]
    for e, user in enumerate(split.test.rows):
        assert not set(split.test.targets.to_lists()[e].tolist()) & _owned(split.test.history, user)


# ---------------------------------------------------------------------------------------------
# ranking: one implementation for every model


def _phase(history, targets, rows, candidates=np.arange(1, 6)):
    return Phase(Sequences.from_lists(history), np.asarray(rows), Sequences.from_lists(targets), np.asarray(candidates))


def test_rank_phase_excludes_history_and_counts_ties_against_the_target():
    phase = _phase([[1], [2], []], [[2], [3, 4]], rows=[0, 1])
    # scores over candidates 1..5: item 1 best ... item 5 worst; item 3 ties with item 4
    scorer = ConstantScorer(np.array([0.0, 5.0, 4.0, 3.0, 3.0, 1.0]))
    result = rank_phase(scorer, phase, ks=(1, 2))
    # user 0: item 1 excluded -> target 2 first. user 1: item 2 excluded, item 1 first, 3 and 4 tie:
    # each target counts item 1 and the other tied target -> rank 2 for both
    assert result.per_user["hr@1"].tolist() == [1.0, 0.0]
    assert result.per_user["recall@2"].tolist() == [1.0, 0.0]
    assert result.top[:, :2].tolist() == [[2, 3], [1, 3]] or result.top[:, :2].tolist() == [[2, 3], [1, 4]]


def test_a_target_scored_nan_or_unknown_to_the_model_is_a_miss_never_rank_zero():
    phase = _phase([[1], [1], [1]], [[2], [3], [9]], rows=[0, 1, 2], candidates=np.arange(1, 6))

    class NaNForItem2:
        def scores(self, rows):
            s = torch.tensor([[0.0, 1.0, float("nan"), 0.5, 0.4, 0.3]]).expand(len(rows), -1).clone()
            return s

    result = rank_phase(NaNForItem2(), phase, ks=(10,))
    # user 0's target (item 2) scores NaN: a miss; user 1's target 3 has NaN item 2 above it -> rank 1;
    # user 2's target 9 is not an available candidate: a miss
    assert result.per_user["hr@10"].tolist() == [0.0, 1.0, 0.0]
    assert result.per_user["mrr@10"] == pytest.approx([0.0, 0.5, 0.0])


def test_factor_scorer_gives_items_the_model_does_not_know_minus_infinity():
    phase = _phase([[1]], [[4]], rows=[0], candidates=np.array([1, 2, 3, 4]))
    item_ids = np.array([4, 2])                         # the model knows items 4 and 2 only
    scorer = FactorScorer(phase, item_ids, torch.tensor([[1.0], [2.0]]), lambda rows: torch.ones(len(rows), 1))
    scores = scorer.scores(np.array([0]))
    assert scores[0, 1:].tolist() == [-INF, 2.0, -INF, 1.0]
    result = rank_phase(scorer, phase, ks=(2,))
    assert result.per_user["mrr@2"].tolist() == [0.5]   # item 2 above item 4; unknown items never compete
    assert result.top.tolist() == [[2, 4]]
    assert coverage(result.top, 2, 4) == 0.5


def test_sequence_models_read_the_phase_history_through_their_vocabulary():
    from toy_model import random_model

    model = random_model(num_items=6, dim=4, seed=1, max_len=3)
    item_ids = np.array([10, 20, 30, 40, 50, 60])
    phase = _phase([[10, 20, 99, 30]], [[40]], rows=[0], candidates=item_ids)
    scores = SequenceModelScorer(model, item_ids, phase).scores(np.array([0]))
    expected = model.encode(torch.tensor([[1, 2, 3]])) @ model.item_embeddings()[1:].T   # 99 is unknown: dropped
    assert torch.allclose(scores[0, 1:], expected[0])


def test_the_core_scorer_ranks_the_lists_the_job_would_publish():
    """CoreScorer (how `recsys evaluate` measures scoring.dtype=bfloat16): the core's fp32 top-N
    gives every user the same top list and the same metrics at k <= N as the model's full scores."""
    from toy_model import random_model

    from recsys.evaluation.ranking import CoreScorer

    model = random_model(num_items=30, dim=4, seed=2, max_len=4)
    item_ids = np.arange(100, 130)
    rng = np.random.default_rng(0)
    histories = [list(rng.choice(item_ids, size=5, replace=False)) for _ in range(20)]
    targets = [[int(rng.choice(sorted(set(item_ids) - set(h))))] for h in histories]
    phase = _phase(histories, targets, rows=list(range(20)), candidates=item_ids[:25])   # 5 items not candidates
    full = rank_phase(SequenceModelScorer(model, item_ids, phase), phase, ks=(5,))
    core = rank_phase(CoreScorer(model, item_ids, phase, top_n=5, dtype="float32"), phase, ks=(5,))
    assert np.array_equal(core.top, full.top)
    for name in ("ndcg@5", "hr@5"):
        assert np.allclose(core.per_user[name], full.per_user[name])


# ---------------------------------------------------------------------------------------------
# report: bootstrap intervals and paired differences


def _result(values: np.ndarray, top: np.ndarray):
    from recsys.evaluation.ranking import PhaseResult

    per_user = {f"{m}@10": values for m in ("ndcg", "hr", "recall", "mrr")}
    per_user["pop_pct@10"] = np.full(len(values), 50.0)
    return PhaseResult(per_user, top)


def test_bootstrap_intervals_are_seeded_and_paired_differences_of_identical_models_are_zero():
    rng = np.random.default_rng(0)
    values = rng.random(300)
    top = rng.integers(1, 50, size=(300, 10))
    results = {"als": _result(values, top), "same": _result(values.copy(), top), "better": _result(values + 0.1, top)}
    a = compare(results, protocol="loo", ks=(10,), candidates=49, reference="als", bootstrap=Bootstrap(200, 1))
    b = compare(results, protocol="loo", ks=(10,), candidates=49, reference="als", bootstrap=Bootstrap(200, 1))
    assert a.intervals == b.intervals
    lo, hi = a.intervals["als"]["ndcg@10"]
    assert lo < values.mean() < hi
    assert a.differences["same"]["ndcg@10"] == (0.0, 0.0, 0.0)
    diff, lo, hi = a.differences["better"]["ndcg@10"]
    assert diff == pytest.approx(0.1) and lo == pytest.approx(0.1) and hi == pytest.approx(0.1)
    assert a.ratios["better"]["ndcg@10"][0] == pytest.approx((values.mean() + 0.1) / values.mean())
    table = format_table(a)
    assert "| als |" in table and "Paired difference to als" in table
    doc = a.to_json()
    assert set(doc) >= {"protocol", "k", "models"} and doc["k"] == [10]
    assert set(doc["models"]["als"]) == {"ndcg@10", "hr@10", "recall@10", "mrr@10", "coverage@10", "pop_pct@10"}


def test_seeds_are_averaged_per_user_and_their_variance_widens_the_interval():
    """Three trainings whose means differ by a seed offset (+-0.05) on the same users: the merged row
    is the per-user mean, and its interval resamples seeds too, so it is wider than the interval of
    users alone (the same per-user means as one seed) and its paired difference to a copy of one
    seed is no longer a point."""
    from recsys.evaluation.ranking import merge_seeds

    rng = np.random.default_rng(0)
    values = rng.random(400)
    top = rng.integers(1, 50, size=(400, 10))
    seeds = [_result(values + offset, top) for offset in (-0.05, 0.0, 0.05)]
    merged = merge_seeds(seeds)
    assert merged.seeds == 3 and np.allclose(merged.per_user["ndcg@10"], values)
    assert merged.seed_means("ndcg@10") == pytest.approx([values.mean() - 0.05, values.mean(), values.mean() + 0.05])
    assert merge_seeds(seeds[:1]) is seeds[0]
    results = {"als": _result(values.copy(), top), "seeded": merged, "one": _result(values.copy(), top)}
    c = compare(results, protocol="loo", ks=(10,), candidates=49, reference="als", bootstrap=Bootstrap(500, 1),
                pairs=[("seeded", "one"), ("one", "missing")])
    assert c.models["seeded"]["ndcg@10"] == pytest.approx(values.mean())
    assert set(c.pair_differences) == {"seeded - one"}                 # a pair with an absent row is left out
    assert c.pair_differences["seeded - one"]["ndcg@10"] == pytest.approx(c.differences["seeded"]["ndcg@10"])
    assert "| seeded - one |" in format_table(c)
    width = {name: np.subtract(*c.intervals[name]["ndcg@10"][::-1]) for name in ("seeded", "one")}
    assert width["seeded"] > 1.5 * width["one"]
    assert c.differences["one"]["ndcg@10"][1:] == (0.0, 0.0)
    _, lo, hi = c.differences["seeded"]["ndcg@10"]
    assert lo < -0.01 and hi > 0.01                  # the seed spread alone: +-0.05 / sqrt(3) per resample
