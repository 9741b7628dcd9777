"""Tonight's lists against the previous night's, and the previous night's against what users then did,
computed in each scoring task on the rows it emits. Pure numpy/pyarrow, like :mod:`recsys.scoring.checks`.

The nightly job joins each user's previous list (column :data:`PREVIOUS_COLUMN`, null for a user who had
none) and the items the user touched since that list was published (:data:`TOUCHED_COLUMN`; those the user
had touched before, :data:`TOUCHED_KNOWN_COLUMN`; the user's personal-frequency list as of then,
:data:`PERSONAL_FREQUENCY_COLUMN`) onto the histories it scores, so each task holds, per user, everything the comparison needs; the task adds up
counts, sums and histograms (:class:`TaskComparison`) and ships them back in its statistics row, and
the driver merges them (:func:`merge`). No second pass over the events or the output, no per-user data
on the driver. The figures are defined in :mod:`recsys.model.list_metrics`.

Cost: a small share of scoring the same chunk, through the matrix forms of :mod:`recsys.model.list_metrics`
(measured: docs/performance.md, "Figures that lived in the code").
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys.data.contracts import (HISTORY_COLUMN, PERSONAL_FREQUENCY_COLUMN, PREVIOUS_COLUMN, SOURCE_MODEL,
                                   TOUCHED_COLUMN, TOUCHED_KNOWN_COLUMN)
from recsys.model import list_metrics as lm
from recsys.scoring.checks import CandidateIndex

SAMPLE_PER_CHUNK = 512               # scores kept per chunk for tonight's deciles (tomorrow's PSI bins)
SAMPLE_PER_TASK = 4096
_NO_ITEM = np.iinfo(np.int64).min        # pads id matrices: equal to no item id


@dataclass(frozen=True)
class CompareSpec:
    """What a task needs to compare, minted on the driver from the previous night's manifest."""

    top_n: int
    popularity_ranking: np.ndarray    # [M] int64, the previous night's popularity ranking (empty: no baseline)
    score_edges: np.ndarray           # [E] float64, the previous night's score bin edges (empty: no PSI)

    @property
    def short_k(self) -> int:
        return min(lm.SHORT_K, self.top_n)


def lists_of(arr: pa.Array) -> tuple[lm.Lists, np.ndarray]:
    """A list<bigint> Arrow column -> (its rows as :class:`Lists`, [R] bool: the row is not null)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    valid = ~np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    lengths = arr.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.zeros(len(arr) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = arr.flatten()
    ids = values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False) if len(values) else np.zeros(0, np.int64)
    return lm.Lists(offsets, ids), valid


def _sums(names: Iterable[str]) -> dict[str, float]:
    return dict.fromkeys(names, 0.0)


_COUNTS = ("both", "first_changed", "identical", "touched_users", "realized_users", "realized_pop_users",
           "realized_repeat_users", "realized_new_users", "realized_pfreq_users", "score_count", "blend_score_count")
# the model's hits over the repeat targets (touched items the user knew before the list) and the new ones, and
# the personal-frequency baseline's over all targets: each as HR and NDCG at k and at n
_SPLIT_SUMS = tuple(f"{who}_{m}_{key}" for who in ("repeat", "new", "pfreq") for m in ("hr", "ndcg") for key in "kn")
_SUMS = ("jaccard_n_sum", "jaccard_k_sum", "hr_k", "hr_n", "ndcg_k", "ndcg_n", "pop_hr_k", "pop_hr_n", "pop_ndcg_k",
         "pop_ndcg_n") + _SPLIT_SUMS


@dataclass
class TaskComparison:
    """Counts, sums and histograms over the rows one task emitted; ``add_chunk`` folds in the next chunk."""

    spec: CompareSpec
    candidate_ids_sorted: np.ndarray
    # False where a repeat blend lets known items compete: the lists' scores are then the blend's (known items'
    # counts and ages, new items' ranks: recsys.model.repeats), not the model's, so they say nothing about the
    # model, and the blend chosen at each training moves their scale; they are counted, never binned or sampled
    model_scores: bool = True
    totals: dict[str, float] = field(default_factory=lambda: _sums(_COUNTS + _SUMS))
    jaccard_n_hist: np.ndarray = field(default_factory=lambda: np.zeros(lm.JACCARD_BINS, np.int64))
    jaccard_k_hist: np.ndarray = field(default_factory=lambda: np.zeros(lm.JACCARD_BINS, np.int64))
    score_bins: np.ndarray | None = None
    sample: list[np.ndarray] = field(default_factory=list)
    seconds: float = 0.0
    _index: CandidateIndex | None = None

    def add_chunk(self, chunk: pa.RecordBatch, out: pa.RecordBatch) -> None:
        """Fold in ``out`` (user_id, recommendations, source), scored from ``chunk`` row for row."""
        started = time.perf_counter()
        if self._index is None:
            self._index = CandidateIndex(self.candidate_ids_sorted)
        recs = out.column("recommendations")
        new = _recommended(recs)
        is_model = np.asarray(pc.equal(out.column("source"), SOURCE_MODEL).fill_null(False)
                              .to_numpy(zero_copy_only=False), dtype=bool)
        self._scores(recs, is_model)
        names = chunk.schema.names
        if PREVIOUS_COLUMN in names:
            previous, has_previous = lists_of(chunk.column(PREVIOUS_COLUMN))
            self._overlap(new, previous, has_previous)
            if TOUCHED_COLUMN in names:
                touched, _ = lists_of(chunk.column(TOUCHED_COLUMN))
                known = lists_of(chunk.column(TOUCHED_KNOWN_COLUMN))[0] if TOUCHED_KNOWN_COLUMN in names else None
                frequent = (lists_of(chunk.column(PERSONAL_FREQUENCY_COLUMN))[0]
                            if PERSONAL_FREQUENCY_COLUMN in names else None)
                self._realized(previous, has_previous, touched, lists_of(chunk.column(HISTORY_COLUMN))[0],
                               known, frequent)
        self.seconds += time.perf_counter() - started

    def _scores(self, recs: pa.Array, is_model: np.ndarray) -> None:
        """Model rows' scores: counted in the previous night's bins, and a sample for tonight's (only counted
        where they are a repeat blend's: ``model_scores``)."""
        lengths = recs.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        scores = recs.flatten().field("score").to_numpy(zero_copy_only=False)
        if not is_model.all():
            scores = scores[np.repeat(is_model, lengths)]
        finite = np.isfinite(scores)
        if not finite.all():
            scores = scores[finite]
        if not self.model_scores:
            self.totals["blend_score_count"] += len(scores)
            return
        self.totals["score_count"] += len(scores)
        if len(self.spec.score_edges):
            counts = lm.bin_counts_sorted_edges(scores, self.spec.score_edges)
            self.score_bins = counts if self.score_bins is None else self.score_bins + counts
        kept = sum(len(s) for s in self.sample)
        if len(scores) and kept < SAMPLE_PER_TASK:
            # drawn at random (seeded by the chunk): every k-th score would alias with the lists' ranks and
            # sample some ranks only, a pattern that moves with the chunk's size and shows as a large PSI
            # between nights of one model (measured: docs/performance.md, "Figures that lived in the code")
            take = min(SAMPLE_PER_CHUNK, SAMPLE_PER_TASK - kept)
            rng = np.random.default_rng([len(self.sample), len(scores)])
            self.sample.append(scores[rng.integers(0, len(scores), take)].astype(np.float64))

    def _overlap(self, new: lm.Lists, previous: lm.Lists, has_previous: np.ndarray) -> None:
        rows = np.flatnonzero(has_previous)
        if not len(rows):
            return
        assert self._index is not None
        n_cols = len(self._index.ids)
        k = self.spec.short_k
        # as dense candidate positions: tonight's items all are candidates; an item of the previous list
        # that no longer is gets -1 and matches nothing
        every = len(rows) == new.n_rows
        if not every:
            new, previous = new.take(rows), previous.take(rows)
        a_ids, b_ids = lm.padded(new), lm.padded(previous)
        a = self._index.positions(a_ids.reshape(-1)).reshape(a_ids.shape)
        b = self._index.positions(b_ids.reshape(-1)).reshape(b_ids.shape)
        if len(previous.ids) != b.size:        # short lists: their padding must stay padding
            b = np.where(b_ids == lm.PAD, lm.PAD, b)
        if len(new.ids) != a.size:
            a = np.where(a_ids == lm.PAD, lm.PAD, a)
        len_a, len_b = new.lengths, previous.lengths
        inter_n, inter_k = lm.overlap_counts(a, b, n_cols, k)
        union_n = len_a + len_b - inter_n
        union_k = np.minimum(len_a, k) + np.minimum(len_b, k) - inter_k
        j_n = np.divide(inter_n, union_n, out=np.ones(len(rows)), where=union_n > 0)
        j_k = np.divide(inter_k, union_k, out=np.ones(len(rows)), where=union_k > 0)
        first_a = np.where(len_a > 0, a_ids[:, 0] if a_ids.shape[1] else -2, -2)
        first_b = np.where(len_b > 0, b_ids[:, 0] if b_ids.shape[1] else -3, -3)
        t = self.totals
        t["both"] += len(rows)
        t["first_changed"] += int((first_a != first_b).sum())
        t["identical"] += int((j_n >= 1.0).sum())
        t["jaccard_n_sum"] += float(j_n.sum())
        t["jaccard_k_sum"] += float(j_k.sum())
        self.jaccard_n_hist += lm.jaccard_histogram(j_n)
        self.jaccard_k_hist += lm.jaccard_histogram(j_k)

    def _realized(self, previous: lm.Lists, has_previous: np.ndarray, touched: lm.Lists, history: lm.Lists,
                  known: lm.Lists | None = None, frequent: lm.Lists | None = None) -> None:
        """The previous lists (and the popularity baseline) against what their users touched since; with
        ``known`` (the touched items each user had before), also over the repeat and the new targets apart;
        with ``frequent`` (each user's personal-frequency list as of then), that baseline on the same users."""
        t = self.totals
        active = touched.lengths > 0
        t["touched_users"] += int(active.sum())
        rows = np.flatnonzero(active & has_previous)
        if not len(rows):
            return
        k, n = self.spec.short_k, self.spec.top_n
        touched_r = touched.take(rows)
        t_rows, n_touched = touched_r.rows(), touched_r.lengths
        lists = lm.padded(previous.take(rows), pad=_NO_ITEM)
        model = lm.hits_in_lists(lists, t_rows, touched_r.ids, n_touched, (k, n))
        t["realized_users"] += len(rows)
        t["hr_k"] += int(model[k].hit.sum())
        t["hr_n"] += int(model[n].hit.sum())
        t["ndcg_k"] += float(model[k].ndcg.sum())
        t["ndcg_n"] += float(model[n].ndcg.sum())
        if known is not None:
            self._split(lists, touched_r, known.take(rows), (k, n))
        if frequent is not None:
            pfreq = lm.hits_in_lists(lm.padded(frequent.take(rows), pad=_NO_ITEM), t_rows, touched_r.ids, n_touched,
                                     (k, n))
            t["realized_pfreq_users"] += len(rows)
            self._add("pfreq", pfreq, k, n)
        if not len(self.spec.popularity_ranking):
            return
        # What each user had before the previous list was made: tonight's history less what was touched
        # since. History is oldest first and the touched items are the newest, so they are its last ones.
        hist = history.take(rows)
        before = np.maximum(hist.lengths - n_touched, 0)
        keep = hist.positions() < np.repeat(before, hist.lengths)
        pop = lm.popularity_hits(self.spec.popularity_ranking, hist.rows()[keep], hist.ids[keep], touched_r, (k, n))
        t["realized_pop_users"] += len(rows)
        t["pop_hr_k"] += int(pop[k].hit.sum())
        t["pop_hr_n"] += int(pop[n].hit.sum())
        t["pop_ndcg_k"] += float(pop[k].ndcg.sum())
        t["pop_ndcg_n"] += float(pop[n].ndcg.sum())

    def _split(self, lists: np.ndarray, touched: lm.Lists, known: lm.Lists, ks: tuple[int, int]) -> None:
        """The model's hits over each user's repeat targets and over the new ones, each over the users who had
        at least one such target (a user without any adds 0 to the sums, so the sums run over every row)."""
        repeat = lm.member(touched.rows(), touched.ids, known.rows(), known.ids, touched.n_rows)
        for who, keep in (("repeat", repeat), ("new", ~repeat)):
            part = touched.where(keep)
            found = lm.hits_in_lists(lists, part.rows(), part.ids, part.lengths, ks)
            self.totals[f"realized_{who}_users"] += int((part.lengths > 0).sum())
            self._add(who, found, *ks)

    def _add(self, who: str, found: dict[int, lm.Realized], k: int, n: int) -> None:
        t = self.totals
        for key, cut in (("k", k), ("n", n)):
            t[f"{who}_hr_{key}"] += int(found[cut].hit.sum())
            t[f"{who}_ndcg_{key}"] += float(found[cut].ndcg.sum())

    def finish(self) -> dict[str, Any]:
        """-> plain numbers and lists (JSON for the task's statistics row)."""
        sample = np.concatenate(self.sample) if self.sample else np.zeros(0)
        return {**self.totals, "jaccard_n_hist": self.jaccard_n_hist.tolist(),
                "jaccard_k_hist": self.jaccard_k_hist.tolist(),
                "score_bins": None if self.score_bins is None else self.score_bins.tolist(),
                "score_sample": [round(float(s), 6) for s in sample], "compare_s": self.seconds}


def _recommended(recs: pa.Array) -> lm.Lists:
    """list<struct<item_id, score>> -> the item ids as :class:`Lists`."""
    if isinstance(recs, pa.ChunkedArray):
        recs = recs.combine_chunks()
    lengths = recs.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.zeros(len(recs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = recs.flatten().field("item_id").to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    return lm.Lists(offsets, ids)


def merge(payloads: Iterable[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The tasks' :meth:`TaskComparison.finish` payloads -> run totals (None when no task compared)."""
    payloads = [p for p in payloads if p]
    if not payloads:
        return None
    out: dict[str, Any] = {name: float(sum(p.get(name, 0) for p in payloads)) for name in _COUNTS + _SUMS}
    out["compare_s"] = float(sum(p.get("compare_s", 0.0) for p in payloads))
    for name in ("jaccard_n_hist", "jaccard_k_hist"):
        out[name] = np.sum([np.asarray(p[name], np.int64) for p in payloads], axis=0)
    bins = [np.asarray(p["score_bins"], np.int64) for p in payloads if p.get("score_bins") is not None]
    out["score_bins"] = np.sum(bins, axis=0) if bins else None
    out["score_sample"] = np.concatenate([np.asarray(p.get("score_sample", []), np.float64) for p in payloads])
    return out
