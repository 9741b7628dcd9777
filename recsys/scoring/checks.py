"""Checks of scored rows against what only the scoring task has in hand: its users' histories and
the candidate set. Pure numpy/pyarrow, run inside each scoring task on the rows it emits.

This is half of the validation the nightly job does in its scoring pass (``recsys.publish.validate``
has the other half, Spark aggregates observed on the rows as they are written, and combines both
into the report). Here: every user read gets exactly one row (no user missing, none unexpected,
none twice within the task), no row recommends an item excluded for its user (an item of the rules'
``excluded_items``, or of the user's history while known items are masked: by a masking repeat blend or
``recommend.exclude.touched``), every recommended item is a candidate, lists are shorter than N only when
fewer eligible candidates exist, and how often each item was recommended (availability, coverage, the
long-tail plot). Counts travel back
with the task's statistics row; the driver sums them. No second pass over the output, no join.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# what a task counts: the names of recsys.publish.validate.CHECKS it owns
TASK_CHECKS = ("missing_users", "unexpected_users", "duplicate_rows", "short_lists_unexplained", "excluded_items",
               "unavailable_items")


@dataclass
class TaskChecks:
    """Counts over the rows one task emitted; ``add_chunk`` folds in the next chunk.

    A small share of scoring the same rows, several times cheaper than matching (row, item) keys
    through sorts (measured: docs/performance.md, "Figures that lived in the code"): the recommended
    ids are looked up in the candidate set once, through a dense id -> position table where the id
    range allows, and counted per candidate position; the seen check compares each row's list with
    its own history.
    """

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TASK_CHECKS, 0))
    users: list[np.ndarray] = field(default_factory=list)         # emitted user ids, for duplicates
    _index: "CandidateIndex | None" = None
    _per_candidate: np.ndarray | None = None                      # [C] times each candidate was recommended
    _others: list[np.ndarray] = field(default_factory=list)        # recommended ids that are not candidates

    def add_chunk(self, in_users: np.ndarray, histories: pa.Array, out: pa.RecordBatch, *,
                  candidate_ids_sorted: np.ndarray, rules: ListRules, excluded: pa.Array | None = None) -> None:
        """Check ``out`` (user_id, recommendations, source) against the chunk it was scored from.
        ``rules``: what a well-formed list holds and how long it is (:class:`ListRules`); ``excluded``: each
        user's items the rules exclude (list<bigint> aligned with ``in_users``)."""
        if self._index is None:
            self._index = CandidateIndex(candidate_ids_sorted)
            self._per_candidate = np.zeros(len(candidate_ids_sorted), dtype=np.int64)
        elif self._index.ids is not candidate_ids_sorted and not np.array_equal(self._index.ids, candidate_ids_sorted):
            # counts are kept per candidate position: a task scores against one candidate set
            raise ValueError("TaskChecks.add_chunk: the candidate set changed within a task "
                             f"({len(self._index.ids)} -> {len(candidate_ids_sorted)} ids); use one TaskChecks per set")
        flat_ids = _flat_ids(out.column("recommendations"))
        positions = self._index.positions(flat_ids)
        c = check_rows(in_users, histories, out, candidates=self._index, rules=rules, positions=positions,
                       excluded=excluded)
        for name in TASK_CHECKS:
            if name != "duplicate_rows":
                self.counts[name] += c[name]
        available = positions >= 0
        self._per_candidate += np.bincount(positions[available], minlength=len(self._per_candidate))
        if not available.all():
            self._others.append(flat_ids[~available])
        users = out.column("user_id")
        self.users.append(users.drop_null().to_numpy() if users.null_count else users.to_numpy(zero_copy_only=False))

    def finish(self) -> dict:
        """-> the counts plus ``item_counts`` ([ids], [times]) as plain lists (JSON for the stats row)."""
        users = np.concatenate(self.users) if self.users else np.zeros(0, np.int64)
        self.counts["duplicate_rows"] = int(len(users) - len(np.unique(users)))
        ids, times = np.zeros(0, np.int64), np.zeros(0, np.int64)
        if self._index is not None:
            hit = np.flatnonzero(self._per_candidate)
            ids, times = self._index.ids[hit], self._per_candidate[hit]
        if self._others:
            other_ids, other_times = np.unique(np.concatenate(self._others), return_counts=True)
            ids, times = np.concatenate([ids, other_ids]), np.concatenate([times, other_times])
            order = np.argsort(ids, kind="stable")
            ids, times = ids[order], times[order]
        return {**self.counts, "item_counts": [ids.tolist(), times.tolist()]}


class CandidateIndex:
    """Item id -> position in the sorted candidate ids (-1: not a candidate).

    A dense lookup table when the ids span at most ``DENSE_SPAN`` values (32 MiB of int32): one
    gather per id, much faster than a binary search over the candidates (measured: docs/performance.md,
    "Figures that lived in the code"); sparse id spaces fall back to the binary search.
    """

    DENSE_SPAN = 8 * 2**20

    def __init__(self, ids_sorted: np.ndarray):
        self.ids = ids_sorted
        self._low = int(ids_sorted[0]) if len(ids_sorted) else 0
        span = int(ids_sorted[-1]) - self._low + 1 if len(ids_sorted) else 0
        self._table: np.ndarray | None = None
        if 0 < span <= self.DENSE_SPAN:
            self._table = np.full(span, -1, dtype=np.int32)
            self._table[ids_sorted - self._low] = np.arange(len(ids_sorted), dtype=np.int32)

    def positions(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if not len(self.ids):
            return np.full(len(ids), -1, dtype=np.int64)
        if self._table is not None:
            offset = ids - self._low
            if len(offset) and offset.min() >= 0 and offset.max() < len(self._table):   # the usual case: one gather
                return self._table[offset]
            inside = (offset >= 0) & (offset < len(self._table))
            out = np.full(len(ids), -1, dtype=np.int64)
            out[inside] = self._table[offset[inside]]
            return out
        at = np.searchsorted(self.ids, ids).clip(max=len(self.ids) - 1)
        return np.where(self.ids[at] == ids, at, -1)


def _flat_ids(recs: pa.Array) -> np.ndarray:
    flat = recs.flatten()   # respects offsets and slices
    return flat.field("item_id").to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _list_lengths(arr: pa.Array) -> np.ndarray:
    lengths = arr.value_lengths().fill_null(0)
    return lengths.to_numpy(zero_copy_only=False).astype(np.int64)


@dataclass(frozen=True)
class ListRules:
    """What a well-formed list may hold and how long it is.

    ``known_allowed``: the model's repeat blend lets the user's known items into the list (and no rule masks
    them), so holding one is no violation; otherwise they are off limits, as the rules' excluded items always
    are. A list holds ``top_n`` items, fewer only when fewer eligible candidates exist (candidates not off
    limits for the user); with ``min_new_items`` and no ``fill``, the known items it may hold are capped at
    ``top_n - min_new_items``. A fallback list (``source == fallback_name``) holds the fallback's
    ``min(top_n, fallback_len)`` items less those off limits, or, with ``fill`` (the popularity ranking over every
    candidate tops lists up), as many as a model list. Each expected length is a lower bound: a row is flagged
    only when it is provably shorter than the rules allow."""

    top_n: int
    fallback_name: str
    fallback_len: int
    known_allowed: bool = False
    min_new_items: int = 0
    fill: bool = False

    def fallback_size(self) -> int:
        return min(self.top_n, self.fallback_len)


def check_rows(in_users: np.ndarray, histories: pa.Array, out: pa.RecordBatch, *,
               candidates: "CandidateIndex | np.ndarray", rules: ListRules, positions: np.ndarray | None = None,
               excluded: pa.Array | None = None) -> dict[str, int]:
    """The task-side checks for one batch of emitted rows against the users (and histories) it read.

    ``histories`` is the list<bigint> history column aligned with ``in_users``, ``excluded`` the rules'
    excluded items likewise (None: none). Vectorised over the batch: no Python per row. ``candidates``: the
    sorted candidate ids, or their :class:`CandidateIndex` when the caller has one already (a task's checks
    build it once); ``positions``: the recommended ids' positions in it, likewise.
    """
    index = candidates if isinstance(candidates, CandidateIndex) else CandidateIndex(np.asarray(candidates))
    in_users = np.asarray(in_users, dtype=np.int64)
    out_users_arr = out.column("user_id")
    valid_user = ~np.asarray(out_users_arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    out_users = out_users_arr.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    order = np.argsort(in_users, kind="stable")
    pos = np.searchsorted(in_users[order], out_users).clip(max=max(len(in_users) - 1, 0))
    found = valid_user & (len(in_users) > 0)
    if len(in_users):
        found &= in_users[order][pos] == out_users
    in_row = np.where(found, order[pos] if len(in_users) else 0, -1)                 # [R] input row of each output row
    missing = int(len(in_users) - len(np.unique(in_row[found])))
    unexpected = int((valid_user & ~found).sum())

    recs = out.column("recommendations")
    sizes = _list_lengths(recs)                                                      # [R]
    flat_ids = _flat_ids(recs)                                                       # [I]

    hist_len = _list_lengths(histories)                                              # [U]
    hist_ids = histories.flatten().to_numpy(zero_copy_only=False).astype(np.int64)   # [H]
    if excluded is None:
        ex_len, ex_ids = np.zeros(len(hist_len), np.int64), np.zeros(0, np.int64)
    else:
        ex_len = _list_lengths(excluded)                                             # [U]
        ex_ids = excluded.flatten().to_numpy(zero_copy_only=False).astype(np.int64)  # [X]

    # excluded: a recommended item off limits for the user the row was scored for (the rules' excluded items;
    # the user's history while known items are masked)
    hits = np.zeros(len(sizes), dtype=bool)
    if len(flat_ids) and len(hist_ids) and not rules.known_allowed:
        hits |= _rows_holding(sizes, flat_ids, in_row, hist_len, hist_ids)
    if len(flat_ids) and len(ex_ids):
        hits |= _rows_holding(sizes, flat_ids, in_row, ex_len, ex_ids)

    # how many of each user's history and excluded items are candidates: what the rules take from a list
    n_users = len(hist_len)
    hist_cand = _per_row(hist_len, index.positions(hist_ids) >= 0, n_users)          # [U]
    ex_cand = _per_row(ex_len, index.positions(ex_ids) >= 0, n_users)                # [U]
    own = np.maximum(in_row, 0)
    hist_r = np.where(found, hist_cand[own] if n_users else 0, 0)                   # [R]
    ex_r = np.where(found, ex_cand[own] if n_users else 0, 0)                       # [R]
    n_candidates, top_n = len(index.ids), rules.top_n
    off = ex_r + (0 if rules.known_allowed else hist_r)                             # [R] off limits (at most)
    eligible = np.maximum(n_candidates - off, 0)
    model_len = np.minimum(top_n, eligible)
    if rules.known_allowed and rules.min_new_items and not rules.fill:
        new = np.maximum(n_candidates - hist_r - ex_r, 0)
        known = np.maximum(hist_r - ex_r, 0)
        model_len = np.minimum(top_n, new + np.minimum(max(top_n - rules.min_new_items, 0), known))
    is_fallback = np.asarray(pc.equal(out.column("source"), rules.fallback_name).fill_null(False)
                             .to_numpy(zero_copy_only=False), dtype=bool)
    fallback_len = model_len if rules.fill else np.maximum(rules.fallback_size() - off, 0)
    expected = np.where(is_fallback, fallback_len, model_len)
    short_unexplained = int((found & (sizes < expected)).sum())

    if positions is None:
        positions = index.positions(flat_ids)
    unavailable = int((positions < 0).sum())
    return {"missing_users": missing, "unexpected_users": unexpected, "short_lists_unexplained": short_unexplained,
            "excluded_items": int(hits.sum()), "unavailable_items": unavailable, "duplicate_rows": 0}


def _per_row(lengths: np.ndarray, flags: np.ndarray, rows: int) -> np.ndarray:
    """[rows] how many flagged entries each ragged row holds."""
    owner = np.repeat(np.arange(len(lengths)), lengths)
    return np.bincount(owner[flags], minlength=rows).astype(np.int64)


def _padded(lengths: np.ndarray, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ragged lists -> [rows, longest] values and a mask of the real entries (row-major = flat order)."""
    width = int(lengths.max()) if len(lengths) else 0
    valid = np.arange(width) < lengths[:, None]
    values = np.zeros((len(lengths), width), dtype=np.int64)
    values[valid] = flat
    return values, valid


_SEEN_BLOCK = 8_000_000   # row-block size for the seen comparison, in compared pairs


def _rows_with_seen_items(rec_len: np.ndarray, rec_ids: np.ndarray, in_row: np.ndarray, hist_len: np.ndarray,
                          hist_ids: np.ndarray) -> int:
    """How many output rows recommend an item of their input row's history (:func:`_rows_holding`)."""
    return int(_rows_holding(rec_len, rec_ids, in_row, hist_len, hist_ids).sum())


def _rows_holding(rec_len: np.ndarray, rec_ids: np.ndarray, in_row: np.ndarray, list_len: np.ndarray,
                  list_ids: np.ndarray) -> np.ndarray:
    """[output rows] bool: the row (scored for input row ``in_row``, -1: no input row) recommends an item of
    that input row's list (its history, or its excluded items). Each list is compared with its own input list,
    in row blocks of bounded size: faster than matching (row, item) keys through a sort, at the default
    shapes (measured: docs/performance.md, "Figures that lived in the code")."""
    holding = np.zeros(len(rec_len), dtype=bool)
    recs, rec_valid = _padded(rec_len, rec_ids)
    hist, hist_valid = _padded(list_len, list_ids)
    rows = np.flatnonzero(in_row >= 0)
    if not len(rows) or not recs.shape[1] or not hist.shape[1]:
        return holding
    block = max(1, _SEEN_BLOCK // (recs.shape[1] * hist.shape[1]))
    for start in range(0, len(rows), block):
        r = rows[start:start + block]
        h = in_row[r]
        same = recs[r][:, :, None] == hist[h][:, None, :]
        same &= rec_valid[r][:, :, None]
        same &= hist_valid[h][:, None, :]
        holding[r] = same.any(axis=(1, 2))
    return holding
