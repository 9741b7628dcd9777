"""The item-to-item weights' co-occurrence counts, by Spark from training's events window, and their fits.

Two fits from one aggregation. The weights the repeat blend is chosen with are fitted as the model that ranks the
new items on the validation days was trained (the selection model): without each held-out user's newest item (the
pair of their latest event; users with fewer than ``MIN_HELD_OUT_LEN`` items hold none out), so neither ranker of
new items is judged on pairs it trained on and the other did not.
The weights saved with the model for the nights are fitted on every pair of the window, as the refit model is
trained on every item. One self-join of each user's distinct items, each flagged when it is the held-out newest,
yields both counts.

Only the window's ``train.repeats.item_to_item.max_items`` items with the most users take part (ties by item id):
the driver collects at most ``max_items ** 2 / 2`` counts and inverts a ``max_items``-square matrix
(:func:`recsys.model.item_to_item.ease_weights`). The self-join costs the sum over users of their distinct
items squared, spread over the executors.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from recsys.config import Config
from recsys.learning.shards import HASH_BUCKETS, held_out_bucket
from recsys.model.stream import MIN_HELD_OUT_LEN
from recsys.model.item_to_item import ItemToItem, from_co_counts

log = logging.getLogger(__name__)


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
           .join(F.broadcast(index), "item_id").select("user_id", "pos", "held"))
    left = had.select("user_id", F.col("pos").alias("i"), F.col("held").alias("held_i"))
    right = had.select("user_id", F.col("pos").alias("j"), F.col("held").alias("held_j"))
    counts = (left.join(right, "user_id").filter(F.col("i") <= F.col("j"))
              .groupBy("i", "j")
              .agg(F.count(F.lit(1)).alias("all"),
                   F.sum(F.when(~F.col("held_i") & ~F.col("held_j"), 1).otherwise(0)).alias("trained"))
              .toArrow())
    rows, cols = (counts.column(c).to_numpy().astype(np.int64) for c in ("i", "j"))
    whole = counts.column("all").to_numpy().astype(np.float64)
    trained = counts.column("trained").to_numpy().astype(np.float64)
    log.info("item-to-item weights over %d items (%d co-occurring pairs, l2 %g)", len(item_ids), len(rows),
             settings.l2)
    return ItemToItemFits(validation=from_co_counts(item_ids, rows, cols, trained, settings.l2),
                          night=from_co_counts(item_ids, rows, cols, whole, settings.l2))
