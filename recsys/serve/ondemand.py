"""The on-demand path: score any set of users now, on the warm backend, with the nightly job's stages.

What a request needs and what it costs:

- **Histories** come from a DataFrame cached in the backend (``WarmWindow``): for every user with
  events in the window ``[as_of - history.window_days, as_of)``, their newest ``history.max_items``
  distinct items with the time and tie-break key they were ranked by, range-partitioned and sorted
  by ``user_id``. It is built once (one pass over the window) and rebuilt only when the window
  moves (a new day) or its partitions change (a new or rewritten file). A request filters it by
  user id: Spark's in-memory scan skips the cached batches whose ``user_id`` range holds none of
  them, so a request reads a few batches, not the window. Events of the partitions from ``as_of``
  on ("today") are read for the requested users only and merged on top, by the same history
  definition the nightly job uses (``recsys.data.history``: ``build_histories`` is
  ``entries_to_histories(newest_entries(...))``).
- **Model, candidates and fallback** come from the nightly job's stages (``recsys.pipelines.nightly_stages``:
  ``read_catalog``, ``popularity_fallback_stage``, ``scoring_spec``) on the same inputs (the alias,
  the newest catalog snapshot on or before the date, popularity over the window's histories), 
  checked again every ``serve.refresh_s``; the workers' cache key (model version, candidate-set
  digest) makes the next batch after a change load the new ones.
- **Scoring** is the nightly job's ``recsys.pipelines.nightly_stages.score_users`` on one partition per batch; the
  rows are collected instead of written.

- **Rules** (``recommend.*``, docs/rules.md) are the nightly job's: the catalog rules shape the candidates in
  ``read_catalog``, the event rules' ``excluded_items`` are built with the cached window (from ``as_of``'s
  start) and today's events of those types are added per request, and the scorer applies the rest.

So for a user the nightly job scored for date D, a request served ``as_of`` D (with no events of D
yet) returns the row the job published: same history, exclusions, candidates, fallback, model and scorer.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import pyarrow as pa

from recsys.config import Config
from recsys.errors import first_line
from recsys.scoring.cache import CacheUse

log = logging.getLogger(__name__)

WINDOW_PARTITION_BYTES = 64 << 20


class BackendUnavailable(Exception):
    """The Spark Connect server cannot be reached (down, restarted, or the session is gone)."""


class BatchFailed(Exception):
    """The backend answered, but the batch's Spark job failed."""


_UNAVAILABLE_MARKERS = ("UNAVAILABLE", "Connection refused", "failed to connect", "Socket closed",
                        "RetriesExceeded", "INVALID_HANDLE.SESSION", "SESSION_CLOSED", "SESSION_NOT_FOUND",
                        "Cannot invoke RPC on closed channel", "connection reset", "Broken pipe",
                        "DEADLINE_EXCEEDED", "GOAWAY", "Stream removed")


def is_backend_unavailable(exc: BaseException) -> bool:
    """Connection-level failures (retrying on another backend may help) vs failures of the job itself."""
    import grpc

    from recsys.errors import SparkUnavailable

    if isinstance(exc, (BackendUnavailable, SparkUnavailable)):
        return True
    if isinstance(exc, grpc.RpcError):
        return True
    text = f"{type(exc).__name__}: {exc}"
    return any(marker.lower() in text.lower() for marker in _UNAVAILABLE_MARKERS)


def connect(url: str, backend_timeout_s: float):
    """A Spark Connect session on ``url`` whose lost-connection retries stop after ~``backend_timeout_s``.

    The client's default policy retries an unreachable server for about ten minutes; a request
    would hang that long. Backoff starts at 100 ms and is capped at 1 s, so the retry budget is
    about one retry per second of ``backend_timeout_s``.
    """
    from pyspark.sql import SparkSession
    from pyspark.sql.connect.client.retries import DefaultPolicy

    from recsys.spark.session import wait_for_connect_server

    wait_for_connect_server(url, 0)   # nothing listening: say so now, not after the client's first call's retries
    spark = SparkSession.builder.remote(url).create()
    spark.release_session_on_close = False   # stop() closes the channel; the warm server session stays
    retries = max(1, math.ceil(backend_timeout_s))
    spark.client.set_retry_policies([DefaultPolicy(max_retries=retries, initial_backoff=100, backoff_multiplier=2.0,
                                                   max_backoff=1000, jitter=0)])
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    return spark


@dataclass
class WarmWindow:
    """The window's per-user entries, cached in the backend, and what they were built from."""

    as_of: dt.date
    key: tuple            # (as_of, window partitions and their files): a change means a rebuild
    frame: Any            # cached DataFrame: user_id, _entries
    users: int
    build_s: float
    today: tuple[str, ...]   # partition paths from as_of on: read per request for the requested users
    name: str = ""           # the cached temporary view in the backend session


@dataclass(frozen=True)
class ScoringContext:
    """Model, candidates and fallback for the current window: what the workers' cache is keyed by."""

    spec: Any             # ScoringSpec
    model_version: str
    model_uri: str
    catalog_snapshot: dt.date
    key: tuple


@dataclass
class BatchResult:
    rows: dict[int, dict[str, Any]]
    model_cache: CacheUse = CacheUse()   # the workers' model cache in this job: hits, loads, load seconds
    seconds: float = 0.0


def _files_key(fs, parts) -> tuple:
    from recsys.data.readers import with_files

    out = []
    for part in parts:
        files = with_files(fs, part).files
        if files:
            out.append((str(part.date), tuple(files)))
    return tuple(out)


class OnDemand:
    """The backend side of ``recsys serve``: one Connect session, the warm window, the scoring context.

    Thread-safe: batches run from several threads at once (each is one Spark job); ``refresh``
    runs from the frontend's maintenance thread and swaps the window and context atomically.
    """

    def __init__(self, cfg: Config, url: str, hooks=None):
        self.cfg = cfg
        self.url = url
        self.hooks = hooks   # recsys.hooks.Hooks: fault injection for game days (docs/faults.md); None: none
        self.spark = None
        self.window: WarmWindow | None = None
        self.context: ScoringContext | None = None
        self._lock = threading.RLock()
        self._model_checked = 0.0
        self._model = None

    # -- connection ---------------------------------------------------------------------------

    def connect(self) -> None:
        with self._lock:
            self.close()
            try:
                self.spark = connect(self.url, self.cfg.serve.backend_timeout_s)
                self.spark.sql("SELECT 1").collect()
            except Exception as exc:
                self.spark = None
                raise BackendUnavailable(f"cannot reach the backend at {self._where()}: {first_line(exc, with_type=True)}") from None
            self.window = None
            self.context = None
            self._model = None

    def close(self) -> None:
        spark, self.spark = self.spark, None
        if spark is not None:
            try:
                spark.stop()
            except Exception:  # a dead backend cannot be told goodbye
                pass

    def ping(self) -> None:
        spark = self.spark
        if spark is None:
            raise BackendUnavailable("not connected to the backend")
        try:
            spark.sql("SELECT 1").collect()
        except Exception as exc:
            raise BackendUnavailable(f"the backend at {self._where()} does not answer: {first_line(exc, with_type=True)}") from None

    def _where(self) -> str:
        return self.url.split("/;", 1)[0]

    # -- what requests are scored against ------------------------------------------------------

    def as_of(self) -> dt.date:
        if self.cfg.serve.as_of:
            return dt.date.fromisoformat(self.cfg.serve.as_of)
        return dt.datetime.now(dt.timezone.utc).date()

    def refresh(self, *, force_model: bool = False) -> bool:
        """Rebuild what changed (window, model, catalog); True if anything did. Raises on failure."""
        with self._lock:
            spark = self.spark
            if spark is None:
                raise BackendUnavailable("not connected to the backend")
            changed = self._refresh_window(spark)
            changed = self._refresh_context(spark, force_model=force_model or changed) or changed
            return changed

    def _refresh_window(self, spark) -> bool:
        from pyspark import StorageLevel
        from pyspark.sql import functions as F

        from recsys.data import history as hist
        from recsys.data import rules as data_rules
        from recsys.data.partitions import list_partitions
        from recsys.data.readers import events_window, read_events
        from recsys.redaction import redact_uri

        cfg = self.cfg
        as_of = self.as_of()
        start = as_of - dt.timedelta(days=cfg.history.window_days)
        fs, parts = list_partitions(cfg.paths.events, "events")
        window_key = (str(as_of), _files_key(fs, [p for p in parts if start <= p.date < as_of]))
        today = tuple(p.path for p in parts if p.date >= as_of)
        if self.window is not None and self.window.key == window_key:
            self.window.today = today
            return False
        started = time.perf_counter()
        # The cached window is a temporary view of the backend's session named after what it holds:
        # a restarted frontend joining the same session finds it cached and builds nothing.
        exclude = data_rules.exclusion_since(cfg.recommend, as_of)
        key_text = repr((window_key, cfg.paths.events, cfg.history.max_items, cfg.history.tie_break_seed,
                         cfg.history.event_types, exclude))
        name = "recsys_window_" + hashlib.sha256(key_text.encode()).hexdigest()[:16]
        if spark.catalog.tableExists(name) and spark.catalog.isCached(name):
            frame = spark.table(name)
            reused = True
        else:
            events = read_events(spark, cfg.paths.events, lambda d: start <= d < as_of)
            if events is None:
                excluded = f", {hist.EXCLUDED_COLUMN} ARRAY<BIGINT>" if exclude else ""
                frame = spark.createDataFrame([], f"user_id BIGINT, {hist.ENTRIES_COLUMN} ARRAY<STRUCT<ts: TIMESTAMP, "
                                                  f"tie: BIGINT, item_id: BIGINT, n: BIGINT>>{excluded}")
            else:
                window = hist.drop_null_ids(events_window(events, as_of, cfg.history.window_days,
                                                          cfg.history.event_types))
                if exclude:   # once per window: the nightly job counts these on its own pass over the events
                    types = [rule.event_type for rule in cfg.recommend.exclude.events]
                    present = sorted(r[0] for r in window.filter(F.col("event_type").isin(types))
                                     .select("event_type").distinct().collect())
                    data_rules.check_event_types(
                        cfg.recommend, {f"rule_events_{i}": int(t in present) for i, t in enumerate(types)},
                        lambda: sorted(r[0] for r in window.select("event_type").distinct().limit(1000).collect()
                                       if r[0] is not None),
                        f"the events between {start} and {as_of} (exclusive) under {redact_uri(cfg.paths.events)!r}")
                frame = hist.newest_entries(window, max_items=cfg.history.max_items,
                                            tie_break_seed=cfg.history.tie_break_seed, exclude=exclude)
            # Range-partitioned and sorted by user: a request's filter skips the batches that cannot hold
            # its users. One partition per ~64 MB of window files: every partition is a task per request.
            files = [f for _, names in window_key[1] for f in names]
            size = sum(info.size or 0 for info in fs.get_file_info(files)) if files else 0
            most = max(1, int(spark.conf.get("spark.sql.shuffle.partitions", "8")))
            partitions = max(1, min(most, math.ceil(size / WINDOW_PARTITION_BYTES)))
            frame = frame.repartitionByRange(partitions, "user_id").sortWithinPartitions("user_id")
            frame.createOrReplaceTempView(name)
            spark.catalog.cacheTable(name, StorageLevel.MEMORY_AND_DISK)
            frame = spark.table(name)
            reused = False
        users = frame.count()
        old, self.window = self.window, WarmWindow(as_of, window_key, frame, users, time.perf_counter() - started,
                                                   today, name)
        if old is not None and old.name != name:
            try:
                spark.catalog.uncacheTable(old.name)
                spark.catalog.dropTempView(old.name)
            except Exception:  # the backend that held it may be gone
                pass
        log.info("warm window %s..%s: %d users %s in %.1fs", start, as_of, users,
                 "found cached in the backend" if reused else "cached", self.window.build_s)
        return True

    def _refresh_context(self, spark, *, force_model: bool) -> bool:
        from recsys.tracking.last_model import resolve_or_remembered

        cfg = self.cfg
        now = time.monotonic()
        if self._model is None or force_model or now - self._model_checked >= cfg.serve.refresh_s:
            self._model, _ = resolve_or_remembered(cfg.mlflow, cfg.paths.driver_dir)
            self._model_checked = now
        model = self._model
        snapshot = _newest_snapshot(cfg.paths.catalog, self.window.as_of)
        key = (model.uri, model.version, model.source, snapshot, self.window.key)
        if self.context is not None and self.context.key == key:
            return False
        spec, snapshot_date = build_spec(spark, cfg, self.window, model, self.hooks)
        self.context = ScoringContext(spec, model.version, model.uri, snapshot_date, key)
        log.info("scoring context: model %s version %s, catalog snapshot %s, %d candidates",
                 model.name, model.version, snapshot_date, len(spec.candidates_item_ids))
        return True

    # -- a batch ---------------------------------------------------------------------------------

    def histories_for(self, user_ids: Sequence[int]):
        """user_id, history for exactly these users (an empty history for users without events)."""
        from pyspark.sql import functions as F

        from recsys.data import history as hist
        from recsys.data.readers import read_events

        spark, window, cfg = self.spark, self.window, self.cfg
        ids = [int(u) for u in user_ids]
        wanted = spark.createDataFrame(pa.table({"user_id": pa.array(ids, pa.int64())}))
        entries = window.frame.filter(F.col("user_id").isin(ids))
        excluding = hist.EXCLUDED_COLUMN in window.frame.columns   # event rules: built with the window
        empty = F.array().cast("array<bigint>")
        if window.today:
            today = read_events(spark, cfg.paths.events, lambda d: d >= window.as_of)
            recent = hist.drop_null_ids(today.filter(F.col("user_id").isin(ids)))
            if cfg.history.event_types:
                recent = recent.filter(F.col("event_type").isin(list(cfg.history.event_types)))
            merged = hist.entries_to_events(entries).unionByName(
                recent.select("user_id", "item_id", "ts", F.lit(1).cast("bigint").alias(hist.WEIGHT_COLUMN)))
            known = hist.build_histories(merged, max_items=cfg.history.max_items,
                                         tie_break_seed=cfg.history.tie_break_seed)
            if excluding:   # the window's exclusions, and today's events of the rules' types (all after the night)
                types = [rule.event_type for rule in cfg.recommend.exclude.events]
                today_ex = (recent.filter(F.col("event_type").isin(types)).groupBy("user_id")
                            .agg(F.collect_set("item_id").alias("_today_excluded")))
                known = (known.join(entries.select("user_id", hist.EXCLUDED_COLUMN), "user_id", "left")
                         .join(today_ex, "user_id", "left")
                         .withColumn(hist.EXCLUDED_COLUMN, F.array_union(F.coalesce(hist.EXCLUDED_COLUMN, empty),
                                                                         F.coalesce("_today_excluded", empty)))
                         .drop("_today_excluded"))
        else:
            known = hist.entries_to_histories(entries)
        joined = wanted.join(F.broadcast(known), "user_id", "left")
        columns = (hist.HISTORY_COLUMN, hist.HISTORY_COUNTS_COLUMN, hist.HISTORY_LAST_US_COLUMN,
                   *((hist.EXCLUDED_COLUMN,) if excluding else ()))
        return joined.select("user_id", *(F.coalesce(F.col(c), empty).alias(c) for c in columns)).coalesce(1)

    def score(self, user_ids: Sequence[int]) -> BatchResult:
        """One Spark job for these users -> their rows (user_id -> row) and the workers' figures."""
        from recsys.pipelines.nightly_stages import score_users, workers_refusal
        from recsys.scoring.stage import worker_figures

        spark, context = self.spark, self.context
        if spark is None or context is None or self.window is None:
            raise BackendUnavailable("the backend is not connected or not warm yet")
        started = time.perf_counter()
        try:
            scored, observation = score_users(self.histories_for(user_ids), context.spec, 0)
            table = scored.toArrow()
            figures = worker_figures(observation)
        except Exception as exc:
            if is_backend_unavailable(exc):
                raise BackendUnavailable(f"the backend at {self._where()} failed: {first_line(exc, with_type=True)}") from None
            refusal = workers_refusal(exc)
            if refusal is not None:   # configuration, not this batch: the frontend stays not ready, saying why
                raise BatchFailed(f"the executors refused scoring.dtype={context.spec.params.dtype}: {refusal}") from None
            raise BatchFailed(f"the Spark job for {len(user_ids)} user(s) failed: {first_line(exc, with_type=True)}") from exc
        rows = {}
        for row in table.to_pylist():
            rows[row["user_id"]] = row
        return BatchResult(rows, figures.totals.model, time.perf_counter() - started)


def _newest_snapshot(root: str, as_of: dt.date) -> str | None:
    from recsys.data.partitions import list_partitions, with_files

    fs, parts = list_partitions(root, "catalog")
    for part in reversed([p for p in parts if p.date <= as_of]):
        part = with_files(fs, part)
        if part.files:
            return f"{part.date}:{','.join(part.files)}"
    return None


def build_spec(spark, cfg: Config, window: WarmWindow, model, hooks=None) -> tuple[Any, dt.date]:
    """The nightly job's stages for ``window``: catalog -> candidates, popularity fallback -> ScoringSpec."""
    from recsys.data.history import entries_to_histories
    from recsys.hooks import NO_HOOKS
    from recsys.pipelines import nightly_stages as stages
    from recsys.scoring.shipping import ship_model

    vocab = stages.load_vocabulary(model)
    catalog = stages.read_catalog(spark, cfg.paths, cfg.catalog.max_age_days, window.as_of, vocab, model.version,
                                  cfg.recommend)
    fallback = stages.popularity_fallback_stage(entries_to_histories(window.frame), catalog.candidates,
                                                cfg.scoring.top_n, lists_for=window.as_of)
    shipped = ship_model(spark, model.local_dir, name=model.name, version=model.version,
                         scratch=cfg.paths.driver_dir)   # the backend's executors get the files through Spark
    spec = stages.scoring_spec(shipped, catalog, fallback, cfg, lists_for=window.as_of, hooks=hooks or NO_HOOKS)
    return spec, catalog.snapshot.date
