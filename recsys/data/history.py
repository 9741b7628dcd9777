"""Per-user histories: what a model reads about each user, built the same way for training and scoring.

One definition, used by ``recsys train`` and the nightly job alike, so the model is served exactly
the kind of sequence it was trained on:

- events with a null user, item or timestamp are dropped (and counted through an observation);
- repeated interactions with an item collapse to the latest one in the sequence, and what the repeats
  said is kept beside it: how many events the user had with the item, and when the latest was
  (``history_counts``, ``history_last_us``, aligned with ``history``), which the repeat blend scores
  known items by (:mod:`recsys.model.repeats`);
- items are ordered by that latest time, ties broken by a seeded hash of (user, item) —
  never by item id, whose order would leak into a sequential model;
- the most recent ``max_items`` items are kept, oldest first, as external item ids.

Histories hold item *ids*, not model indices: they are plain data, independent of any model.
Mapping ids to a model's vocabulary (and counting unknown items) happens where the model is, in
the scoring core and in training.
"""
from __future__ import annotations

import datetime as dt
from functools import reduce
from typing import Sequence

import numpy as np
import pyarrow as pa
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from recsys.data.contracts import (EXCLUDED_COLUMN, HISTORY_COLUMN, HISTORY_COUNTS_COLUMN, HISTORY_LAST_US_COLUMN,
                                   PERSONAL_FREQUENCY_COLUMN, TOUCHED_COLUMN, TOUCHED_KNOWN_COLUMN)
from recsys.sequences import Sequences

__all__ = ["ENTRIES_COLUMN", "EXCLUDED_COLUMN", "HISTORY_COLUMN", "HISTORY_COUNTS_COLUMN", "HISTORY_LAST_US_COLUMN", "WEIGHT_COLUMN",
           "build_histories", "drop_null_ids", "entries_to_events",
           "entries_to_histories", "histories_to_sequences", "history_metrics", "input_quality_metrics",
           "newest_entries"]


def input_quality_metrics() -> list[Column]:
    """Counts of raw window events and of rows dropped for null ids; observed on the raw events."""
    return [
        F.count(F.lit(1)).alias("events_read"),
        F.count_if(F.col("user_id").isNull()).alias("dropped_null_user_id"),
        F.count_if(F.col("item_id").isNull()).alias("dropped_null_item_id"),
        F.count_if(F.col("ts").isNull()).alias("dropped_null_ts"),
    ]


def drop_null_ids(events: DataFrame) -> DataFrame:
    return events.filter(F.col("user_id").isNotNull() & F.col("item_id").isNotNull() & F.col("ts").isNotNull())


ExcludeSince = Sequence[tuple[str, dt.datetime]]   # (event_type, since): recommend.exclude.events at a night


def build_histories(events: DataFrame, *, max_items: int, tie_break_seed: int,
                    touched_since: dt.datetime | None = None, frequency_items: int | None = None,
                    exclude: ExcludeSince = ()) -> DataFrame:
    """events(user_id, item_id, ts) -> user_id, history (array<bigint>, oldest first, <= max_items), and aligned
    with it history_counts (array<bigint>: events per item) and history_last_us (array<bigint>: the latest).

    ``touched_since``: also ``touched_items``, the distinct items whose latest event is at or after that
    time (every one of them, not only the newest ``max_items``), from the same aggregation: what the
    nightly job measures the previous night's lists against without a second pass over the events; and
    ``touched_known_items``, those of them the user had an event with before that time (the repeats among
    what the user did; the rest were new to the user).
    ``frequency_items`` (with ``touched_since``): also ``personal_frequency_items``, the user's personal-frequency
    list as of ``touched_since``: the items with events before it, most such events first, ties by the latest
    such event, then by item id, at most ``frequency_items`` of them (empty for a user new since then): the
    baseline the previous night's lists are measured against beside popularity, from the same aggregation.
    ``exclude``: also ``excluded_items``, the distinct items the user had an event of one of the types with at or
    after its time (events need ``event_type``), every one of them, from the same aggregation: the operators'
    exclusions hold for items the history's ``max_items`` let go.
    """
    return entries_to_histories(newest_entries(events, max_items=max_items, tie_break_seed=tie_break_seed,
                                               touched_since=touched_since, frequency_items=frequency_items,
                                               exclude=exclude))


ENTRIES_COLUMN = "_entries"   # array<struct<ts, tie, item_id, n>>, newest first
WEIGHT_COLUMN = "_events"     # optional on events: how many events one row stands for (entries_to_events)


def newest_entries(events: DataFrame, *, max_items: int, tie_break_seed: int,
                   touched_since: dt.datetime | None = None, frequency_items: int | None = None,
                   keys: tuple[str, ...] = ("user_id",), exclude: ExcludeSince = ()) -> DataFrame:
    """events(user_id, item_id, ts) -> user_id, _entries: each user's newest ``max_items`` distinct items.
    ``keys``: what one history is of (default: a user; the repeat blend's validation: a user on a day).

    The ranking of a history, kept with its keys (latest time, seeded tie-break hash) so that newer
    events can be merged on top and ranked again exactly: the on-demand service caches these for
    the window and adds today's events per request (``entries_to_events`` + ``build_histories``).
    Keeping only the newest ``max_items`` loses nothing: newer events only push older items down.
    """
    # One shuffle by user serves both aggregations below (per user and item, then per user); left to
    # itself Spark shuffles twice, by (user, item) and then by user. The same histories, one shuffle
    # fewer (measured: docs/performance.md, "Figures that lived in the code").
    if frequency_items is not None and frequency_items < 1:
        raise ValueError(f"frequency_items={frequency_items}: a personal-frequency list needs room for at least "
                         f"1 item; pass scoring.top_n")
    count = F.sum(WEIGHT_COLUMN) if WEIGHT_COLUMN in events.columns else F.count(F.lit(1))
    excluded = ([F.bool_or(reduce(lambda a, b: a | b, [(F.col("event_type") == F.lit(event_type)) &
                                                        (F.col("ts") >= F.lit(since)) for event_type, since in exclude]))
                 .alias("_excluded")] if exclude else [])
    before = []   # per (user, item): events before touched_since, and the latest of them
    if touched_since is not None:
        earlier = F.col("ts") < F.lit(touched_since)
        weight = F.col(WEIGHT_COLUMN) if WEIGHT_COLUMN in events.columns else F.lit(1)
        before = [F.sum(F.when(earlier, weight).otherwise(0)).cast("bigint").alias("_n_before"),
                  F.max(F.when(earlier, F.col("ts"))).alias("_ts_before")]
    latest = events.repartition("user_id").groupBy(*keys, "item_id").agg(F.max("ts").alias("ts"),
                                                                          count.cast("bigint").alias("n"),
                                                                          *excluded, *before)
    tie = F.xxhash64(F.col("user_id"), F.col("item_id"), F.lit(tie_break_seed))
    entry = F.struct(F.col("ts"), tie.alias("tie"), F.col("item_id"), F.col("n"))
    touched = []
    if touched_since is not None:
        since = F.col("ts") >= F.lit(touched_since)
        known = F.col("_n_before") > 0
        touched += [F.collect_list(F.when(since, F.col("item_id"))).alias(TOUCHED_COLUMN),
                    F.collect_list(F.when(since & known, F.col("item_id"))).alias(TOUCHED_KNOWN_COLUMN)]
        if frequency_items is not None:
            # sorted descending as a struct: most events before, then the latest of them, then the smaller item
            # id (bitwise_not reverses the order of ids without the overflow of a negation)
            key = F.struct(F.col("_n_before"), F.col("_ts_before"), F.bitwise_not(F.col("item_id")).alias("not_id"))
            ranked = F.slice(F.sort_array(F.collect_list(F.when(known, key)), asc=False), 1, int(frequency_items))
            touched.append(F.transform(ranked, lambda e: F.bitwise_not(e["not_id"])).alias(PERSONAL_FREQUENCY_COLUMN))
    if exclude:
        touched.append(F.collect_list(F.when(F.col("_excluded"), F.col("item_id"))).alias(EXCLUDED_COLUMN))
    return latest.groupBy(*keys).agg(
        F.slice(F.sort_array(F.collect_list(entry), asc=False), 1, max_items).alias(ENTRIES_COLUMN), *touched)


def entries_to_histories(entries: DataFrame) -> DataFrame:
    """user_id, _entries -> user_id, history (item ids, oldest first), history_counts, history_last_us."""
    oldest_first = F.reverse(ENTRIES_COLUMN)
    history = F.transform(oldest_first, lambda e: e["item_id"])
    counts = F.transform(oldest_first, lambda e: e["n"])
    last_us = F.transform(oldest_first, lambda e: F.unix_micros(e["ts"]))
    extra = [c for c in entries.columns if c not in ("user_id", ENTRIES_COLUMN)]   # touched/excluded items, a day
    return entries.select("user_id", history.alias(HISTORY_COLUMN), counts.alias(HISTORY_COUNTS_COLUMN),
                          last_us.alias(HISTORY_LAST_US_COLUMN), *extra)


def entries_to_events(entries: DataFrame) -> DataFrame:
    """user_id, _entries -> user_id, item_id, ts, _events: one row per kept item, at its latest time, standing
    for as many events as the user had with it (so that merging newer events keeps the counts)."""
    return entries.select("user_id", F.explode(ENTRIES_COLUMN).alias("e")).select(
        "user_id", F.col("e.item_id").alias("item_id"), F.col("e.ts").alias("ts"), F.col("e.n").alias(WEIGHT_COLUMN))


def history_metrics(excluded: bool = False) -> list[Column]:
    """Observed on the histories as they are written; ``excluded``: they hold ``excluded_items`` (the rules')."""
    return [
        F.count(F.lit(1)).alias("users_in_window"),
        F.sum(F.size(HISTORY_COLUMN)).alias("history_items"),
        F.max(F.size(HISTORY_COLUMN)).alias("history_max_len"),
        *([F.sum(F.size(EXCLUDED_COLUMN)).alias("rule_excluded_pairs"),
           F.count_if(F.size(EXCLUDED_COLUMN) > 0).alias("rule_excluded_users")] if excluded else []),
    ]


def histories_to_sequences(table: pa.Table) -> tuple[np.ndarray, Sequences]:
    """A collected histories table -> (user_ids, id sequences)."""
    return table.column("user_id").to_numpy(), Sequences.from_arrow(table.column(HISTORY_COLUMN))
