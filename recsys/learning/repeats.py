"""The repeat blend's held-out days, built by Spark from the events, and its fit at the end of training.

The rows need no model, so training writes them in its read stage, from the same read of the events window
as the histories' shards (:func:`recsys.pipelines.train.run_training`); the fit ranks them once a model exists.

For each of the ``train.repeats.validation_days`` days before the training date: the users active that
day, their histories before it (built by the nightly job's own history code, counts and latest times
included), and the distinct items they had that day: at most ``train.repeats.max_rows`` (user, day) rows,
a seeded sample by user (the fit needs a few thousand, never everyone). When training holds out only a share
of the users (``train.held_out_share``), the rows are theirs: the model ranking the new items has trained on
every other user's newest item, which falls in these very days and would make new items look better.

Beside them, over every user (the rows are a sample), how many users had each item on each day from the day
before the first validation day on: the new items' recent-popularity prior on each validation day
(:func:`recsys.model.repeats.popularity_prior`), the count the night takes from its histories: collected to the
driver as one row per item (catalog-sized, as the item counts are) holding its days' counts.

The rows are written as Parquet under the training's work directory and streamed back a chunk at a time,
as the held-out users of training are: nothing per user is collected to the driver, and the memory the
fit takes is a chunk's whatever ``max_rows`` is. Each chunk is ranked by the model and added to the grid's
sums (:class:`recsys.model.repeats.BlendSums`); the choice is made once, on the totals.
"""
from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from recsys.config import Config
from recsys.data import history as hist
from recsys.learning.shards import held_out_bucket, parquet_files
from recsys.learning.item_to_item import ItemToItemFits, fit_item_to_item
from recsys.model.repeats import (BlendValidation, RecentUsers, RepeatBlend, ValidationDays, blend_grid, blend_sums,
                                  choose_blend, rank_validation_days)
from recsys.model.stream import HASH_BUCKETS, ShardFiles, read_batches
from recsys.sequences import Sequences

log = logging.getLogger(__name__)

DAY = "_day"
TARGETS = "_targets"
HASH_BUCKETS = 1 << 30
ROWS_PER_FILE = 100_000   # (user, day) rows per written file
ROWS_PER_CHUNK = 2048     # (user, day) rows ranked at once: a [chunk, items] score matrix in memory


@dataclass(frozen=True)
class BlendDays:
    """What training's read stage wrote for the blend: the (user, day) rows' files, the days' popularity, and the
    item-to-item weights (None: ``train.repeats.item_to_item.weights`` is [0], or the window had no pairs)."""

    rows: ShardFiles
    recent: RecentUsers
    item_to_item: ItemToItemFits | None = None
    validation_rows: int | None = None   # (user, day) rows before sampling; None: not counted


def write_validation_days(events: DataFrame, cfg: Config, date: dt.date, directory: str, *,
                          held_out_below: int = HASH_BUCKETS) -> BlendDays:
    """Write the held-out (user, day) rows of the days before ``date`` under ``directory`` (see the module
    docstring), count the users per item of those days and the day before, and return both; below
    ``HASH_BUCKETS``, only the held-out users' rows (the counts are everyone's, as the night's are). With item-to-item
    weights among the choices, their fits too (:mod:`recsys.learning.item_to_item`).
    ``events``: :func:`recsys.learning.shards.training_events`, the read training's shards are written from."""
    settings = cfg.train.repeats
    first = dt.datetime.combine(date - dt.timedelta(days=settings.validation_days), dt.time(), dt.timezone.utc)
    day = F.to_date(F.col("ts"))                                  # the session's time zone is UTC (runtime_settings)
    # one row per item (catalog-sized, like the item counts training collects), its (day, users) pairs in a list
    recent = (events.filter(F.col("ts") >= F.lit(first - dt.timedelta(days=1)))
              .groupBy(day.alias(DAY), "item_id").agg(F.countDistinct("user_id").alias("users"))
              .groupBy("item_id").agg(F.collect_list(F.struct(F.unix_micros(F.col(DAY).cast("timestamp")).alias(DAY),
                                                              "users")).alias("days")).toArrow())
    targets = (events.filter(F.col("ts") >= F.lit(first)).select("user_id", day.alias(DAY), "item_id")
               .groupBy("user_id", DAY).agg(F.array_sort(F.collect_set("item_id")).alias(TARGETS)))
    if held_out_below < HASH_BUCKETS:
        targets = targets.filter(held_out_bucket("user_id", cfg.train.seed) < F.lit(held_out_below))
    targets, rows = _sample(targets, settings.max_rows, cfg.train.seed)
    before = (events.join(F.broadcast(targets.select("user_id", DAY)), "user_id")
              .filter(F.col("ts") < F.col(DAY).cast("timestamp")))
    histories = hist.entries_to_histories(hist.newest_entries(before, max_items=cfg.history.max_items,
                                                              tie_break_seed=cfg.history.tie_break_seed,
                                                              keys=("user_id", DAY)))
    files = max(1, -(-min(rows, settings.max_rows) // ROWS_PER_FILE))
    (targets.join(histories, ["user_id", DAY]).repartition(files, "user_id").sortWithinPartitions("user_id", DAY)
     .select(F.unix_micros(F.col(DAY).cast("timestamp")).alias(DAY), hist.HISTORY_COLUMN,
             hist.HISTORY_COUNTS_COLUMN, hist.HISTORY_LAST_US_COLUMN, TARGETS)
     .write.mode("overwrite").parquet(directory))
    weighs_new = rows >= settings.min_rows          # enough rows to choose a ranking of new items on
    i2i = (fit_item_to_item(events, cfg, held_out_below=held_out_below)
           if weighs_new and any(settings.item_to_item.weights) else None)
    return BlendDays(parquet_files(directory), _recent_users(recent), i2i, rows)


def _recent_users(per_item: pa.Table) -> RecentUsers:
    """item_id, days: list<(_day, users)> -> the flat (day, item, users) entries."""
    days = per_item.column("days").combine_chunks()
    pairs = days.flatten()
    return RecentUsers(day_us=pairs.field(DAY).to_numpy(zero_copy_only=False).astype(np.int64),
                       item_ids=np.repeat(per_item.column("item_id").to_numpy(), days.value_lengths().to_numpy()),
                       users=pairs.field("users").to_numpy(zero_copy_only=False).astype(np.int64))


def _sample(targets: DataFrame, max_rows: int, seed: int) -> tuple[DataFrame, int]:
    """At most about ``max_rows`` rows, whole users kept or left (a seeded hash of the user id); and how
    many rows there were before sampling."""
    rows = targets.count()
    if rows <= max_rows:
        return targets, rows
    share = int(HASH_BUCKETS * max_rows / rows)
    bucket = F.pmod(F.xxhash64(F.col("user_id"), F.lit(seed), F.lit("repeat-blend")), F.lit(HASH_BUCKETS))
    return targets.filter(bucket < share), rows


def validation_chunks(files: ShardFiles, rows_per_chunk: int = ROWS_PER_CHUNK) -> Iterator[ValidationDays]:
    """The written rows, ``rows_per_chunk`` at a time."""
    columns = [DAY, hist.HISTORY_COLUMN, hist.HISTORY_COUNTS_COLUMN, hist.HISTORY_LAST_US_COLUMN, TARGETS]
    for batch in read_batches(files.paths, columns, rows_per_chunk):
        yield _as_days(batch)


def _as_days(rows: pa.RecordBatch | pa.Table) -> ValidationDays:
    def seqs(name: str) -> Sequences:
        return Sequences.from_arrow(rows.column(name))

    return ValidationDays(histories=seqs(hist.HISTORY_COLUMN), counts=seqs(hist.HISTORY_COUNTS_COLUMN).items,
                          last_us=seqs(hist.HISTORY_LAST_US_COLUMN).items,
                          day_start_us=rows.column(DAY).to_numpy(zero_copy_only=False).astype(np.int64),
                          targets=seqs(TARGETS))


class Ranker(Protocol):
    """A model and its vocabulary (external item id of model index i + 1): what ranks the new items."""

    model: Any
    item_ids: np.ndarray


def fit_repeat_blend(cfg: Config, date: dt.date, ranker: Ranker, device, days: BlendDays) -> RepeatBlend:
    """The blend chosen on the held-out days' rows (:func:`write_validation_days`), with the model that ranks
    the new items."""
    model, item_ids = ranker.model.to(device), ranker.item_ids   # ranked on this device
    settings = cfg.train.repeats
    few = days.validation_rows is not None and days.validation_rows < settings.min_rows
    if few:
        log.info("[train %s] %d (user, day) rows, fewer than train.repeats.min_rows=%d: new items keep the model's "
                 "ranking (no popularity prior, no item-to-item scores)", date, days.validation_rows, settings.min_rows)
    weights = (0.0,) if few else settings.popularity_weights
    # without fitted weights (none asked for, too few rows, or no pairs) the grid holds no item-to-item weight
    i2i_weights = settings.item_to_item.weights if days.item_to_item is not None else (0.0,)
    i2i = days.item_to_item.validation if days.item_to_item is not None else None
    candidates = blend_grid(popularity_weights=weights, item_to_item_weights=i2i_weights)
    sums = blend_sums(BlendValidation.empty(), candidates)
    for chunk in validation_chunks(days.rows):
        ranked = rank_validation_days(model, item_ids, chunk, recent=days.recent, popularity_weights=weights,
                                      item_to_item=i2i, item_to_item_weights=i2i_weights)
        sums = sums.add(blend_sums(ranked, candidates))
    blend = choose_blend(sums, cfg.train.repeats.objective)
    nan = float("nan")
    log.info("[train %s] repeat blend on %d (user, day) rows of the last %d days, chosen for %s: %s (NDCG@10 %.4f, "
             "masked %.4f, without the popularity prior %.4f, without item-to-item scores %.4f; HR@10 %.4f, masked "
             "%.4f; %.0f%% of the day's items were known)",
             date, sums.rows, cfg.train.repeats.validation_days, cfg.train.repeats.objective, describe(blend),
             blend.figures.get("ndcg_at_10", nan), blend.figures.get("masked_ndcg_at_10", nan),
             blend.figures.get("no_prior_ndcg_at_10", nan), blend.figures.get("no_item_to_item_ndcg_at_10", nan),
             blend.figures.get("hr_at_10", nan), blend.figures.get("masked_hr_at_10", nan),
             100 * blend.figures.get("known_target_share", 0.0))
    return blend


def describe(blend: RepeatBlend) -> str:
    prior = f", new items' popularity_weight {blend.popularity_weight:g}" if blend.popularity_weight else ""
    if blend.item_to_item_weight:
        prior += f", item_to_item_weight {blend.item_to_item_weight:g}"
    if blend.masks_known:
        return f"known items masked{prior}"
    return (f"known items compete (repeat_bias {blend.repeat_bias:g}, age_weight {blend.age_weight:g}, "
            f"new_rank_weight {blend.new_rank_weight:g}{prior})")
