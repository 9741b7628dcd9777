"""The gate's noise: per-user NDCG@10 pairs two versions user by user, and a refusal inside the paired noise is
``close`` (the next night may start warm again), beyond it ``worse`` (the next night trains in full).

The end-to-end ``worse`` path (a diverged warm fit, the alias kept, the next night full) is in
tests/test_training_refit.py; here the figures it rests on, without Spark or MLflow.
"""
import numpy as np
import pytest
import torch

from recsys.learning.split import mean_gain, split_last_item, validation_set
from recsys.model.metrics import evaluate_ranking
from recsys.model.sasrec import SASRec, SASRecConfig
from recsys.pipelines.train import GATE_NOISE_Z, paired_standard_error, refused_verdict
from recsys.sequences import Sequences, Vocabulary

ITEMS = 40


def _split(users: int = 120, seed: int = 0):
    rng = np.random.default_rng(seed)
    seqs = [list(rng.integers(1, ITEMS + 1, rng.integers(4, 12))) for _ in range(users)]
    return split_last_item(Sequences.from_lists(seqs), first_us=np.arange(users, dtype=np.int64))


def _model(seed: int) -> SASRec:
    torch.manual_seed(seed)
    return SASRec(SASRecConfig(num_items=ITEMS, dim=8, layers=1, heads=1, max_len=8, dropout=0.0))


def _training_score(model, item_ids, split) -> float:
    """The selection metric as training computes it (evaluate_ranking over the users whose target the
    vocabulary knows), spread over every held-out user: what the gate's mean of gains must equal."""
    valid = validation_set(Vocabulary(item_ids), split)
    known = evaluate_ranking(model, valid.histories, valid.targets, ks=(10,))["ndcg@10"]
    return known * len(valid.targets) / split.users


def test_per_user_gains_average_to_the_training_metric_and_count_an_unknown_target_as_zero():
    split = _split()
    model = _model(0)
    known = np.arange(1, ITEMS + 1)
    gains = split.user_gains(model, known, "cpu")
    assert gains.shape == (split.users,) and gains.min() >= 0 and gains.max() <= 1
    assert mean_gain(gains) == pytest.approx(_training_score(model, known, split), abs=1e-6)
    # a vocabulary without the items 1..10: users whose target is one of them score 0, the others as before
    fewer = np.arange(11, ITEMS + 1)
    model_fewer = SASRec(SASRecConfig(num_items=len(fewer), dim=8, layers=1, heads=1, max_len=8, dropout=0.0))
    gains_fewer = split.user_gains(model_fewer, fewer, "cpu")
    lacking = np.isin(split.valid_targets, np.arange(1, 11))
    assert lacking.any() and (gains_fewer[lacking] == 0).all()
    assert mean_gain(gains_fewer) == pytest.approx(_training_score(model_fewer, fewer, split), abs=1e-6)


def test_a_refusal_by_a_few_users_is_close_and_one_by_many_is_worse():
    rng = np.random.default_rng(1)
    holder = np.where(rng.random(900) < 0.35, 1.0 / np.log2(rng.integers(0, 10, 900) + 2.0), 0.0)
    # the candidate misses three users' targets the holder ranked first: a gap of 3/900 (0.0033)
    candidate = holder.copy()
    candidate[np.flatnonzero(holder == 1.0)[:3]] = 0.0
    gap = holder.mean() - candidate.mean()
    se = paired_standard_error(candidate, holder)
    assert gap == pytest.approx(3 / 900) and 0 < se
    assert refused_verdict(gap, se) == "close"
    # the candidate misses every target the holder hit: far beyond the noise
    diverged = np.zeros_like(holder)
    gap, se = holder.mean() - diverged.mean(), paired_standard_error(diverged, holder)
    assert gap > GATE_NOISE_Z * se and refused_verdict(gap, se) == "worse"


def test_identical_versions_have_no_noise_and_any_gap_between_them_is_worse():
    same = np.array([0.0, 1.0, 0.5, 0.0])
    assert paired_standard_error(same, same) == 0.0
    assert refused_verdict(1e-9, 0.0) == "worse" and refused_verdict(0.0, 0.0) == "close"


def test_figures_that_do_not_pair_grant_no_noise():
    assert paired_standard_error(np.array([1.0, 0.0, 0.5]), np.array([1.0, 0.0])) == 0.0
    assert paired_standard_error(np.array([1.0]), np.array([0.0])) == 0.0
