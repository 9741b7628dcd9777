"""Evaluation protocols: what a model may learn from, what it is tuned on, what it is tested on.

Two protocols, both in two phases with the same shape (:class:`Phase`):

- ``loo`` (leave-last-one-out): each user's full sequence is built by the project's own history
  builder (:func:`recsys.data.history.build_histories`: repeats collapse to their latest time, ties
  in time broken by a seeded hash of (user, item), never by item id). For users with at least
  three items the last one is the test target and the second-to-last the validation target.
  Validation phase: history = everything before the validation item. Test phase: history =
  everything before the test item (the validation item included). Users with fewer than three
  items are never evaluated; their items are history (training data) in both phases.
- ``temporal``: a split date ``D`` and a window of ``N`` days. Validation phase: history = events
  before ``D - N``, targets = what each user did in ``[D - N, D)``. Test phase: history = events
  before ``D``, targets = what each user did in ``[D, D + N)``. A user is evaluated in a phase
  when they have history before it and at least one target in it.

In both, a user's targets never include an item already in that user's phase history (the
ranking excludes history items, so such a target could only ever be a miss), and what is ranked is
the phase's catalog snapshot's available items (the newest snapshot on or before the phase's
cut-off, as the nightly job would read it). Hyperparameters are chosen on the validation phase;
nothing about the test phase is used before the test.

The splits themselves are pure numpy (:func:`leave_last_out`, :func:`temporal_split`), so they are
tested on hand-made sequences; the ``load_*`` functions do the Spark I/O at the edge.
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from recsys.errors import InputDataError
from recsys.sequences import Sequences, lookup_sorted

PROTOCOLS = ("loo", "temporal")
LOO_MIN_ITEMS = 3             # one for training, one for validation, one for the test
FULL_HISTORY = 2_147_483_647  # build_histories' max_items when the whole history is wanted


@dataclass(frozen=True)
class Phase:
    """One evaluation round.

    ``history[u]`` is what models may learn from and read about user ``u`` (aligned with
    :attr:`EvalSplit.user_ids`), and what is excluded from that user's ranking;
    ``targets[e]`` the held-out items of evaluated user ``rows[e]``.
    """

    history: Sequences       # [U] external item ids, oldest first
    rows: np.ndarray         # [E] int64, indices into EvalSplit.user_ids, ascending
    targets: Sequences       # [E] external item ids, none in that user's history, unordered
    candidates: np.ndarray   # [C] int64 sorted unique external ids of the available items: what is ranked

    def __post_init__(self) -> None:
        if len(self.targets) != len(self.rows):
            raise ValueError(f"a phase needs one target list per evaluated user: {len(self.rows)} rows, "
                             f"{len(self.targets)} target lists")
        if len(self.rows) and (self.rows.min() < 0 or self.rows.max() >= len(self.history)):
            raise ValueError("phase rows must index users of the history")

    @property
    def users(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class EvalSplit:
    protocol: str
    user_ids: np.ndarray            # [U] external user ids
    valid: Phase
    test: Phase
    info: dict[str, Any] = field(default_factory=dict)   # the split's parameters and counts, logged with the run


def leave_last_out(user_ids: np.ndarray, sequences: Sequences, candidates: np.ndarray) -> EvalSplit:
    """The ``loo`` split of full per-user sequences (oldest first, as ``build_histories`` orders them)."""
    if len(user_ids) != len(sequences):
        raise ValueError(f"{len(user_ids)} user ids but {len(sequences)} sequences")
    lengths = sequences.lengths
    rows = np.flatnonzero(lengths >= LOO_MIN_ITEMS)
    ends = sequences.offsets[1:]
    test_pos, valid_pos = ends[rows] - 1, ends[rows] - 2
    test_history = _drop_positions(sequences, test_pos)
    valid_history = _drop_positions(sequences, np.concatenate([test_pos, valid_pos]))
    candidates = np.unique(np.asarray(candidates, dtype=np.int64))
    one_each = np.arange(len(rows) + 1, dtype=np.int64)
    split = EvalSplit(
        protocol="loo",
        user_ids=np.asarray(user_ids, dtype=np.int64),
        valid=Phase(valid_history, rows, Sequences(one_each, sequences.items[valid_pos]), candidates),
        test=Phase(test_history, rows, Sequences(one_each, sequences.items[test_pos]), candidates),
    )
    info = {"users": len(user_ids), "interactions": int(len(sequences.items)), "evaluated_users": len(rows),
            "users_too_short": int(len(user_ids) - len(rows)), "candidates": len(candidates)}
    return EvalSplit(split.protocol, split.user_ids, split.valid, split.test, info)


@dataclass(frozen=True)
class WindowInputs:
    """One phase of the temporal split before it is a :class:`Phase`: per user (aligned with the split's
    user ids, empty where a user has nothing) the history before the window and the items in it."""

    history: Sequences
    window: Sequences
    candidates: np.ndarray     # the items available at the window's start


def temporal_split(user_ids: np.ndarray, valid: WindowInputs, test: WindowInputs,
                   info: dict[str, Any] | None = None) -> EvalSplit:
    """The ``temporal`` split from per-user histories before each cut-off and the items of each window.

    Window items already in the phase's history are dropped; users with no history or no target
    left are not evaluated in that phase.
    """
    for phase, inputs in (("valid", valid), ("test", test)):
        for part in ("history", "window"):
            rows = len(getattr(inputs, part))
            if rows != len(user_ids):
                raise ValueError(f"{phase}_{part} has {rows} rows, expected one per user ({len(user_ids)})")
    valid = _window_phase(valid.history, valid.window, valid.candidates)
    test = _window_phase(test.history, test.window, test.candidates)
    info = dict(info or {})
    info.update({"users": len(user_ids), "valid_users": valid.users, "test_users": test.users,
                 "valid_targets": int(len(valid.targets.items)), "test_targets": int(len(test.targets.items)),
                 "candidates": len(test.candidates)})
    return EvalSplit("temporal", np.asarray(user_ids, dtype=np.int64), valid, test, info)


def _window_phase(history: Sequences, window: Sequences, candidates: np.ndarray) -> Phase:
    user_of = np.repeat(np.arange(len(window)), window.lengths)
    new = ~_member(user_of, window.items, np.repeat(np.arange(len(history)), history.lengths), history.items)
    has_history = history.lengths > 0
    keep = new & has_history[user_of]
    kept_user = user_of[keep]
    counts = np.bincount(kept_user, minlength=len(window))
    rows = np.flatnonzero(counts > 0)
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts[rows], out=offsets[1:])
    order = np.argsort(kept_user, kind="stable")
    return Phase(history, rows, Sequences(offsets, window.items[keep][order]),
                 np.unique(np.asarray(candidates, dtype=np.int64)))


def _member(users_a: np.ndarray, items_a: np.ndarray, users_b: np.ndarray, items_b: np.ndarray) -> np.ndarray:
    """For each (user, item) pair of ``a``, whether ``b`` holds the same pair. Vectorised."""
    if len(items_a) == 0 or len(items_b) == 0:
        return np.zeros(len(items_a), dtype=bool)
    a = np.rec.fromarrays([users_a, items_a])
    _, found = lookup_sorted(np.unique(np.rec.fromarrays([users_b, items_b])), a)
    return found


def _drop_positions(seqs: Sequences, positions: np.ndarray) -> Sequences:
    keep = np.ones(len(seqs.items), dtype=bool)
    keep[positions] = False
    owner = np.repeat(np.arange(len(seqs)), seqs.lengths)
    counts = np.bincount(owner[keep], minlength=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return Sequences(offsets, seqs.items[keep])


# --------------------------------------------------------------------------------------------
# Spark I/O: read the input layout, build sequences with the project's history builder.


def read_events(spark, data_root: str, event_types: tuple[str, ...] = ()):
    """Events of ``<data_root>/events`` with the contract's columns; rows with null ids dropped."""
    from pyspark.sql import functions as F

    from recsys.data import history as hist
    from recsys.data import readers

    root = f"{data_root.rstrip('/')}/events"
    events = readers.read_events(spark, root)
    if events is None:
        raise InputDataError(f"no events under {root}: no dt= partition holds files; nothing to evaluate")
    if event_types:
        events = events.filter(F.col("event_type").isin(list(event_types)))
    return hist.drop_null_ids(events.select("user_id", "item_id", "event_type", "ts"))


def available_items(spark, data_root: str, date: dt.date) -> tuple[dt.date, np.ndarray]:
    """The available items of the newest catalog snapshot on or before ``date``, sorted; the snapshot
    is checked as the nightly job checks it (empty, null or repeated ids, nothing available)."""
    from recsys.data.readers import catalog_figures, read_catalog_snapshot

    root = f"{data_root.rstrip('/')}/catalog"
    snapshot = read_catalog_snapshot(spark, root, date)
    _, items = catalog_figures(snapshot, root)
    return snapshot.date, items


def load_loo(spark, data_root: str, *, tie_break_seed: int, event_types: tuple[str, ...] = ()) -> EvalSplit:
    """The ``loo`` split of the dataset at ``data_root`` (``events/`` and ``catalog/`` in the input layout)."""
    from recsys.data import history as hist

    events = read_events(spark, data_root, event_types)
    histories = hist.build_histories(events, max_items=FULL_HISTORY, tie_break_seed=tie_break_seed).toArrow()
    if histories.num_rows == 0:
        raise InputDataError(f"no events under {data_root}/events{_types_note(event_types)}; nothing to evaluate")
    user_ids, sequences = _sorted_by_user(*hist.histories_to_sequences(histories))
    snapshot, candidates = available_items(spark, data_root, dt.date.max)
    split = leave_last_out(user_ids, sequences, candidates)
    if split.test.users == 0:
        raise InputDataError(f"no user under {data_root}/events has {LOO_MIN_ITEMS} or more distinct items; "
                             "leave-last-one-out needs one item each for training, validation and test")
    split.info.update({"catalog_snapshot": str(snapshot), "tie_break_seed": tie_break_seed})
    return split


def load_temporal(spark, data_root: str, *, split_date: dt.date | None, test_days: int, tie_break_seed: int,
                  event_types: tuple[str, ...] = ()) -> EvalSplit:
    """The ``temporal`` split; without ``split_date``, the test window is the data's last ``test_days`` days."""
    from pyspark.sql import functions as F

    from recsys.data import history as hist

    if test_days < 1:
        raise InputDataError(f"--test-days must be at least 1, got {test_days}")
    events = read_events(spark, data_root, event_types)
    last_day = events.agg(F.max(F.to_date("ts"))).first()[0]   # a UTC day: the session time zone is UTC
    if last_day is None:
        raise InputDataError(f"no events under {data_root}/events{_types_note(event_types)}; nothing to evaluate")
    if split_date is None:
        split_date = last_day + dt.timedelta(days=1 - test_days)
    days = dt.timedelta(days=test_days)
    valid_start = split_date - days
    cut = {name: F.lit(dt.datetime.combine(d, dt.time())) for name, d in
           (("valid", valid_start), ("test", split_date), ("end", split_date + days))}

    def histories_before(ts_col):
        frame = hist.build_histories(events.filter(F.col("ts") < ts_col), max_items=FULL_HISTORY,
                                     tie_break_seed=tie_break_seed)
        return hist.histories_to_sequences(frame.toArrow())

    def window(start, end):
        frame = (events.filter((F.col("ts") >= start) & (F.col("ts") < end))
                 .groupBy("user_id").agg(F.array_sort(F.collect_set("item_id")).alias("items")))
        table = frame.toArrow()
        return table.column("user_id").to_numpy(), Sequences.from_arrow(table.column("items"))

    test_users, test_hist = histories_before(cut["test"])
    if len(test_users) == 0:
        raise InputDataError(f"no events before the split date {split_date} under {data_root}/events; "
                             "choose a later --split-date")
    user_ids = np.sort(test_users)
    valid_history = _align(user_ids, *histories_before(cut["valid"]))
    valid_window = _align(user_ids, *window(cut["valid"], cut["test"]))
    test_history = _align(user_ids, test_users, test_hist)
    test_window = _align(user_ids, *window(cut["test"], cut["end"]))
    valid_snapshot, valid_candidates = available_items(spark, data_root, valid_start)
    test_snapshot, test_candidates = available_items(spark, data_root, split_date)
    info = {"split_date": str(split_date), "test_days": test_days, "valid_start": str(valid_start),
            "test_end": str(split_date + days), "tie_break_seed": tie_break_seed,
            "catalog_snapshot": str(test_snapshot), "valid_catalog_snapshot": str(valid_snapshot)}
    split = temporal_split(user_ids, WindowInputs(valid_history, valid_window, valid_candidates),
                           WindowInputs(test_history, test_window, test_candidates), info)
    if split.test.users == 0 or split.valid.users == 0:
        raise InputDataError(
            f"the temporal split at {split_date} with {test_days} test days leaves {split.valid.users} validation "
            f"and {split.test.users} test users (users with history before a window and a new item in it); "
            "choose another --split-date or more --test-days")
    return split


def _sorted_by_user(user_ids: np.ndarray, seqs: Sequences) -> tuple[np.ndarray, Sequences]:
    order = np.argsort(user_ids, kind="stable")
    return user_ids[order], seqs.take(order)


def _align(user_ids: np.ndarray, ids: np.ndarray, seqs: Sequences) -> Sequences:
    """``seqs`` (one row per ``ids``) re-indexed to ``user_ids`` (sorted); users without a row get []."""
    pos, inside = lookup_sorted(user_ids, ids)
    source = np.full(len(user_ids), len(seqs), dtype=np.int64)         # len(seqs): the empty row appended below
    source[pos[inside]] = np.flatnonzero(inside)
    with_empty = Sequences(np.append(seqs.offsets, seqs.offsets[-1]), seqs.items)
    return with_empty.take(source)


def _types_note(event_types: tuple[str, ...]) -> str:
    return f" of types {list(event_types)}" if event_types else ""

