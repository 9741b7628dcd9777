"""Item-to-item weights beside the model: EASE (Steck 2019), fitted in closed form at training. Pure numpy/torch.

Why: on a log where users come back, the lists' hits on items new to the user are bounded by how well new items are
ranked, and a sequence model trained on next items ranks them about as well as matrix factorisation. EASE learns, for
every pair of the log's most used items, how much having one says about the other (a ridge regression of each item's
column on all the others, the diagonal held at zero). Its scores, added to the model's for the items a user does not
know, rank those items better than either alone on Wikipedia edits and on the sample data (docs/quality.md, "A second
ranker beside the model"). The repeat blend chooses how much they add (``RepeatBlend.item_to_item_weight``, 0 among
the choices), so a log where they do not help keeps the model's ranking.

The fit: ``G`` the items x items co-occurrence counts (users who had both, each user's distinct items), ``P = (G + l2
I)^-1``, ``B = -P / diag(P)`` column by column, ``diag(B) = 0``. A user's score for item ``j`` is the sum of ``B[i, j]``
over the items ``i`` they had. Only the ``max_items`` items with the most users take part (``train.repeats.
item_to_item.max_items``): the inverse is cubic in them and ``B`` is square, so a large catalog keeps its head; the
other items get no item-to-item score (their ranking is the model's).
"""
from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from recsys.sequences import Vocabulary

FILE = "item_to_item.npz"


@dataclass(frozen=True, eq=False)
class ItemToItem:
    """EASE weights over a set of items: ``weights[a, b]`` is what having ``item_ids[a]`` says for ``item_ids[b]``."""

    item_ids: np.ndarray   # [V] int64 external ids, distinct
    weights: np.ndarray    # [V, V] float32, zero diagonal
    l2: float

    def __post_init__(self) -> None:
        v = len(self.item_ids)
        if self.weights.shape != (v, v):
            raise ValueError(f"item-to-item weights have shape {self.weights.shape} for {v} items; expected ({v}, {v})")
        if len(np.unique(self.item_ids)) != v:
            raise ValueError("item-to-item item ids have duplicates: each row must be a distinct item")

    def known_to(self, vocab: "Vocabulary") -> tuple[np.ndarray, np.ndarray]:
        """The weighted items a model's vocabulary knows: (their rows here, their model indices). Only those can be
        in a history the model reads or be scored."""
        index = vocab.index_of(self.item_ids)
        rows = np.flatnonzero(index > 0)
        return rows, index[rows]

    def save(self, path: Path) -> None:
        """One ``.npz`` (numbers only, no pickle): item ids, weights, l2."""
        buffer = io.BytesIO()
        np.savez(buffer, item_ids=self.item_ids.astype(np.int64), weights=self.weights.astype(np.float32),
                 l2=np.array([self.l2]))
        Path(path).write_bytes(buffer.getvalue())

    @classmethod
    def load(cls, path: Path) -> "ItemToItem":
        try:
            with np.load(Path(path), allow_pickle=False) as data:
                return cls(data["item_ids"].astype(np.int64), data["weights"].astype(np.float32), float(data["l2"][0]))
        except (OSError, KeyError, ValueError) as exc:
            raise ValueError(f"{path} is not a recsys item-to-item file ({exc}): restore it from the saved model, or "
                             "delete it and choose a repeat blend without item_to_item_weight") from exc


def ease_weights(gram: np.ndarray, l2: float) -> np.ndarray:
    """EASE's closed form from the co-occurrence counts ``gram`` [V, V] (symmetric; its diagonal: each item's users).

    >>> w = ease_weights(np.array([[2.0, 2.0, 0.0], [2.0, 2.0, 0.0], [0.0, 0.0, 1.0]]), 1.0)
    >>> round(float(w[0, 1]), 3), round(float(w[1, 0]), 3), float(abs(w[2]).sum() + abs(w[:, 2]).sum())
    (0.667, 0.667, 0.0)
    """
    if l2 <= 0:
        raise ValueError(f"the item-to-item l2 must be positive, got {l2}")
    gram = np.asarray(gram, dtype=np.float64)
    precision = np.linalg.inv(gram + l2 * np.eye(len(gram)))
    weights = -precision / np.diag(precision)[None, :]
    np.fill_diagonal(weights, 0.0)
    return weights.astype(np.float32)


def from_co_counts(item_ids: np.ndarray, rows: np.ndarray, cols: np.ndarray, counts: np.ndarray,
                   l2: float) -> ItemToItem:
    """Fit from sparse co-occurrence counts: (row, col, users) of the upper triangle, diagonal included (positions
    into ``item_ids``). Items no user had (an empty row) keep all-zero weights.

    >>> fit = from_co_counts(np.array([7, 8, 9]), np.array([0, 0, 1, 2]), np.array([0, 1, 1, 2]),
    ...                      np.array([2, 2, 2, 1]), 1.0)
    >>> round(float(fit.weights[0, 1]), 3), round(float(fit.weights[1, 0]), 3), fit.item_ids.tolist()
    (0.667, 0.667, [7, 8, 9])
    """
    item_ids = np.asarray(item_ids, dtype=np.int64)
    gram = np.zeros((len(item_ids), len(item_ids)))
    rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
    np.add.at(gram, (rows, cols), counts)
    off = rows != cols
    np.add.at(gram, (cols[off], rows[off]), np.asarray(counts)[off])
    return ItemToItem(item_ids, ease_weights(gram, l2), float(l2))


def pair_counts(offsets: np.ndarray, positions: np.ndarray, held: np.ndarray, n_items: int,
                max_pairs: int = 1 << 24) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Co-occurrence counts of a batch of users' distinct items, ``max_pairs`` pairs at a time: (keys ``i * n_items +
    j`` with ``i <= j``, distinct and ascending; users with both; users with both, neither the held-out newest) per
    chunk, a key possibly again in a later chunk. ``offsets`` [U + 1] and ``positions`` [S]: each user's items
    (positions into the weighted items, each once a user); ``held`` [S]: the item is its user's held-out newest.
    Vectorised: every (item, itself or a later item of the same user) pair of a chunk at once. For a catalog small
    enough to hold its counts as two dense arrays, :func:`add_pair_counts` is the faster form.

    >>> [(k.tolist(), a.tolist(), t.tolist()) for k, a, t in pair_counts(np.array([0, 2, 3]), np.array([1, 0, 1]),
    ...                                                                    np.array([False, True, False]), 2)]
    [([0, 1, 3], [1, 1, 2], [0, 0, 2])]
    """
    for keys, kept in _pair_keys(offsets, positions, held, n_items, max_pairs):
        keys, inverse, every = np.unique(keys, return_inverse=True, return_counts=True)
        trained = np.bincount(inverse, weights=kept, minlength=len(keys))
        yield keys, every.astype(np.int64), trained.astype(np.int64)


def add_pair_counts(offsets: np.ndarray, positions: np.ndarray, held: np.ndarray, n_items: int, every: np.ndarray,
                    trained: np.ndarray, max_pairs: int = 1 << 24) -> None:
    """:func:`pair_counts` added into two dense ``[n_items ** 2]`` int64 arrays (``every``: users with both items;
    ``trained``: without the held-out newest), the count of key ``i * n_items + j`` at that index. A ``bincount``
    per chunk instead of a sort: about 10x less CPU a pair (docs/performance.md, "Item-to-item scores in the core").

    >>> every, trained = np.zeros(4, dtype=np.int64), np.zeros(4, dtype=np.int64)
    >>> add_pair_counts(np.array([0, 2, 3]), np.array([1, 0, 1]), np.array([False, True, False]), 2, every, trained)
    >>> every.tolist(), trained.tolist()
    ([1, 1, 0, 2], [0, 0, 0, 2])
    """
    size = n_items * n_items
    if every.shape != (size,) or trained.shape != (size,):
        raise ValueError(f"dense pair counts for {n_items} items need two arrays of {size} counts, not "
                         f"{every.shape} and {trained.shape}")
    for keys, kept in _pair_keys(offsets, positions, held, n_items, max_pairs):
        every += np.bincount(keys, minlength=size)
        trained += np.bincount(keys, weights=kept, minlength=size).astype(np.int64)


def _pair_keys(offsets: np.ndarray, positions: np.ndarray, held: np.ndarray, n_items: int,
               max_pairs: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every (item, itself or a later item of the same user) pair, at most ``max_pairs`` (or one item's pairs) at a
    time: (keys ``i * n_items + j``, ``i <= j``; whether neither is its user's held-out newest)."""
    positions = np.asarray(positions, dtype=np.int64)
    held = np.asarray(held, dtype=bool)
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    owner = np.repeat(np.arange(len(lengths)), lengths)
    partners = offsets[owner + 1] - np.arange(len(positions))                       # [S] itself and the later items
    ends = np.cumsum(partners)
    start = 0
    while start < len(positions):                                                      # the items whose pairs fit
        stop = max(start + 1, int(np.searchsorted(ends, (ends[start - 1] if start else 0) + max_pairs, "right")))
        count = partners[start:stop]
        first = np.repeat(np.arange(start, stop), count)                                # [P] each pair's first item
        second = first + np.arange(len(first)) - np.repeat(np.cumsum(count) - count, count)
        a, b = positions[first], positions[second]
        yield np.minimum(a, b) * n_items + np.maximum(a, b), ~(held[first] | held[second])
        start = stop


def user_scores(weights: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, n_rows: int) -> torch.Tensor:
    """[n_rows, W] item-to-item scores: row ``r`` sums ``weights[p]`` over its items' positions ``p`` (``rows``,
    ascending, and ``positions`` aligned, one entry per distinct item a user had; a position -1: an item without
    weights, skipped). ``weights`` [V, W]: the rows of every weighted item, its columns those scored (a subset, e.g.
    the candidates).

    One ``embedding_bag`` sum per row: the weights' rows are added where they lie, never gathered into a
    ``[items, W]`` copy first (on the CPU about 50x faster than a gather and an index-add, measured on a row block of
    the bench's shape: docs/performance.md, "Item-to-item scores in the core").

    >>> w = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    >>> user_scores(w, torch.tensor([0, 0, 1]), torch.tensor([0, 1, -1]), 3).tolist()
    [[2.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    """
    keep = positions >= 0
    kept_rows = rows[keep]
    counts = torch.bincount(kept_rows, minlength=n_rows)[:n_rows]
    offsets = torch.cumsum(counts, 0) - counts                                  # each row's first entry
    return torch.nn.functional.embedding_bag(positions[keep], weights, offsets, mode="sum")
