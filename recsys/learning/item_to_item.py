"""The item-to-item weights' co-occurrence counts, by Spark from training's events window, and their fits.

Two fits from one aggregation: the counts of the (user, item) pairs first seen before the repeat blend's first
validation day (the weights the blend is chosen with: fitted on nothing those days hold, as the model ranking the
new items there has not trained on them either) and the counts of the whole window (the weights saved with the model
for the nights). A pair (i, j) counts for a user before the split when the user had both i and j before it, so one
self-join of each user's distinct items, with the first time each was had, yields both.

Only the window's ``train.repeats.item_to_item.max_items`` items with the most users take part (ties by item id):
the driver collects at most ``max_items ** 2 / 2`` counts and inverts a ``max_items``-square matrix
(:func:`recsys.model.item_to_item.ease_weights`). The self-join costs the sum over users of their distinct
items squared, spread over the executors.
"""
from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

import numpy as np
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from recsys.config import Config
from recsys.model.item_to_item import ItemToItem, from_co_counts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ItemToItemFits:
    """The weights the repeat blend is chosen with, and the ones saved with the model for the nights."""

    validation: ItemToItem   # fitted on the pairs before the first validation day
    night: ItemToItem        # fitted on the whole window


def fit_item_to_item(events: DataFrame, cfg: Config, split: dt.datetime) -> ItemToItemFits | None:
    """Both fits from ``events`` (user_id, item_id, ts: the training window); None when the window has no events.
    ``split``: the first validation day's first instant (UTC)."""
    settings = cfg.train.repeats.item_to_item
    pairs = events.groupBy("user_id", "item_id").agg(F.unix_micros(F.min("ts")).alias("first"))
    top = (pairs.groupBy("item_id").agg(F.count(F.lit(1)).alias("users"))
           .orderBy(F.desc("users"), "item_id").limit(settings.max_items).toArrow())
    item_ids = np.sort(top.column("item_id").to_numpy().astype(np.int64))
    if not len(item_ids):
        return None
    spark = events.sparkSession
    index = spark.createDataFrame([(int(i), p) for p, i in enumerate(item_ids)], "item_id long, pos int")
    had = pairs.join(F.broadcast(index), "item_id").select("user_id", "pos", "first")
    left = had.select("user_id", F.col("pos").alias("i"), F.col("first").alias("first_i"))
    right = had.select("user_id", F.col("pos").alias("j"), F.col("first").alias("first_j"))
    split_us = int(split.timestamp() * 1_000_000)
    counts = (left.join(right, "user_id").filter(F.col("i") <= F.col("j"))
              .groupBy("i", "j")
              .agg(F.count(F.lit(1)).alias("all"),
                   F.sum(F.when(F.greatest("first_i", "first_j") < F.lit(split_us), 1).otherwise(0)).alias("before"))
              .toArrow())
    rows, cols = (counts.column(c).to_numpy().astype(np.int64) for c in ("i", "j"))
    whole = counts.column("all").to_numpy().astype(np.float64)
    before = counts.column("before").to_numpy().astype(np.float64)
    log.info("item-to-item weights over %d items (%d co-occurring pairs, l2 %g)", len(item_ids), len(rows),
             settings.l2)
    return ItemToItemFits(validation=from_co_counts(item_ids, rows, cols, before, settings.l2),
                          night=from_co_counts(item_ids, rows, cols, whole, settings.l2))
