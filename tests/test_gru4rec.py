"""GRU4Rec honours the same contract as SASRec: padding-invariant encode, round trip, it learns."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from recsys.model.base import SequenceRecommender
from recsys.model.gru4rec import GRU4Rec, GRU4RecConfig
from recsys.model.io import load_model, save_model
from recsys.model.training import TrainSettings, ValidationSet, fit
from recsys.sequences import Sequences

NUM_ITEMS = 40


def make_model(seed: int = 0, **overrides) -> GRU4Rec:
    torch.manual_seed(seed)
    config = GRU4RecConfig(**{"num_items": NUM_ITEMS, "dim": 16, "layers": 2, "max_len": 8, "dropout": 0.1, **overrides})
    model = GRU4Rec(config)
    with torch.no_grad():                  # biases away from their zero init, as after training
        model.proj.bias.normal_()
    return model.eval()


def test_gru4rec_satisfies_the_scoring_contract():
    model = make_model()
    assert isinstance(model, SequenceRecommender)
    assert model.item_embeddings().shape == (NUM_ITEMS + 1, 16)
    assert model.encode(torch.tensor([[0, 0, 3, 4]])).shape == (1, 16)


def test_padding_amount_does_not_change_the_user_vector():
    model = make_model()
    items = torch.tensor([[5, 9, 2]])
    vectors = [model.encode(torch.cat([torch.zeros(1, pad, dtype=torch.long), items], dim=1)) for pad in (0, 1, 5)]
    assert all(torch.allclose(vectors[0], v, atol=1e-6) for v in vectors[1:])
    # in a batch with a longer row, the short row is padded and must still give the same vector
    batch = torch.tensor([[0, 0, 0, 0, 0, 5, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8]])
    assert torch.allclose(model.encode(batch)[0], vectors[0][0], atol=1e-6)


def test_all_padding_rows_are_finite():
    model = make_model()
    assert torch.isfinite(model.encode(torch.zeros(3, 8, dtype=torch.long))).all()


def test_round_trip_gives_identical_user_vectors(tmp_path):
    model = make_model(seed=3)
    save_model(model, np.arange(100, 100 + NUM_ITEMS), tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.model_type == "gru4rec" and loaded.config == model.config
    seq = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 0, 9, 10]])
    assert torch.equal(loaded.model.encode(seq), model.encode(seq))


@pytest.mark.parametrize("bad", [dict(dim=0), dict(layers=0), dict(max_len=0), dict(dropout=1.0)])
def test_config_rejects_nonsense(bad):
    with pytest.raises(ValueError, match="GRU4RecConfig"):
        GRU4RecConfig(**{"num_items": NUM_ITEMS, **bad})


def test_learns_that_each_item_is_followed_by_the_next():
    rng = np.random.default_rng(0)
    runs = [(s + np.arange(n)) % NUM_ITEMS + 1 for s, n in zip(rng.integers(0, NUM_ITEMS, 150), rng.integers(4, 15, 150))]
    targets = np.array([r[-1] % NUM_ITEMS + 1 for r in runs])
    train = Sequences.from_lists(runs)
    config = GRU4RecConfig(num_items=NUM_ITEMS, dim=32, layers=1, max_len=10, dropout=0.1)
    settings = TrainSettings(epochs=12, batch_size=32, learning_rate=5e-3, patience=3, seed=3, num_threads=1)
    result = fit(train, config, settings, valid=ValidationSet(train, targets))
    assert result.best_metrics["ndcg@10"] > 0.8
