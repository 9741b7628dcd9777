"""The held-out split that training and the gate share: each user's newest item set aside.

Id-space and model-independent, so every model version (the candidate and the alias holder, with
different vocabularies) is scored on the same users, user by user (``user_gains``; the gate's score is their
:func:`mean_gain`). Each held-out item carries when the user first interacted with it, so the gate can keep
only the items an older model version never trained on (:meth:`SplitData.since`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from recsys.sequences import Sequences, Vocabulary

if TYPE_CHECKING:
    from recsys.model.stream import ShardFiles


@dataclass(frozen=True)
class SplitData:
    """Id-space training data: model-independent, so any model version can be evaluated on it."""

    train: Sequences               # item ids, oldest first (validation targets removed)
    valid_histories: Sequences     # item ids, for users with a validation target
    valid_targets: np.ndarray      # [V] item ids
    valid_first_us: np.ndarray | None = None   # [V] when the user first interacted with the target (epoch us, UTC)

    @property
    def users(self) -> int:
        return len(self.valid_targets)

    def since(self, cutoff_us: int) -> SplitData:
        """The validation users whose target they first touched at or after ``cutoff_us``: interactions
        that a model trained on the events before that instant has never seen, not even as an earlier
        repeat. ``train`` is kept whole (it describes what the candidate learned from)."""
        if self.valid_first_us is None:
            raise ValueError("this split has no target times (split_last_item without first_us); "
                             "it cannot be restricted to a period")
        rows = np.flatnonzero(self.valid_first_us >= cutoff_us)
        return SplitData(self.train, self.valid_histories.take(rows), self.valid_targets[rows],
                         self.valid_first_us[rows])

    def user_gains(self, model, item_ids: np.ndarray, device) -> np.ndarray:
        """[V] each validation user's NDCG@10, in this split's order (0 where ``item_ids`` lacks the target):
        the selection metric user by user, so two versions' figures pair and their mean is the gate's score."""
        return held_out_gains(model, Vocabulary(item_ids), self.valid_histories, self.valid_targets, device)


@dataclass(frozen=True)
class StreamedHeldOut:
    """The held-out split read from training shards, chunk by chunk: :class:`SplitData`'s gate interface
    (``users``, ``since``, ``user_gains``) without the histories in memory."""

    files: ShardFiles
    since_us: int | None = None
    held_out_below: int | None = None   # the held-out users' bucket cut (None: every user)

    @cached_property
    def users(self) -> int:
        from recsys.model.stream import held_out_chunks

        return sum(len(c.targets) for c in held_out_chunks(self.files, since_us=self.since_us,
                                                             held_out_below=self.held_out_below))

    def since(self, cutoff_us: int) -> "StreamedHeldOut":
        return StreamedHeldOut(self.files, cutoff_us if self.since_us is None else max(cutoff_us, self.since_us),
                               self.held_out_below)

    def user_gains(self, model, item_ids: np.ndarray, device) -> np.ndarray:
        """[V] each held-out user's NDCG@10 in the files' order (0 where ``item_ids`` lacks the target)."""
        from recsys.model.stream import held_out_chunks

        vocab = Vocabulary(item_ids)
        parts = [held_out_gains(model, vocab, c.histories, c.targets, device)
                 for c in held_out_chunks(self.files, since_us=self.since_us, held_out_below=self.held_out_below)]
        return np.concatenate(parts) if parts else np.zeros(0)


def split_last_item(seqs: Sequences, min_len: int = 3, first_us: np.ndarray | None = None) -> SplitData:
    """Hold out each user's newest item as the validation target (users with >= ``min_len`` items).

    ``first_us`` [U], optional: when each user first interacted with their newest item (epoch
    microseconds), kept with the targets for :meth:`SplitData.since`.
    """
    train, rows, targets = seqs.split_newest(min_len)
    if first_us is not None and len(first_us) != len(seqs):
        raise ValueError(f"first_us has {len(first_us)} entries for {len(seqs)} sequences")
    return SplitData(train=train, valid_histories=train.take(rows), valid_targets=targets,
                     valid_first_us=None if first_us is None else np.asarray(first_us, dtype=np.int64)[rows])


def build_vocabulary(train: Sequences, min_count: int) -> Vocabulary:
    """Items seen at least ``min_count`` times in training, ordered by id (stable across runs)."""
    ids, counts = np.unique(train.items, return_counts=True)
    return Vocabulary(ids[counts >= min_count])


def validation_set(vocab: Vocabulary, split: SplitData):
    """Validation users whose target the model can know, histories mapped to its vocabulary."""
    from recsys.model.training import ValidationSet

    _, histories, targets = known_targets(vocab, split.valid_histories, split.valid_targets)
    return ValidationSet(histories=histories, targets=targets)


def known_targets(vocab: Vocabulary, histories: Sequences, targets: np.ndarray
                  ) -> tuple[np.ndarray, Sequences, np.ndarray]:
    """The rows whose target ``vocab`` knows, with their histories and targets mapped to its indices: what a
    model can be scored on (the other rows are misses, whatever it ranks)."""
    index = vocab.index_of(np.asarray(targets))
    keep = np.flatnonzero(index > 0)
    mapped, _ = vocab.map_sequences(histories.take(keep))
    return keep, mapped, index[keep]


def held_out_gains(model, vocab: Vocabulary, histories: Sequences, targets: np.ndarray, device) -> np.ndarray:
    """[V] NDCG@10 of each user's held-out ``targets`` (item ids) after ``histories`` (item ids); 0 for a target
    outside ``vocab``."""
    from recsys.model.metrics import SELECTION_K, ndcg_gains, ranking_ranks

    keep, mapped, index = known_targets(vocab, histories, targets)
    gains = np.zeros(len(targets))
    if len(keep):
        gains[keep] = ndcg_gains(ranking_ranks(model, mapped, index, device=device), SELECTION_K)
    return gains


def mean_gain(gains: np.ndarray) -> float:
    """The gate's score from per-user gains: their mean (a target a version's vocabulary lacks counts 0, so any
    two versions are compared on the same users), NaN when no user was held out.

    >>> mean_gain(np.array([1.0, 0.0, 0.5])), mean_gain(np.zeros(0))
    (0.5, nan)
    """
    return float(gains.mean()) if len(gains) else float("nan")
