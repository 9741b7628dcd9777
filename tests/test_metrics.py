"""Ranking metrics against hand-computed cases, and the traps: NaN, exclusion, ties, padding."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from recsys.model.metrics import evaluate_ranking, hit_rate_at_k, mrr, ndcg_at_k, target_ranks
from recsys.sequences import Sequences

INF = math.inf

# 5 items (columns 1..5; column 0 is padding). Scores descend with the item index: 1 is best.
SCORES = torch.tensor([[0.0, 0.9, 0.8, 0.7, 0.6, 0.5]] * 4)


def test_hand_computed_ranks():
    targets = torch.tensor([1, 3, 5, 4])
    exclude = torch.tensor([[0, 0], [0, 1], [2, 3], [0, 4]])
    # user 0: item 1 is best -> 0; user 1: item 1 excluded, item 2 above -> 1;
    # user 2: items 2, 3 excluded, 1 and 4 above -> 2; user 3: its target is excluded -> miss
    assert target_ranks(SCORES, targets, exclude).tolist() == [0.0, 1.0, 2.0, INF]


def test_hand_computed_metrics():
    ranks = torch.tensor([0.0, 1.0, 3.0, INF])
    # NDCG@3: (1 + 1/log2(3) + 0 + 0) / 4
    assert ndcg_at_k(ranks, 3) == pytest.approx(0.40773243839286437, abs=1e-12)
    # NDCG@5: (1 + 1/log2(3) + 1/log2(5) + 0) / 4
    assert ndcg_at_k(ranks, 5) == pytest.approx(0.5154015779112127, abs=1e-12)
    assert hit_rate_at_k(ranks, 3) == 0.5
    assert hit_rate_at_k(ranks, 4) == 0.75
    assert mrr(ranks) == pytest.approx(0.4375)          # (1 + 1/2 + 1/4 + 0) / 4
    assert mrr(ranks, k=3) == pytest.approx(0.375)      # rank 3 is cut off
    assert ndcg_at_k(torch.tensor([0.0]), 10) == 1.0


def test_nan_target_is_a_miss_never_rank_zero():
    scores = SCORES[:1].clone()
    scores[0, 2] = float("nan")
    ranks = target_ranks(scores, torch.tensor([2]), torch.zeros(1, 1, dtype=torch.long))
    assert ranks.tolist() == [INF]
    assert ndcg_at_k(ranks, 10) == 0.0 and hit_rate_at_k(ranks, 10) == 0.0


def test_nan_competitor_counts_as_above_the_target():
    scores = SCORES[:1].clone()
    scores[0, 5] = float("nan")  # topk would put it first
    assert target_ranks(scores, torch.tensor([1]), torch.zeros(1, 1, dtype=torch.long)).tolist() == [1.0]


def test_excluded_items_and_padding_column_do_not_compete():
    scores = SCORES[:1].clone()
    scores[0, 0] = 100.0  # padding column scoring highest must not count
    ranks = target_ranks(scores, torch.tensor([4]), torch.tensor([[1, 2, 3]]))
    assert ranks.tolist() == [0.0]


def test_ties_are_pessimistic():
    constant = torch.ones(2, 6)
    ranks = target_ranks(constant, torch.tensor([3, 1]), torch.tensor([[0], [2]]))
    assert ranks.tolist() == [4.0, 3.0]  # every other competing item ties, so all count
    assert ndcg_at_k(target_ranks(torch.zeros(1, 101), torch.tensor([50]), torch.zeros(1, 1, dtype=torch.long)), 10) == 0.0


def test_out_of_range_target_is_a_miss():
    ranks = target_ranks(SCORES[:2], torch.tensor([0, 6]), torch.zeros(2, 1, dtype=torch.long))
    assert ranks.tolist() == [INF, INF]


def test_metrics_refuse_empty_input():
    with pytest.raises(ValueError, match="at least one user"):
        ndcg_at_k(torch.zeros(0), 10)


class LastItemModel(torch.nn.Module):
    """A real SequenceRecommender with fixed weights, so scores can be worked out by hand.

    The user vector of a history whose newest item is i is [i, 1]; item j's embedding is
    [j, -j^2 / 2]; the score i*j - j^2/2 peaks at j = i and falls symmetrically around it.
    For i = 5 the scores of items 1..9 are 4.5, 8, 10.5, 12, 12.5, 12, 10.5, 8, 4.5.
    """

    max_len = 3
    num_items = 9

    def __init__(self):
        super().__init__()
        idx = torch.arange(self.num_items + 1, dtype=torch.float32)
        self.items = torch.stack([idx, -(idx ** 2) / 2], dim=1)        # [N+1, 2]
        self.users = torch.stack([idx, torch.ones_like(idx)], dim=1)   # [N+1, 2], row = newest item

    def encode(self, seq: torch.Tensor) -> torch.Tensor:
        return self.users[seq[:, -1]]

    def item_embeddings(self) -> torch.Tensor:
        return self.items


def test_evaluate_ranking_by_hand():
    histories = Sequences.from_lists([[5], [1, 2, 5], [9, 8, 7, 6, 5]])
    targets = np.array([6, 6, 4])
    # user 0: 5 excluded; item 4 ties with target 6 -> rank 1
    # user 1: 1, 2, 5 excluded; item 4 ties with target 6 -> rank 1
    # user 2: 5..9 excluded; nothing left scores >= target 4 -> rank 0
    metrics = evaluate_ranking(LastItemModel(), histories, targets, ks=(1, 2), batch_size=2)
    assert metrics["hr@1"] == pytest.approx(1 / 3)
    assert metrics["hr@2"] == 1.0
    assert metrics["ndcg@1"] == pytest.approx(1 / 3)
    assert metrics["ndcg@2"] == pytest.approx(0.7539531690476383)  # (2 / log2(3) + 1) / 3
    assert metrics["mrr"] == pytest.approx(0.6666666666666666)     # (1/2 + 1/2 + 1) / 3


def test_evaluate_ranking_excludes_the_whole_history_not_just_what_the_model_reads():
    # The model reads [1, 2, 5] (max_len 3); 4 and 6 are older but seen, so they do not compete.
    # Target 3 (10.5) then only ties with 7 -> rank 1. Were 4 and 6 competing it would be rank 3.
    histories = Sequences.from_lists([[4, 6, 1, 2, 5]])
    assert evaluate_ranking(LastItemModel(), histories, np.array([3]))["mrr"] == pytest.approx(1 / 2)


def test_evaluate_ranking_with_explicit_exclusions():
    histories = Sequences.from_lists([[4, 6, 1, 2, 5]])
    nothing = Sequences.from_lists([[]])
    # Nothing excluded: 4, 5, 6 score above target 3 and 7 ties -> rank 4
    assert evaluate_ranking(LastItemModel(), histories, np.array([3]), exclude=nothing)["mrr"] == pytest.approx(1 / 5)


def test_evaluate_ranking_refuses_padding_targets():
    with pytest.raises(ValueError, match="1..9"):
        evaluate_ranking(LastItemModel(), Sequences.from_lists([[1]]), np.array([0]))
