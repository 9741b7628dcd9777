"""Losses: the full softmax's block-wise gradient is cross-entropy's; the sampled softmax tends to the full one
under a skewed proposal, masks accidental hits, repeats for a seed, and trains a model as well as the full
softmax on a small catalog."""
from __future__ import annotations

import logging
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from cores import SHARE
from recsys.model import losses
from recsys.model.losses import (full_softmax_loss, item_log_q, sampled_softmax_loss, training_loss,
                                 vocabulary_counts)
from recsys.model.sasrec import SASRecConfig
from recsys.model.training import TrainSettings, ValidationSet, fit
from recsys.sequences import Sequences


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


def _loss_and_gradients(loss, hidden, items, targets, *, bf16=False, dtype=torch.float32, upstream=1.0):
    hidden = hidden.to(dtype).clone().requires_grad_()
    items = items.to(dtype).clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        value = loss(hidden, items, targets)
    (value * upstream).backward()
    return value.item(), hidden.grad.double(), items.grad.double()


def _cross_entropy(hidden, items, targets):
    return torch.nn.functional.cross_entropy(hidden @ items.T, targets)


def test_the_full_softmax_s_blockwise_loss_and_gradients_are_cross_entropy_s(monkeypatch):
    # blocks of 64 rows over 200 rows: three full blocks and a short one, each with its own targets
    monkeypatch.setattr(losses, "CHUNK_LOGITS", 1)
    g = torch.Generator().manual_seed(3)
    hidden, items = torch.randn(200, 16, generator=g), torch.randn(500, 16, generator=g)
    targets = torch.randint(0, 500, (200,), generator=g)
    exact = _loss_and_gradients(_cross_entropy, hidden, items, targets, dtype=torch.float64, upstream=3.0)
    value, grad_hidden, grad_items = _loss_and_gradients(full_softmax_loss, hidden, items, targets, upstream=3.0)
    assert value == pytest.approx(exact[0], rel=1e-6)
    assert torch.allclose(grad_hidden, exact[1], rtol=1e-4, atol=1e-7)       # scaled by the upstream gradient
    assert torch.allclose(grad_items, exact[2], rtol=1e-4, atol=1e-7)
    with torch.no_grad():                                                    # no gradient wanted: plain value
        assert full_softmax_loss(hidden, items, targets).item() == pytest.approx(exact[0], rel=1e-6)


def test_the_full_softmax_in_bf16_is_as_close_to_the_exact_gradient_as_autocast_s_cross_entropy(monkeypatch):
    monkeypatch.setattr(losses, "CHUNK_LOGITS", 100_000)                     # blocks of 64 rows
    g = torch.Generator().manual_seed(4)
    hidden, items = torch.randn(300, 32, generator=g), torch.randn(3000, 32, generator=g) * 0.1
    targets = torch.randint(0, 3000, (300,), generator=g)
    exact = _loss_and_gradients(_cross_entropy, hidden, items, targets, dtype=torch.float64)
    ours = _loss_and_gradients(full_softmax_loss, hidden, items, targets, bf16=True)
    autocast = _loss_and_gradients(_cross_entropy, hidden, items, targets, bf16=True)
    for i in (1, 2):
        error = ((ours[i] - exact[i]).norm() / exact[i].norm()).item()
        assert 1e-4 < error < 1.5 * ((autocast[i] - exact[i]).norm() / exact[i].norm()).item()   # bf16, no worse
    assert ours[0] == pytest.approx(exact[0], rel=1e-3)


def test_logits_that_fit_one_block_train_exactly_as_one_cross_entropy():
    # a small catalog (the sample data's 1,000 items at a full batch): nothing to gain from blocks, same bits
    g = torch.Generator().manual_seed(5)
    hidden, items = torch.randn(800, 64, generator=g), torch.randn(1000, 64, generator=g)
    targets = torch.randint(0, 1000, (800,), generator=g)
    ours = _loss_and_gradients(full_softmax_loss, hidden, items, targets, bf16=True)
    plain = _loss_and_gradients(_cross_entropy, hidden, items, targets, bf16=True)
    assert ours[0] == plain[0] and torch.equal(ours[1], plain[1]) and torch.equal(ours[2], plain[2])


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


def test_vocabulary_counts_drop_the_padding_index_and_count_unseen_items_as_zero():
    assert vocabulary_counts(np.array([0, 2, 1]), 4).tolist() == [2, 1, 0, 0]
    with pytest.raises(ValueError, match="at most num_items"):
        vocabulary_counts(np.ones(7), 4)


def test_sampled_loss_falls_back_to_the_full_softmax_when_the_sample_is_no_smaller_than_the_catalog(caplog):
    counts = torch.ones(100)
    with caplog.at_level(logging.WARNING, logger="recsys.model.losses"):
        assert training_loss("sampled", 100, counts, seed=0) is full_softmax_loss
    assert "100 negatives but only 100 items" in caplog.text
    assert training_loss("full", 10, counts, seed=0) is full_softmax_loss
    assert training_loss("sampled", 99, counts, seed=0) is not full_softmax_loss
    with pytest.raises(ValueError, match="full, sampled.*'bpr'"):
        training_loss("bpr", 10, counts, seed=0)


def test_train_settings_refuse_an_unknown_loss_and_no_negatives():
    with pytest.raises(ValueError, match=r"TrainSettings.loss must be one of full, sampled, got 'sampeld'"):
        TrainSettings(loss="sampeld")
    with pytest.raises(ValueError, match="TrainSettings.negatives must be at least 1.*got 0"):
        TrainSettings(loss="sampled", negatives=0)


NUM_ITEMS = 300


def skewed_successor_task(users: int = 1200, seed: int = 0) -> tuple[Sequences, ValidationSet]:
    """Item i is followed by i + 1 (cyclically), runs of 4..12 items starting at Zipf-distributed items,
    so item popularity is skewed as in real logs. Target: the item after each user's last."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, NUM_ITEMS + 1)
    starts = rng.choice(NUM_ITEMS, users, p=weights / weights.sum())
    lengths = rng.integers(4, 13, users)
    runs = [(s + np.arange(n)) % NUM_ITEMS + 1 for s, n in zip(starts, lengths)]
    targets = np.array([r[-1] % NUM_ITEMS + 1 for r in runs], dtype=np.int64)
    return Sequences.from_lists(runs), ValidationSet(Sequences.from_lists(runs), targets)


def test_a_model_trained_with_sampled_softmax_ranks_nearly_as_well_as_with_the_full_softmax():
    """A 300-item catalog, 32 negatives a step (about a tenth of it): validation NDCG@10 within 0.1 of
    the full softmax's, both far above a random ranking's (about 0.02)."""
    train, valid = skewed_successor_task()
    config = SASRecConfig(num_items=NUM_ITEMS, dim=32, layers=1, heads=2, max_len=10, dropout=0.1)
    full = TrainSettings(epochs=5, batch_size=64, learning_rate=5e-3, patience=3, seed=3, num_threads=SHARE)
    by_full = fit(train, config, full, valid=valid).best_metrics["ndcg@10"]
    by_sampled = fit(train, config, replace(full, loss="sampled", negatives=32), valid=valid).best_metrics["ndcg@10"]
    assert by_full > 0.6 and by_sampled > 0.6, (by_full, by_sampled)
    assert by_sampled > by_full - 0.1, (by_full, by_sampled)


def test_training_with_sampled_softmax_repeats_for_a_seed():
    train, _ = skewed_successor_task(users=200)
    config = SASRecConfig(num_items=NUM_ITEMS, dim=16, layers=1, heads=1, max_len=10, dropout=0.1)
    settings = TrainSettings(epochs=1, batch_size=32, seed=5, num_threads=SHARE, loss="sampled", negatives=32)
    a, b = (fit(train, config, settings).model.state_dict() for _ in range(2))
    c = fit(train, config, replace(settings, seed=6)).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_training_from_streamed_shards_samples_from_their_item_counts(tmp_path):
    """recsys train streams its windows from shard files: the proposal comes from their counts, and
    a streamed sampled-softmax fit learns and repeats for a seed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recsys.model.stream import ShardFiles, StreamedWindows, StreamSettings
    from recsys.sequences import Vocabulary

    train, _ = skewed_successor_task(users=300)
    ids = train.items + 1000                                                     # external ids
    lists = [ids[a:b].tolist() for a, b in zip(train.offsets[:-1], train.offsets[1:])]
    path = tmp_path / "part-00000.parquet"
    pq.write_table(pa.table({"user_id": pa.array(np.arange(len(lists)), pa.int64()),
                             "history": pa.array(lists, pa.list_(pa.int64())),
                             "newest_first_us": pa.array(np.zeros(len(lists)), pa.int64())}), path)
    vocab = Vocabulary(np.unique(ids))
    config = SASRecConfig(num_items=len(vocab), dim=16, layers=1, heads=1, max_len=10, dropout=0.1)
    settings = TrainSettings(epochs=3, batch_size=32, learning_rate=5e-3, seed=5, num_threads=SHARE,
                             loss="sampled", negatives=32)

    def run():
        source = StreamedWindows(ShardFiles((str(path),)), vocab, StreamSettings(
            max_len=10, batch_size=32, seed=5, hold_out_newest=False, random_offsets=False, users_per_chunk=64,
            shuffle_windows=128))
        assert vocabulary_counts(source.item_counts, len(vocab)).sum() == len(ids)
        return fit(source, config, settings)

    first, second = run(), run()
    assert first.curve[-1]["train_loss"] < first.curve[0]["train_loss"]
    assert all(torch.equal(v, second.model.state_dict()[k]) for k, v in first.model.state_dict().items())
