"""Checks of scored rows against what only the scoring task has in hand: its users' histories and
the candidate set. Pure numpy/pyarrow, run inside each scoring task on the rows it emits.

This is half of the validation the nightly job does in its scoring pass (``recsys.publish.validate``
has the other half, Spark aggregates observed on the rows as they are written, and combines both
into the report). Here: every user read gets exactly one row (no user missing, none unexpected,
none twice within the task), no row recommends an item from the user's history, every recommended
item is a candidate, lists are shorter than N only when fewer unseen candidates exist, and how
often each item was recommended (availability, coverage, the long-tail plot). Counts travel back
with the task's statistics row; the driver sums them. No second pass over the output, no join.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# what a task counts: the names of recsys.publish.validate.CHECKS it owns
TASK_CHECKS = ("missing_users", "unexpected_users", "duplicate_rows", "short_lists_unexplained", "seen_items",
               "unavailable_items")


@dataclass
class TaskChecks:
    """Counts over the rows one task emitted; ``add`` folds in the next chunk."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TASK_CHECKS, 0))
    item_ids: list[np.ndarray] = field(default_factory=list)      # recommended ids, folded by ``item_counts``
    users: list[np.ndarray] = field(default_factory=list)         # emitted user ids, for duplicates

    def add_chunk(self, in_users: np.ndarray, histories: pa.Array, out: pa.RecordBatch, *,
                  candidate_ids_sorted: np.ndarray, top_n: int, fallback_name: str, fallback_len: int) -> None:
        """Check ``out`` (user_id, recommendations, source) against the chunk it was scored from."""
        c = check_rows(in_users, histories, out, candidate_ids_sorted=candidate_ids_sorted, top_n=top_n,
                       fallback_name=fallback_name, fallback_len=fallback_len)
        for name in TASK_CHECKS:
            if name != "duplicate_rows":
                self.counts[name] += c[name]
        ids = _flat_ids(out.column("recommendations"))
        self.item_ids.append(ids)
        users = out.column("user_id")
        self.users.append(users.drop_null().to_numpy() if users.null_count else users.to_numpy(zero_copy_only=False))

    def finish(self) -> dict:
        """-> the counts plus ``item_counts`` ([ids], [times]) as plain lists (JSON for the stats row)."""
        users = np.concatenate(self.users) if self.users else np.zeros(0, np.int64)
        self.counts["duplicate_rows"] = int(len(users) - len(np.unique(users)))
        ids = np.concatenate(self.item_ids) if self.item_ids else np.zeros(0, np.int64)
        uniq, times = np.unique(ids, return_counts=True)
        return {**self.counts, "item_counts": [uniq.tolist(), times.tolist()]}


def _flat_ids(recs: pa.Array) -> np.ndarray:
    flat = recs.flatten()   # respects offsets and slices
    return flat.field("item_id").to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _row_of_flat(lengths: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(len(lengths)), lengths)


def _list_lengths(arr: pa.Array) -> np.ndarray:
    lengths = arr.value_lengths().fill_null(0)
    return lengths.to_numpy(zero_copy_only=False).astype(np.int64)


def check_rows(in_users: np.ndarray, histories: pa.Array, out: pa.RecordBatch, *, candidate_ids_sorted: np.ndarray,
               top_n: int, fallback_name: str, fallback_len: int) -> dict[str, int]:
    """The task-side checks for one batch of emitted rows against the users (and histories) it read.

    ``histories`` is the list<bigint> history column aligned with ``in_users``. Vectorised over the
    batch: no Python per row.
    """
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
    rec_row = _row_of_flat(sizes)                                                    # [I] output row of each item

    hist_len = _list_lengths(histories)                                              # [U]
    hist_ids = histories.flatten().to_numpy(zero_copy_only=False).astype(np.int64)   # [H]
    hist_row = _row_of_flat(hist_len)                                                # [H] input row of each item

    # seen: a recommended (input row, item) pair that is also a history (input row, item) pair
    seen_rows = 0
    if len(flat_ids) and len(hist_ids):
        mapped = in_row[rec_row]                                                     # [I] input row, -1 unknown
        keep = mapped >= 0
        codes, inverse = np.unique(np.concatenate([flat_ids[keep], hist_ids]), return_inverse=True)
        width = len(codes)
        rec_keys = mapped[keep] * width + inverse[: keep.sum()]
        hist_keys = hist_row * width + inverse[keep.sum():]
        hit = np.isin(rec_keys, hist_keys)
        seen_rows = int(len(np.unique(rec_row[keep][hit])))

    is_fallback = np.asarray(pc.equal(out.column("source"), fallback_name).fill_null(False)
                             .to_numpy(zero_copy_only=False), dtype=bool)
    n_candidates = len(candidate_ids_sorted)
    own_hist = np.where(found, hist_len[np.maximum(in_row, 0)] if len(hist_len) else 0, 0)
    expected = np.where(is_fallback, min(top_n, fallback_len), np.minimum(top_n, np.maximum(n_candidates - own_hist, 0)))
    short_unexplained = int((found & (sizes < expected)).sum())

    if n_candidates and len(flat_ids):
        at = np.searchsorted(candidate_ids_sorted, flat_ids).clip(max=n_candidates - 1)
        unavailable = int((candidate_ids_sorted[at] != flat_ids).sum())
    else:
        unavailable = int(len(flat_ids))
    return {"missing_users": missing, "unexpected_users": unexpected, "short_lists_unexplained": short_unexplained,
            "seen_items": seen_rows, "unavailable_items": unavailable, "duplicate_rows": 0}
