"""The held-out split that training and the gate share: each user's newest item set aside.

Id-space and model-independent, so every model version (the candidate and the alias holder, with
different vocabularies) is scored on the same users by :func:`score_on_split`. Each held-out item
carries when the user first interacted with it, so the gate can keep only the items an older model
version never trained on (:meth:`SplitData.since`).
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


    def score(self, model, item_ids: np.ndarray, device) -> float:
        """The selection metric over all these users (:func:`score_on_split`)."""
        return score_on_split(model, item_ids, self, device)

    def user_gains(self, model, item_ids: np.ndarray, device) -> np.ndarray:
        """[V] each validation user's NDCG@10, in this split's order (0 where ``item_ids`` lacks the target):
        the terms whose mean :meth:`score` is, so two versions' figures pair user by user."""
        return held_out_gains(model, Vocabulary(item_ids), self.valid_histories, self.valid_targets, device)


@dataclass(frozen=True)
class StreamedHeldOut:
    """The held-out split read from training shards, chunk by chunk: :class:`SplitData`'s gate interface
    (``users``, ``since``, ``score``) without the histories in memory."""

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

    def score(self, model, item_ids: np.ndarray, device) -> float:
        """NDCG@10 over every held-out user; a target outside ``item_ids`` counts as a miss."""
        from recsys.model.metrics import SELECTION_K, SELECTION_METRIC
        from recsys.model.stream import held_out_chunks, ranking_sums

        sums = ranking_sums(model, Vocabulary(item_ids), held_out_chunks(self.files, since_us=self.since_us,
                                                                         held_out_below=self.held_out_below),
                            ks=(SELECTION_K,), device=device)
        return sums.mean_over_all(SELECTION_METRIC)

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

    histories, _ = vocab.map_sequences(split.valid_histories)
    targets = vocab.index_of(split.valid_targets)
    keep = np.flatnonzero(targets > 0)
    return ValidationSet(histories=histories.take(keep), targets=targets[keep])


def held_out_gains(model, vocab: Vocabulary, histories: Sequences, targets: np.ndarray, device) -> np.ndarray:
    """[V] NDCG@10 of each user's held-out ``targets`` (item ids) after ``histories`` (item ids); 0 for a target
    outside ``vocab``."""
    from recsys.model.metrics import SELECTION_K, ndcg_gains, ranking_ranks

    mapped, _ = vocab.map_sequences(histories)
    index = vocab.index_of(np.asarray(targets))
    keep = np.flatnonzero(index > 0)
    gains = np.zeros(len(index))
    if len(keep):
        gains[keep] = ndcg_gains(ranking_ranks(model, mapped.take(keep), index[keep], device=device), SELECTION_K)
    return gains


def score_on_split(model, item_ids: np.ndarray, split: SplitData, device) -> float:
    """The selection metric (NDCG@10) over *all* validation users; a target the model's vocabulary lacks counts as a miss.

    Any two model versions scored with this function are compared on the same users, whatever
    their vocabularies.
    """
    from recsys.model.metrics import SELECTION_K, SELECTION_METRIC, evaluate_ranking

    valid = validation_set(Vocabulary(item_ids), split)
    if len(split.valid_targets) == 0:
        return float("nan")
    if len(valid.targets) == 0:
        return 0.0
    scores = evaluate_ranking(model, valid.histories, valid.targets, ks=(SELECTION_K,), device=device)
    return float(scores[SELECTION_METRIC]) * len(valid.targets) / len(split.valid_targets)
