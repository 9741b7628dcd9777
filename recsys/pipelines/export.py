"""``recsys export --date D``: the published lists of D into Redis as a new version, then one switch of the pointer.

Also the nightly job's last stage when ``export.after_publish`` is set (:func:`recsys.pipelines.nightly.run_nightly`).
In the order a run meets them:

1. the date's lock (the partition cannot be replaced while it is read; a concurrent ``recommend`` of the
   date exits 4), then the published night of D (:func:`recsys.publish.published.find_published`: the run
   directory ``output.table``'s partition names, or without a table the date's pointer): none, or one whose
   manifest records failed checks, is refused with exit 2;
2. Redis: unreachable -> exit 1, nothing changed; then the export lock (another live export -> exit 4);
   versions left by dead exports (state ``writing`` or ``removing``) are removed first;
3. the skip and order rules: the pointer already names this partition's run -> nothing to do (exit 0)
   unless ``force``; the pointer names a later date -> refused (exit 2) unless ``allow_older``
   (the nightly stage skips instead: a backfill must not move readers back);
4. a new version ``vN``: the executors write every user (:mod:`recsys.export.writer`), the counts are
   checked against the manifest, the fallback list is written, and one script moves the pointer
   (:func:`recsys.export.redis_store.switch`); any failure before that leaves the pointer where it was and
   the partial version is removed (now, or by the next export when Redis was down);
5. versions beyond ``export.keep_versions`` are removed; the figures go into the version's record in Redis
   and into the partition's MLflow run (a store that fails there: exit 5, the lists are served).
"""
from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pyspark.sql import SparkSession

from recsys import __version__
from recsys.config import Config
from recsys.errors import ConfigError, ExitCode, InputDataError, first_line
from recsys.export import redis_store as store
from recsys.export.encoding import encode_list
from recsys.export.writer import WriteSpec, write_files
from recsys.hooks import NO_HOOKS, Hooks
from recsys.publish.lock import DateLock
from recsys.publish.published import PublishedPartition, find_published, new_run_key
from recsys.spark.session import job_description
from recsys.tracking import store as tracking
from recsys.tracking import tags
from recsys.redaction import redact_uri

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportResult:
    """What an export did: a new version switched to, or nothing (skipped, and why)."""

    date: dt.date
    status: Literal["exported", "skipped"]
    version: str | None               # the version the pointer names now (this run's, or the one found)
    previous: str | None              # what it named before this run
    store: str                        # the Redis URL, without credentials
    reason: str | None = None         # why it was skipped
    figures: dict[str, Any] = field(default_factory=dict)
    removed: tuple[str, ...] = ()     # versions removed (dead exports' leftovers, beyond keep_versions)
    tracking_error: str | None = None

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.TRACKING_FAILED if self.tracking_error else ExitCode.OK

    def summary(self) -> str:
        if self.status == "skipped":
            return f"export {self.date}: skipped, {self.reason}"
        f = self.figures
        return (f"export {self.date}: version {self.version} in {self.store} serves {f['users']:,} users "
                f"({f['value_bytes'] / 2**20:,.1f} MiB of lists, {f['seconds']:.1f}s, {f['users_per_s']:,.0f} users/s); "
                f"the pointer moved from {self.previous or 'nothing'}"
                + (f"; removed {', '.join(self.removed)}" if self.removed else ""))


def run_export(spark: SparkSession, cfg: Config, date: dt.date, *, force: bool = False, allow_older: bool = False,
               older_is_error: bool = True, hooks: Hooks = NO_HOOKS) -> ExportResult:
    """Export the published partition of ``date`` (see the module's docstring for the rules and exit codes).

    ``older_is_error``: False for the nightly stage, where a date older than the one served (a backfill)
    is skipped instead of refused.
    """
    export = cfg.export
    if not export.redis_url:
        raise ConfigError("export.redis_url is not set: name the Redis to export to (--set export.redis_url="
                          "redis://HOST:PORT/DB or the export section of the --conf file; docs/export.md)")
    table = _output_table(spark, cfg)
    if find_published(cfg.paths.output, date, table) is None:   # checked again under the lock; no lock for a typo
        raise InputDataError(_not_published(cfg, date))
    run_key = new_run_key("export")
    with DateLock(cfg.paths.output, date, run_key):
        published = find_published(cfg.paths.output, date, table)
        if published is None:
            raise InputDataError(_not_published(cfg, date))
        refusal = published.refusal()
        if refusal:
            raise InputDataError(f"not exporting {date}: {refusal}")
        client = store.connect(export.redis_url, export.timeout_s)
        try:
            result = _export(_Export(spark, cfg, client, run_key, hooks), published, force=force,
                             allow_older=allow_older, older_is_error=older_is_error)
        finally:
            client.close()
    if result.status == "exported":
        result = _record(cfg, published, result)
    log.info("%s", result.summary())
    return result


def _output_table(spark: SparkSession, cfg: Config):
    """``output.table`` (its partition is the commit point readers of a date follow), or None without one:
    then the date's pointer names the published run (:func:`recsys.publish.published.find_published`)."""
    if cfg.output.table is None:
        return None
    from recsys.pipelines.nightly import output_table   # here: the nightly job imports this module for its last stage

    return output_table(spark, cfg)


def _not_published(cfg: Config, date: dt.date) -> str:
    where = f"table {cfg.output.table}" if cfg.output.table else redact_uri(cfg.paths.output)
    return (f"nothing is published for {date} in {where!r} (no complete run with _SUCCESS and _manifest.json); "
            f"run `recsys recommend --date {date}` first")


@dataclass(frozen=True)
class _Export:
    """One export's context, handed down once: the session, the configuration, the Redis client, this
    export's run key (``exported_by``) and the hooks."""

    spark: SparkSession
    cfg: Config
    client: Any                       # redis.Redis (imported where it is used)
    run_key: str
    hooks: Hooks


def _export(job: _Export, published: PublishedPartition, *, force: bool, allow_older: bool,
            older_is_error: bool) -> ExportResult:
    import redis

    cfg, client = job.cfg, job.client
    export, date = cfg.export, published.date
    keys = store.Keyspace(export.prefix)
    where = redact_uri(export.redis_url)
    try:
        lock = store.ExportLock(client, keys, export.lock_ttl_s).acquire()
    except redis.RedisError as exc:
        raise store.unavailable(export.redis_url, exc, "taking the export lock") from None
    try:
        try:
            pointer = store.read_pointer(client, keys)
            removed = _remove_dead_versions(client, keys, pointer)
        except redis.RedisError as exc:
            raise store.unavailable(export.redis_url, exc, "reading the pointer") from None
        current = pointer.version if pointer else None
        if pointer is not None and pointer.run == published.run and not force:
            removed += _retention(client, keys, pointer.version, export.keep_versions)
            return ExportResult(date, "skipped", current, current, where, removed=tuple(removed),
                                reason=f"{where} already serves this partition (run {published.run}) as version "
                                       f"{current}, switched at {pointer.switched_at}; pass --force to export it again")
        if pointer is not None and pointer.date > date and not allow_older:
            why = (f"{where} serves the later date {pointer.date} (version {current}); exporting {date} would move "
                   f"readers back a night")
            if older_is_error:
                raise ConfigError(f"not exporting {date}: {why}; pass --allow-older to do it")
            return ExportResult(date, "skipped", current, current, where, reason=why, removed=tuple(removed))
        result = _write_and_switch(job, keys, lock, published, pointer)
        try:
            removed += _retention(client, keys, result.version, export.keep_versions)
        except redis.RedisError as exc:   # the switch happened: old versions are removed by the next export
            log.warning("export %s: switched to %s, but removing old versions failed: %s", date, result.version,
                        first_line(exc))
        return ExportResult(**{**result.__dict__, "removed": tuple(removed)})
    finally:
        lock.release()


def _remove_dead_versions(client, keys: store.Keyspace, pointer: store.Pointer | None) -> list[str]:
    """Versions no live export is writing (this one holds the lock): what killed exports left behind."""
    removed = []
    for version, record in store.read_versions(client, keys).items():
        if record.get("state") != store.LIVE and (pointer is None or version != pointer.version):
            count = store.remove_version(client, keys, version)
            log.warning("removed version %s (%s, %d keys), left by an export that did not finish", version,
                        record.get("state"), count)
            removed.append(version)
    return removed


def _retention(client, keys: store.Keyspace, current: str | None, keep: int) -> list[str]:
    """Complete versions beyond the newest ``keep`` (the served one always kept) -> removed."""
    live = [v for v, r in store.read_versions(client, keys).items() if r.get("state") == store.LIVE and v != current]
    doomed = sorted(live, key=store.version_number, reverse=True)[max(0, keep - 1):]
    for version in doomed:
        count = store.remove_version(client, keys, version)
        log.info("removed version %s (%d keys): export.keep_versions=%d", version, count, keep)
    return doomed


def _write_and_switch(job: _Export, keys: store.Keyspace, lock: store.ExportLock, published: PublishedPartition,
                      pointer: store.Pointer | None) -> ExportResult:
    import redis

    spark, cfg, client, run_key, hooks = job.spark, job.cfg, job.client, job.run_key, job.hooks
    export, date = cfg.export, published.date
    where = redact_uri(export.redis_url)
    files = published.files()
    if not files:
        raise InputDataError(f"the published partition {redact_uri(published.path)} holds no data files")
    fallback = _fallback(published, files)
    sources = tuple(published.sources)
    record = {"date": str(date), "run": published.run, "run_id": published.run_id,
              "model_version": published.model_version, "catalog_snapshot": published.catalog_snapshot,
              "sources": list(sources), "exported_by": run_key, "recsys_version": __version__,
              "partition": redact_uri(published.path)}
    started = time.perf_counter()
    try:
        version = store.begin_version(client, keys, record)
    except redis.RedisError as exc:
        raise store.unavailable(export.redis_url, exc, "registering a new version") from None
    log.info("export %s: writing version %s to %s from %d file(s) of %s", date, version, where, len(files),
             redact_uri(published.path))
    spec = WriteSpec(export.redis_url, export.prefix, version, sources, export.batch_users, export.pipeline_users,
                     export.timeout_s, hooks.pause_max_s if hooks.pause_at == "export_writing" else None)
    try:
        with job_description(spark, f"recsys export {date}: version {version}"):
            written = write_files(spark, files, spec)
        write_s = time.perf_counter() - started
        figures = _check_written(written, files, published, version)
        if fallback is not None:
            client.set(keys.fallback_key(version), encode_list(fallback[0], fallback[1], sources.index(fallback[2])))
        hooks.pause("before_switch")
        if lock.lost:
            raise store.SwitchRefused(f"the export lock {keys.lock} was lost while version {version} was written")
        seconds = time.perf_counter() - started
        figures.update(write_s=round(write_s, 3), seconds=round(seconds, 3),
                       users_per_s=round(figures["users"] / seconds, 1) if seconds > 0 else 0.0)
        switched_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        pointer_fields = {"version": version, "date": str(date), "model_version": published.model_version,
                          "run": published.run, "run_id": published.run_id or "",
                          "catalog_snapshot": published.catalog_snapshot, "sources": list(sources),
                          "fallback_name": fallback[2] if fallback else "", "users": str(figures["users"]),
                          "switched_at": switched_at, "format": str(store.FORMAT)}
        store.switch(client, keys, lock, store.Switch(version, len(files), pointer_fields,
                                                      {**record, **figures, "switched_at": switched_at}),
                     pointer.version if pointer else None)
    except BaseException as exc:
        _abandon(client, keys, version, date)
        if isinstance(exc, redis.RedisError) or (not isinstance(exc, (KeyboardInterrupt, store.StoreUnavailable))
                                                  and not _answers(client)):
            raise store.unavailable(export.redis_url, exc, f"writing version {version}") from None
        raise
    return ExportResult(date, "exported", version, pointer.version if pointer else None, where, figures=figures)


def _check_written(written: list[dict[str, Any]], files: list[str], published: PublishedPartition,
                   version: str) -> dict[str, Any]:
    """The tasks' figures -> the version's; refuses (nothing switched) a version that is not the whole partition."""
    by_file = {row["path"]: row for row in written}
    missing = sorted(set(files) - set(by_file))
    users = sum(int(row["users"]) for row in by_file.values())
    if missing or (published.rows is not None and users != published.rows):
        raise RuntimeError(f"version {version} is incomplete: {users:,} users written from {len(by_file)} of "
                           f"{len(files)} files, the manifest counts {published.rows} rows"
                           + (f"; no figures for {missing[:3]}" if missing else "") + "; nothing was switched")
    return {"users": users, "value_bytes": sum(int(r["value_bytes"]) for r in by_file.values()),
            "key_bytes": sum(int(r["key_bytes"]) for r in by_file.values()), "files": len(files),
            "tasks": len({(r["host"], r["pid"], r["partition"]) for r in written}),
            "task_retries": sum(1 for r in written if r["attempt"] > 0)}


def _fallback(published: PublishedPartition, files: list[str]) -> tuple[Any, Any, str] | None:
    """(item ids, scores, name) of the list users without a row get: from the manifest, else from a row that has it."""
    recorded = published.fallback
    if recorded is not None:
        return list(recorded.item_ids), list(recorded.scores), recorded.name
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    from recsys import fs as rfs

    name = published.sources[-1]
    fs, _ = rfs.resolve(files[0])
    dataset = ds.dataset([rfs.resolve(f)[1] for f in files], filesystem=fs, format="parquet")
    rows = dataset.scanner(columns=["recommendations"], filter=pc.field("source") == name).head(1).to_pylist()
    if not rows:
        log.info("export %s: no fallback list in the manifest and no %s row: users missing from the lists get "
                 "none", published.date, name)
        return None
    recs = rows[0]["recommendations"]
    return [r["item_id"] for r in recs], [r["score"] for r in recs], name


def _abandon(client, keys: store.Keyspace, version: str, date: dt.date) -> None:
    """Remove a version that will not be switched to, if Redis still answers; else the next export does."""
    try:
        count = store.remove_version(client, keys, version)
        log.warning("export %s: removed the unfinished version %s (%d keys); the pointer is unchanged", date,
                    version, count)
    except Exception as exc:
        log.warning("export %s: could not remove the unfinished version %s (%s); the next export removes it",
                    date, version, first_line(exc))


def _answers(client) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False


def _record(cfg: Config, published: PublishedPartition, result: ExportResult) -> ExportResult:
    """The export's figures on the MLflow run that published the partition (if it was recorded)."""
    if not published.run_id:
        log.warning("export %s: the partition has no MLflow run (it was published untracked); the figures are in "
                    "Redis only (%s)", result.date, store.Keyspace(cfg.export.prefix).versions)
        return result
    metrics = {f"export_{k}": v for k, v in result.figures.items() if isinstance(v, (int, float))}
    error = tracking.note_on_run(cfg.mlflow, published.run_id, metrics,
                                 {tags.EXPORT_VERSION: result.version or "", tags.EXPORT_STORE: result.store})
    if error:
        log.warning("export %s: version %s is served, but its figures could not be recorded on MLflow run %s: %s",
                    result.date, result.version, published.run_id, error)
        return ExportResult(**{**result.__dict__, "tracking_error": error})
    return result
