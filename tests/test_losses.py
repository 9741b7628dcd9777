"""Losses: the sampled softmax tends to the full one under a skewed proposal, masks accidental hits,
repeats for a seed, and trains a model as well as the full softmax on a small catalog."""
from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from recsys.model.losses import (full_softmax_loss, item_log_q, sampled_softmax_loss, target_counts,
                                 training_loss)


def skewed_problem(num_items: int = 1000, rows: int = 64, dim: int = 16, seed: int = 0):
    """Zipf-like item counts, and scores that rise with popularity (as a trained model's do), so a
    proposal-independent correction would misjudge the partition function, not only shift it."""
    g = torch.Generator().manual_seed(seed)
    counts = (2000.0 / torch.arange(1, num_items + 1) ** 1.1).floor()          # [N] 2000 .. 1, some 0
    log_q = item_log_q(counts)                                                  # [N]
    items = torch.randn(num_items, dim, generator=g) * 0.5                      # [N, D]
    items[:, 0] = 0.6 * (log_q - log_q.mean()) / log_q.std()                    # popularity direction
    hidden = torch.randn(rows, dim, generator=g)                                # [T, D]
    hidden[:, 0] = 2.0
    targets = torch.randint(0, num_items, (rows,), generator=g)                 # [T]
    return hidden, items, targets, log_q


def test_an_uninformed_model_s_full_softmax_loss_is_log_of_the_catalog_size():
    hidden, items = torch.zeros(5, 8), torch.randn(300, 8)
    assert full_softmax_loss(hidden, items, torch.tensor([0, 1, 2, 3, 299])).item() == pytest.approx(math.log(300))


def test_the_corrected_sampled_loss_tends_to_the_full_loss_and_its_gradient_as_negatives_grow():
    """Averaged over draws, the sampled loss approaches the full softmax's, and its gradient points the
    same way. Without the log-q correction (or with a correction that ignores q) it would be off by
    more than log(negatives / catalog), scores here being correlated with the proposal."""
    hidden, items, targets, log_q = skewed_problem()
    hidden.requires_grad_(True)
    full = full_softmax_loss(hidden, items, targets)
    full_grad, = torch.autograd.grad(full, hidden)
    generator = torch.Generator().manual_seed(1)
    errors, cosines = {}, {}
    for negatives in (32, 512, 8192):
        losses, grads = [], []
        for _ in range(30):
            loss = sampled_softmax_loss(hidden, items, targets, log_q, negatives, generator)
            losses.append(loss.item())
            grads.append(torch.autograd.grad(loss, hidden)[0])
        errors[negatives] = abs(np.mean(losses) - full.item()) / full.item()
        mean_grad = torch.stack(grads).mean(0)
        cosines[negatives] = float(torch.nn.functional.cosine_similarity(mean_grad.flatten(), full_grad.flatten(), 0))
    assert errors[8192] < 0.005, errors
    assert errors[32] > errors[512] > errors[8192], errors       # the log's downward bias shrinks
    assert cosines[8192] > 0.995 and cosines[8192] >= cosines[32], cosines


def test_a_sampled_negative_equal_to_the_row_s_target_is_masked_out():
    """A proposal on item 3 alone: every negative is item 3. A row whose target is 3 keeps only its
    positive (loss 0, log 2 unmasked); a row with another target sees item 3 as its one negative."""
    items = torch.randn(10, 4, generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    log_q = torch.full((10,), float("-inf"))
    log_q[3] = 0.0
    hit = sampled_softmax_loss(hidden[:1], items, torch.tensor([3]), log_q, 16, torch.Generator().manual_seed(0))
    assert hit.item() == 0.0
    other = sampled_softmax_loss(hidden[1:], items, torch.tensor([5]), log_q, 16, torch.Generator().manual_seed(0))
    s5, s3 = hidden[1] @ items[5], hidden[1] @ items[3]
    # 16 copies of item 3, each corrected by log(16 * 1): together exactly one exp(s3)
    assert other.item() == pytest.approx((-s5 + torch.logaddexp(s5, s3)).item(), rel=1e-5)


def test_the_same_generator_seed_draws_the_same_negatives_and_another_seed_others():
    hidden, items, targets, log_q = skewed_problem()

    def loss(seed: int) -> float:
        return sampled_softmax_loss(hidden, items, targets, log_q, 64, torch.Generator().manual_seed(seed)).item()

    assert loss(7) == loss(7)
    assert loss(7) != loss(8)


def test_the_proposal_is_smoothed_popularity_with_every_item_possible():
    q = item_log_q(torch.tensor([0.0, 1.0, 15.0, 80.0])).exp()
    assert q.sum().item() == pytest.approx(1.0)
    assert torch.all(q > 0) and torch.all(q[1:] > q[:-1])
    assert q[3] / q[1] == pytest.approx((81 / 2) ** 0.75, rel=1e-5)
    assert torch.allclose(item_log_q(torch.tensor([0, 5, 500]), power=0.0).exp(), torch.full((3,), 1 / 3))
    with pytest.raises(ValueError, match="smoothing > 0"):
        item_log_q(torch.tensor([0.0, 3.0]), smoothing=0.0)
    with pytest.raises(ValueError, match="non-negative"):
        item_log_q(torch.tensor([-1.0, 3.0]))


def test_target_counts_count_labels_and_not_the_padding():
    labels = torch.tensor([[0, 2, 2], [0, 0, 3]])
    assert target_counts(labels, 4).tolist() == [0, 2, 1, 0]


def test_sampled_loss_falls_back_to_the_full_softmax_when_the_sample_is_no_smaller_than_the_catalog(caplog):
    counts = torch.ones(100)
    with caplog.at_level(logging.WARNING, logger="recsys.model.losses"):
        assert training_loss("sampled", 100, counts, seed=0) is full_softmax_loss
    assert "100 negatives but only 100 items" in caplog.text
    assert training_loss("full", 10, counts, seed=0) is full_softmax_loss
    assert training_loss("sampled", 99, counts, seed=0) is not full_softmax_loss
    with pytest.raises(ValueError, match="full, sampled.*'bpr'"):
        training_loss("bpr", 10, counts, seed=0)
