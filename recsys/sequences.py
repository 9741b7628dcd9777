"""Per-user item sequences in compressed (CSR) form, and their conversion to padded tensors input.

The same layout as an Arrow list array (offsets + flat values), so histories move between Spark,
the scoring core and training without per-row Python objects. Pure numpy/pyarrow.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class Sequences:
    """Per-user item sequences, oldest first: user ``u`` owns ``items[offsets[u]:offsets[u + 1]]``.

    What ``items`` holds depends on the stage, and the variable name should say which: external
    item ids (histories as read, what the scoring core is given) or model indices (after
    :meth:`Vocabulary.map_sequences`: positions in a model's vocabulary shifted by one, 0 being
    padding, so real items are ``1..num_items``; what models train on).
    """

    offsets: np.ndarray  # [U + 1] int64, offsets[0] == 0, non-decreasing
    items: np.ndarray    # [offsets[-1]] int64

    def __post_init__(self) -> None:
        if self.offsets.ndim != 1 or len(self.offsets) == 0 or self.offsets[0] != 0:
            raise ValueError("offsets must be a 1-d array starting at 0")
        if self.offsets[-1] != len(self.items):
            raise ValueError(f"offsets end at {self.offsets[-1]} but there are {len(self.items)} items")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @classmethod
    def from_lists(cls, lists: list[list[int]] | list[np.ndarray]) -> "Sequences":
        lengths = np.fromiter((len(x) for x in lists), dtype=np.int64, count=len(lists))
        offsets = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        items = np.concatenate([np.asarray(x, dtype=np.int64) for x in lists]) if len(lists) else np.zeros(0, np.int64)
        return cls(offsets, items.astype(np.int64, copy=False))

    @classmethod
    def from_arrow(cls, array: pa.Array | pa.ChunkedArray) -> "Sequences":
        """Zero-copy where possible; null lists become empty sequences."""
        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks() if array.num_chunks != 1 else array.chunk(0)
        if array.null_count:
            array = array.fill_null(pa.scalar([], type=array.type))
        offsets = array.offsets.to_numpy().astype(np.int64)   # int32 (list) or int64 (large_list)
        values = array.values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        start, end = offsets[0], offsets[-1]
        return cls(offsets - start, values[start:end])

    def to_lists(self) -> list[np.ndarray]:
        return [self.items[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:])]

    def split_newest(self, min_len: int, eligible: np.ndarray | None = None
                     ) -> tuple["Sequences", np.ndarray, np.ndarray]:
        """Each sequence of at least ``min_len`` items without its newest item: (the sequences that are
        left, the rows that gave one up, the items they gave up). The held-out split of training, in one
        place for the in-memory and the streamed paths, so both hold out exactly the same items.
        ``eligible`` [U] bool, optional: only these rows may give one up (the held-out users of one fit).

        >>> seqs = Sequences(np.array([0, 3, 4, 7]), np.array([1, 2, 3, 4, 5, 6, 7]))
        >>> left, rows, targets = seqs.split_newest(3)
        >>> left.offsets.tolist(), rows.tolist(), targets.tolist()
        ([0, 2, 3, 5], [0, 2], [3, 7])
        >>> seqs.split_newest(3, eligible=np.array([False, True, True]))[2].tolist()
        [7]
        """
        lengths = self.lengths
        has_target = lengths >= min_len
        if eligible is not None:
            has_target &= np.asarray(eligible, dtype=bool)
        last_pos = self.offsets[1:] - 1
        keep = np.ones(len(self.items), dtype=bool)
        keep[last_pos[has_target]] = False
        offsets = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(lengths - has_target.astype(np.int64), out=offsets[1:])
        return Sequences(offsets, self.items[keep]), np.flatnonzero(has_target), self.items[last_pos[has_target]]

    def take(self, rows: np.ndarray) -> "Sequences":
        """A subset of users, vectorised (no per-row Python)."""
        rows = np.asarray(rows, dtype=np.int64)
        starts, ends = self.offsets[rows], self.offsets[rows + 1]
        lengths = ends - starts
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        idx = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
        return Sequences(offsets, self.items[idx])


def pad_left(seqs: Sequences, max_len: int, pad: int = 0) -> np.ndarray:
    """The last ``max_len`` items of each sequence, right-aligned: ``[U, max_len]`` int64.

    Newest item in the last column, padding (0) on the left, the layout causal sequence models
    read. Vectorised: one gather through the offsets, no per-row Python.
    """
    n = len(seqs)
    out = np.full((n, max_len), pad, dtype=np.int64)
    if n == 0 or max_len == 0:
        return out
    ends = seqs.offsets[1:]                                   # [U]
    starts = seqs.offsets[:-1]                                # [U]
    idx = ends[:, None] - max_len + np.arange(max_len)[None]  # [U, L] positions into items
    valid = idx >= starts[:, None]
    out[valid] = seqs.items[idx[valid]]
    return out


def lookup_sorted(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of ``values`` sits in the sorted, unique ``keys``: (positions, found).

    The one binary-search id lookup of the project (vocabularies, candidate sets, user lists):
    ``positions[i]`` is the index of ``values[i]`` in ``keys`` where ``found[i]``, and a valid
    but meaningless index elsewhere (clipped into range, 0 for empty ``keys``).
    """
    keys = np.asarray(keys)
    values = np.asarray(values)
    if len(keys) == 0:
        return np.zeros(len(values), dtype=np.int64), np.zeros(len(values), dtype=bool)
    pos = np.minimum(np.searchsorted(keys, values), len(keys) - 1)
    return pos, keys[pos] == values


class Vocabulary:
    """A model's item vocabulary: external item id <-> model index (1-based; 0 is padding).

    Built once per model (the scorer caches it with the model), then maps whole chunks of ids with
    one vectorised binary search.
    """

    def __init__(self, item_ids: np.ndarray):
        self.item_ids = np.ascontiguousarray(item_ids, dtype=np.int64)   # item_ids[i] has index i + 1
        self._order = np.argsort(self.item_ids, kind="stable")
        self._sorted = self.item_ids[self._order]
        if len(self._sorted) > 1 and np.any(self._sorted[1:] == self._sorted[:-1]):
            raise ValueError("vocabulary item ids must be unique")

    def __len__(self) -> int:
        return len(self.item_ids)

    def index_of(self, ids: np.ndarray) -> np.ndarray:
        """Model index of each id, 0 where the model does not know the item."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(self._sorted) == 0:
            return np.zeros(len(ids), dtype=np.int64)
        pos, known = lookup_sorted(self._sorted, ids)
        return np.where(known, self._order[pos] + 1, 0)

    def map_sequences(self, seqs: Sequences) -> tuple[Sequences, int]:
        """Id sequences -> index sequences with unknown items dropped (order kept); also the drop count."""
        idx = self.index_of(seqs.items)
        known = idx > 0
        if known.all():
            return Sequences(seqs.offsets, idx), 0
        row_of = np.repeat(np.arange(len(seqs)), seqs.lengths)
        kept = np.bincount(row_of[known], minlength=len(seqs))
        offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(kept, out=offsets[1:])
        return Sequences(offsets, idx[known]), int((~known).sum())
