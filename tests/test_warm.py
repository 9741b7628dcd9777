"""recsys.model.warm: a trained model's weights carried to a larger vocabulary, for every registered model type."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from recsys.model.registry import MODEL_TYPES, build_model
from recsys.model.warm import ITEM_TENSORS, grown_state


@pytest.mark.parametrize("model_type", sorted(MODEL_TYPES))
def test_known_items_keep_their_rows_new_ones_get_fresh_rows_and_scores_of_known_items_do_not_change(model_type):
    config_cls, _ = MODEL_TYPES[model_type]
    old_ids, new_ids = np.array([3, 5, 9, 12]), np.array([3, 4, 5, 9, 12, 20])
    torch.manual_seed(0)
    trained = build_model(config_cls(num_items=len(old_ids), dim=8, max_len=6)).eval()
    fresh_model = build_model(config_cls(num_items=len(new_ids), dim=8, max_len=6))
    named = {n for n, p in trained.named_parameters() if p is trained.item_embeddings()}
    assert named == set(ITEM_TENSORS)                  # the one item-sized tensor is the one grown_state remaps

    grown = build_model(config_cls(num_items=len(new_ids), dim=8, max_len=6)).eval()
    grown.load_state_dict(grown_state(trained.state_dict(), old_ids, new_ids, fresh_model.state_dict()))
    rows = grown.item_embeddings().detach()
    assert torch.equal(rows[[1, 3, 4, 5]], trained.item_embeddings().detach()[1:])          # 3, 5, 9, 12
    assert torch.equal(rows[[2, 6]], fresh_model.item_embeddings().detach()[[2, 6]])        # 4 and 20 are new
    # a history of known items scores the known items exactly as before
    seq_old, seq_new = torch.tensor([[0, 0, 1, 2, 3]]), torch.tensor([[0, 0, 1, 3, 4]])
    with torch.no_grad():
        before = trained(seq_old)[:, -1] @ trained.item_embeddings()[1:].T
        after = grown(seq_new)[:, -1] @ grown.item_embeddings()[[1, 3, 4, 5]].T
    assert torch.allclose(before, after, atol=1e-6)


def test_a_different_architecture_is_refused_naming_the_tensor():
    config_cls, _ = MODEL_TYPES["sasrec"]
    small = build_model(config_cls(num_items=3, dim=8, max_len=6)).state_dict()
    wide = build_model(config_cls(num_items=4, dim=16, max_len=6)).state_dict()
    with pytest.raises(ValueError, match="item tensor 'item_emb.weight'|tensor '"):
        grown_state(small, np.array([1, 2, 3]), np.array([1, 2, 3, 4]), wide)
