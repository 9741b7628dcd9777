"""The item-to-item weights' co-occurrence counts, by Spark from training's events window, and their fits.

Two fits from one aggregation. The weights the repeat blend is chosen with are fitted as the model that ranks the
new items on the validation days was trained (the selection model): without each held-out user's newest item (the
pair of their latest event; users with fewer than ``MIN_HELD_OUT_LEN`` items hold none out), so neither ranker of
new items is judged on pairs it trained on and the other did not. The weights saved with the model for the nights
are fitted on every pair of the window, as the refit model is trained on every item.

One pass yields both counts: each user's distinct items, the held-out newest flagged, collected per user; each
task counts its users' pairs with numpy (:func:`recsys.model.item_to_item.add_pair_counts` into two dense arrays,
or :func:`~recsys.model.item_to_item.pair_counts` above ``DENSE_ITEMS`` items: the sum over users of their items
squared, halved, in vectorised chunks rather than as the rows of a self-join, which Spark would shuffle one by one:
docs/performance.md, "Item-to-item scores in the core") and Spark adds the tasks' counts up. Only the
window's ``train.repeats.item_to_item.max_items`` items with the most users take part (ties by item id): the driver
collects at most ``max_items ** 2 / 2`` counts and inverts a ``max_items``-square matrix
(:func:`recsys.model.item_to_item.ease_weights`).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from recsys.config import Config
from recsys.learning.shards import HASH_BUCKETS, held_out_bucket
from recsys.model.item_to_item import ItemToItem, add_pair_counts, from_co_counts, pair_counts
from recsys.model.stream import MIN_HELD_OUT_LEN

log = logging.getLogger(__name__)

COUNTS_DDL = "key long, all long, trained long"
DENSE_ITEMS = 2048   # up to this many weighted items a task adds its counts up in two dense arrays (64 MiB at most)


@dataclass(frozen=True)
class ItemToItemFits:
    """The weights the repeat blend is chosen with, and the ones saved with the model for the nights."""

    validation: ItemToItem   # without each held-out user's newest item (as the selection model trained)
    night: ItemToItem        # every pair of the window (as the refit model trained)


def fit_item_to_item(events: DataFrame, cfg: Config, *, held_out_below: int = HASH_BUCKETS) -> ItemToItemFits | None:
    """Both fits from ``events`` (user_id, item_id, ts: the training window); None when the window has no events.
    ``held_out_below``: the users whose :func:`~recsys.learning.shards.held_out_bucket` is below it held out their
    newest item in training (all users at ``HASH_BUCKETS``)."""
    settings = cfg.train.repeats.item_to_item
    pairs = events.groupBy("user_id", "item_id").agg(F.max("ts").alias("last"))
    top = (pairs.groupBy("item_id").agg(F.count(F.lit(1)).alias("users"))
           .orderBy(F.desc("users"), "item_id").limit(settings.max_items).toArrow())
    item_ids = np.sort(top.column("item_id").to_numpy().astype(np.int64))
    if not len(item_ids):
        return None
    newest = Window.partitionBy("user_id").orderBy(F.desc("last"), F.desc("item_id"))
    held = ((F.row_number().over(newest) == 1) & (held_out_bucket("user_id", cfg.train.seed) < F.lit(held_out_below))
            & (F.count(F.lit(1)).over(Window.partitionBy("user_id")) >= F.lit(MIN_HELD_OUT_LEN)))
    index = events.sparkSession.createDataFrame([(int(i), p) for p, i in enumerate(item_ids)], "item_id long, pos int")
    had = (pairs.withColumn("held", held)          # ranked among all the user's items, then cut to the top items
           .join(F.broadcast(index), "item_id")
           .groupBy("user_id").agg(F.collect_list(F.struct("pos", "held")).alias("items")))
    task = partial(_partition_counts, len(item_ids), len(item_ids) <= DENSE_ITEMS)
    counts = (had.select("items").mapInArrow(task, COUNTS_DDL)
              .groupBy("key").agg(F.sum("all").alias("all"), F.sum("trained").alias("trained")).toArrow())
    keys = counts.column("key").to_numpy().astype(np.int64)
    rows, cols = keys // len(item_ids), keys % len(item_ids)
    whole = counts.column("all").to_numpy().astype(np.float64)
    trained = counts.column("trained").to_numpy().astype(np.float64)
    log.info("item-to-item weights over %d items (%d co-occurring pairs, l2 %g)", len(item_ids), len(rows),
             settings.l2)
    return ItemToItemFits(validation=from_co_counts(item_ids, rows, cols, trained, settings.l2),
                          night=from_co_counts(item_ids, rows, cols, whole, settings.l2))


def _partition_counts(n_items: int, dense: bool, batches: Iterator[pa.RecordBatch],
                      max_pairs: int = 1 << 24) -> Iterator[pa.RecordBatch]:
    """A task's users (``items``: list<struct<pos, held>>) -> their co-occurrence counts (:func:`pair_counts`): added
    up over the task and sent once when ``dense`` (few enough items for two ``n_items ** 2`` arrays), else chunk by
    chunk (Spark sums them either way)."""
    every = np.zeros(n_items * n_items if dense else 0, dtype=np.int64)
    trained = np.zeros_like(every)
    for batch in batches:
        items = batch.column(0)
        pos, held = items.flatten().flatten()              # the users' (pos, held) entries, one after another
        offsets = items.offsets.to_numpy()
        offsets = offsets - offsets[0]
        pos, held = pos.to_numpy(zero_copy_only=False), held.to_numpy(zero_copy_only=False)
        if dense:
            add_pair_counts(offsets, pos, held, n_items, every, trained, max_pairs)
            continue
        for keys, all_, kept in pair_counts(offsets, pos, held, n_items, max_pairs):
            yield _counts_batch(keys, all_, kept)
    if dense:
        nonzero = np.flatnonzero(every)
        yield _counts_batch(nonzero, every[nonzero], trained[nonzero])


def _counts_batch(keys: np.ndarray, every: np.ndarray, trained: np.ndarray) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array(keys, pa.int64()), pa.array(every, pa.int64()),
                                       pa.array(trained, pa.int64())], names=["key", "all", "trained"])
