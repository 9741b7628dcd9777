"""Ranking metrics for leave-one-out evaluation with full ranking over the catalog (pure torch/numpy).

Everything starts from :func:`target_ranks`, the 0-based rank of each user's held-out item among
the items it competes with. Conventions, chosen so that a broken model can never look good:

- **Ties are pessimistic**: the rank counts every competing item scoring *at least* as high as the
  target. A model that scores everything equally (collapsed, all-zero, untrained) ranks every target
  last instead of first; with continuous scores ties are rare and the choice changes nothing.
- **NaN is a miss**: a target whose own score is NaN gets rank +inf (``NaN > x`` is False, so a
  naive count would rank it first). A competing item with a NaN score counts as higher than the
  target, because ``torch.topk`` puts NaN first and would recommend it.
- **Excluded items do not compete** (already-seen items, as the nightly job masks them), column 0
  (padding) never competes, and a target that is itself excluded is a miss.

With one target per user (leave-one-out) recall@k equals hit rate@k. Protocols with several
targets per user (a temporal split: everything a user did in the test days) go through
:func:`user_metrics`, which turns the rank of each (user, target) pair into per-user values.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from recsys.model.base import SequenceRecommender
from recsys.sequences import Sequences, pad_left

# The one metric models are chosen on: the epoch (early stopping in training and in ``recsys
# evaluate``), the gate between a new version and the alias holder, ALS's grid point. Whatever
# cut-offs a report asks for, the choice is made on this one.
SELECTION_K = 10
SELECTION_METRIC = f"ndcg@{SELECTION_K}"


def validation_name(metric: str) -> str:
    """The name a validation-set figure carries in MLflow and logs (``ndcg@10`` -> ``val_ndcg@10``)."""
    return metric if metric.startswith("val_") else f"val_{metric}"


def target_ranks(scores: torch.Tensor, targets: torch.Tensor, exclude: torch.Tensor) -> torch.Tensor:
    """0-based rank of each target among the non-excluded items, [B] float (+inf for a miss).

    ``scores`` [B, num_items + 1] (column 0 is padding), ``targets`` [B] item indices,
    ``exclude`` [B, L] item indices left or right padded with 0.
    """
    if scores.dim() != 2 or targets.shape != scores.shape[:1] or exclude.dim() != 2 or exclude.shape[0] != scores.shape[0]:
        raise ValueError(f"expected scores [B, N+1], targets [B], exclude [B, L]; got {tuple(scores.shape)}, "
                         f"{tuple(targets.shape)}, {tuple(exclude.shape)}")
    B, n_cols = scores.shape
    targets = targets.to(torch.int64)
    valid_target = (targets >= 1) & (targets < n_cols)                                   # [B]
    safe_targets = torch.where(valid_target, targets, torch.zeros_like(targets))         # [B]
    excluded = torch.zeros(B, n_cols, dtype=torch.bool, device=scores.device)            # [B, N+1]
    excluded.scatter_(1, exclude.to(torch.int64).clamp(0, n_cols - 1), True)
    excluded[:, 0] = True                                                                # padding never competes
    target_score = scores.gather(1, safe_targets[:, None])                               # [B, 1]
    beats = (scores >= target_score) | torch.isnan(scores)                               # [B, N+1]
    competitors = beats & ~excluded
    competitors.scatter_(1, safe_targets[:, None], False)                                # not itself
    ranks = competitors.sum(dim=1).to(torch.float32)                                     # [B]
    target_excluded = excluded.gather(1, safe_targets[:, None])[:, 0]                    # [B]
    miss = ~valid_target | target_excluded | torch.isnan(target_score[:, 0])
    return torch.where(miss, torch.full_like(ranks, math.inf), ranks)


def _check(ranks: torch.Tensor) -> torch.Tensor:
    ranks = torch.as_tensor(ranks, dtype=torch.float64)
    if ranks.numel() == 0:
        raise ValueError("no ranks to average: evaluate at least one user")
    return ranks


def ndcg_at_k(ranks: torch.Tensor, k: int) -> float:
    """Mean NDCG@k with one relevant item per user: the mean of :func:`ndcg_gains`."""
    return float(ndcg_gains(ranks, k).mean())


def hit_rate_at_k(ranks: torch.Tensor, k: int) -> float:
    """Share of users whose target is in the top k (equals recall@k with one target per user)."""
    ranks = _check(ranks)
    return float((ranks < k).to(torch.float64).mean())


def mrr(ranks: torch.Tensor, k: int | None = None) -> float:
    """Mean reciprocal rank, 1 / (rank + 1); with ``k``, ranks at or beyond k count as 0."""
    ranks = _check(ranks)
    rr = 1.0 / (ranks + 1.0)
    if k is not None:
        rr = torch.where(ranks < k, rr, torch.zeros_like(rr))
    return float(rr.mean())


def user_metrics(ranks: torch.Tensor | np.ndarray, offsets: np.ndarray, ks: Sequence[int]) -> dict[str, np.ndarray]:
    """Per-user ``ndcg@k``, ``hr@k``, ``recall@k`` and ``mrr@k`` from the ranks of every user's targets.

    ``ranks`` [T] holds, user after user, the 0-based position of each target in that user's ranked
    list (:func:`target_ranks`, so other targets of the same user compete too, and +inf is a miss);
    user ``u`` owns ``ranks[offsets[u]:offsets[u + 1]]`` and must own at least one. Per-user values
    (not means) so that callers can bootstrap over users. For one target per user the means equal
    :func:`ndcg_at_k`, :func:`hit_rate_at_k` and :func:`mrr` with ``k``.

    - NDCG@k: DCG of the hits over the ideal DCG of min(k, targets) hits;
    - HR@k: 1 if any target is in the top k; recall@k: the share of the user's targets in the top k;
    - MRR@k: 1 / (rank + 1) of the best-ranked target, 0 when it is at or beyond k.
    """
    r = torch.as_tensor(ranks, dtype=torch.float64).cpu().numpy()
    offsets = np.asarray(offsets, dtype=np.int64)
    counts = np.diff(offsets)
    if len(counts) == 0:
        raise ValueError("no ranks to average: evaluate at least one user")
    if np.any(counts < 1) or offsets[0] != 0 or offsets[-1] != len(r):
        raise ValueError(f"offsets must start at 0, end at len(ranks)={len(r)} and give every user at least one "
                         f"target; got {counts.min()} targets for some user")
    user = np.repeat(np.arange(len(counts)), counts)
    best = np.minimum.reduceat(r, offsets[:-1])                                     # [U]
    out: dict[str, np.ndarray] = {}
    for k in ks:
        hit = r < k                                                                  # [T]
        gain = np.where(hit, 1.0 / np.log2(np.where(hit, r, 0.0) + 2.0), 0.0)       # [T]
        ideal = np.cumsum(1.0 / np.log2(np.arange(k) + 2.0))[np.minimum(counts, k) - 1]  # [U]
        hits = np.bincount(user, weights=hit, minlength=len(counts))                 # [U]
        out[f"ndcg@{k}"] = np.bincount(user, weights=gain, minlength=len(counts)) / ideal
        out[f"hr@{k}"] = (hits > 0).astype(np.float64)
        out[f"recall@{k}"] = hits / counts
        out[f"mrr@{k}"] = np.where(best < k, 1.0 / (np.where(best < k, best, 0.0) + 1.0), 0.0)
    return out


@torch.no_grad()
def ranking_ranks(model: SequenceRecommender, histories: Sequences, targets: np.ndarray, *, batch_size: int = 1024,
                  device: str | torch.device = "cpu", exclude: Sequences | None = None) -> torch.Tensor:
    """[U] each user's 0-based rank of ``targets[u]`` under full ranking (:func:`evaluate_ranking`'s arguments):
    the per-user figures behind its means, for what needs their spread (the training gate's noise)."""
    targets = np.asarray(targets, dtype=np.int64)
    exclude = histories if exclude is None else exclude
    if len(targets) != len(histories) or len(exclude) != len(histories):
        raise ValueError(f"histories ({len(histories)}), targets ({len(targets)}) and exclude ({len(exclude)}) "
                         "must have one row per user")
    if len(targets) == 0:
        raise ValueError("no users to evaluate")
    if targets.min() < 1 or targets.max() > model.num_items:
        raise ValueError(f"targets must be item indices in 1..{model.num_items} (0 is padding), "
                         f"got values in {targets.min()}..{targets.max()}")
    was_training = getattr(model, "training", False)
    if was_training:
        model.eval()
    try:
        items = model.item_embeddings()                                                  # [N+1, D]
        ranks = []
        for start in range(0, len(targets), batch_size):
            rows = np.arange(start, min(start + batch_size, len(targets)))
            seq = torch.from_numpy(pad_left(histories.take(rows), model.max_len)).to(device)   # [b, L]
            seen = exclude.take(rows)
            seen_t = torch.from_numpy(pad_left(seen, max(1, int(seen.lengths.max(initial=0))))).to(device)
            scores = model.encode(seq) @ items.T                                           # [b, N+1]
            ranks.append(target_ranks(scores.float(), torch.from_numpy(targets[rows]).to(device), seen_t).cpu())
    finally:
        if was_training:
            model.train()
    return torch.cat(ranks)


def ndcg_gains(ranks: torch.Tensor, k: int) -> np.ndarray:
    """[U] float64 per-user NDCG@k with one relevant item: 1 / log2(rank + 2) when rank < k, else 0
    (the terms :func:`ndcg_at_k` averages)."""
    ranks = _check(ranks).double()
    return torch.where(ranks < k, 1.0 / torch.log2(ranks.clamp(max=k) + 2.0), torch.zeros_like(ranks)).numpy()


def evaluate_ranking(model: SequenceRecommender, histories: Sequences, targets: np.ndarray, *,
                     ks: Sequence[int] = (10,), batch_size: int = 1024, device: str | torch.device = "cpu",
                     exclude: Sequences | None = None) -> dict[str, float]:
    """Leave-one-out metrics with full ranking: ``{"ndcg@k", "hr@k" for k in ks, "mrr"}``.

    ``histories[u]`` is what the model reads (its last ``max_len`` items), ``targets[u]`` the held-out
    item index, ``exclude[u]`` the items removed from the ranking (default: the whole history, as the
    nightly job masks seen items). ``model`` must already be on ``device``; it is put in eval mode for
    the call and restored afterwards.
    """
    all_ranks = ranking_ranks(model, histories, targets, batch_size=batch_size, device=device, exclude=exclude)
    out: dict[str, float] = {}
    for k in ks:
        out[f"ndcg@{k}"] = ndcg_at_k(all_ranks, k)
        out[f"hr@{k}"] = hit_rate_at_k(all_ranks, k)
    out["mrr"] = mrr(all_ranks)
    return out
