"""A trained model's weights carried over to a larger vocabulary: the start of a fit that continues it.

A model's item-sized tensors (the item embedding, tied to the output layer: ``[num_items + 1, D]``, row 0
padding) are indexed by the model's vocabulary. A fit that continues a trained model on more data (the
refit that continues the selected model, ``train.refit_epochs``) has a vocabulary holding the old one and
the items seen only in the new data; this maps each known item's row to its place in the new vocabulary
and gives every new item the row a freshly built model has (its seeded initialisation), so the fit that
follows learns them from their first interactions. Every other tensor is carried over as it is.

Pure torch/numpy: runs wherever training runs.
"""
from __future__ import annotations

import numpy as np
import torch

from recsys.sequences import Vocabulary


ITEM_TENSORS = ("item_emb.weight",)   # every registered model's item-sized tensor (its item_embeddings())


def grown_state(state: dict[str, torch.Tensor], old_ids: np.ndarray, new_ids: np.ndarray,
                fresh: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a model over ``old_ids``) as a state of the model ``fresh`` is (over ``new_ids``).

    The item tensors (``ITEM_TENSORS``: ``[num_items + 1, ...]``, row 0 padding) are remapped row by row
    (an old item the new vocabulary lacks is dropped); new items keep ``fresh``'s rows. Every other
    tensor is carried over; one that differs in shape raises ValueError (not the same architecture).

    >>> old = {"item_emb.weight": torch.tensor([[0.], [1.], [2.]]), "ln.weight": torch.tensor([5.])}
    >>> fresh = {"item_emb.weight": torch.full((4, 1), 9.), "ln.weight": torch.tensor([0.])}
    >>> grown = grown_state(old, np.array([10, 20]), np.array([10, 15, 20]), fresh)
    >>> grown["item_emb.weight"].flatten().tolist(), grown["ln.weight"].tolist()
    ([0.0, 1.0, 9.0, 2.0], [5.0])
    """
    old_ids, new_ids = np.asarray(old_ids), np.asarray(new_ids)
    old_index = Vocabulary(old_ids).index_of(new_ids)              # each new item's row in the old model, 0: none
    known = old_index > 0
    new_rows = torch.from_numpy(np.concatenate([[0], np.flatnonzero(known) + 1]))     # padding stays padding
    old_rows = torch.from_numpy(np.concatenate([[0], old_index[known]]))
    out: dict[str, torch.Tensor] = {}
    for name, target in fresh.items():
        if name not in state:
            raise ValueError(f"the trained model has no tensor {name!r}: not the same model type")
        source = state[name]
        if name in ITEM_TENSORS:
            if source.shape != (len(old_ids) + 1, *target.shape[1:]) or target.shape[0] != len(new_ids) + 1:
                raise ValueError(f"item tensor {name!r} is {tuple(source.shape)} for {len(old_ids)} items and "
                                 f"{tuple(target.shape)} for {len(new_ids)}: not the same architecture")
            grown = target.clone()
            grown[new_rows] = source[old_rows].to(grown.dtype)
            out[name] = grown
        elif source.shape == target.shape:
            out[name] = source.clone()
        else:
            raise ValueError(f"tensor {name!r} is {tuple(source.shape)} in the trained model and "
                             f"{tuple(target.shape)} in the new one: not the same architecture")
    return out


def continued_model(selected: torch.nn.Module, old_ids: np.ndarray, new_ids: np.ndarray, model_config,
                    seed: int) -> torch.nn.Module:
    """A new model of ``model_config`` (over ``new_ids``) holding ``selected``'s weights (over ``old_ids``), the
    new items' rows a fresh model's built under ``seed``: where a refit that continues the selected model
    starts (``recsys train`` and ``recsys evaluate`` alike). ``selected`` itself is left as it is."""
    from recsys.model.registry import build_model

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        fresh = build_model(model_config)
    weights = {k: v.detach().cpu() for k, v in selected.state_dict().items()}
    fresh.load_state_dict(grown_state(weights, old_ids, new_ids, fresh.state_dict()))
    return fresh
