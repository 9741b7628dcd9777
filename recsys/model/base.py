"""The contract every recommendation model honours, so the scoring core stays model-agnostic.

A model turns a user's recent items into one vector and scores items by dot product with their
embeddings. That shape is what makes batch scoring fast: one matrix product per chunk of users,
tileable over the catalog, fused with masking and top-k (see ``recsys.scoring.core``).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class SequenceRecommender(Protocol):
    """What the scoring core needs from a model.

    Item indices are vocabulary positions shifted by one: 0 is padding, real items ``1..num_items``.
    """

    max_len: int     # how many of the most recent items ``encode`` looks at
    num_items: int   # vocabulary size, padding excluded

    def encode(self, seq: torch.Tensor) -> torch.Tensor:
        """``seq``: [B, max_len] int64, left-padded with 0, newest item last -> [B, D] user vectors.

        Must return finite vectors for all-padding rows too (callers route users without history
        to a fallback, but a NaN must never reach a ranking).
        """
        ...

    def item_embeddings(self) -> torch.Tensor:
        """[num_items + 1, D]: row i scores item index i; row 0 (padding) is never recommended."""
        ...


def drop_padding_columns(seq: torch.Tensor, *aligned: torch.Tensor, multiple: int = 1) -> tuple[torch.Tensor, ...]:
    """``seq`` [B, L] (and each ``aligned`` [B, L]) without the leading columns that are padding in every row.

    Histories are left-padded to ``max_len``, but most users hold far fewer items, so a block of
    users is often mostly padding. Both models give the same outputs at the real positions without
    those columns (SASRec counts positions back from the newest item and never attends to padding;
    GRU4Rec's state stays exactly zero through padding), so ``encode``'s cost follows the block's
    longest row instead of ``max_len``. Reads one value back from the device.

    ``multiple``: keep a width that is a multiple of it (or all ``L`` columns), a few padding columns more:
    training's batches then come in a handful of shapes that the CPU's matrix kernels tile evenly instead of
    every width up to ``L`` (docs/quality.md, "Batches by length").

    >>> drop_padding_columns(torch.tensor([[0, 0, 3, 4], [0, 0, 0, 5]]))[0].tolist()
    [[3, 4], [0, 5]]
    >>> drop_padding_columns(torch.tensor([[0, 0, 0, 4], [0, 0, 0, 5]]), multiple=2)[0].tolist()
    [[0, 4], [0, 5]]
    """
    real = (seq != 0).any(dim=0)                                               # [L]
    first = int(torch.argmax(real.to(torch.uint8)))       # 0 when no column has an item: nothing dropped
    if multiple > 1:
        first = max(0, seq.shape[1] - -(-(seq.shape[1] - first) // multiple) * multiple)
    if first == 0:
        return (seq, *aligned)
    return (seq[:, first:], *(a[:, first:] for a in aligned))
