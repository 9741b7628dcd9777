"""A deterministic stand-in model for testing the model-agnostic scoring core.

The core only needs the ``SequenceRecommender`` contract; this model honours it with fixed
embeddings so a test can compute the expected ranking by hand (or with plain numpy).
"""
from __future__ import annotations

import torch


class MeanEmbeddingModel(torch.nn.Module):
    """User vector = mean of the embeddings of the (non-padding) items in the window."""

    def __init__(self, item_emb: torch.Tensor, max_len: int = 4):
        super().__init__()
        self.emb = torch.nn.Parameter(item_emb.clone(), requires_grad=False)  # [num_items + 1, D]
        self.max_len = max_len
        self.num_items = item_emb.shape[0] - 1

    def encode(self, seq: torch.Tensor) -> torch.Tensor:
        mask = (seq > 0).float()[..., None]                 # [B, L, 1]
        total = (self.emb[seq] * mask).sum(1)               # [B, D]
        return total / mask.sum(1).clamp(min=1.0)

    def item_embeddings(self) -> torch.Tensor:
        return self.emb


def random_model(num_items: int, dim: int = 8, seed: int = 0, max_len: int = 4) -> MeanEmbeddingModel:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(num_items + 1, dim, generator=g)
    emb[0] = 0.0
    return MeanEmbeddingModel(emb, max_len=max_len)
