"""GRU4Rec: a recurrent next-item model over a user's most recent items (Hidasi et al., 2016).

Trained like SASRec (``recsys.model.training``: every position predicts the next item against the
full catalog), so the two differ only in the sequence encoder: a GRU reads the items in order
where SASRec attends over them. The item embedding table is both the input embedding and the
output layer, so a user vector scores items by a dot product with :meth:`GRU4Rec.item_embeddings`
(the :class:`~recsys.model.base.SequenceRecommender` contract).

Padding never changes the result for real items: the GRU has no bias terms and the padding
embedding is zero, so from the zero initial state a padding step computes
``n = tanh(0) = 0`` and ``h' = (1 - z) * 0 + z * 0 = 0``: the state is still exactly zero when the
first real item arrives, however much padding precedes it. That is what lets the nightly job
left-pad every history to ``max_len`` and lets :meth:`GRU4Rec.encode` drop all-padding columns.

Device and dtype are the caller's choice: the module creates every tensor on the device of its input.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from recsys.model.base import drop_padding_columns
from recsys.model.configs import GRU4RecConfig

__all__ = ["GRU4Rec", "GRU4RecConfig"]


class GRU4Rec(nn.Module):
    """Implements :class:`~recsys.model.base.SequenceRecommender`.

    Input ``seq`` is [B, L] item indices with ``L <= max_len``, left-padded with 0, newest last.
    """

    def __init__(self, config: GRU4RecConfig):
        super().__init__()
        self.config = config
        self.max_len = config.max_len
        self.num_items = config.num_items
        self.item_emb = nn.Embedding(config.num_items + 1, config.dim, padding_idx=0)
        self.emb_dropout = nn.Dropout(config.dropout)
        self.gru = nn.GRU(config.dim, config.dim, num_layers=config.layers, batch_first=True, bias=False,
                          dropout=config.dropout if config.layers > 1 else 0.0)
        self.out_dropout = nn.Dropout(config.dropout)
        self.proj = nn.Linear(config.dim, config.dim)
        with torch.no_grad():
            nn.init.normal_(self.item_emb.weight, std=0.02)
            self.item_emb.weight[0].zero_()
            nn.init.normal_(self.proj.weight, std=0.02)
            nn.init.zeros_(self.proj.bias)

    def item_embeddings(self) -> torch.Tensor:
        """[num_items + 1, D], the same parameter the input embedding uses (row 0 is padding, zero)."""
        return self.item_emb.weight

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        """Hidden state per position, [B, L] -> [B, L, D]; position t has read items up to t."""
        if seq.dim() != 2:
            raise ValueError(f"seq must be [batch, length], got shape {tuple(seq.shape)}")
        if seq.shape[1] > self.max_len:
            raise ValueError(f"seq has {seq.shape[1]} columns but the model reads at most max_len={self.max_len}: "
                             "keep the most recent items (recsys.sequences.pad_left)")
        x = self.emb_dropout(self.item_emb(seq))                                   # [B, L, D]
        h, _ = self.gru(x)                                                          # [B, L, D]
        return self.proj(self.out_dropout(h))                                       # [B, L, D]

    def encode(self, seq: torch.Tensor) -> torch.Tensor:
        """User vectors, [B, L] -> [B, D]: the output at the newest position.

        Leading columns that are padding in every row are dropped first (exact, see the module
        docstring); that reads one value back from the device per call.
        """
        (seq,) = drop_padding_columns(seq)                                          # [B, L']
        return self.forward(seq)[:, -1]                                             # [B, D]
