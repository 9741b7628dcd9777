"""Training data written by Spark as Parquet shards, for training processes to stream: nothing per user reaches the driver.

``recsys train`` used to collect every history to the driver (``toArrow()``) and train there; at the
millions of users the nightly job scores, the driver ran out of memory before the first epoch. Now
the executors write the histories (built by the nightly job's own code, ``recsys.data.history``) as
``train.shards`` Parquet files under the training's work directory, users spread over the files by
hash, and the training processes read them a chunk at a time (``recsys.model.stream``). What the
driver collects is catalog-sized, never user-sized: each item's count (for the vocabularies) and
a few totals.

Each row carries a seeded hash bucket of the user id (``held_out_bucket``): the users whose bucket is below
the cut :func:`recsys.model.stream.held_out_below` draws from ``train.held_out_share`` and
``train.held_out_min_users`` hold out their newest item, for choosing the epoch count and for the gate.

``train.max_users`` caps the users trained on by a seeded hash of the user id: the same users every
night for the same population, about ``max_users`` of them (each user is kept with probability
``max_users / users``, so the count varies by a fraction of a percent at scale).
"""
from __future__ import annotations

import datetime as dt
import logging
import uuid
from dataclasses import dataclass, replace

import numpy as np
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from recsys import fs as rfs
from recsys.config import Config
from recsys.data import history as hist
from recsys.data.contracts import partition_name
from recsys.data.readers import KeptWindow, events_window_once
from recsys.model.stream import (HASH_BUCKETS, HELD_OUT_BUCKET, HISTORY, MIN_HELD_OUT_LEN, NEWEST_FIRST_US, NEWEST_US,
                                 USER_ID, ShardFiles, held_out_below)
from recsys.sequences import Vocabulary

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class ItemCounts:
    """Each item's occurrences in the histories: all of them (the refit's) and without the held-out users' newest.
    Widened from a sample to every user by :func:`_population_items`: there, at ``train.min_item_count`` 1, the
    counts outside the sample are lower bounds (enough to decide which items reach the minimum)."""

    item_ids: np.ndarray       # [I] sorted
    all_events: np.ndarray     # [I]
    selection: np.ndarray      # [I]

    def vocabulary(self, min_count: int, *, held_out: bool) -> Vocabulary:
        """Items seen at least ``min_count`` times, ordered by id (``build_vocabulary``'s rule)."""
        counts = self.selection if held_out else self.all_events
        return Vocabulary(self.item_ids[counts >= min_count])


@dataclass(frozen=True)
class TrainingShards:
    """What Spark wrote for one training: the files, the item counts and the totals the driver reports."""

    directory: str
    files: ShardFiles
    items: ItemCounts
    users: int
    interactions: int
    held_out_users: int          # users whose newest item is held out (the epoch count's and the gate's)
    sampled_from: int | None     # users before the train.max_users sample (None: no sample)
    held_out_below: int = HASH_BUCKETS   # the bucket cut of those users (HASH_BUCKETS: every user with enough items)
    eligible_users: int = 0      # users with enough items to hold one out (MIN_HELD_OUT_LEN)

    @property
    def held_out_share(self) -> float:
        """The share of the eligible users that is held out (1.0: every one)."""
        return self.held_out_users / self.eligible_users if self.eligible_users else 1.0


def training_work_dir(cfg: Config, date: dt.date) -> str:
    """A fresh directory for this attempt's shards under ``paths.work/train/dt=D/``."""
    return rfs.join(train_work_root(cfg.paths.work, date), uuid.uuid4().hex[:12])


def train_work_root(work: str, date: dt.date) -> str:
    return rfs.join(work, "train", partition_name(date))


def remove_stale_attempts(work: str, date: dt.date) -> None:
    """Shards left by earlier attempts of ``date`` (a killed run): a rerun starts clean."""
    base = train_work_root(work, date)
    fs, root = rfs.resolve(base)
    for path in rfs.list_dirs(fs, root):
        log.info("removing the shards of an earlier training attempt: %s", path)
        rfs.delete_dir_if_exists(fs, path)


def held_out_bucket(user_id: str, seed: int):
    """The user's held-out bucket in [0, HASH_BUCKETS): a seeded hash of the id, the same every night, so
    the same users are held out from one night to the next (the repeat blend's rows use it too)."""
    return F.pmod(F.xxhash64(F.col(user_id), F.lit(seed), F.lit("held_out")), F.lit(HASH_BUCKETS))


def training_window(spark: SparkSession, cfg: Config, date: dt.date) -> KeptWindow:
    """The window :func:`training_events` reads, to be kept for the night's stages of the same process (``recsys
    night``, the demo: the nightly histories read the same ``history`` settings)."""
    return KeptWindow(spark, cfg.paths.events, date, cfg.history.window_days, cfg.history.event_types)


def training_events(spark: SparkSession, cfg: Config, date: dt.date, kept: KeptWindow | None = None) -> DataFrame:
    """The events training reads: the ``history.window_days`` before ``date``, rows without an id dropped;
    from ``kept`` when the process keeps that window for its night's stages too."""
    return hist.drop_null_ids(events_window_once(spark, cfg.paths.events, date, cfg.history.window_days,
                                                 cfg.history.event_types, kept))


def training_histories(spark: SparkSession, cfg: Config, date: dt.date, events: DataFrame | None = None) -> DataFrame:
    """user_id, history (item ids, oldest first, up to ``train.history_items``), newest_first_us, newest_us,
    held_out_bucket: each user's history before ``date``, when they *first* touched their newest item (histories
    collapse repeats to the latest time; the gate must know whether an older model could have seen the pair at
    all), when they last did (the user's newest event: a warm night trains on the users active since the model
    it starts from, :class:`recsys.model.stream.Replay`) and the user's held-out bucket. ``events``:
    :func:`training_events`, when the caller has read them already (None: read here)."""
    if events is None:
        events = training_events(spark, cfg, date)
    histories = hist.build_histories(events, max_items=cfg.train.history_items,
                                     tie_break_seed=cfg.history.tie_break_seed)
    first_seen = events.groupBy("user_id", "item_id").agg(F.unix_micros(F.min("ts")).alias(NEWEST_FIRST_US),
                                                          F.unix_micros(F.max("ts")).alias(NEWEST_US))
    # histories used once (a second reference would build them, shuffles and all, a second time)
    return (histories.withColumn("item_id", F.element_at(hist.HISTORY_COLUMN, -1))
            .join(first_seen, ["user_id", "item_id"]).drop("item_id")
            .select(USER_ID, F.col(hist.HISTORY_COLUMN).alias(HISTORY), NEWEST_FIRST_US, NEWEST_US,
                    held_out_bucket(USER_ID, cfg.train.seed).alias(HELD_OUT_BUCKET)))


def write_training_shards(spark: SparkSession, cfg: Config, date: dt.date, directory: str, *,
                          shards: int, events: DataFrame | None = None) -> TrainingShards:
    """Write the training histories of ``date`` as ``shards`` Parquet files under ``directory`` and read
    back the item counts and totals (aggregates only: nothing per user is collected). ``events``: as
    :func:`training_histories`.

    With ``train.max_users``, only the sample's histories are built: the users are counted and drawn, and the
    items outside the sample found, from the events themselves, so a night at a million users does not build a
    million histories (shuffles and all) to keep a fortieth of them."""
    if events is None:
        events = training_events(spark, cfg, date)
    if cfg.train.max_users is None:
        return _write_shards(spark, cfg, directory, shards, training_histories(spark, cfg, date, events), None)
    sample = _sample_users(events, cfg.train.max_users, cfg.train.seed)
    written = _write_shards(spark, cfg, directory, shards, training_histories(spark, cfg, date, sample.events),
                            sample.users)
    if sample.others is None:
        return written
    return replace(written, items=_population_items(written.items, events, sample.others, cfg.train.min_item_count))


def _write_shards(spark: SparkSession, cfg: Config, directory: str, shards: int, histories: DataFrame,
                  sampled_from: int | None) -> TrainingShards:
    """:func:`write_training_shards`'s write and statistics: ``histories`` (the users trained on) as the shard
    files, the item counts and totals read back from them."""
    # Training reads each file's rows in order (the users' window offsets and the shuffle buffer follow it), and
    # the order a shuffle delivers rows in is Spark's: it changes with the partitioning upstream and, on a
    # cluster, with the order the executors' blocks arrive. A seeded hash of the user orders each file instead,
    # so the same data trains the same model (users mixed: not by id, and not by held_out_bucket's hash)
    order = F.xxhash64(USER_ID, F.lit(cfg.train.seed), F.lit("shard_order"))
    (histories.repartition(shards, F.xxhash64(USER_ID, F.lit(cfg.train.seed))).sortWithinPartitions(order, USER_ID)
     .write.mode("overwrite").parquet(directory))
    written = spark.read.parquet(directory)
    files = parquet_files(directory)
    totals, below, items = _statistics(written, cfg.train.held_out_share, cfg.train.held_out_min_users)
    return TrainingShards(directory, files, items, users=int(totals["users"] or 0),
                          interactions=int(totals["interactions"] or 0),
                          held_out_users=int((items.all_events - items.selection).sum()), sampled_from=sampled_from,
                          held_out_below=below, eligible_users=int(totals["eligible_users"] or 0))


@dataclass(frozen=True)
class _Sample:
    events: DataFrame              # the sampled users' events (all of ``events`` when there are no more users)
    others: DataFrame | None       # the other users' events (None: every user is in the sample)
    users: int                     # users before the sample


def _sample_users(events: DataFrame, max_users: int, seed: int) -> _Sample:
    """The events of about ``max_users`` users chosen by a seeded hash of their id (all of them when there are
    fewer), the others' events, and how many users there were."""
    users = events.select(USER_ID).distinct().count()
    if users <= max_users:
        return _Sample(events, None, users)
    share = int(HASH_BUCKETS * max_users / users)
    drawn = F.pmod(F.xxhash64(F.col(USER_ID), F.lit(seed), F.lit("max_users")), F.lit(HASH_BUCKETS)) < share
    log.info("train.max_users=%d: training on a seeded sample of about %d of %d users", max_users, max_users, users)
    return _Sample(events.filter(drawn), events.filter(~drawn), users)


def _population_items(sample: ItemCounts, events: DataFrame, others: DataFrame, min_count: int) -> ItemCounts:
    """The sample's counts widened to every item of every user (one small collect, one row per item).

    The vocabularies come from the whole population, not from the users trained on: an item only users outside
    the sample touched must stay recommendable, above all to those users, whose lists offer it back as one of
    their own (a repeat). Training still reaches its embedding: the full softmax pushes every item down as a
    negative in every step. The held-out newest items are the sample's (only trained users are held out).

    The counts decide only which items reach ``train.min_item_count``. At 1 (the default), an item reaches it
    if the sample's count does or anyone outside the sample touched it: the sample's counts plus one for each
    item found among the ``others``' events (a catalog-sized aggregation of their item ids), a lower bound of
    the population's count that decides as the exact one does. A higher minimum counts each item's users
    exactly, as the histories count them (once per user: histories collapse repeats; ``train.history_items``
    cuts only a user with more distinct items than that): the distinct (user, item) pairs of ``events``, at a
    million users about as costly as building every user's history."""
    if min_count <= 1:
        outside = others.select("item_id").distinct().toArrow().column("item_id").to_numpy().astype(np.int64)
        item_ids = np.union1d(sample.item_ids, outside)
        all_events = np.zeros_like(item_ids)
        all_events[np.searchsorted(item_ids, sample.item_ids)] += sample.all_events
        all_events[np.searchsorted(item_ids, outside)] += 1
    else:
        table = (events.select(USER_ID, "item_id").distinct().groupBy("item_id")
                 .agg(F.count(F.lit(1)).alias("all_events")).orderBy("item_id").toArrow())
        item_ids = table.column("item_id").to_numpy().astype(np.int64)
        all_events = table.column("all_events").to_numpy().astype(np.int64)
    held_out = np.zeros_like(all_events)
    held_out[np.searchsorted(item_ids, sample.item_ids)] = sample.all_events - sample.selection
    return ItemCounts(item_ids, all_events, all_events - held_out)


def _statistics(written: DataFrame, share: float, min_users: int) -> tuple[dict, int, ItemCounts]:
    """Totals, the held-out users' bucket cut and per-item counts of the written shards (two small collects:
    one row, one row per item). Every held-out user gives up one item, so the held-out users are the
    difference of the two counts."""
    n = F.size(HISTORY)
    totals = written.agg(F.count(F.lit(1)).alias("users"), F.sum(n).alias("interactions"),
                         F.count_if(n >= MIN_HELD_OUT_LEN).alias("eligible_users")).first().asDict()
    below = held_out_below(share, min_users, int(totals["eligible_users"] or 0))
    exploded = written.select(F.posexplode(HISTORY).alias("pos", "item_id"), n.alias("n"), HELD_OUT_BUCKET)
    held_out = ((exploded.pos == exploded.n - 1) & (exploded.n >= MIN_HELD_OUT_LEN)
                & (exploded[HELD_OUT_BUCKET] < F.lit(below)))
    table = (exploded.groupBy("item_id").agg(F.count(F.lit(1)).alias("all_events"),
                                             F.count_if(~held_out).alias("selection"))
             .orderBy("item_id").toArrow())
    items = ItemCounts(table.column("item_id").to_numpy().astype(np.int64),
                       table.column("all_events").to_numpy().astype(np.int64),
                       table.column("selection").to_numpy().astype(np.int64))
    return totals, below, items


def parquet_files(directory: str) -> ShardFiles:
    """The Parquet files Spark wrote under ``directory`` (its markers and hidden files left out), sorted."""
    fs, root = rfs.resolve(directory)
    from pyarrow import fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(root, recursive=False))
    names = sorted(i.path for i in infos if i.type == pafs.FileType.File and i.base_name.endswith(".parquet")
                   and not i.base_name.startswith(("_", ".")))
    scheme = directory.split("://", 1)[0] + "://" if "://" in directory else ""
    return ShardFiles(tuple(f"{scheme}{p}" if scheme and not p.startswith(scheme) else p for p in names))
